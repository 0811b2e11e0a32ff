package main

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestDeviceJSONMatchesStruct(t *testing.T) {
	env := newTestEnv(t, nil)
	a := env.alice
	ctx := context.Background()
	fw := []byte("\xe9firmware one")
	w := env.upload(a.device, a.token, map[string]string{"name": "one", "version": "1.0"}, fw)
	if w.Code != http.StatusCreated {
		t.Fatalf("upload: %d %s", w.Code, w.Body)
	}
	md5sum := decode(t, w)["data"].(map[string]any)["md5"].(string)
	steps := []struct {
		name string
		sql  string
		args []any
	}{
		{"new device", "", nil},
		{"description and odd name", `UPDATE devices SET name = ?, description = ? WHERE uid = ?`,
			[]any{"<b>\"quoted\" & \u00e9\u0001</b>", "line\nbreak", a.device}},
		{"telemetry, unknown firmware", `UPDATE devices SET status = 'online', local_ip = '10.0.0.2', public_ip = '203.0.113.9',
			last_rssi = -61.5, first_seen_at = '2026-11-21T12:00:00.000000Z', last_seen_at = '2026-11-21T12:01:00.000000Z',
			current_md5 = '0123456789abcdef0123456789abcdef', current_version = 'x' WHERE uid = ?`, []any{a.device}},
		{"whole rssi", `UPDATE devices SET last_rssi = -60 WHERE uid = ?`, []any{a.device}},
		{"target set", `UPDATE devices SET target_firmware_id = (SELECT id FROM firmwares WHERE md5 = ?) WHERE uid = ?`, []any{md5sum, a.device}},
		{"running the target", `UPDATE devices SET current_md5 = ?, last_ota_at = '2026-11-21T13:00:00.000000Z' WHERE uid = ?`, []any{md5sum, a.device}},
		{"description cleared", `UPDATE devices SET description = NULL, status = 'reconnecting' WHERE uid = ?`, []any{a.device}},
	}
	for _, st := range steps {
		if st.sql != "" {
			if _, err := env.st.wdb.Exec(st.sql, st.args...); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
		}
		fast, err := env.st.devicePage(ctx, a.id, a.device)
		if err != nil {
			t.Fatalf("%s: deviceJSON: %v", st.name, err)
		}
		want, err := json.Marshal(env.device(a))
		if err != nil {
			t.Fatal(err)
		}
		if !jsonEqual(t, fast, want) {
			t.Errorf("%s:\nSQL    %s\nstruct %s", st.name, fast, want)
		}
	}
	if _, err := env.st.devicePage(ctx, env.bob.id, a.device); err != errDeviceNotFound {
		t.Errorf("bob reading alice's device: got %v, want errDeviceNotFound", err)
	}
}

// TestDevicesJSON checks the list: oldest first, summary fields only, and
// only the user's own devices.
func TestDevicesJSON(t *testing.T) {
	env := newTestEnv(t, nil)
	ctx := context.Background()
	uids := []string{env.alice.device}
	for _, name := range []string{"b", "a", "c"} {
		uid, err := env.st.createDevice(ctx, env.alice.email, "esp8266", "d1", name, 1884)
		if err != nil {
			t.Fatal(err)
		}
		uids = append(uids, uid)
	}
	raw, err := env.st.deviceListPage(ctx, env.alice.id)
	if err != nil {
		t.Fatal(err)
	}
	var list []map[string]any
	if err := json.Unmarshal(raw, &list); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	if len(list) != len(uids) {
		t.Fatalf("got %d devices, want %d: %s", len(list), len(uids), raw)
	}
	for i, d := range list {
		full := decode(t, env.request("GET", "/v1/user/devices/"+uids[i], env.alice.token, nil))["data"].(map[string]any)
		want := map[string]any{}
		for _, k := range []string{"uid", "name", "status", "last_seen_at", "platform", "board", "board_variant"} {
			want[k] = full[k]
		}
		got, _ := json.Marshal(d)
		exp, _ := json.Marshal(want)
		if string(got) != string(exp) {
			t.Errorf("item %d:\ngot  %s\nwant %s", i, got, exp)
		}
	}
	raw, err = env.st.deviceListPage(ctx, 999)
	if err != nil || string(raw) != "[]" {
		t.Errorf("no devices: got %s, %v; want []", raw, err)
	}
}

// TestReadCacheSeesOtherWriters: the read cache must never serve a token or
// a device page from before a commit made elsewhere (another process, such
// as the CLI or a sqlite3 shell, modelled by a second store on the file).
func TestReadCacheSeesOtherWriters(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	other, err := openStore(ctx, dir, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	uidUser, err := st.createUser(ctx, "U", "u@example.com", "user", "x")
	if err != nil {
		t.Fatal(err)
	}
	uid, err := st.createDevice(ctx, "u@example.com", "esp32", "devkit", "before", 1883)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := issueToken(ctx, st, uidUser, "t", false)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // the second round is served from the cache
		if _, err := authenticate(ctx, st, tok); err != nil {
			t.Fatalf("authenticate: %v", err)
		}
		if j, err := st.deviceListPage(ctx, uidUser); err != nil || !strings.Contains(string(j), `"before"`) {
			t.Fatalf("devicesJSON = %s, %v", j, err)
		}
	}
	if _, err := other.wdb.Exec(`UPDATE devices SET name = 'after'`); err != nil {
		t.Fatal(err)
	}
	if j, _ := st.devicePage(ctx, uidUser, uid); !strings.Contains(string(j), `"after"`) {
		t.Errorf("device page after another writer's rename: %s", j)
	}
	if j, _ := st.deviceListPage(ctx, uidUser); !strings.Contains(string(j), `"after"`) {
		t.Errorf("device list after another writer's rename: %s", j)
	}
	if _, err := other.wdb.Exec(`DELETE FROM tokens`); err != nil {
		t.Fatal(err)
	}
	if rec, err := authenticate(ctx, st, tok); err != errTokenNotFound {
		t.Errorf("token deleted by another writer: got %v, %v; want errTokenNotFound", rec, err)
	}
}
