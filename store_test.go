package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// storeAt opens the store in dir, closed at the end of the test: another
// process on the same data directory, or the same one after a restart.
// A test that closes it itself uses openAt.
func storeAt(tb testing.TB, dir string) *store.Store {
	tb.Helper()
	st := openAt(tb, dir)
	tb.Cleanup(func() { st.Close() })
	return st
}

// openAtVersion opens the store in dir as the release that knew the
// first version migrations did; the caller closes it. It swaps the
// package's migrations while it opens: its callers must not run in
// parallel.
func openAtVersion(tb testing.TB, dir string, version int) *store.Store {
	orig := store.Migrations
	defer func() { store.Migrations = orig }()
	store.Migrations = orig[:version]
	return openAt(tb, dir)
}

// storeAtVersion is openAtVersion, closed at the end of the test.
func storeAtVersion(tb testing.TB, dir string, version int) *store.Store {
	tb.Helper()
	st := openAtVersion(tb, dir, version)
	tb.Cleanup(func() { st.Close() })
	return st
}

// openAt opens the store in dir; the caller closes it.
func openAt(tb testing.TB, dir string) *store.Store {
	tb.Helper()
	st, err := store.Open(context.Background(), dir, time.Now, store.Quotas{})
	must(tb, err)
	return st
}

// storeUser creates a user with a device on st and returns the user's id
// and the device's internal id and uid.
func storeUser(t *testing.T, st *store.Store, email string) (userID, deviceID int64, uid string) {
	t.Helper()
	ctx := context.Background()
	userID, err := st.CreateUser(ctx, email, email, "user", "x", "")
	if err == nil {
		uid, err = createDeviceOf(ctx, st, email, "esp32", "devkit", "")
	}
	if err != nil {
		t.Fatalf("create user and device: %v", err)
	}
	d, err := st.Device(ctx, userID, uid)
	must(t, err)
	return userID, d.ID, uid
}

func TestStoreMigrate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st := openAt(t, dir)
	version := fmt.Sprint(len(store.Migrations))
	wantDB(t, st, version, `PRAGMA user_version`)
	wantDB(t, st, "audit boards boots command_buttons commands devices firmware_runs firmwares fleet_hours history_rows invites known_clients legacy_buckets legacy_series library_firmwares password_resets platforms presence rollout_devices rollouts sqlite_sequence teams tokens users webhook_deliveries webhook_queue webhooks",
		`SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name)`)
	userID, deviceID, uid := storeUser(t, st, "keep@example.com")
	st.Close()

	// Reopening migrates nothing and keeps the data.
	st = openAt(t, dir)
	wantDB(t, st, version, `PRAGMA user_version`)
	if d, err := st.Device(context.Background(), userID, uid); err != nil || d.ID != deviceID {
		t.Errorf("device after reopening: got %v, %v; want id %d", d, err, deviceID)
	}

	// A newer schema than the program knows is refused.
	mustExec(t, st, fmt.Sprintf(`PRAGMA user_version = %d`, len(store.Migrations)+1))
	st.Close()
	if st, err := store.Open(context.Background(), dir, time.Now, store.Quotas{}); err == nil {
		st.Close()
		t.Error("openStore on a newer schema: got nil error")
	}
}

// TestStoreMigrationAtomic: a migration that fails leaves neither its
// changes nor a new version behind, and a later good one applies. It
// swaps the package's migrations, so it must not run in parallel.
func TestStoreMigrationAtomic(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	orig := store.Migrations
	t.Cleanup(func() { store.Migrations = orig })
	dir := t.TempDir()
	openAt(t, dir).Close()

	store.Migrations = append(slices.Clone(orig), `CREATE TABLE extra (x TEXT); INSERT INTO no_such_table VALUES (1);`)
	if st, err := store.Open(context.Background(), dir, time.Now, store.Quotas{}); err == nil {
		st.Close()
		t.Fatal("openStore with a failing migration: got nil error")
	}
	store.Migrations = orig
	st := openAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(orig)), `PRAGMA user_version`)
	wantDB(t, st, "0", `SELECT count(*) FROM sqlite_master WHERE name = 'extra'`)
	st.Close()

	store.Migrations = append(slices.Clone(orig), `CREATE TABLE extra (x TEXT);`)
	wantDB(t, storeAt(t, dir), fmt.Sprint(len(orig)+1), `PRAGMA user_version`)
}

// oldFleet is the data of a release before teams, written as SQL that
// holds from schema version 3 on: two users with tokens (a gap in their
// ids), devices, a firmware, a button, a command and a rollout.
const oldFleet = `
INSERT INTO users (id, name, email, role, password_hash, created_at) VALUES
	(1, 'Alice', 'alice@example.com', 'user', 'x', '2026-01-01T00:00:00.000000Z'),
	(2, 'Bob', 'bob@example.com', 'user', 'x', '2026-01-01T00:00:00.000000Z');
INSERT INTO tokens (id, user_id, name, secret_hash, created_at) VALUES
	(1, 1, 'a', x'01', '2026-01-01T00:00:00.000000Z'), (3, 2, 'b', x'03', '2026-01-01T00:00:00.000000Z');
INSERT INTO platforms (id, key, name) VALUES (1, 'esp32', 'esp32');
INSERT INTO boards (id, key, name) VALUES (1, 'devkit', 'devkit');
INSERT INTO devices (id, uid, owner_id, name, platform_id, board_id, created_at) VALUES
	(1, 'esp32_a1', 1, 'A1', 1, 1, '2026-01-01T00:00:00.000000Z'),
	(2, 'esp32_a2', 1, 'A2', 1, 1, '2026-01-01T00:00:00.000000Z'),
	(3, 'esp32_b1', 2, 'B1', 1, 1, '2026-01-01T00:00:00.000000Z');
INSERT INTO firmwares (id, device_id, name, md5, size, created_at, sha256) VALUES
	(1, 1, 'fw', 'md5a', 4, '2026-01-01T00:00:00.000000Z', 'shaa'),
	(2, 2, 'fw', 'md5a', 4, '2026-01-01T00:00:00.000000Z', 'shaa');
INSERT INTO command_buttons (device_id, id, label, payload) VALUES (1, 'b', 'B', '{}');
INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline) VALUES
	('c1', 1, 'reboot', '{}', 'sent', '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:30.000000Z');
INSERT INTO rollouts (id, owner_id, md5, sha256, state, batch_size, max_failures, created_at, updated_at) VALUES
	(1, 1, 'md5a', 'shaa', 'running', 1, 0, '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:00.000000Z');
INSERT INTO rollout_devices (rollout_id, position, device_id, state) VALUES (1, 0, 1, 'waiting'), (1, 1, 2, 'waiting');`

