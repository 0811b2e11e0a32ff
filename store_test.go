package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// storeAt opens the store in dir, closed at the end of the test: another
// process on the same data directory, or the same one after a restart.
// A test that closes it itself uses openAt.
func storeAt(tb testing.TB, dir string) *store {
	tb.Helper()
	st := openAt(tb, dir)
	tb.Cleanup(func() { st.Close() })
	return st
}

// openAt opens the store in dir; the caller closes it.
func openAt(tb testing.TB, dir string) *store {
	tb.Helper()
	st, err := openStore(context.Background(), dir, time.Now)
	must(tb, err)
	return st
}

// storeUser creates a user with a device on st and returns the user's id
// and the device's internal id and uid.
func storeUser(t *testing.T, st *store, email string) (userID, deviceID int64, uid string) {
	t.Helper()
	ctx := context.Background()
	userID, err := st.createUser(ctx, email, email, "user", "x")
	if err == nil {
		uid, err = st.createDevice(ctx, email, "esp32", "devkit", "", 1883)
	}
	if err != nil {
		t.Fatalf("create user and device: %v", err)
	}
	d, err := deviceIn(ctx, st.read, userID, uid)
	must(t, err)
	return userID, d.id, uid
}

func TestStoreMigrate(t *testing.T) {
	dir := t.TempDir()
	st := openAt(t, dir)
	version := fmt.Sprint(len(migrations))
	wantDB(t, st, version, `PRAGMA user_version`)
	wantDB(t, st, "boards command_buttons commands devices firmwares platforms rollout_devices rollouts tokens users",
		`SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name)`)
	userID, deviceID, uid := storeUser(t, st, "keep@example.com")
	st.Close()

	// Reopening migrates nothing and keeps the data.
	st = openAt(t, dir)
	wantDB(t, st, version, `PRAGMA user_version`)
	if d, err := deviceIn(context.Background(), st.read, userID, uid); err != nil || d.id != deviceID {
		t.Errorf("device after reopening: got %v, %v; want id %d", d, err, deviceID)
	}

	// A newer schema than the program knows is refused.
	mustExec(t, st, fmt.Sprintf(`PRAGMA user_version = %d`, len(migrations)+1))
	st.Close()
	if st, err := openStore(context.Background(), dir, time.Now); err == nil {
		st.Close()
		t.Error("openStore on a newer schema: got nil error")
	}
}

// TestStoreMigrationAtomic: a migration that fails leaves neither its
// changes nor a new version behind, and a later good one applies. It
// swaps the package's migrations, so it must not run in parallel.
func TestStoreMigrationAtomic(t *testing.T) {
	orig := migrations
	t.Cleanup(func() { migrations = orig })
	dir := t.TempDir()
	openAt(t, dir).Close()

	migrations = append(slices.Clone(orig), `CREATE TABLE extra (x TEXT); INSERT INTO no_such_table VALUES (1);`)
	if st, err := openStore(context.Background(), dir, time.Now); err == nil {
		st.Close()
		t.Fatal("openStore with a failing migration: got nil error")
	}
	migrations = orig
	st := openAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(orig)), `PRAGMA user_version`)
	wantDB(t, st, "0", `SELECT count(*) FROM sqlite_master WHERE name = 'extra'`)
	st.Close()

	migrations = append(slices.Clone(orig), `CREATE TABLE extra (x TEXT);`)
	wantDB(t, storeAt(t, dir), fmt.Sprint(len(orig)+1), `PRAGMA user_version`)
}

// TestStorePragmas: every pooled connection, readers and the writer, has
// foreign keys, WAL and a busy timeout.
func TestStorePragmas(t *testing.T) {
	st := newTestStore(t, nil)
	ctx := context.Background()
	const readers = 4
	for i := range readers + 1 {
		db := st.db
		if i == readers {
			db = st.wdb
		}
		c, err := db.Conn(ctx) // a new connection while the earlier ones are held
		must(t, err)
		defer c.Close()
		var fk, busy int
		var mode string
		err = errors.Join(c.QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk),
			c.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode), c.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
		if err != nil || fk != 1 || mode != "wal" || busy < 1000 {
			t.Errorf("connection %d: foreign_keys=%d journal_mode=%s busy_timeout=%d (%v), want 1, wal, >= 1000", i, fk, mode, busy, err)
		}
	}
	if n := st.db.Stats().OpenConnections; n < readers {
		t.Errorf("read pool has %d connections, want %d distinct ones checked", n, readers)
	}
}

// TestStoreCleanFirmwareFiles: opening the store removes unfinished uploads
// and files without a row, and keeps files that rows need.
func TestStoreCleanFirmwareFiles(t *testing.T) {
	dir := t.TempDir()
	st := openAt(t, dir)
	_, _, uid := storeUser(t, st, "a@example.com")
	addFirmwareFile(t, st, uid, []byte("\xe9a firmware with a row"))
	st.Close()
	fw := filepath.Join(dir, "firmware")
	for _, name := range []string{strings.Repeat("ab", 16) + ".bin", "tmp/upload-123", "tmp/upload-456"} {
		must(t, os.WriteFile(filepath.Join(fw, name), []byte("left by a crash"), 0o600))
	}
	st = storeAt(t, dir)
	checkFirmwareFiles(t, st.db, fw)
	wantDB(t, st, "1", `SELECT count(*) FROM firmwares`)
}

