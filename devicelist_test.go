package main

import (
	"context"
	"fmt"
	"testing"
)

// addFleet gives the team n more devices, by SQL in one statement: in id
// order they cycle through the statuses, platforms esp32 and esp8266
// (boards devkitc, wroom and d1), and every tenth reports the md5
// 00…0<n%7>. Names are "fleet <n>", uids <platform>_fleet<team>x<n>.
func addFleet(tb testing.TB, st *store, teamID int64, n int) {
	tb.Helper()
	for _, key := range []string{"esp32", "esp8266"} {
		mustExec(tb, st, `INSERT INTO platforms (key, name) VALUES (?1, ?1) ON CONFLICT DO NOTHING`, key)
	}
	for _, key := range []string{"devkitc", "wroom", "d1"} {
		mustExec(tb, st, `INSERT INTO boards (key, name) VALUES (?1, ?1) ON CONFLICT DO NOTHING`, key)
	}
	mustExec(tb, st, `WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < ?2)
		INSERT INTO devices (uid, owner_id, name, status, platform_id, board_id, current_md5, created_at)
		SELECT iif(i % 2, 'esp32', 'esp8266') || printf('_fleet%dx%d', ?1, i), ?1, 'fleet ' || i,
			CASE i % 4 WHEN 0 THEN 'pending' WHEN 1 THEN 'online' WHEN 2 THEN 'offline' ELSE 'reconnecting' END,
			(SELECT id FROM platforms WHERE key = iif(i % 2, 'esp32', 'esp8266')),
			(SELECT id FROM boards WHERE key = CASE WHEN i % 2 = 0 THEN 'd1' WHEN i % 3 = 0 THEN 'wroom' ELSE 'devkitc' END),
			iif(i % 10 = 0, printf('%032d', i % 7), NULL), '2026-01-01T00:00:00.000000Z'
		FROM seq`, teamID, n)
}

func TestScratchPlans(t *testing.T) {
	env := newTestEnv(t, nil)
	u, _ := env.st.userByEmail(context.Background(), env.alice.email)
	addFleet(t, env.st, u.teamID, 20000)
	// no analyze
	for _, f := range []deviceFilter{{}, {statuses: []string{"online"}}, {statuses: []string{"online", "offline"}}, {platform: "esp32"}, {board: "d1"}, {platform: "esp32", board: "wroom"}, {q: "fleet 1"}, {statuses: []string{"online"}, platform: "esp32"}} {
		where, args := matchingDevices(u.teamID, f)
		for _, q := range []string{`SELECT ` + summaryColumns + summaryFrom + where + ` AND d.id > 5 ORDER BY d.id LIMIT 101`, `SELECT count(*) FROM devices d` + where} {
			rows, err := env.st.reader.db.Query("EXPLAIN QUERY PLAN "+q, args...)
			must(t, err)
			fmt.Println("==", f)
			for rows.Next() {
				var a, b, c int
				var d string
				rows.Scan(&a, &b, &c, &d)
				fmt.Println("  ", d)
			}
			rows.Close()
		}
	}
}