// oldReleaseDB makes, in a new directory, the database of a release that
// knew the first version migrations, holding oldFleet. It swaps the
// package's migrations meanwhile: its callers must not run in parallel
// (the parallel tests start once they have ended).
func oldReleaseDB(t *testing.T, version int) (dir string, old *store.Store) {
	orig := store.Migrations
	t.Cleanup(func() { store.Migrations = orig })
	store.Migrations = orig[:version]
	dir = t.TempDir()
	old = storeAt(t, dir)
	mustExec(t, old, oldFleet)
	store.Migrations = orig
	return dir, old
}

// TestStoreMigrateAutoincrement: version 4 rebuilds the tables of a
// database made by the release before (version 3) with AUTOINCREMENT,
// keeping every row, id and index; ids then go on from the largest ever
// handed out, so a deleted one never comes back.
func TestStoreMigrateAutoincrement(t *testing.T) {
	// Not parallel: it swaps the package's migrations (oldReleaseDB).
	ctx := context.Background()
	orig := store.Migrations
	_, old := oldReleaseDB(t, 3)
	dir := t.TempDir()
	must(t, old.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))

	store.Migrations = orig[:5] // up to the release before teams
	st := storeAt(t, dir)
	wantDB(t, st, "5", `PRAGMA user_version`)
	sameState(t, "the migration", dbState(t, old), dbState(t, st))
	schema := `SELECT group_concat(type || ' ' || name || ' ' || tbl_name || ' ' || coalesce(sql, ''), char(10))
		FROM (SELECT * FROM sqlite_master WHERE type != 'table' ORDER BY name)`
	if before, after := scalar(t, old, schema), scalar(t, st, schema); before != after {
		t.Errorf("indexes:\nbefore %s\nafter  %s", before, after)
	}
	tables := []string{"devices", "firmwares", "rollouts", "tokens", "users"}
	wantDB(t, st, strings.Join(tables, ","), `SELECT group_concat(name) FROM
		(SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE '%AUTOINCREMENT%' ORDER BY name)`)
	var seqs []string
	for _, table := range tables {
		seqs = append(seqs, table+" "+scalar(t, old, `SELECT max(id) FROM `+table))
	}
	wantDB(t, st, strings.Join(seqs, ","), `SELECT group_concat(name || ' ' || seq) FROM (SELECT * FROM sqlite_sequence ORDER BY name)`)

	// The newest token and firmware deleted, the next ones get new ids.
	newest := func(table string) int64 {
		n, err := strconv.ParseInt(scalar(t, st, `SELECT max(id) FROM `+table), 10, 64)
		must(t, err)
		return n
	}
	tok := newest("tokens")
	mustExec(t, st, `DELETE FROM tokens WHERE id = ?`, tok)
	if id, _, err := issueToken(ctx, st, 2, "next", nil, nil); err != nil || id <= tok {
		t.Errorf("token after deleting token %d: id %d (%v), want a new one", tok, id, err)
	}
	fw := newest("firmwares")
	mustExec(t, st, `UPDATE devices SET target_firmware_id = NULL`)
	mustExec(t, st, `DELETE FROM firmwares WHERE id = ?`, fw)
	mustExec(t, st, `INSERT INTO firmwares (device_id, name, md5, sha256, size, created_at)
		SELECT device_id, name, 'next', sha256, size, created_at FROM firmwares WHERE id = 1`)
	if id := newest("firmwares"); id != fw+1 {
		t.Errorf("firmware after deleting firmware %d: id %d, want %d", fw, id, fw+1)
	}
}

// TestStoreMigrateTeams: version 6 puts each user of the release before
// teams in a team of their own, with their devices and rollouts, as its
// admin; through the API nobody sees anything new.
func TestStoreMigrateTeams(t *testing.T) {
	// Not parallel: it swaps the package's migrations (oldReleaseDB).
	ctx := context.Background()
	_, old := oldReleaseDB(t, 5)
	dir := t.TempDir()
	must(t, old.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))
	before := dbState(t, old)
	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	wantDB(t, st, "1 Alice 1 admin,2 Bob 2 admin", `SELECT group_concat(t.id || ' ' || t.name || ' ' || u.id || ' ' || u.role)
		FROM users u JOIN teams t ON t.id = u.team_id`)
	wantDB(t, st, "0 0", `SELECT (SELECT count(*) FROM commands WHERE sent_by IS NOT NULL) || ' ' ||
		(SELECT count(*) FROM rollouts WHERE created_by IS NOT NULL)`)
	after := dbState(t, st)
	for _, kind := range []string{"device", "firmware", "button", "command", "rollout", "rollout device", "token"} {
		for _, teamID := range []int64{1, 2} {
			keep := func(rows []string) (out []string) {
				for _, r := range rows {
					if strings.HasPrefix(r, kind+" |") {
						for strings.HasSuffix(r, " | <nil>") { // sent_by, created_by, and version 9's health, halt_reason
							r = strings.TrimSuffix(r, " | <nil>")
						}
						out = append(out, r)
					}
				}
				return out
			}
			if b, a := keep(before[teamID]), keep(after[teamID]); !slices.Equal(b, a) {
				t.Errorf("owner %d's %ss: before %q, after %q", teamID, kind, b, a)
			}
		}
	}

	srv := newTestServer(t, testOptions(st, &recordingLink{}, testLogger(t)))
	env := &testEnv{t: t, st: st, srv: srv}
	for _, u := range []struct {
		id                int64
		devices, rollouts string
	}{{1, "esp32_a1,esp32_a2", "1"}, {2, "esp32_b1", ""}} {
		_, tok, err := issueToken(ctx, st, u.id, "t", nil, nil)
		must(t, err)
		var devices, rollouts struct{ Data []map[string]any }
		for path, into := range map[string]any{"/v1/user/devices": &devices, "/v1/user/rollouts": &rollouts} {
			must(t, json.Unmarshal(env.want(t, 200, "GET", path, tok, nil).Body.Bytes(), into))
		}
		var uids, ids []string
		for _, d := range devices.Data {
			uids = append(uids, d["uid"].(string))
		}
		for _, r := range rollouts.Data {
			ids = append(ids, fmt.Sprint(r["id"]))
		}
		if got := strings.Join(uids, ","); got != u.devices || strings.Join(ids, ",") != u.rollouts {
			t.Errorf("user %d sees devices %s and rollouts %v, want %s and %s", u.id, got, ids, u.devices, u.rollouts)
		}
		if got := decode(t, env.want(t, 200, "GET", "/v1/user/team", tok, nil))["data"].(map[string]any)["members"].([]any); len(got) != 1 {
			t.Errorf("user %d's team has members %v, want only them", u.id, got)
		}
	}
}

