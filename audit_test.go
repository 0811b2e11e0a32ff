package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// auditPage reads GET /v1/user/team/audit with query as token's user.
func auditPage(t *testing.T, env *testEnv, token, query string) []model.AuditEntry {
	t.Helper()
	var got struct{ Data []model.AuditEntry }
	must(t, json.Unmarshal(env.want(t, 200, "GET", "/v1/user/team/audit"+query, token, nil).Body.Bytes(), &got))
	return got.Data
}

// TestAuditLog: the log as the API shows it: newest first, in pages of
// ?limit= 1–100 (25) before a cursor, only the team's own entries, none
// pushed out by writing many; no entry holds a secret; commands name
// their sender. TestTeamRoles checks each write's one entry.
func TestAuditLog(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	v := newAPIVars(env)
	teamVars(t, env, v)
	env.setStatus(env.alice.device, "online")

	// Writes that handle secrets: a token, an invite and its redeeming.
	tok := decode(t, env.want(t, 201, "POST", "/v1/user/tokens", env.alice.token, `{"name":"ci"}`))["data"].(map[string]any)["token"].(string)
	secret := invite(t, env, v, "carol@example.com")
	redeemed := decode(t, redeem(env, "192.0.2.1:1", secret, "carol-password"))["token"].(string)
	cmd := decode(t, env.want(t, 200, "POST", "/v1/user/devices/"+env.alice.device+"/reboot", redeemed, nil))["command_id"].(string)
	var dump strings.Builder
	for _, row := range dbState(t, env.st)[1] {
		if strings.HasPrefix(row, "audit |") {
			dump.WriteString(row + "\n")
		}
	}
	_, tokSecret, _ := strings.Cut(tok, "|")
	_, redeemedSecret, _ := strings.Cut(redeemed, "|")
	for _, s := range []string{tokSecret, secret, sha256Hex([]byte(secret)), "carol-password", redeemedSecret} {
		if strings.Contains(strings.ToLower(dump.String()), strings.ToLower(s)) {
			t.Errorf("the audit log holds the secret %q:\n%s", s, dump.String())
		}
	}

	// The command names its sender, and its audit entry names the command.
	carol := scalar(t, env.st, `SELECT id FROM users WHERE email = 'carol@example.com'`)
	sentBy := func(want string) {
		t.Helper()
		w := env.want(t, 200, "GET", "/v1/user/devices/"+env.alice.device+"/commands/"+cmd, env.alice.token, nil)
		var got struct {
			Data struct {
				SentBy json.RawMessage `json:"sent_by"`
			}
		}
		must(t, json.Unmarshal(w.Body.Bytes(), &got))
		if !jsonEqual(t, got.Data.SentBy, []byte(want)) {
			t.Errorf("sent_by: got %s, want %s", got.Data.SentBy, want)
		}
	}
	sentBy(`{"id":` + carol + `,"name":"New"}`)
	entries := auditPage(t, env, v["vic_token"], "")
	wantEntry := fmt.Sprintf(`{"id":3,"at":"{now}","actor":{"id":%s,"name":"New"},"action":"command.send","device_uid":"{alice}","detail":{"kind":"reboot","command_id":%q}}`, carol, cmd)
	if got := apiJSON(entries[0]); len(entries) != 3 || !jsonEqual(t, []byte(got), []byte(v.expand(wantEntry))) {
		t.Fatalf("newest of %d entries: got %s, want %s", len(entries), got, v.expand(wantEntry))
	}
	// A removed member's entries still name them; their commands no one.
	env.want(t, 200, "DELETE", "/v1/user/team/members/"+carol, v["ada_token"], nil)
	sentBy(`null`)
	if e := auditPage(t, env, env.alice.token, "?before=4")[0]; e.Actor == nil || e.Actor.Name != "New" {
		t.Errorf("entry of a removed member: got actor %+v, want New", e.Actor)
	}

	// A rollout's OTA commands are sent by its creator.
	fw := []byte("\xe9rollout")
	apiUpload(env, env.alice, "fw", fw)
	env.want(t, 201, "POST", "/v1/user/rollouts", v["ada_token"], map[string]any{"md5": md5Hex(fw), "device_uids": []string{env.alice.device}})
	wantDB(t, env.st, v["ada"], `SELECT sent_by FROM commands WHERE kind = 'ota'`)

	// Pages: newest first, limit and before; another team sees only its own.
	fill(t, env, 2, 200)
	fill(t, env, 1, 200)
	ids := func(list []model.AuditEntry) string {
		var s []string
		for _, e := range list {
			s = append(s, strconv.FormatInt(e.ID, 10))
		}
		return strings.Join(s, ",")
	}
	newest := 206 // the team's own numbers: team 2's 200 entries take none
	for _, tt := range []struct{ query, want string }{
		{"", span(newest, 25)},
		{"?limit=1", span(newest, 1)},
		{"?limit=100", span(newest, 100)},
		{"?limit=3&before=8", "7,6,5"},
		{"?before=3", "2,1"},
		{"?before=1", ""},
	} {
		if got := ids(auditPage(t, env, env.alice.token, tt.query)); got != tt.want {
			t.Errorf("%s: got ids %s, want %s", tt.query, got, tt.want)
		}
	}
	for _, e := range auditPage(t, env, env.bob.token, "?limit=100") {
		if string(e.Detail) != `{"name":"filler 2"}` {
			t.Errorf("bob sees an entry of alice's team: %+v", e)
		}
	}
	for _, q := range []string{"limit=0", "limit=101", "limit=x", "limit=", "before=0", "before=-1", "before=x"} {
		field, _, _ := strings.Cut(q, "=")
		msg := map[string]string{"limit": "The limit field must be an integer between 1 and 100.", "before": "The before field must be the id of an audit entry."}[field]
		checkAnswer(t, env.request("GET", "/v1/user/team/audit?"+q, env.alice.token, nil), 422, apiFieldError(field, msg))
	}

	// Entries go by age, not by count: a member who writes 10,100 times
	// pushes nothing out (before, the newest 10,000 of a team were kept).
	fill(t, env, 1, 10_100)
	for range 100 {
		env.want(t, 200, "PATCH", "/v1/user/team", v["ada_token"], `{"name":"Greenhouse"}`)
	}
	wantDB(t, env.st, "1", `SELECT count(*) FROM audit WHERE id = 1`)
	if e := auditPage(t, env, env.alice.token, "?limit=1")[0]; string(e.Detail) != `{"name":"Greenhouse"}` {
		t.Errorf("newest entry: got %s %s, want the team's rename", e.Action, e.Detail)
	}
}

