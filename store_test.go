package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// storeUser creates a user with a device on st and returns the device's
// internal id and uid.
func storeUser(t *testing.T, st *store, email string) (int64, string) {
	t.Helper()
	ctx := context.Background()
	userID, err := st.createUser(ctx, email, email, "user", "x")
	if err != nil {
		t.Fatalf("createUser: %v", err)
	}
	uid, err := st.createDevice(ctx, email, "esp32", "devkit", "", 1883)
	if err != nil {
		t.Fatalf("createDevice: %v", err)
	}
	d, err := deviceIn(ctx, st.read, userID, uid)
	if err != nil {
		t.Fatalf("deviceOf: %v", err)
	}
	return d.id, uid
}

// storeFirmware stores content as a firmware of the device, the way an
// upload does: through a temporary file.
func storeFirmware(t *testing.T, st *store, deviceID int64, content []byte) string {
	t.Helper()
	tmp, err := st.newFirmwareTemp()
	if err != nil {
		t.Fatal(err)
	}
	sums, tooBig, err := hashToTemp(tmp, bytes.NewReader(content), maxFirmwareSize)
	tmp.Close()
	if err != nil || tooBig {
		t.Fatalf("hashToTemp: %v, tooBig %v", err, tooBig)
	}
	if _, err := st.createFirmware(context.Background(), deviceID, newFirmware{name: new(string), md5: sums.md5, sha256: sums.sha256, size: sums.size, tmpPath: tmp.Name()}); err != nil {
		t.Fatalf("createFirmware: %v", err)
	}
	return sums.md5
}