// release9Fleet adds to oldFleet, once migrated to version 9, rows in
// every state and role, and a user, a device and a rollout deleted after
// the largest ids, so that their sequences run past those ids.
const release9Fleet = `
UPDATE devices SET status = 'online' WHERE uid = 'esp32_a1';
UPDATE devices SET status = 'offline' WHERE uid = 'esp32_a2';
UPDATE devices SET status = 'reconnecting' WHERE uid = 'esp32_b1';
INSERT INTO devices (uid, owner_id, name, platform_id, board_id, created_at) VALUES
	('esp32_a3', 1, 'A3', 1, 1, '2026-01-02T00:00:00.000000Z'), ('esp32_gone', 1, 'Gone', 1, 1, '2026-01-02T00:00:00.000000Z');
DELETE FROM devices WHERE uid = 'esp32_gone';
INSERT INTO users (name, email, role, password_hash, created_at, team_id) VALUES
	('Vic', 'vic@example.com', 'viewer', 'x', '2026-01-02T00:00:00.000000Z', 1),
	('Gone', 'gone@example.com', 'user', 'x', '2026-01-02T00:00:00.000000Z', 1);
DELETE FROM users WHERE email = 'gone@example.com';
INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, finished_at, deadline, sent_by) VALUES
	('c2', 1, 'ota', '{}', 'running', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', NULL, '2026-01-02T00:15:00.000000Z', 1),
	('c3', 2, 'ota', '{}', 'succeeded', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:01:00.000000Z', '2026-01-02T00:01:00.000000Z', '2026-01-02T00:15:00.000000Z', 1),
	('c4', 1, 'ota', '{}', 'failed', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:01:00.000000Z', '2026-01-02T00:01:00.000000Z', '2026-01-02T00:15:00.000000Z', NULL),
	('c5', 2, 'ota', '{}', 'timed_out', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:15:00.000000Z', '2026-01-02T00:15:00.000000Z', '2026-01-02T00:15:00.000000Z', NULL);
INSERT INTO rollouts (owner_id, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at, created_by) VALUES
	(1, 'md5a', 'shaa', 'paused', 1, 0, '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', NULL, 1),
	(1, 'md5a', 'shaa', 'halted', 1, 0, '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:16:00.000000Z', NULL),
	(2, 'md5b', 'shab', 'cancelled', 1, 0, '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:16:00.000000Z', 2),
	(1, 'md5a', 'shaa', 'completed', 2, 0, '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', '2026-01-02T00:16:00.000000Z', 1),
	(1, 'md5a', 'shaa', 'running', 1, 0, '2026-01-02T00:00:00.000000Z', '2026-01-02T00:00:00.000000Z', NULL, 1);
DELETE FROM rollouts WHERE id = (SELECT max(id) FROM rollouts);
INSERT INTO rollout_devices (rollout_id, position, device_id, state, command_id, error) VALUES
	(2, 0, 1, 'running', 'c2', NULL), (2, 1, 4, 'pending', NULL, NULL), (3, 0, 1, 'failed', 'c4', 'no space'),
	(3, 1, 2, 'timed_out', 'c5', NULL), (4, 0, 3, 'skipped', NULL, NULL), (5, 0, 2, 'succeeded', 'c3', NULL);`

