package history

import (
	"database/sql"
	"os"
	"strings"
	"testing"

	_ "modernc.org/sqlite"
)

// TestPresencePlan: each presence statement finds a chunk's devices'
// open intervals from the chunk (by device id, in presence_device), never by
// walking every open interval of the fleet and the chunk for each
// (presence_age, to_at IS NULL), which made a restart's million statuses
// quadratic: 100,000 retained statuses applied 4,000 in 3 minutes.
func TestPresencePlan(t *testing.T) {
	db, err := sql.Open("sqlite", "file::memory:")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	schema, err := os.ReadFile("../store/schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(string(schema)); err != nil {
		t.Fatalf("schema.sql: %v", err)
	}
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