// TestAuditPrunedByAge: PruneAudit deletes every entry older than its
// cutoff, of every team, however many, in steps, and no newer one; the
// service prunes at -audit-days from its start.
func TestAuditPrunedByAge(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	ctx := context.Background()
	at := func(age time.Duration) string { return env.clock.now().Add(-age).UTC().Format(store.TimeFormat) }
	const day = 24 * time.Hour
	old := 2*store.AuditPruneStep + 7
	fill(t, env, 1, old)
	fill(t, env, 2, 5)
	mustExec(t, env.st, `UPDATE audit SET at = ?`, at(91*day))
	fill(t, env, 1, 3)
	mustExec(t, env.st, `UPDATE audit SET at = ? WHERE id > ?`, at(90*day-time.Second), old+5)
	fill(t, env, 2, 4)
	mustExec(t, env.st, `UPDATE audit SET at = ? WHERE id > ?`, at(0), old+8)
	n, err := env.st.PruneAudit(ctx, env.clock.now().Add(-90*day))
	must(t, err)
	if n != int64(old+5) {
		t.Errorf("pruned %d entries, want %d", n, old+5)
	}
	wantDB(t, env.st, fmt.Sprintf("%d 7", old+6), `SELECT min(id) || ' ' || count(*) FROM audit`)
	n, err = env.st.PruneAudit(ctx, env.clock.now().Add(-90*day))
	if err != nil || n != 0 {
		t.Errorf("pruned again: got %d, %v; want 0, nil", n, err)
	}

	// The service prunes when it starts, at -audit-days.
	dir := t.TempDir()
	st := openAt(t, dir)
	mustExec(t, st, `INSERT INTO teams (name, created_at) VALUES ('t', '')`)
	mustExec(t, st, `INSERT INTO audit (team_id, number, at, action) VALUES (1, 1, ?1, 'team.update'), (1, 2, ?2, 'team.update')`,
		time.Now().Add(-25*time.Hour).UTC().Format(store.TimeFormat), time.Now().Add(-23*time.Hour).UTC().Format(store.TimeFormat))
	st.Close()
	serveInProcess(t, nil, "-data", dir, "-audit-days", "1")
	st = storeAt(t, dir)
	for deadline := time.Now().Add(20 * time.Second); scalar(t, st, `SELECT count(*) FROM audit`) != "1"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the service did not prune the entry older than -audit-days 1: %s entries", scalar(t, st, `SELECT count(*) FROM audit`))
		}
	}
	wantDB(t, st, "2", `SELECT id FROM audit`)
}