// TestStoreMigrateChecks: version 10 rebuilds the tables of a database
// made by the release before (version 9) with CHECK constraints on the
// states and roles, and team_id for owner_id, keeping every row and id,
// the sequences that keep deleted ids from coming back, and the indexes
// under their new names. A bad value is refused then (TestStatesMatchSchema).
func TestStoreMigrateChecks(t *testing.T) {
	// Not parallel: it swaps the package's migrations (oldReleaseDB).
	ctx := context.Background()
	_, v5 := oldReleaseDB(t, 5)
	dir9, dir10 := t.TempDir(), t.TempDir()
	must(t, v5.VacuumInto(ctx, filepath.Join(dir9, "devicehub.db")))
	old := storeAtVersion(t, dir9, 9)
	mustExec(t, old, release9Fleet)
	must(t, old.VacuumInto(ctx, filepath.Join(dir10, "devicehub.db")))

	st := storeAt(t, dir10)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	sameState(t, "the migration", dbState(t, old), dbState(t, st))
	sequences := `SELECT group_concat(name || ' ' || seq) FROM (SELECT * FROM sqlite_sequence ORDER BY name)`
	for _, db := range []*store.Store{old, st} {
		wantDB(t, db, "devices 5,firmwares 2,rollouts 6,teams 2,tokens 3,users 4", sequences)
	}
	indexes := func(db *store.Store, rename *strings.Replacer) []string {
		names := strings.Fields(rename.Replace(scalar(t, db, `SELECT group_concat(name, ' ') FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL`)))
		slices.Sort(names)
		return names
	}
	// Version 21 found the open presence intervals by presence_device.
	if before, after := indexes(old, strings.NewReplacer("_owner", "_team", "presence_open", "")), indexes(st, strings.NewReplacer("commands_team_finished", "",
		"boots_age", "", "firmware_runs_age", "", "history_rows_age", "", "presence_age", "",
		"webhooks_team", "", "webhook_queue_webhook", "", "webhook_deliveries_webhook", "", "rollouts_reverts", "")); !slices.Equal(before, after) { // and version 14's, 16's, 18's and 19's
		t.Errorf("indexes: before %q (renamed), after %q", before, after)
	}
	wantDB(t, st, "0", `SELECT count(*) FROM sqlite_master WHERE sql LIKE '%owner_id%'`)
	wantDB(t, st, "9", `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND sql LIKE '%CHECK (%'`) // and invites' role, version 12, history_rows' step, 16, and the webhook queue's and deliveries' type, 20

	// Nothing given out again: the next ids follow the deleted ones.
	id, err := st.CreateUser(ctx, "Next", "next@example.com", model.RoleUser, "x", "")
	must(t, err)
	uid, err := createDeviceOf(ctx, st, "next@example.com", "esp32", "devkit", "")
	must(t, err)
	wantDB(t, st, "5 6", `SELECT ?1 || ' ' || id FROM devices WHERE uid = ?2`, id, uid)
}

// TestStatesMatchSchema: each list of internal/model/states.go, and the
// types a webhook's queue holds (webhooks.go), is the one the CHECK
// constraint of its column names, in the same order, and the database
// refuses a value that is not in it.
func TestStatesMatchSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := storeAt(t, t.TempDir())
	teamID, deviceID, _ := storeUser(t, st, "ann@example.com")
	mustExec(t, st, `INSERT INTO rollouts (team_id, md5, sha256, state, batch_size, max_failures, created_at, updated_at)
		VALUES (?, 'm', 's', 'running', 1, 0, 't', 't')`, teamID)
	mustExec(t, st, `INSERT INTO webhooks (team_id, url, events, offline_minutes, secret, created_at, offline_checked_at)
		VALUES (?, 'https://203.0.113.7/', '[]', 5, 's', 't', 't')`, teamID)
	tests := []struct {
		table, column, list string
		insert              string // with the value as ?1
	}{
		{"users", "role", store.SQLIn(model.Roles...),
			`INSERT INTO users (name, email, role, password_hash, created_at, team_id) VALUES ('B', 'b@example.com', ?1, 'x', 't', ?2)`},
		{"devices", "status", store.SQLIn(model.DeviceStatuses...),
			`INSERT INTO devices (uid, team_id, name, status, platform_id, board_id, created_at) SELECT 'u', ?2, 'n', ?1, platform_id, board_id, 't' FROM devices`},
		{"commands", "state", store.SQLIn(model.CommandStates...),
			`INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline) VALUES ('c', ?3, 'reboot', '{}', ?1, 't', 't', 't')`},
		{"rollouts", "state", store.SQLIn(model.RolloutStates...),
			`INSERT INTO rollouts (team_id, md5, sha256, state, batch_size, max_failures, created_at, updated_at) VALUES (?2, 'm', 's', ?1, 1, 0, 't', 't')`},
		{"rollout_devices", "state", store.SQLIn(model.RolloutDeviceStates...),
			`INSERT INTO rollout_devices (rollout_id, position, device_id, state) SELECT id, 1, ?3, ?1 FROM rollouts`},
		{"commands", "kind", store.SQLIn(model.CommandKinds...),
			`INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline) VALUES ('k', ?3, ?1, '{}', 'sent', 't', 't', 't')`},
		{"webhook_queue", "type", store.SQLIn(webhookQueuedTypes...),
			`INSERT INTO webhook_queue (webhook_id, event_id, type, body) SELECT id, 'e', ?1, '{}' FROM webhooks`},
		{"webhook_deliveries", "type", store.SQLIn(webhookQueuedTypes...),
			`INSERT INTO webhook_deliveries (id, webhook_id, event_id, type, at, duration_ms, attempt) SELECT 'd', id, 'e', ?1, 't', 0, 1 FROM webhooks`},
	}
	for _, tt := range tests {
		t.Run(tt.table+"."+tt.column, func(t *testing.T) {
			wantDB(t, st, "1", `SELECT instr(sql, ?) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?`,
				"CHECK ("+tt.column+" IN "+tt.list+")", tt.table)
			insert := func(value string) error {
				tx, err := storeWriter(st).BeginTx(ctx, nil)
				must(t, err)
				defer tx.Rollback()
				_, err = tx.ExecContext(ctx, tt.insert, value, teamID, deviceID)
				return err
			}
			for _, value := range strings.Split(strings.Trim(tt.list, "()'"), "', '") {
				if err := insert(value); err != nil {
					t.Errorf("%s %q: %v", tt.column, value, err)
				}
			}
			if err := insert("bogus"); err == nil || !strings.Contains(err.Error(), "CHECK constraint failed") {
				t.Errorf("%s %q: got %v, want a CHECK constraint failure", tt.column, "bogus", err)
			}
		})
	}
}