func userVersion(t *testing.T, st *store) int {
	t.Helper()
	var v int
	if err := st.db.QueryRow(`PRAGMA user_version`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestStoreMigrate(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := userVersion(t, st), len(migrations); got != want {
		t.Errorf("user_version of a new database: got %d, want %d", got, want)
	}
	var tables string
	err = st.db.QueryRow(`SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name)`).Scan(&tables)
	if err != nil {
		t.Fatal(err)
	}
	if want := "boards command_buttons commands devices firmwares platforms rollout_devices rollouts tokens users"; tables != want {
		t.Errorf("tables: got %q, want %q", tables, want)
	}
	deviceID, uid := storeUser(t, st, "keep@example.com")
	st.Close()

	// Reopening migrates nothing and keeps the data.
	st, err = openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer st.Close()
	if got, want := userVersion(t, st), len(migrations); got != want {
		t.Errorf("user_version after reopening: got %d, want %d", got, want)
	}
	u, err := st.userByEmail(ctx, "keep@example.com")
	if err != nil {
		t.Fatalf("user after reopening: %v", err)
	}
	d, err := deviceIn(ctx, st.read, u.ID, uid)
	if err != nil || d.id != deviceID {
		t.Errorf("device after reopening: got %v, %v; want id %d", d, err, deviceID)
	}
}

func TestStoreRefusesNewerSchema(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.wdb.Exec(fmt.Sprintf(`PRAGMA user_version = %d`, len(migrations)+1)); err != nil {
		t.Fatal(err)
	}
	st.Close()
	if st, err := openStore(ctx, dir, time.Now); err == nil {
		st.Close()
		t.Fatal("openStore on a newer schema: got nil error")
	}
}

// TestStoreMigrationAtomic: a migration that fails leaves neither its
// changes nor a new version behind, and a later good one applies. It
// swaps the package's migrations, so it must not run in parallel.
func TestStoreMigrationAtomic(t *testing.T) {
	orig := migrations
	t.Cleanup(func() { migrations = orig })
	ctx := context.Background()
	dir := t.TempDir()
	st, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	st.Close()

	migrations = append(copyStrings(orig), `CREATE TABLE extra (x TEXT); INSERT INTO no_such_table VALUES (1);`)
	if st, err := openStore(ctx, dir, time.Now); err == nil {
		st.Close()
		t.Fatal("openStore with a failing migration: got nil error")
	}
	migrations = orig
	st, err = openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if got := userVersion(t, st); got != len(orig) {
		t.Errorf("user_version after a failed migration: got %d, want %d", got, len(orig))
	}
	var n int
	st.db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE name = 'extra'`).Scan(&n)
	if n != 0 {
		t.Error("table of a failed migration exists")
	}
	st.Close()

	migrations = append(copyStrings(orig), `CREATE TABLE extra (x TEXT);`)
	st, err = openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatalf("openStore with a good migration: %v", err)
	}
	defer st.Close()
	if got := userVersion(t, st); got != len(orig)+1 {
		t.Errorf("user_version after a good migration: got %d, want %d", got, len(orig)+1)
	}
}

// copyStrings copies s, so that appending to the copy leaves s alone.
func copyStrings(s []string) []string { return append([]string(nil), s...) }

// TestStorePragmas: every pooled connection, readers and the writer, has
// foreign keys, WAL and a busy timeout.
func TestStorePragmas(t *testing.T) {
	st := newTestStore(t, nil)
	ctx := context.Background()
	const readers = 4
	var conns []*sql.Conn
	for range readers {
		c, err := st.db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	w, err := st.wdb.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	conns = append(conns, w)

	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var fk, busy int
			var mode string
			err := errors.Join(
				c.QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk),
				c.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode),
				c.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
			if err != nil {
				t.Errorf("connection %d: %v", i, err)
				return
			}
			if fk != 1 || mode != "wal" || busy < 1000 {
				t.Errorf("connection %d: foreign_keys=%d journal_mode=%s busy_timeout=%d, want 1, wal, >= 1000", i, fk, mode, busy)
			}
		}()
	}
	wg.Wait()
	if st.db.Stats().OpenConnections < readers {
		t.Errorf("read pool has %d connections, want %d distinct ones checked", st.db.Stats().OpenConnections, readers)
	}
}

// TestStoreCleanFirmwareFiles: opening the store removes unfinished uploads
// and files without a row, and keeps files that rows need.
func TestStoreCleanFirmwareFiles(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	deviceID, _ := storeUser(t, st, "a@example.com")
	used := []byte("a firmware with a row")
	storeFirmware(t, st, deviceID, used)
	st.Close()

	fw := filepath.Join(dir, "firmware")
	orphan := filepath.Join(fw, strings.Repeat("ab", 16)+".bin")
	write := func(path string) {
		t.Helper()
		if err := os.WriteFile(path, []byte("left by a crash"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(orphan)
	write(filepath.Join(fw, "tmp", "upload-123"))
	write(filepath.Join(fw, "tmp", "upload-456"))

	st, err = openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if got, err := os.ReadFile(st.firmwarePath(sha256Hex(used))); err != nil || !bytes.Equal(got, used) {
		t.Errorf("file with a row: got %q, %v; want it kept", got, err)
	}
	if _, err := os.Stat(orphan); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file without a row: got %v, want it removed", err)
	}
	tmp, err := os.ReadDir(filepath.Join(fw, "tmp"))
	if err != nil || len(tmp) != 0 {
		t.Errorf("firmware/tmp: got %d entries, %v; want it empty", len(tmp), err)
	}
}

// TestStoreConcurrentWriters: many concurrent writers, also from a second
// process-like store on the same file, never fail with "database is locked".
func TestStoreConcurrentWriters(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st1, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	defer st1.Close()
	deviceID, uid := storeUser(t, st1, "busy@example.com")
	u, err := st1.userByEmail(ctx, "busy@example.com")
	if err != nil {
		t.Fatal(err)
	}
	st2, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()

	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, 4*n)
	for i := range n {
		st := st1
		if i%2 == 1 {
			st = st2
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := commandButton{ID: "b" + strconv.Itoa(i), Label: "L", Payload: json.RawMessage(`{}`)}
			if err := st.createButton(ctx, deviceID, b); err != nil {
				errs <- fmt.Errorf("createButton %d: %w", i, err)
			}
			name := fmt.Sprintf("name %d", i)
			if _, err := st.updateDevice(ctx, u.ID, uid, deviceUpdate{name: &name}); err != nil {
				errs <- fmt.Errorf("updateDevice %d: %w", i, err)
			}
			if _, err := issueToken(ctx, st, u.ID, "t", i%3 == 0); err != nil {
				errs <- fmt.Errorf("issueToken %d: %w", i, err)
			}
			if _, err := st.buttonsOf(ctx, deviceID); err != nil {
				errs <- fmt.Errorf("buttonsOf %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	list, err := st1.buttonsOf(ctx, deviceID)
	if err != nil || len(list) != n {
		t.Errorf("buttons: got %d, %v; want %d", len(list), err, n)
	}
	var tokens int
	st1.db.QueryRow(`SELECT count(*) FROM tokens`).Scan(&tokens)
	if tokens != n {
		t.Errorf("tokens: got %d, want %d", tokens, n)
	}
}

func TestPasswordHash(t *testing.T) {
	if passwordIterations < 600_000 {
		t.Errorf("passwordIterations: got %d, want >= 600000", passwordIterations)
	}
	h, err := hashPassword("correct horse", testIterations)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^pbkdf2-sha256\$1000\$[A-Za-z0-9+/]{22}\$[A-Za-z0-9+/]{43}$`).MatchString(h) {
		t.Errorf("hash %q is not pbkdf2-sha256$<iterations>$<salt>$<key>", h)
	}
	h2, _ := hashPassword("correct horse", testIterations)
	if h == h2 {
		t.Error("two hashes of one password are equal: no random salt")
	}
	parts := strings.Split(h, "$")
	tests := []struct {
		name     string
		hash     string
		password string
		want     bool
	}{
		{"right password", h, "correct horse", true},
		{"right password, second hash", h2, "correct horse", true},
		{"wrong password", h, "correct horsf", false},
		{"empty password", h, "", false},
		{"password with a suffix", h, "correct horse ", false},
		{"empty hash", "", "correct horse", false},
		{"other scheme", "bcrypt$" + strings.Join(parts[1:], "$"), "correct horse", false},
		{"too few parts", strings.Join(parts[:3], "$"), "correct horse", false},
		{"too many parts", h + "$x", "correct horse", false},
		{"iterations not a number", strings.Join([]string{parts[0], "many", parts[2], parts[3]}, "$"), "correct horse", false},
		{"zero iterations", strings.Join([]string{parts[0], "0", parts[2], parts[3]}, "$"), "correct horse", false},
		{"other iterations", strings.Join([]string{parts[0], "1001", parts[2], parts[3]}, "$"), "correct horse", false},
		{"salt not base64", strings.Join([]string{parts[0], parts[1], "!!!", parts[3]}, "$"), "correct horse", false},
		{"key not base64", strings.Join([]string{parts[0], parts[1], parts[2], "!!!"}, "$"), "correct horse", false},
		{"empty key", strings.Join([]string{parts[0], parts[1], parts[2], ""}, "$"), "correct horse", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := checkPassword(tt.hash, tt.password); got != tt.want {
				t.Errorf("checkPassword(%q, %q): got %v, want %v", tt.hash, tt.password, got, tt.want)
			}
		})
	}
}