// TestStoreConcurrentWriters: many concurrent writers, also from a second
// store on the same file (as another process would), never fail with
// "database is locked".
func TestStoreConcurrentWriters(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	stores := []*store{storeAt(t, dir), storeAt(t, dir)}
	userID, deviceID, uid := storeUser(t, stores[0], "busy@example.com")
	const n = 50
	var wg sync.WaitGroup
	for i := range n {
		st := stores[i%2]
		wg.Go(func() {
			name := fmt.Sprintf("name %d", i)
			_, err1 := st.updateDevice(ctx, userID, uid, deviceUpdate{name: &name})
			_, _, err2 := issueToken(ctx, st, userID, "t", i%3 == 0)
			_, err3 := st.buttonsOf(ctx, deviceID)
			err := errors.Join(st.createButton(ctx, deviceID, commandButton{ID: fmt.Sprint("b", i), Label: "L", Payload: json.RawMessage(`{}`)}), err1, err2, err3)
			if err != nil {
				t.Errorf("writer %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	wantDB(t, stores[0], fmt.Sprint(n, " ", n), `SELECT (SELECT count(*) FROM command_buttons) || ' ' || (SELECT count(*) FROM tokens)`)
}

// TestReadCacheSeesOtherWriters: the read cache never serves a token or a
// device page from before a commit made elsewhere (another process, such
// as the CLI or a sqlite3 shell, played by a second store on the file).
func TestReadCacheSeesOtherWriters(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, other := storeAt(t, dir), storeAt(t, dir)
	userID, _, uid := storeUser(t, st, "u@example.com")
	_, tok, err := issueToken(ctx, st, userID, "t", false)
	must(t, err)
	pages := func(want string) {
		t.Helper()
		detail, err1 := st.devicePage(ctx, userID, uid)
		list, err2 := st.deviceListPage(ctx, userID)
		if !strings.Contains(string(detail), want) || !strings.Contains(string(list), want) {
			t.Errorf("pages: got %s and %s (%v), want the name %s", detail, list, errors.Join(err1, err2), want)
		}
	}
	for range 2 { // the second round is served from the cache
		if _, err := authenticate(ctx, st, tok); err != nil {
			t.Fatalf("authenticate: %v", err)
		}
		pages(`"name":"` + uid + `"`)
	}
	mustExec(t, other, `UPDATE devices SET name = 'renamed elsewhere'`)
	pages(`"name":"renamed elsewhere"`)
	mustExec(t, other, `DELETE FROM tokens`)
	if rec, err := authenticate(ctx, st, tok); err != errTokenNotFound {
		t.Errorf("a token deleted elsewhere: got %v, %v; want errTokenNotFound", rec, err)
	}
}

func TestPasswordHash(t *testing.T) {
	if passwordIterations < 600_000 {
		t.Errorf("passwordIterations: got %d, want >= 600000", passwordIterations)
	}
	h, err := hashPassword("correct horse", testIterations)
	must(t, err)
	if !regexp.MustCompile(`^pbkdf2-sha256\$1000\$[A-Za-z0-9+/]{22}\$[A-Za-z0-9+/]{43}$`).MatchString(h) {
		t.Errorf("hash %q is not pbkdf2-sha256$<iterations>$<salt>$<key>", h)
	}
	h2, _ := hashPassword("correct horse", testIterations)
	if h == h2 {
		t.Error("two hashes of one password are equal: no random salt")
	}
	p := strings.Split(h, "$")
	with := func(i int, v string) string { q := slices.Clone(p); q[i] = v; return strings.Join(q, "$") }
	tests := []struct {
		name, hash, password string
		want                 bool
	}{
		{"right password", h, "correct horse", true},
		{"right password, second hash", h2, "correct horse", true},
		{"wrong password", h, "correct horsf", false},
		{"empty password", h, "", false},
		{"password with a suffix", h, "correct horse ", false},
		{"empty hash", "", "correct horse", false},
		{"other scheme", with(0, "bcrypt"), "correct horse", false},
		{"too few parts", strings.Join(p[:3], "$"), "correct horse", false},
		{"too many parts", h + "$x", "correct horse", false},
		{"iterations not a number", with(1, "many"), "correct horse", false},
		{"zero iterations", with(1, "0"), "correct horse", false},
		{"other iterations", with(1, "1001"), "correct horse", false},
		{"salt not base64", with(2, "!!!"), "correct horse", false},
		{"key not base64", with(3, "!!!"), "correct horse", false},
		{"empty key", with(3, ""), "correct horse", false},
	}
	for _, tt := range tests {
		if got := checkPassword(tt.hash, tt.password); got != tt.want {
			t.Errorf("%s: checkPassword(%q, %q) = %v, want %v", tt.name, tt.hash, tt.password, got, tt.want)
		}
	}
}

// TestInsertCommandAfterClose: a request still running when the store has
// closed (a shutdown past its grace period) gets an error, not a panic.
func TestInsertCommandAfterClose(t *testing.T) {
	st := openAt(t, t.TempDir())
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
	must(t, err)
	defer w.close()
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