// TestStoreMigrateInvites: version 12 moves each member of the release
// before who had not set a password yet to an invite, under their id,
// with their link; the users' sequence goes on from where it was, so that
// the next member invited gets an id no user has had, and a moved link
// still makes its member's account under the same id.
func TestStoreMigrateInvites(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	ctx := context.Background()
	dir := t.TempDir()
	old := openAtVersion(t, dir, 11)
	const at = "2026-01-01T00:00:00.000000Z"
	mustExec(t, old, `INSERT INTO teams (id, name, created_at) VALUES (1, 'A', ?1), (2, 'B', ?1);
		INSERT INTO users (id, team_id, name, email, role, password_hash, created_at) VALUES
			(1, 1, 'Alice', 'alice@example.com', 'admin', 'x', ?1), (2, 2, 'Bob', 'bob@example.com', 'admin', 'x', ?1),
			(3, 1, 'Carol', 'carol@example.com', 'viewer', '', ?1), (4, 2, 'Dave', 'dave@example.com', 'user', '', ?1),
			(5, 2, 'Erin', 'erin@example.com', 'user', 'x', ?1);
		DELETE FROM users WHERE id = 5;
		INSERT INTO invites (user_id, secret_hash, expires_at) VALUES (3, ?2, '2099-01-01T00:00:00.000000Z'), (4, x'04', ?1);`,
		at, hashSecret("carol's secret"))
	old.Close()
	v14 := openAtVersion(t, dir, 14)
	wantDB(t, v14, "1 alice@example.com,2 bob@example.com", `SELECT group_concat(id || ' ' || email) FROM users`)
	wantDB(t, v14, fmt.Sprintf("3 1 Carol carol@example.com viewer %X 2099-01-01T00:00:00.000000Z %[2]s,4 2 Dave dave@example.com user 04 %[2]s %[2]s",
		hashSecret("carol's secret"), at), `SELECT group_concat(id || ' ' || team_id || ' ' || name || ' ' || email || ' ' || role || ' ' ||
		hex(secret_hash) || ' ' || expires_at || ' ' || created_at) FROM invites`)
	// Version 15 ends the links whose maker is unknown: Dave's.
	mustExec(t, v14, `UPDATE invites SET invited_by = 1 WHERE id = 3`)
	v14.Close()
	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	wantDB(t, st, "3", `SELECT group_concat(id) FROM invites`)
	m, err := st.InviteMember(ctx, 1, 1, "Fred", "fred@example.com", model.RoleUser, hashSecret("fred's"), time.Now().Add(time.Hour), nil)
	if err != nil || m.ID != 6 {
		t.Errorf("next member invited: got %+v, %v; want id 6, past the users' sequence", m, err)
	}
	u, err := st.RedeemInvite(ctx, hashSecret("carol's secret"), "carol's hash")
	if err != nil || u.ID != 3 || u.TeamID != 1 || u.Role != model.RoleViewer {
		t.Errorf("carol's moved link: got %+v, %v; want user 3, a viewer of team 1", u, err)
	}
}

// TestStoreMigratePlatformKeys: version 11 gives each team its own row of
// each platform and board key its devices use, numbered with the key's
// old id, so that no device shows another id than before; a key that no
// device used goes; a new key is then numbered after the team's own keys
// only.
func TestStoreMigratePlatformKeys(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	ctx := context.Background()
	orig := store.Migrations
	t.Cleanup(func() { store.Migrations = orig })
	store.Migrations = orig[:10] // the release before version 11
	old := storeAt(t, t.TempDir())
	mustExec(t, old, `
INSERT INTO teams (id, name, created_at) VALUES (1, 'A', 'x'), (2, 'B', 'x'), (3, 'C', 'x');
INSERT INTO users (id, name, email, role, password_hash, created_at, team_id) VALUES
	(1, 'A', 'a@example.com', 'admin', 'x', 'x', 1), (2, 'B', 'b@example.com', 'admin', 'x', 'x', 2),
	(3, 'C', 'c@example.com', 'admin', 'x', 'x', 3);
INSERT INTO platforms (id, key, name) VALUES (1, 'esp32', 'ESP32'), (2, 'esp8266', 'esp8266'), (3, 'rp2040', 'rp2040');
INSERT INTO boards (id, key, name) VALUES (1, 'devkit', 'devkit'), (2, 'd1', 'd1');
INSERT INTO devices (id, uid, team_id, name, platform_id, board_id, created_at) VALUES
	(1, 'esp32_a', 1, 'a', 1, 1, 'x'), (2, 'esp8266_a', 1, 'a', 2, 2, 'x'),
	(3, 'esp32_b', 2, 'b', 1, 1, 'x'), (4, 'esp8266_c', 3, 'c', 2, 1, 'x');`)
	before := dbState(t, old)
	dir := t.TempDir()
	must(t, old.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))

	store.Migrations = orig
	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	sameState(t, "the migration", before, dbState(t, st))
	keys := func(table string) string {
		return scalar(t, st, `SELECT group_concat(team_id || ' ' || number || ' ' || key || ' ' || name, ',')
			FROM (SELECT * FROM `+table+` ORDER BY team_id, number)`)
	}
	if got, want := keys("platforms"), "1 1 esp32 ESP32,1 2 esp8266 esp8266,2 1 esp32 ESP32,3 2 esp8266 esp8266"; got != want {
		t.Errorf("platforms: got %s, want %s", got, want)
	}
	if got, want := keys("boards"), "1 1 devkit devkit,1 2 d1 d1,2 1 devkit devkit,3 1 devkit devkit"; got != want {
		t.Errorf("boards: got %s, want %s", got, want)
	}
	// Each device shows the ids it showed before, from rows of its team.
	wantDB(t, st, "esp32_a 1 1,esp8266_a 2 2,esp32_b 1 1,esp8266_c 2 1", `SELECT group_concat(d.uid || ' ' || p.number || ' ' || b.number, ',')
		FROM devices d JOIN platforms p ON p.id = d.platform_id AND p.team_id = d.team_id
		JOIN boards b ON b.id = d.board_id AND b.team_id = d.team_id ORDER BY d.id`)

	// A key new to the team comes after the team's own, whoever else
	// used it: team 3 has platform 2 and board 1.
	uid, err := st.CreateDevice(ctx, 3, store.NewDevice{Platform: "esp32", Board: "wroom"}, nil)
	must(t, err)
	d, err := st.Device(ctx, 3, uid)
	must(t, err)
	if d.Platform.ID != 3 || d.Board.ID != 2 {
		t.Errorf("team 3's next platform and board: ids %d and %d, want 3 and 2", d.Platform.ID, d.Board.ID)
	}
}

