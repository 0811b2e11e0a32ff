package history

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"testing"
	"time"

	_ "modernc.org/sqlite"
)

// TestPresencePlan: each presence statement finds a chunk's devices'
// open intervals from the chunk (by device id, in presence_device), never by
// walking every open interval of the fleet and the chunk for each
// (presence_age, to_at IS NULL), which made a restart's million statuses
// quadratic: 100,000 retained statuses applied 4,000 in 3 minutes.
func TestPresencePlan(t *testing.T) {
	db := openSchema(t)
	args := make([]any, 0, 2*presenceChunk+1)
	for range presenceChunk {
		args = append(args, 1, true)
	}
	args = append(args, sql.Named("now", 1e9))
	values := `WITH r(d, o) AS (VALUES (?, ?)` + strings.Repeat(`, (?, ?)`, presenceChunk-1) + `) `
	for _, q := range append(presenceStmts, offlineStmt) {
		rows, err := db.Query("EXPLAIN QUERY PLAN "+values+q, args...)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		var plan []string
		for rows.Next() {
			var id, parent, unused int
			var detail string
			if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, detail)
		}
		rows.Close()
		text := strings.Join(plan, "\n")
		if !strings.Contains(text, "presence_device (device_id=? AND to_at=?)") {
			t.Errorf("%s:\ngot plan\n%s\nwant presence searched by presence_device (device_id=? AND to_at=?)", q, text)
		}
	}
}

// TestPresenceChunks: a flush of more changes than a chunk holds writes
// every device's interval, though its chunks differ in size and only some
// run the offline statement: each statement is prepared for its chunk's
// size (recordChunks).
func TestPresenceChunks(t *testing.T) {
	db := openSchema(t)
	var changes []Change
	for id := range int64(presenceChunk + 1) {
		changes = append(changes, Change{DeviceID: id + 1, Online: id < presenceChunk}) // the last chunk, alone, offline
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if err := RecordPresence(context.Background(), tx, time.Unix(1e9, 0), changes); err != nil {
		t.Fatalf("presence of %d devices: %v", len(changes), err)
	}
	var open, online int
	if err := tx.QueryRow(`SELECT count(*), sum(online) FROM presence WHERE to_at IS NULL`).Scan(&open, &online); err != nil {
		t.Fatal(err)
	}
	if open != presenceChunk+1 || online != presenceChunk {
		t.Errorf("%d open intervals, %d online; want %d, %d", open, online, presenceChunk+1, presenceChunk)
	}
}

// openSchema opens a database in memory with schema.sql applied.
func openSchema(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file::memory:")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	schema, err := os.ReadFile("../store/schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(string(schema)); err != nil {
		t.Fatalf("schema.sql: %v", err)
	}
	return db
}
