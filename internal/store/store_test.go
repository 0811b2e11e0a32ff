package store

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"devicehub/internal/model"
)

// The store's tests that need what it keeps to itself: its connections,
// its version checks, its schema's text. The server's tests (store_test.go
// beside main.go) test the rest of it through its methods.

// testStore opens a store on a fresh data directory, closed at the end of
// the test.
func testStore(t *testing.T) *Store {
	t.Helper()
	st := openTestStore(t)
	t.Cleanup(func() { st.Close() })
	return st
}

// openTestStore opens a store on a fresh data directory; the caller
// closes it.
func openTestStore(t *testing.T) *Store {
	t.Helper()
	st, err := Open(context.Background(), t.TempDir(), time.Now, Quotas{})
	must(t, err)
	return st
}

// testUser adds a user, in a team of their own.
func testUser(t *testing.T, st *Store, email string) {
	t.Helper()
	_, err := st.CreateUser(context.Background(), email, email, model.RoleUser, "x", "")
	must(t, err)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestIsUniqueErr: isUniqueErr knows SQLite's UNIQUE and PRIMARY KEY
// refusals by their codes, wrapped or not, and nothing by its text.
func TestIsUniqueErr(t *testing.T) {
	t.Parallel()
	st := testStore(t)
	testUser(t, st, "ann@example.com")
	exec := func(query string) error {
		_, err := st.writer.Exec(query)
		return err
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"unique", exec(`INSERT INTO users (name, email, password_hash, created_at, team_id) SELECT name, email, 'x', 't', team_id FROM users`), true},
		{"primary key", exec(`INSERT INTO users (id, name, email, password_hash, created_at, team_id) SELECT id, name, 'b@example.com', 'x', 't', team_id FROM users`), true},
		{"wrapped", fmt.Errorf("insert user: %w", exec(`INSERT INTO teams (id, name, created_at) SELECT id, name, 't' FROM teams`)), true},
		{"check", exec(`UPDATE users SET role = 'owner'`), false},
		{"only the text", errors.New("UNIQUE constraint failed: users.email"), false},
		{"nil", nil, false},
	}
	for _, tt := range tests {
		if got := isUniqueErr(tt.err); got != tt.want {
			t.Errorf("%s: isUniqueErr(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// TestStorePragmas: every pooled connection, readers and the writer, has
// foreign keys, WAL and a busy timeout.
func TestStorePragmas(t *testing.T) {
	t.Parallel()
	st := testStore(t)
	ctx := context.Background()
	const readers = 4
	for i := range readers + 1 {
		db := st.reader.DB
		if i == readers {
			db = st.writer
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
	if n := st.reader.DB.Stats().OpenConnections; n < readers {
		t.Errorf("read pool has %d connections, want %d distinct ones checked", n, readers)
	}
}

// TestVersionChecksShare: a check of the data version may take a read
// that began after the caller's mark, never one that began before it.
func TestVersionChecksShare(t *testing.T) {
	t.Parallel()
	var v versionChecks
	v.finished.L = &v.mu
	reads := 0
	check := func(what string, mark, answer, want int64, wantReads int) {
		got, err := v.read(mark, func() (int64, error) { reads++; return answer, nil })
		if err != nil || got != want || reads != wantReads {
			t.Errorf("%s: got %d, %v after %d reads; want %d after %d", what, got, err, reads, want, wantReads)
		}
	}
	request := v.mark() // a request begins
	check("its token check", v.mark(), 1, 1, 1)
	check("its page lookup takes that read", request, 2, 1, 1)
	check("a check that begins after the read reads anew", v.mark(), 3, 3, 2)
}

// TestInsertCommandAfterClose: a request still running when the store has
// closed (a shutdown past its grace period) gets an error, not a panic.
func TestInsertCommandAfterClose(t *testing.T) {
	t.Parallel()
	st := openTestStore(t)
	st.Close()
	if err := st.InsertCommand(&model.Command{ID: "late"}, &DeviceRef{}, "", nil); !errors.Is(err, errStoreClosed) {
		t.Errorf("insertCommand after Close: got %v, want errStoreClosed", err)
	}
}

// TestSchemaSections: schema.sql's sections are numbered 1, 2, 3, … in
// order, so that a stray or mistyped heading cannot renumber the
// migrations that PRAGMA user_version counts.
func TestSchemaSections(t *testing.T) {
	t.Parallel()
	headings := regexp.MustCompile(`(?m)^-- version (\d+)`).FindAllStringSubmatch(schemaSQL, -1)
	if len(headings) != len(Migrations) {
		t.Fatalf("%d headings, %d migrations", len(headings), len(Migrations))
	}
	for i, h := range headings {
		if h[1] != strconv.Itoa(i+1) {
			t.Errorf("section %d is headed version %s", i+1, h[1])
		}
	}
}

// TestCheckpointFromReader: the writer leaves the WAL to checkpoint,
// which copies every frame of it into the database from a reader.
func TestCheckpointFromReader(t *testing.T) {
	t.Parallel()
	st := testStore(t)
	testUser(t, st, "wal@example.com")
	frames := func() (log, done int) {
		var busy int
		must(t, st.reader.DB.QueryRow(`PRAGMA wal_checkpoint(PASSIVE)`).Scan(&busy, &log, &done))
		return log, done
	}
	var auto int
	must(t, st.writer.QueryRow(`PRAGMA wal_autocheckpoint`).Scan(&auto))
	if auto != 0 {
		t.Errorf("the writer's wal_autocheckpoint: got %d, want 0", auto)
	}
	must(t, st.Checkpoint(context.Background()))
	if log, done := frames(); log == 0 || done != log {
		t.Errorf("after a checkpoint: %d frames in the WAL, %d copied; want all", log, done)
	}
}