// TestStoreMigrateTeamData: version 14 counts what each team's JSON
// weighs, in bytes, from the rows a database of the release before holds
// (multi-byte characters counted as bytes), and keeps counting as rows
// come and go.
func TestStoreMigrateTeamData(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	dir := t.TempDir()
	old := openAtVersion(t, dir, 13)
	const at = "2026-01-01T00:00:00.000000Z"
	mustExec(t, old, `INSERT INTO teams (id, name, created_at) VALUES (1, 'A', ?1), (2, 'B', ?1), (3, 'C', ?1);
		INSERT INTO platforms (id, team_id, number, key, name) VALUES (1, 1, 1, 'esp32', 'esp32'), (2, 2, 1, 'esp32', 'esp32');
		INSERT INTO boards (id, team_id, number, key, name) VALUES (1, 1, 1, 'devkit', 'devkit'), (2, 2, 1, 'devkit', 'devkit');
		INSERT INTO devices (id, uid, team_id, name, platform_id, board_id, created_at) VALUES
			(1, 'a1', 1, 'a1', 1, 1, ?1), (2, 'a2', 1, 'a2', 1, 1, ?1), (3, 'b1', 2, 'b1', 2, 2, ?1);
		INSERT INTO command_buttons (device_id, id, label, payload) VALUES (1, 'x', 'X', '{"é":1}'), (3, 'y', 'Y', '{}');
		INSERT INTO commands (id, device_id, kind, payload, state, result, created_at, updated_at, finished_at, deadline) VALUES
			('c1', 1, 'custom', '{"n":1}', 'succeeded', '{"ok":"ü"}', ?1, ?1, ?1, ?1),
			('c2', 2, 'custom', '{}', 'sent', NULL, ?1, ?1, NULL, ?1),
			('c3', 3, 'reboot', '{}', 'sent', NULL, ?1, ?1, NULL, ?1);`, at)
	old.Close()
	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	counts := `SELECT group_concat(id || ':' || button_bytes || '+' || command_bytes, ' ') FROM teams`
	wantDB(t, st, "1:8+20 2:2+2 3:0+0", counts) // {"é":1} is 8 bytes (7 characters); {"n":1} 7, {"ok":"ü"} 11, {} 2
	mustExec(t, st, `UPDATE commands SET result = '{"ok":true}' WHERE id = 'c2'`)
	mustExec(t, st, `DELETE FROM commands WHERE id = 'c1'`)
	wantDB(t, st, "1:8+13 2:2+2 3:0+0", counts)
	mustExec(t, st, `DELETE FROM devices WHERE id = 1`)
	mustExec(t, st, `DELETE FROM teams WHERE id = 2`)
	wantDB(t, st, "1:0+13 3:0+0", counts)
}

// TestIDsNeverReused: through the API, a token or firmware created after
// the newest one was deleted gets a new id, so that an id kept by a client
// or an admin never names something else.
func TestIDsNeverReused(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	a := env.alice
	for _, tt := range []struct {
		what, path string
		create     func(i byte) string // returns the id
	}{
		{"token", "/v1/user/tokens/", func(byte) string {
			w := env.request("POST", "/v1/user/tokens", a.token, map[string]string{"name": "t"})
			return fmt.Sprint(decode(t, w)["data"].(map[string]any)["id"])
		}},
		{"firmware", "/v1/user/devices/" + a.device + "/firmwares/", func(i byte) string {
			return apiUpload(env, a, "f", otaFirmware(1<<10, i))
		}},
	} {
		first := tt.create(1)
		apiWantStatus(t, env, "DELETE", tt.path+first, a.token, http.StatusOK)
		n1, _ := strconv.Atoi(first)
		if n2, _ := strconv.Atoi(tt.create(2)); n2 <= n1 {
			t.Errorf("%s after deleting %s %d: id %d, want a new one", tt.what, tt.what, n1, n2)
		}
	}
}

// TestStoreCleanFirmwareFiles: opening the store removes unfinished uploads
// and files without a row, and keeps files that rows need, also one that a
// removal had moved aside.
func TestStoreCleanFirmwareFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st := openAt(t, dir)
	_, _, uid := storeUser(t, st, "a@example.com")
	sha := addFirmwareFile(t, st, uid, []byte("\xe9a firmware with a row"))
	st.Close()
	fw := filepath.Join(dir, "firmware")
	for _, name := range []string{strings.Repeat("ab", 16) + ".bin", "tmp/upload-123", "tmp/upload-456", strings.Repeat("cd", 32) + ".bin.x1"} {
		must(t, os.WriteFile(filepath.Join(fw, name), []byte("left by a crash"), 0o600))
	}
	// Moved aside by a removal that crashed before its commit: it goes back.
	must(t, os.Rename(filepath.Join(fw, sha+".bin"), filepath.Join(fw, "tmp", sha+".bin.x2")))
	st = storeAt(t, dir)
	checkFirmwareFiles(t, storeReader(st), fw)
	wantDB(t, st, "1", `SELECT count(*) FROM firmwares`)
}