func TestAuthenticate(t *testing.T) {
	st := newTestStore(t, nil)
	ctx := context.Background()
	userID, err := st.createUser(ctx, "U", "u@example.com", "user", "x")
	if err != nil {
		t.Fatal(err)
	}
	tok, err := issueToken(ctx, st, userID, "t", false)
	if err != nil {
		t.Fatal(err)
	}
	other, err := issueToken(ctx, st, userID, "other", false)
	if err != nil {
		t.Fatal(err)
	}
	deleted, err := issueToken(ctx, st, userID, "deleted", false)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`^([0-9]+)\|([A-Za-z0-9]{40})$`).FindStringSubmatch(tok)
	if m == nil {
		t.Fatalf("token %q is not <id>|<40 alphanumerics>", tok)
	}
	id, secret := m[1], m[2]
	tokenID, _ := strconv.ParseInt(id, 10, 64)
	otherID, otherSecret, _ := strings.Cut(other, "|")
	deletedID, _, _ := strings.Cut(deleted, "|")
	did, _ := strconv.ParseInt(deletedID, 10, 64)
	if err := st.deleteToken(ctx, did); err != nil {
		t.Fatal(err)
	}

	// Only the secret's SHA-256 is stored.
	var stored []byte
	if err := st.db.QueryRow(`SELECT secret_hash FROM tokens WHERE id = ?`, tokenID).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256([]byte(secret)); !bytes.Equal(stored, sum[:]) {
		t.Errorf("stored secret_hash %x, want the SHA-256 of the secret %x", stored, sum)
	}

	tests := []struct {
		name   string
		token  string
		wantID int64 // 0: errNotFound
	}{
		{"valid", tok, tokenID},
		{"secret without id, looked up by hash", secret, tokenID},
		{"other token", other, storeInt(t, otherID)},
		{"wrong secret", id + "|" + strings.Repeat("x", 40), 0},
		{"other token's secret", id + "|" + otherSecret, 0},
		{"id without secret", id + "|", 0},
		{"id alone", id, 0},
		{"non-numeric id", "abc|" + secret, 0},
		{"leading zeros", "0" + id + "|" + secret, 0},
		{"plus sign", "+" + id + "|" + secret, 0},
		{"negative id", "-" + id + "|" + secret, 0},
		{"id overflows", "99999999999999999999|" + secret, 0},
		{"space in id", " " + id + "|" + secret, 0},
		{"deleted token", deleted, 0},
		{"empty", "", 0},
		{"whole token hashed does not match", "x" + tok, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec, err := authenticate(ctx, st, tt.token)
			if tt.wantID == 0 {
				if !errors.Is(err, errTokenNotFound) {
					t.Errorf("authenticate(%q): got %v, %v; want errTokenNotFound", tt.token, rec, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("authenticate(%q): %v", tt.token, err)
			}
			if rec.id != tt.wantID || rec.user.ID != userID {
				t.Errorf("authenticate(%q): got token %d of user %d, want token %d of user %d", tt.token, rec.id, rec.user.ID, tt.wantID, userID)
			}
		})
	}
}

