package store

import (
	"context"
	"database/sql"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestSchemaNow: a database made from schema_now.sql has the tables,
// indexes and triggers of one that Open migrated from version 1, each
// the same but for layout, comments and quotes.
func TestSchemaNow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st, err := Open(ctx, t.TempDir(), time.Now, Quotas{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	migrated := schemaOf(t, st.reader.DB)

	now, err := os.ReadFile("schema_now.sql")
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "now.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, string(now)); err != nil {
		t.Fatalf("schema_now.sql: %v", err)
	}
	fresh := schemaOf(t, db)

	for _, name := range slices.Sorted(maps.Keys(migrated)) {
		if fresh[name] != migrated[name] {
			t.Errorf("%s:\n migrated: %s\nschema_now.sql: %s", name, migrated[name], fresh[name])
		}
	}
	for name := range fresh {
		if _, ok := migrated[name]; !ok {
			t.Errorf("%s: in schema_now.sql, not in a migrated database", name)
		}
	}
}

var (
	sqlComment = regexp.MustCompile(`--[^\n]*`)
	sqlSpace   = regexp.MustCompile(`\s+`)
	sqlPunct   = regexp.MustCompile(`\s*([(),;])\s*`)
)

// schemaOf returns the type and statement of each table, index and
// trigger of db by name, the statement without comments, quotes and
// layout.
func schemaOf(t *testing.T, db *sql.DB) map[string]string {
	rows, err := db.Query(`SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	schema := map[string]string{}
	for rows.Next() {
		var typ, name, text string
		if err := rows.Scan(&typ, &name, &text); err != nil {
			t.Fatal(err)
		}
		text = strings.ReplaceAll(sqlComment.ReplaceAllString(text, ""), `"`, "")
		text = sqlPunct.ReplaceAllString(sqlSpace.ReplaceAllString(text, " "), "$1")
		schema[name] = typ + ": " + strings.TrimSpace(text)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return schema
}