// TestStoreRemovalBesideUpload: `device remove` and `user remove
// -with-devices`, run beside the service, never delete a firmware file
// that an upload of the same bytes to another device has just committed a
// row for. The test runs that upload on the service's store at the worst
// moment: right after the CLI's store has committed, SQLite's write lock
// released, before its removal returns (commitConnector). And when the
// removal's commit fails, its files stay.
func TestStoreRemovalBesideUpload(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	img := otaFirmware(4<<10, 1)
	removeDevice := func(env *testEnv, cli *store.Store, u testUser) error {
		_, err := cli.DeleteDevice(ctx, env.deviceRef(u), nil)
		return err
	}
	uploadAfter := func(env *testEnv, tx driver.Tx) error {
		err := tx.Commit()
		if err == nil && scalar(t, env.st, `SELECT count(*) FROM firmwares`) == "0" {
			env.uploadOK(env.bob, map[string]string{"name": "same bytes"}, img)
		}
		return err
	}
	tests := []struct {
		name    string
		remove  func(env *testEnv, cli *store.Store, u testUser) error
		commit  func(env *testEnv, tx driver.Tx) error
		wantErr bool
	}{
		{"device remove", removeDevice, uploadAfter, false},
		{"user remove -with-devices", func(env *testEnv, cli *store.Store, u testUser) error {
			_, _, err := cli.DeleteUser(ctx, u.email, true)
			return err
		}, uploadAfter, false},
		{"a removal whose commit fails", removeDevice, func(env *testEnv, tx driver.Tx) error {
			return errors.Join(errors.New("commit failed"), tx.Rollback())
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			env := newTestEnvIn(t, dir, nil)
			env.uploadOK(env.alice, map[string]string{"name": "a"}, img)
			db := sql.OpenDB(commitConnector{storeWriter(env.st).Driver(), "file:" + filepath.Join(dir, "devicehub.db") +
				"?_pragma=foreign_keys(1)&_pragma=busy_timeout(10000)&_txlock=immediate",
				func(tx driver.Tx) error { return tt.commit(env, tx) }})
			defer db.Close()
			db.SetMaxOpenConns(1)
			cli := storeBeside(env.st, db)
			if err := tt.remove(env, cli, env.alice); (err != nil) != tt.wantErr {
				t.Fatalf("removal: %v, want an error: %t", err, tt.wantErr)
			}
			wantDB(t, env.st, "1", `SELECT count(*) FROM firmwares`)
			checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st))
		})
	}
}

// commitConnector opens SQLite connections through drv whose transactions
// end with commit(tx) instead of tx.Commit().
type commitConnector struct {
	drv    driver.Driver
	dsn    string
	commit func(tx driver.Tx) error
}

func (c commitConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return commitConn{conn, c.commit}, nil
}

func (c commitConnector) Driver() driver.Driver { return c.drv }

type commitConn struct {
	driver.Conn
	commit func(tx driver.Tx) error
}

func (c commitConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return commitTx{tx, c.commit}, nil
}

type commitTx struct {
	driver.Tx
	commit func(tx driver.Tx) error
}

func (t commitTx) Commit() error { return t.commit(t.Tx) }