func storeInt(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestInsertCommandAfterClose: a request still running when the store has
// closed (a shutdown past its grace period) gets an error, not a panic.
func TestInsertCommandAfterClose(t *testing.T) {
	st, err := openStore(context.Background(), t.TempDir(), time.Now)
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	if err := st.insertCommand(&command{ID: "late"}); !errors.Is(err, errStoreClosed) {
		t.Errorf("insertCommand after Close: got %v, want errStoreClosed", err)
	}
}

// TestGroupCommitIsolatesABadRecord: when one record of a group commit
// fails (its device is gone), the others are still committed and only
// its own request gets the error.
func TestGroupCommitIsolatesABadRecord(t *testing.T) {
	env := newTestEnv(t, nil)
	w, err := env.st.prepareCommandWriter()
	defer w.close()
	if err != nil {
		t.Fatal(err)
	}
	record := func(id string, deviceID int64) commandInsert {
		now := env.st.timestamp()
		return commandInsert{done: make(chan error, 1), c: &command{ID: id, deviceID: deviceID, Kind: "custom",
			Payload: []byte(`{}`), State: "sent", CreatedAt: now, UpdatedAt: now, deadline: now}}
	}
	good, bad := record("good", env.device(env.alice).id), record("bad", 1<<40)
	env.st.commitInserts(w, nil, []commandInsert{good, bad})
	if err := <-good.done; err != nil {
		t.Errorf("the good record: %v", err)
	}
	if err := <-bad.done; err == nil {
		t.Error("the record of a device that does not exist was committed")
	}
	if _, err := env.st.commandOf(context.Background(), env.device(env.alice).id, "good"); err != nil {
		t.Errorf("the good record is not stored: %v", err)
	}
}