// span is the ids from down to down-n+1, comma-separated.
func span(from, n int) string {
	var s []string
	for id := from; id > from-n; id-- {
		s = append(s, strconv.Itoa(id))
	}
	return strings.Join(s, ",")
}

// fill adds n entries to the team's audit log by SQL, fast, each
// naming the team.
func fill(t *testing.T, env *testEnv, team, n int) {
	t.Helper()
	mustExec(t, env.st, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
		INSERT INTO audit (team_id, number, at, action, detail)
		SELECT ?1, (SELECT coalesce(max(number), 0) FROM audit WHERE team_id = ?1) + i, '2026-11-21T12:00:00.000000Z',
			'team.update', json_object('name', 'filler ' || ?1) FROM n`, team, n)
}

// TestAuditLogFilters: ?actor=, ?member= (by or about the member),
// ?device= and ?action= (a name, or a
// prefix ending in "."), alone and together, see only the team's own
// entries; ?format=csv answers the same entries as CSV, a formula-like
// cell defused.
func TestAuditLogFilters(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	v := newAPIVars(env)
	teamVars(t, env, v)
	env.setStatus(env.alice.device, "online")
	evil := env.addMember("=Evil", "user", env.alice)
	v["evil"] = strconv.FormatInt(evil.id, 10)
	env.want(t, 200, "PATCH", "/v1/user/devices/"+env.alice.device, env.alice.token, `{"name":"Greenhouse"}`) // 1
	env.want(t, 200, "PATCH", "/v1/user/team", v["ada_token"], `{"name":"Team"}`)                             // 2
	invite(t, env, v, "carol@example.com")                                                                    // 3
	env.want(t, 200, "POST", "/v1/user/devices/"+env.alice.device+"/reboot", env.alice.token, nil)            // 4
	env.want(t, 200, "PATCH", "/v1/user/devices/"+env.bob.device, env.bob.token, `{"name":"Bob's"}`)          // bob's team's 1
	env.want(t, 200, "PATCH", "/v1/user/devices/"+env.alice.device, evil.token, `{"name":"=1+1"}`)            // 5

	v["carol"] = scalar(t, env.st, `SELECT detail ->> '$.member_id' FROM audit WHERE action = 'member.invite'`)

	ids := func(list []model.AuditEntry) string {
		var s []string
		for _, e := range list {
			s = append(s, strconv.FormatInt(e.ID, 10))
		}
		return strings.Join(s, ",")
	}
	for _, tt := range []struct{ query, want string }{
		{"", "5,4,3,2,1"},
		{"?actor={alice_id}", "4,1"},
		{"?actor={ada}", "3,2"},
		{"?device={alice}", "5,4,1"},
		{"?action=device.update", "5,1"},
		{"?action=member.", "3"},
		{"?action=member.invite", "3"},
		{"?action=command.send&device={alice}&actor={alice_id}", "4"},
		{"?action=command.send&actor={ada}", ""},
		{"?action=device.update&limit=1", "5"},
		{"?action=device.update&before=5", "1"},
		{"?device={bob}", ""},
		{"?actor={bob_id}", ""},
		{"?member={carol}", "3"}, // about carol: her invite
		{"?member={ada}", "3,2"},
		{"?member={alice_id}", "4,1"},
		{"?member={carol}&action=device.", ""},
		{"?member={bob_id}", ""},
		{"?device=%27%20OR%201%3D1%20--", ""},
	} {
		if got := ids(auditPage(t, env, env.alice.token, v.expand(tt.query))); got != tt.want {
			t.Errorf("%s: got ids %s, want %s", tt.query, got, tt.want)
		}
	}
	for q, field := range map[string]string{"action=member": "action", "action=MEMBER.": "action", "action=%25": "action",
		"actor=0": "actor", "actor=x": "actor", "member=0": "member", "format=xml": "format"} {
		w := env.request("GET", "/v1/user/team/audit?"+q, env.alice.token, nil)
		if w.Code != 422 || !strings.Contains(w.Body.String(), `"`+field+`":`) {
			t.Errorf("?%s: got %d %s, want 422 with a field error on %s", q, w.Code, w.Body, field)
		}
	}

	w := env.want(t, 200, "GET", "/v1/user/team/audit?format=csv&device="+env.alice.device, env.alice.token, nil)
	if ct := w.Header().Get("Content-Type"); ct != "text/csv; charset=utf-8" {
		t.Errorf("Content-Type: got %q, want text/csv; charset=utf-8", ct)
	}
	want := v.expand(strings.Join([]string{
		"id,at,actor_id,actor_name,action,device_uid,detail",
		`5,{now},{evil},'=Evil,device.update,{alice},"{""description"":null,""name"":""=1+1"",""previous_name"":""Greenhouse""}"`,
		`4,{now},{alice_id},Alice,command.send,{alice},"{""command_id"":""` +
			scalar(t, env.st, `SELECT id FROM commands`) + `"",""kind"":""reboot""}"`,
		`1,{now},{alice_id},Alice,device.update,{alice},"{""description"":null,""name"":""Greenhouse"",""previous_name"":""Alice's device""}"`,
	}, "\n") + "\n")
	if got := w.Body.String(); got != want {
		t.Errorf("CSV:\ngot  %s\nwant %s", got, want)
	}
}