// TestStoreConcurrentWriters: many concurrent writers, also from a second
// store on the same file (as another process would), never fail with
// "database is locked".
func TestStoreConcurrentWriters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	stores := []*store.Store{storeAt(t, dir), storeAt(t, dir)}
	userID, deviceID, uid := storeUser(t, stores[0], "busy@example.com")
	device := deviceRefByID(t, stores[0], deviceID)
	const n = 50
	var wg sync.WaitGroup
	for i := range n {
		st := stores[i%2]
		wg.Go(func() {
			name := fmt.Sprintf("name %d", i)
			_, err1 := st.UpdateDevice(ctx, userID, uid, store.DeviceUpdate{Name: &name}, nil)
			var login *int64 // every third a login, at the user's first password
			if i%3 == 0 {
				login = new(int64)
			}
			_, _, err2 := issueToken(ctx, st, userID, fmt.Sprint("t", i), login, nil) // a login replaces its name's tokens
			_, err3 := st.ButtonsOf(ctx, device)
			err := errors.Join(st.CreateButton(ctx, device, model.CommandButton{ID: fmt.Sprint("b", i), Label: "L", Payload: json.RawMessage(`{}`)}, nil), err1, err2, err3)
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
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	st, other := storeAt(t, dir), storeAt(t, dir)
	userID, _, uid := storeUser(t, st, "u@example.com")
	_, tok, err := issueToken(ctx, st, userID, "t", nil, nil)
	must(t, err)
	srv := newTestServer(t, testOptions(st, nil, testLogger(t)))
	pages := func(want string) {
		t.Helper()
		detail, err1 := srv.devicePage(ctx, userID, uid)
		list := httptest.NewRecorder()
		err2 := srv.writeDeviceList(ctx, list, userID)
		if !strings.Contains(string(detail), want) || !strings.Contains(list.Body.String(), want) {
			t.Errorf("pages: got %s and %s (%v), want the name %s", detail, list.Body, errors.Join(err1, err2), want)
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
	if rec, err := authenticate(ctx, st, tok); err != store.ErrTokenNotFound {
		t.Errorf("a token deleted elsewhere: got %v, %v; want errTokenNotFound", rec, err)
	}
}

func TestPasswordHash(t *testing.T) {
	t.Parallel()
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

// TestGroupCommitIsolatesABadRecord: when one record of a group commit
// fails (its device is gone), the others are still committed and only
// its own request gets the error.
func TestGroupCommitIsolatesABadRecord(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	w, err := env.st.PrepareCommandWriter()
	must(t, err)
	defer w.Close()
	record := func(id string, d *store.DeviceRef) store.CommandInsert {
		now := env.st.Timestamp()
		return store.CommandInsert{Done: make(chan error, 1), C: &model.Command{ID: id, Kind: "custom",
			Payload: []byte(`{}`), State: "sent", CreatedAt: now, UpdatedAt: now}, Device: d, Deadline: now}
	}
	gone := env.deviceRef(env.bob) // a device deleted once its request has read it
	_, err = env.st.DeleteDevice(context.Background(), gone, nil)
	must(t, err)
	good, bad := record("good", env.deviceRef(env.alice)), record("bad", gone)
	env.st.CommitInserts(w, nil, []store.CommandInsert{good, bad})
	if err := <-good.Done; err != nil {
		t.Errorf("the good record: %v", err)
	}
	if err := <-bad.Done; err == nil {
		t.Error("the record of a device that does not exist was committed")
	}
	if _, err := env.st.CommandOf(context.Background(), env.deviceRef(env.alice), "good"); err != nil {
		t.Errorf("the good record is not stored: %v", err)
	}
}

// TestStoreMigrateNumbers: version 15 numbers each team's audit entries
// and each device's boots from 1, in the order they were made, and new
// ones go on from there; it ends the reset links made before it, whose
// maker is unknown.
func TestStoreMigrateNumbers(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	dir := t.TempDir()
	old := openAtVersion(t, dir, 14)
	const userA, devA, devB = 1, 1, 2
	const at = "2026-01-01T00:00:00.000000Z"
	mustExec(t, old, `INSERT INTO teams (id, name, created_at) VALUES (1, 'A', ?1), (2, 'B', ?1);
		INSERT INTO users (id, team_id, name, email, role, password_hash, created_at) VALUES
			(1, 1, 'A', 'a@example.com', 'admin', 'x', ?1), (2, 2, 'B', 'b@example.com', 'admin', 'x', ?1);
		INSERT INTO platforms (id, team_id, number, key, name) VALUES (1, 1, 1, 'esp32', 'ESP32'), (2, 2, 1, 'esp32', 'ESP32');
		INSERT INTO boards (id, team_id, number, key, name) VALUES (1, 1, 1, 'devkit', 'DevKit'), (2, 2, 1, 'devkit', 'DevKit');
		INSERT INTO devices (id, uid, team_id, name, status, platform_id, board_id, created_at) VALUES
			(1, 'esp32_a', 1, 'a', 'pending', 1, 1, ?1), (2, 'esp32_b', 2, 'b', 'pending', 2, 2, ?1);`, at)
	mustExec(t, old, `INSERT INTO audit (team_id, at, action) VALUES (1, ?1, 'x'), (2, ?1, 'x'), (1, ?1, 'x'), (1, ?1, 'x');
		INSERT INTO boots (device_id, at, reason, crash) VALUES (?2, ?1, 'r', 0), (?3, ?1, 'r', 0), (?2, ?1, 'r', 0);
		INSERT INTO password_resets (user_id, secret_hash, expires_at) VALUES (?4, x'01', '2099-01-01T00:00:00.000000Z')`,
		at, devA, devB, userA)
	old.Close()
	st := storeAt(t, dir)
	wantDB(t, st, "1:1,2:1,1:2,1:3", `SELECT group_concat(team_id || ':' || number) FROM (SELECT * FROM audit ORDER BY id)`)
	wantDB(t, st, fmt.Sprintf("%d:1,%d:1,%[1]d:2", devA, devB), `SELECT group_concat(device_id || ':' || number) FROM (SELECT * FROM boots ORDER BY id)`)
	wantDB(t, st, "0", `SELECT count(*) FROM password_resets`)
	must(t, st.AddAudit(&model.AuditEntry{TeamID: 1, At: at, Action: "x", Detail: []byte(`{}`)}))
	wantDB(t, st, "4", `SELECT max(number) FROM audit WHERE team_id = 1`)
}

// TestStoreMigrateKinds: version 20 rebuilds commands, webhook_queue and
// webhook_deliveries with CHECK constraints on a command's kind and an
// event's type (TestStatesMatchSchema), keeping their rows, the sequences
// that keep a deleted seq from coming back, and the triggers that count a
// team's command bytes, also when a device is deleted.
func TestStoreMigrateKinds(t *testing.T) {
	// Not parallel: it swaps the package's migrations.
	dir := t.TempDir()
	old := openAtVersion(t, dir, 19)
	teamID, deviceID, _ := storeUser(t, old, "kinds@example.com")
	mustExec(t, old, `INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline, team_id)
		VALUES ('c1', ?1, 'reboot', '{"cmd":"reboot"}', 'sent', 't', 't', 't', ?2)`, deviceID, teamID)
	mustExec(t, old, `INSERT INTO webhooks (team_id, url, events, offline_minutes, secret, created_at, offline_checked_at)
		VALUES (?1, 'https://203.0.113.7/', '["device.status"]', 5, 's', 't', 't')`, teamID)
	mustExec(t, old, `INSERT INTO webhook_queue (webhook_id, event_id, type, body) VALUES (1, 'e1', 'device.status', '{}'), (1, 'e2', 'ping', '{}')`)
	mustExec(t, old, `DELETE FROM webhook_queue WHERE event_id = 'e2'`)
	mustExec(t, old, `INSERT INTO webhook_deliveries (id, webhook_id, event_id, type, at, status, duration_ms, attempt)
		VALUES ('d1', 1, 'e0', 'ping', 't', 200, 12, 1)`)
	rows := `SELECT (SELECT group_concat(seq || ' ' || id || ' ' || device_id || ' ' || kind || ' ' || team_id) FROM commands)
		|| ';' || (SELECT group_concat(seq || ' ' || event_id || ' ' || type) FROM webhook_queue)
		|| ';' || (SELECT group_concat(seq || ' ' || id || ' ' || event_id || ' ' || type || ' ' || status) FROM webhook_deliveries)
		|| ';' || (SELECT command_bytes FROM teams WHERE id = ` + fmt.Sprint(teamID) + `)`
	want := scalar(t, old, rows)
	old.Close()

	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	wantDB(t, st, want, rows)
	mustExec(t, st, `INSERT INTO webhook_queue (webhook_id, event_id, type, body) VALUES (1, 'e3', 'ping', '{}')`)
	wantDB(t, st, "3", `SELECT seq FROM webhook_queue WHERE event_id = 'e3'`)
	wantDB(t, st, "commands_device commands_open commands_team_finished command_added command_changed command_deleted device_deleted",
		`SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_master WHERE type IN ('index', 'trigger') AND sql IS NOT NULL
			AND (tbl_name = 'commands' OR name = 'device_deleted') ORDER BY type, name)`)
	mustExec(t, st, `INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline, team_id)
		VALUES ('c2', ?1, 'custom', '{"x":1}', 'sent', 't', 't', 't', ?2)`, deviceID, teamID)
	wantDB(t, st, fmt.Sprint(len(`{"cmd":"reboot"}`)+len(`{"x":1}`)), `SELECT command_bytes FROM teams WHERE id = ?`, teamID)
	mustExec(t, st, `DELETE FROM devices WHERE id = ?`, deviceID)
	wantDB(t, st, "0 0", `SELECT command_bytes || ' ' || (SELECT count(*) FROM commands) FROM teams WHERE id = ?`, teamID)
}