// TestIDsTellNothingOfOtherTeams: the ids a team reads of its audit
// entries and of a device's boots count only its own, whatever other
// teams write and other devices report between them (docs/security.md
// says which ids are global). Before, team A's audit ids jumped across
// team B's writes, and a device's boot ids across other devices' boots.
func TestIDsTellNothingOfOtherTeams(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	write := func(u testUser, name string) {
		env.want(t, 200, "PATCH", "/v1/user/devices/"+u.device, u.token, map[string]string{"name": name})
	}
	boot := func(u testUser, reason string) {
		tell(env, l, u.device, "telemetry", `{"reset_reason":"`+reason+`"}`)
		env.clock.advance(2 * time.Minute) // past the window that makes two reports one boot
	}
	write(env.alice, "a1")
	boot(env.alice, "poweron")
	for i := range 3 {
		write(env.bob, fmt.Sprint("b", i))
		boot(env.bob, "sw")
	}
	write(env.alice, "a2")
	boot(env.alice, "panic")
	var ids []string
	for _, e := range auditPage(t, env, env.alice.token, "") {
		ids = append(ids, fmt.Sprint(e.ID))
	}
	if got := strings.Join(ids, ","); got != "2,1" {
		t.Errorf("alice's audit ids: got %s, want 2,1", got)
	}
	var boots struct{ Data []model.BootEntry }
	must(t, json.Unmarshal(env.want(t, 200, "GET", "/v1/user/devices/"+env.alice.device+"/boots", env.alice.token, nil).Body.Bytes(), &boots))
	if len(boots.Data) != 2 || boots.Data[0].ID != 2 || boots.Data[1].ID != 1 {
		t.Errorf("alice's boots: got %+v, want ids 2, 1", boots.Data)
	}
	if w := env.want(t, 200, "GET", "/v1/user/devices/"+env.alice.device+"/boots?before=2", env.alice.token, nil); !strings.Contains(w.Body.String(), `"reason":"poweron"`) || strings.Contains(w.Body.String(), "panic") {
		t.Errorf("boots before 2: got %s, want the first only", w.Body)
	}
}

// TestFirmwareWriteNeedsItsAuditEntry: every firmware and library write
// commits with its audit entry or not at all. With the entry's insert
// refused (the test's trigger), each answers 500 and leaves the database
// and the firmware directory as they were: an upload no row and no file,
// an edit, a delete, a set-target and a library delete every row and file
// in place. Before, the entry was committed after the write, in a
// transaction of its own, and its failure only logged.
func TestFirmwareWriteNeedsItsAuditEntry(t *testing.T) {
	t.Parallel()
	onDevice, inLibrary := []byte("\xe9 on the device"), []byte("\xe9 in the library")
	fresh := []byte("\xe9 an upload whose audit entry is refused")
	firmware := "/v1/user/devices/{alice}/firmwares/" + md5Hex(onDevice)
	tests := []struct {
		name string
		send func(env *testEnv, v apiVars) *httptest.ResponseRecorder
	}{
		{"device upload", func(env *testEnv, _ apiVars) *httptest.ResponseRecorder {
			return env.upload(env.alice, map[string]string{"name": "fresh"}, fresh)
		}},
		{"library upload", func(env *testEnv, _ apiVars) *httptest.ResponseRecorder {
			return env.uploadToLibrary(env.alice, map[string]string{"name": "fresh"}, fresh)
		}},
		{"edit", func(env *testEnv, v apiVars) *httptest.ResponseRecorder {
			return env.request("PATCH", v.expand(firmware), env.alice.token, `{"name":"renamed"}`)
		}},
		{"delete", func(env *testEnv, v apiVars) *httptest.ResponseRecorder {
			return env.request("DELETE", v.expand(firmware), env.alice.token, nil)
		}},
		{"set-target", func(env *testEnv, v apiVars) *httptest.ResponseRecorder {
			return env.request("POST", v.expand("/v1/user/devices/{alice}/firmwares/set-target"), env.alice.token,
				map[string]string{"md5": md5Hex(onDevice)})
		}},
		{"library delete", func(env *testEnv, _ apiVars) *httptest.ResponseRecorder {
			return env.request("DELETE", "/v1/user/firmwares/"+sha256Hex(inLibrary), env.alice.token, nil)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, nil)
			v := newAPIVars(env)
			apiUpload(env, env.alice, "on the device", onDevice)
			if w := env.uploadToLibrary(env.alice, map[string]string{"name": "in the library"}, inLibrary); w.Code != 201 {
				t.Fatalf("library upload: %d %s", w.Code, w.Body)
			}
			before := dbState(t, env.st)
			mustExec(t, env.st, `CREATE TRIGGER refuse_audit BEFORE INSERT ON audit BEGIN SELECT RAISE(ABORT, 'refused by the test'); END`)
			checkAnswer(t, tt.send(env, v), 500, `{"message":"Server Error."}`)
			mustExec(t, env.st, `DROP TRIGGER refuse_audit`)
			if after := dbState(t, env.st); !reflect.DeepEqual(after, before) {
				t.Errorf("state after the refused write:\n%v\nwant it as before:\n%v", after, before)
			}
			if _, err := os.Stat(firmwarePath(env.st, sha256Hex(fresh))); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the refused upload's file: %v, want none", err)
			}
			checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st))
		})
	}
}

// TestAuditWithItsWrite: a write commits with its audit entry or not at
// all. With the audit table refusing every insert (a trigger), each
// audited write answers an error and leaves the database as it was: the
// store inserts a write's entry in the write's own transaction.
func TestAuditWithItsWrite(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	v := newAPIVars(env)
	teamVars(t, env, v)
	ctx := context.Background()
	alice := env.alice
	env.setStatus(alice.device, "online")
	second := addDevice(t, env, alice, "esp8266")
	v["second"] = second.device
	v["pend"], _ = inviteAs(t, env, v["ada_token"], "pending@example.com", "user")
	env.want(t, 200, "POST", "/v1/user/team/members/"+v["vic"]+"/reset", v["ada_token"], nil)
	id, _, err := issueToken(ctx, env.st, alice.id, "spare", nil, nil)
	must(t, err)
	v["spare"] = strconv.FormatInt(id, 10)
	env.want(t, 201, "POST", "/v1/user/devices/"+alice.device+"/command-buttons", alice.token, `{"id":"led","label":"LED","payload":{}}`)
	hook := decode(t, env.want(t, 201, "POST", "/v1/user/team/webhooks", v["ada_token"], `{"url":"https://203.0.113.7/in","events":["device.status"]}`))
	v["wh"] = fmt.Sprint(hook["data"].(map[string]any)["id"])
	_, md5sum := env.uploadOK(alice, map[string]string{"name": "fw", "version": "1.0.0"}, []byte("\xe9audit firmware"))
	v["md5"] = md5sum
	rollout := func() string {
		ro := decode(t, env.want(t, 201, "POST", "/v1/user/rollouts", alice.token, v.expand(`{"md5":"{md5}","device_uids":["{alice}"]}`)))
		return fmt.Sprint(ro["data"].(map[string]any)["id"])
	}
	v["ended"] = rollout()
	env.want(t, 200, "POST", "/v1/user/rollouts/"+v["ended"]+"/cancel", alice.token, nil)
	v["running"] = rollout()

	mustExec(t, env.st, `CREATE TRIGGER audit_refused BEFORE INSERT ON audit BEGIN SELECT RAISE(ABORT, 'audit refused'); END`)
	before := dbState(t, env.st)
	for _, c := range []struct{ method, path, token, body string }{
		{"PATCH", "/v1/user/team", "{ada_token}", `{"name":"Renamed"}`},
		{"POST", "/v1/user/team/members", "{ada_token}", `{"email":"new@example.com","name":"New"}`},
		{"PATCH", "/v1/user/team/members/{vic}", "{ada_token}", `{"role":"user"}`},
		{"DELETE", "/v1/user/team/members/{vic}", "{ada_token}", ``},
		{"POST", "/v1/user/team/members/{pend}/invite", "{ada_token}", ``},
		{"POST", "/v1/user/team/members/{vic}/reset", "{ada_token}", ``},
		{"DELETE", "/v1/user/team/members/{vic}/reset", "{ada_token}", ``},
		{"POST", "/v1/user/tokens", "{alice_token}", `{"name":"ci"}`},
		{"DELETE", "/v1/user/tokens/{spare}", "{alice_token}", ``},
		{"POST", "/v1/user/devices", "{alice_token}", `{"platform":"esp32","board":"devkit"}`},
		{"PATCH", "/v1/user/devices/{alice}", "{alice_token}", `{"name":"Renamed"}`},
		{"DELETE", "/v1/user/devices/{second}", "{alice_token}", ``},
		{"POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", `{"id":"fan","label":"Fan","payload":{}}`},
		{"DELETE", "/v1/user/devices/{alice}/command-buttons/led", "{alice_token}", ``},
		{"POST", "/v1/user/devices/{alice}/reboot", "{alice_token}", ``},
		{"POST", "/v1/user/team/webhooks", "{ada_token}", `{"url":"https://203.0.113.8/in","events":["device.status"]}`},
		{"PATCH", "/v1/user/team/webhooks/{wh}", "{ada_token}", `{"enabled":false}`},
		{"DELETE", "/v1/user/team/webhooks/{wh}", "{ada_token}", ``},
		{"POST", "/v1/user/rollouts", "{alice_token}", `{"md5":"{md5}","device_uids":["{alice}"]}`},
		{"POST", "/v1/user/rollouts/{running}/pause", "{alice_token}", ``},
		{"POST", "/v1/user/rollouts/{ended}/revert", "{alice_token}", ``},
	} {
		var body any
		if c.body != "" {
			body = v.expand(c.body)
		}
		w := env.request(c.method, v.expand(c.path), v.expand(c.token), body)
		if w.Code != http.StatusInternalServerError {
			t.Errorf("%s %s: got %d %s, want 500: its entry could not be inserted", c.method, c.path, w.Code, w.Body)
		}
		after := dbState(t, env.st)
		sameState(t, c.method+" "+c.path, before, after)
		before = after
	}
}
