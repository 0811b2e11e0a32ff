package main

// Teams and roles: every route's answer for each role of a team and for
// members of another team, and the members and invites API.

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// addMember adds a member with that role to the team of of, as
// 'user add -team' does, with a token and a second one ({<key>_token2});
// the member's device is of's.
func (e *testEnv) addMember(name string, r model.Role, of testUser) testUser {
	e.t.Helper()
	ctx := context.Background()
	email := strings.ToLower(name) + "@example.com"
	hash, err := hashPassword(name+"-password", testIterations)
	must(e.t, err)
	id, err := e.st.CreateUser(ctx, name, email, r, hash, of.email)
	must(e.t, err)
	_, tok, err := issueToken(ctx, e.st, id, "test", nil, nil)
	must(e.t, err)
	return testUser{id: id, email: email, password: name + "-password", token: tok, device: of.device}
}

// teamOf is the team id of a user.
func teamOf(tb testing.TB, env *testEnv, u testUser) string {
	return scalar(tb, env.st, `SELECT team_id FROM users WHERE id = ?`, u.id)
}

// roleCase is a route and how each role answers it. need is the least
// role that may use it ("viewer" for a read); other is the answer to a
// member of another team, who may use the route but not on this team's
// {a}, {vic} or {ro} (zero: it answers them for their own team). A
// success is status; then effect, a query, gives want, and a write adds
// one audit entry: action by the caller, on device (a var or ""), with
// detail (JSON).
type roleCase struct {
	pattern, path, body string
	form                map[string]string
	need                model.Role
	status              int
	other               apiAnswer
	effect, want        string
	device, detail      string
}

type apiAnswer struct {
	status int
	body   string
}

// The answers to a member of another team who names this team's things.
var (
	otherDevice  = apiAnswer{404, apiDeviceNotFound}
	otherMember  = apiAnswer{404, `{"message":"Member not found."}`}
	otherRollout = apiAnswer{404, `{"message":"Rollout not found."}`}
	otherWebhook = apiAnswer{404, `{"message":"Webhook not found."}`}
)

const apiForbidden = `{"message":"This action is unauthorized."}`

// TestTeamRoles: two teams, each with an admin, a user and a viewer
// (Ada, Alice, Vic; Bea, Bob, Val). Every route of routes() has a row
// (a route without one fails the test) that says what each role gets:
// 403 for a write the role may not do, 404 for another team's device,
// member or rollout, 2xx otherwise. A refusal changes nothing; a success
// has its effect, changes no other team's data and adds exactly one
// audit entry for a write (none for a read); no read answers with any of
// the other team's devices, firmwares, members, commands or webhooks.
func TestTeamRoles(t *testing.T) {
	t.Parallel()
	fwFile := []byte("\xe9team firmware")
	cmd := `SELECT kind FROM commands WHERE sent_by = {me} ORDER BY seq DESC LIMIT 1`
	rows := []roleCase{
		{pattern: "GET /v1/auth/me", path: "/v1/auth/me", need: "viewer", status: 200},
		{pattern: "POST /v1/auth/logout", path: "/v1/auth/logout", need: "viewer", status: 200,
			effect: `SELECT count(*) FROM tokens WHERE user_id = {me}`, want: "1"},

		{pattern: "GET /v1/user/team", path: "/v1/user/team", need: "viewer", status: 200},
		{pattern: "PATCH /v1/user/team", path: "/v1/user/team", body: `{"name":"Renamed"}`, need: "admin", status: 200,
			effect: `SELECT name FROM teams WHERE id = {my_team}`, want: "Renamed", detail: `{"name":"Renamed","previous_name":"{my_team_name}"}`},
		{pattern: "POST /v1/user/team/members", path: "/v1/user/team/members", body: `{"email":"new@example.com","name":"New","role":"viewer"}`,
			need: "admin", status: 201, effect: `SELECT team_id || role FROM invites WHERE email = 'new@example.com'`, want: "{my_team}viewer",
			detail: `{"member_id":{new_user},"name":"New","email":"new@example.com","role":"viewer"}`},
		{pattern: "PATCH /v1/user/team/members/{id}", path: "/v1/user/team/members/{vic}", body: `{"role":"user"}`, need: "admin", status: 200,
			other: otherMember, effect: `SELECT role FROM users WHERE id = {vic}`, want: "user", detail: `{"member_id":{vic},"name":"Vic","role":"user"}`},
		{pattern: "DELETE /v1/user/team/members/{id}", path: "/v1/user/team/members/{vic}", need: "admin", status: 200,
			other: otherMember, effect: `SELECT count(*) FROM users WHERE id = {vic}`, want: "0", detail: `{"member_id":{vic},"name":"Vic","email":"vic@example.com"}`},
		{pattern: "POST /v1/user/team/members/{id}/invite", path: "/v1/user/team/members/{pend}/invite", need: "admin", status: 200,
			other: otherMember, effect: `SELECT invited_by FROM invites WHERE id = {pend}`, want: "{me}",
			detail: `{"member_id":{pend},"name":"Pend","email":"pend@example.com","role":"user"}`},
		{pattern: "POST /v1/user/team/members/{id}/reset", path: "/v1/user/team/members/{vic}/reset", need: "admin", status: 200,
			other: otherMember, effect: `SELECT count(*) FROM password_resets WHERE user_id = {vic}`, want: "1",
			detail: `{"member_id":{vic},"name":"Vic"}`},
		{pattern: "DELETE /v1/user/team/members/{id}/reset", path: "/v1/user/team/members/{vic}/reset", need: "admin", status: 200,
			other: otherMember, effect: `SELECT count(*) FROM password_resets WHERE user_id = {vic}`, want: "0",
			detail: `{"member_id":{vic},"name":"Vic"}`},
		{pattern: "GET /v1/user/team/audit", path: "/v1/user/team/audit", need: "viewer", status: 200},
		{pattern: "GET /v1/user/team/webhooks", path: "/v1/user/team/webhooks", need: "admin", status: 200},
		{pattern: "POST /v1/user/team/webhooks", path: "/v1/user/team/webhooks", body: `{"url":"https://203.0.113.7/in","events":["device.status"]}`,
			need: "admin", status: 201, effect: `SELECT count(*) FROM webhooks WHERE team_id = {my_team} AND url = 'https://203.0.113.7/in'`, want: "1",
			detail: `{"webhook_id":{new_webhook},"host":"203.0.113.7","events":["device.status"]}`},
		{pattern: "PATCH /v1/user/team/webhooks/{id}", path: "/v1/user/team/webhooks/{wh}", body: `{"enabled":false}`, need: "admin", status: 200,
			other: otherWebhook, effect: `SELECT enabled FROM webhooks WHERE id = {wh}`, want: "0", detail: `{"webhook_id":{wh},"enabled":false}`},
		{pattern: "DELETE /v1/user/team/webhooks/{id}", path: "/v1/user/team/webhooks/{wh}", need: "admin", status: 200,
			other: otherWebhook, effect: `SELECT count(*) FROM webhooks WHERE id = {wh}`, want: "0", detail: `{"webhook_id":{wh},"host":"203.0.113.7"}`},
		// A ping is no write the audit log records.
		{pattern: "POST /v1/user/team/webhooks/{id}/test", path: "/v1/user/team/webhooks/{wh}/test", need: "admin", status: 202,
			other: otherWebhook, effect: `SELECT type FROM webhook_queue WHERE webhook_id = {wh}`, want: "ping"},
		{pattern: "GET /v1/user/team/webhooks/{id}/deliveries", path: "/v1/user/team/webhooks/{wh}/deliveries", need: "admin", status: 200, other: otherWebhook},

		{pattern: "GET /v1/user/tokens", path: "/v1/user/tokens", need: "viewer", status: 200},
		{pattern: "POST /v1/user/tokens", path: "/v1/user/tokens", body: `{"name":"ci"}`, need: "viewer", status: 201,
			effect: `SELECT count(*) FROM tokens WHERE user_id = {me} AND name = 'ci'`, want: "1", detail: `{"token_id":{new_token},"name":"ci"}`},
		{pattern: "DELETE /v1/user/tokens/{id}", path: "/v1/user/tokens/{my_token2}", need: "viewer", status: 200,
			effect: `SELECT count(*) FROM tokens WHERE id = {my_token2}`, want: "0", detail: `{"token_id":{my_token2}}`},

		{pattern: "GET /v1/user/devices", path: "/v1/user/devices", need: "viewer", status: 200},
		{pattern: "POST /v1/user/devices", path: "/v1/user/devices", body: `{"platform":"esp32","board":"devkit","name":"New"}`, need: "user", status: 201,
			effect: `SELECT count(*) FROM devices WHERE team_id = {my_team} AND name = 'New'`, want: "1",
			device: "{new_device}", detail: `{"platform":"esp32","board":"devkit","name":"New"}`},
		{pattern: "GET /v1/user/devices/{uid}", path: "/v1/user/devices/{a}", need: "viewer", status: 200, other: otherDevice},
		{pattern: "PATCH /v1/user/devices/{uid}", path: "/v1/user/devices/{a}", body: `{"name":"Renamed"}`, need: "user", status: 200, other: otherDevice,
			effect: `SELECT name FROM devices WHERE uid = '{a}'`, want: "Renamed", device: "{a}",
			detail: `{"name":"Renamed","description":null,"previous_name":"Alice's device"}`},
		{pattern: "DELETE /v1/user/devices/{uid}", path: "/v1/user/devices/{a}", need: "user", status: 200, other: otherDevice,
			effect: `SELECT count(*) FROM devices WHERE uid = '{a}'`, want: "0", device: "{a}", detail: `{}`},
		// Without -mqtt-dynsec: TestDeviceCreateDelete has the broker.
		{pattern: "POST /v1/user/devices/{uid}/credentials", path: "/v1/user/devices/{a}/credentials", need: "user", status: 422, other: otherDevice},

		{pattern: "POST /v1/user/devices/{uid}/reboot", path: "/v1/user/devices/{a}/reboot", need: "user", status: 200, other: otherDevice,
			effect: cmd, want: "reboot", device: "{a}", detail: `{"kind":"reboot","command_id":"{new_command}"}`},
		{pattern: "POST /v1/user/devices/{uid}/wifi-reset", path: "/v1/user/devices/{a}/wifi-reset", need: "user", status: 200, other: otherDevice,
			effect: cmd, want: "wifi_reset", device: "{a}", detail: `{"kind":"wifi_reset","command_id":"{new_command}"}`},
		{pattern: "POST /v1/user/devices/{uid}/ota", path: "/v1/user/devices/{a}/ota", need: "user", status: 200, other: otherDevice,
			effect: cmd, want: "ota", device: "{a}", detail: `{"kind":"ota","command_id":"{new_command}"}`},
		{pattern: "POST /v1/user/devices/{uid}/commands", path: "/v1/user/devices/{a}/commands", body: `{"payload":{"x":1}}`, need: "user", status: 200,
			other: otherDevice, effect: cmd, want: "custom", device: "{a}", detail: `{"kind":"custom","command_id":"{new_command}"}`},
		{pattern: "GET /v1/user/devices/{uid}/commands", path: "/v1/user/devices/{a}/commands", need: "viewer", status: 200, other: otherDevice},
		{pattern: "GET /v1/user/devices/{uid}/commands/{id}", path: "/v1/user/devices/{a}/commands/{cmd}", need: "viewer", status: 200, other: otherDevice},

		{pattern: "GET /v1/user/devices/{uid}/series", path: "/v1/user/devices/{a}/series", need: "viewer", status: 200, other: otherDevice},
		{pattern: "GET /v1/user/devices/{uid}/history", path: "/v1/user/devices/{a}/history?series=rssi", need: "viewer", status: 200, other: otherDevice},
		{pattern: "GET /v1/user/devices/{uid}/presence", path: "/v1/user/devices/{a}/presence", need: "viewer", status: 200, other: otherDevice},
		{pattern: "GET /v1/user/devices/{uid}/boots", path: "/v1/user/devices/{a}/boots", need: "viewer", status: 200, other: otherDevice},

		{pattern: "GET /v1/user/devices/{uid}/command-buttons", path: "/v1/user/devices/{a}/command-buttons", need: "viewer", status: 200, other: otherDevice},
		{pattern: "POST /v1/user/devices/{uid}/command-buttons", path: "/v1/user/devices/{a}/command-buttons", body: `{"id":"fan","label":"Fan","payload":{}}`,
			need: "user", status: 201, other: otherDevice, effect: `SELECT label FROM command_buttons WHERE id = 'fan'`, want: "Fan",
			device: "{a}", detail: `{"button_id":"fan","label":"Fan"}`},
		{pattern: "DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}", path: "/v1/user/devices/{a}/command-buttons/led", need: "user", status: 200,
			other: otherDevice, effect: `SELECT count(*) FROM command_buttons`, want: "0", device: "{a}", detail: `{"button_id":"led"}`},
		{pattern: "POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send", path: "/v1/user/devices/{a}/command-buttons/led/send", need: "user", status: 200,
			other: otherDevice, effect: cmd, want: "button", device: "{a}", detail: `{"kind":"button","command_id":"{new_command}"}`},

		{pattern: "GET /v1/user/firmware-health", path: "/v1/user/firmware-health", need: "viewer", status: 200},
		{pattern: "GET /v1/user/rollouts", path: "/v1/user/rollouts", need: "viewer", status: 200},
		{pattern: "POST /v1/user/rollouts", path: "/v1/user/rollouts", body: `{"md5":"{fw_md5}","device_uids":["{a2}"]}`, need: "user", status: 201,
			other: apiAnswer{422, apiJSON(map[string]any{"message": "The md5 field must be the md5 of one of your firmwares. (and 1 more error)", "errors": map[string][]string{
				"md5": {"The md5 field must be the md5 of one of your firmwares."}, "device_uids": {`The device uids field contains devices you do not have: "{a2}".`}}})},
			effect: `SELECT created_by FROM rollouts ORDER BY id DESC LIMIT 1`, want: "{me}", detail: `{"rollout_id":{new_rollout},"name":null,"md5":"{fw_md5}","firmware":{"name":"fw","version":null},"devices":1}`},
		{pattern: "GET /v1/user/rollouts/{id}", path: "/v1/user/rollouts/{ro}", need: "viewer", status: 200, other: otherRollout},
		{pattern: "POST /v1/user/rollouts/{id}/pause", path: "/v1/user/rollouts/{ro}/pause", need: "user", status: 200, other: otherRollout,
			effect: `SELECT state FROM rollouts WHERE id = {ro}`, want: "paused", detail: `{"rollout_id":{ro},"name":null,"md5":"{fw_md5}","firmware":{"name":"fw","version":null},"devices":1}`},
		{pattern: "POST /v1/user/rollouts/{id}/resume", path: "/v1/user/rollouts/{ro_paused}/resume", need: "user", status: 200, other: otherRollout,
			effect: `SELECT state FROM rollouts WHERE id = {ro_paused}`, want: "running", detail: `{"rollout_id":{ro_paused},"name":null,"md5":"{fw_md5}","firmware":{"name":"fw","version":null},"devices":1}`},
		{pattern: "POST /v1/user/rollouts/{id}/cancel", path: "/v1/user/rollouts/{ro}/cancel", need: "user", status: 200, other: otherRollout,
			effect: `SELECT state FROM rollouts WHERE id = {ro}`, want: "cancelled", detail: `{"rollout_id":{ro},"name":null,"md5":"{fw_md5}","firmware":{"name":"fw","version":null},"devices":1}`},
		{pattern: "POST /v1/user/rollouts/{id}/revert", path: "/v1/user/rollouts/{ro_over}/revert", need: "user", status: 201, other: otherRollout,
			effect: `SELECT reverts FROM rollouts ORDER BY id DESC LIMIT 1`, want: "{ro_over}",
			detail: `{"rollout_id":{new_rollout},"name":"Revert of rollout {ro_over}","md5":null,"firmware":null,"devices":0,"reverts":{ro_over}}`},

		{pattern: "GET /v1/user/firmwares", path: "/v1/user/firmwares", need: "viewer", status: 200},
		{pattern: "POST /v1/user/firmwares", path: "/v1/user/firmwares", form: map[string]string{"name": "up"}, need: "user", status: 201,
			effect: `SELECT count(*) FROM library_firmwares WHERE name = 'up' AND team_id = {my_team} AND uploaded_by = {me}`, want: "1",
			detail: `{"name":"up","version":null,"md5":"{up_md5}","sha256":"{up_sha}"}`},
		{pattern: "DELETE /v1/user/firmwares/{sha256}", path: "/v1/user/firmwares/{lib_sha}", need: "user", status: 200,
			other: apiAnswer{404, `{"message":"Firmware not found."}`}, effect: `SELECT count(*) FROM library_firmwares WHERE sha256 = '{lib_sha}'`,
			want: "0", detail: `{"name":"lib","version":null,"md5":"{lib_md5}","sha256":"{lib_sha}"}`},
		{pattern: "GET /v1/user/devices/{uid}/firmwares", path: "/v1/user/devices/{a}/firmwares", need: "viewer", status: 200, other: otherDevice},
		{pattern: "POST /v1/user/devices/{uid}/firmwares", path: "/v1/user/devices/{a}/firmwares", form: map[string]string{"name": "up"}, need: "user", status: 201,
			other: otherDevice, effect: `SELECT count(*) FROM firmwares WHERE name = 'up'`, want: "1", device: "{a}",
			detail: `{"firmware_id":{new_firmware},"name":"up","md5":"` + md5Hex([]byte("\xe9upload")) + `"}`},
		{pattern: "PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}", path: "/v1/user/devices/{a}/firmwares/{fw2}", body: `{"name":"x"}`, need: "user", status: 200,
			other: otherDevice, effect: `SELECT name FROM firmwares WHERE id = {fw2}`, want: "x", device: "{a}", detail: `{"firmware_id":{fw2},"name":"x"}`},
		{pattern: "DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}", path: "/v1/user/devices/{a}/firmwares/{fw2}", need: "user", status: 200,
			other: otherDevice, effect: `SELECT count(*) FROM firmwares WHERE id = {fw2}`, want: "0", device: "{a}", detail: `{"firmware_id":"{fw2}"}`},
		{pattern: "POST /v1/user/devices/{uid}/firmwares/set-target", path: "/v1/user/devices/{a}/firmwares/set-target", body: `{"md5":"{fw2_md5}"}`,
			need: "user", status: 200, other: otherDevice, effect: `SELECT target_firmware_id FROM devices WHERE uid = '{a}'`, want: "{fw2}",
			device: "{a}", detail: `{"md5":"{fw2_md5}"}`},
	}
	// Routes without a token have no role; the stream is TestEventStream*'s.
	noRole := []string{"/", "GET /healthz", "GET /v1/openapi.json", "GET /{$}", "GET /ota/{uid}/{file}",
		"POST /v1/auth/login", "POST /v1/auth/invite", "POST /v1/auth/invite/info", "POST /v1/auth/reset", "POST /v1/auth/reset/info",
		"GET /v1/user/events"}
	for _, rt := range (&server{}).routes() {
		if !slices.Contains(noRole, rt.pattern) && !slices.ContainsFunc(rows, func(c roleCase) bool { return c.pattern == rt.pattern }) {
			t.Errorf("route %s has no row in TestTeamRoles", rt.pattern)
		}
	}

	fixture := func(t *testing.T) (*testEnv, apiVars, map[string]testUser) {
		env := newTestEnv(t, &recordingLink{})
		users := map[string]testUser{"alice": env.alice, "bob": env.bob,
			"ada": env.addMember("Ada", "admin", env.alice), "vic": env.addMember("Vic", "viewer", env.alice),
			"bea": env.addMember("Bea", "admin", env.bob), "val": env.addMember("Val", "viewer", env.bob)}
		v := newAPIVars(env)
		for key, u := range users {
			v[key+"_token2"], _, _ = strings.Cut(apiAddToken(t, env, u.id), "|")
		}
		v["a"], v["vic"] = env.alice.device, strconv.FormatInt(users["vic"].id, 10)
		a2 := addDevice(t, env, env.alice, "esp32")
		v["a2"] = a2.device
		for _, uid := range []string{v["a"], v["a2"]} {
			env.setStatus(uid, "online")
		}
		tell(env, newOfflineLink(env.st, env.log), v["a"], "telemetry", `{"rssi":-50}`) // a series for GET …/history
		apiAddButton(t, env, env.alice, model.CommandButton{ID: "led", Label: "LED", Payload: json.RawMessage(`{}`)})
		v["fw"], v["fw_md5"] = apiUpload(env, env.alice, "fw", fwFile), md5Hex(fwFile)
		apiUpload(env, a2, "fw", fwFile)
		v["fw2"], v["fw2_md5"] = apiUpload(env, env.alice, "fw2", []byte("\xe9second")), md5Hex([]byte("\xe9second"))
		env.setTarget(env.alice, v["fw_md5"])
		v["pend"] = fmt.Sprint(decode(t, env.want(t, 201, "POST", "/v1/user/team/members", users["ada"].token,
			`{"email":"pend@example.com","name":"Pend"}`))["data"].(map[string]any)["id"])
		env.want(t, 200, "POST", "/v1/user/team/members/"+v["vic"]+"/reset", users["ada"].token, nil)
		libFile := []byte("\xe9library")
		if w := env.uploadToLibrary(env.alice, map[string]string{"name": "lib"}, libFile); w.Code != 201 {
			t.Fatalf("library upload: %d %s", w.Code, w.Body)
		}
		v["lib_md5"], v["lib_sha"] = md5Hex(libFile), sha256Hex(libFile)
		v["up_md5"], v["up_sha"] = md5Hex([]byte("\xe9upload")), sha256Hex([]byte("\xe9upload"))
		v["cmd"] = decode(t, env.want(t, 200, "POST", "/v1/user/devices/"+v["a"]+"/reboot", env.alice.token, nil))["command_id"].(string)
		rollout := func(uid string) string {
			w := env.want(t, 201, "POST", "/v1/user/rollouts", env.alice.token, map[string]any{"md5": v["fw_md5"], "device_uids": []string{uid}})
			return fmt.Sprint(decode(t, w)["data"].(map[string]any)["id"])
		}
		v["ro"], v["ro_paused"] = rollout(v["a"]), rollout(v["a2"])
		v["wh"] = fmt.Sprint(decode(t, env.want(t, 201, "POST", "/v1/user/team/webhooks", users["ada"].token,
			`{"url":"https://203.0.113.7/","events":["device.offline"]}`))["data"].(map[string]any)["id"])
		env.want(t, 200, "POST", "/v1/user/rollouts/"+v["ro_paused"]+"/pause", env.alice.token, nil)
		v["ro_over"] = rollout(v["a"])
		env.want(t, 200, "POST", "/v1/user/rollouts/"+v["ro_over"]+"/cancel", env.alice.token, nil)
		return env, v, users
	}

	// The callers: team A's three roles, and team B's admin and viewer.
	// Reads and refusals share one fixture, as they change nothing; each
	// write that succeeds gets a fresh one.
	callers := []struct {
		key   string
		role  model.Role
		other bool
	}{{"ada", "admin", false}, {"alice", "user", false}, {"vic", "viewer", false}, {"bea", "admin", true}, {"val", "viewer", true}}
	shared, sharedVars, sharedUsers := fixture(t)
	for _, rc := range rows {
		method, _, _ := strings.Cut(rc.pattern, " ")
		read := method == "GET"
		for _, c := range callers {
			want := apiAnswer{rc.status, ""}
			switch {
			case !c.role.May(rc.need):
				want = apiAnswer{403, apiForbidden}
			case c.other && rc.other.status != 0:
				want = rc.other
			}
			t.Run(rc.pattern+" as "+c.key, func(t *testing.T) {
				env, v, users := shared, sharedVars, sharedUsers
				if !read && want.status < 300 {
					t.Parallel() // after the shared fixture's cases
					env, v, users = fixture(t)
				}
				env.t = t
				me := users[c.key]
				v["me"], v["my_team"], v["my_token2"] = strconv.FormatInt(me.id, 10), teamOf(t, env, me), v[c.key+"_token2"]
				v["my_team_name"] = scalar(t, env.st, `SELECT name FROM teams WHERE id = ?`, v["my_team"])
				teamA := []int64{env.alice.id, users["ada"].id, users["vic"].id}
				teamB := []int64{env.bob.id, users["bea"].id, users["val"].id}
				tc := apiCase{method: method, path: rc.path, token: me.token, body: rc.body, form: rc.form}
				if rc.form != nil {
					tc.file = []byte("\xe9upload")
				}
				before, audit := dbState(t, env.st), scalar(t, env.st, `SELECT count(*) FROM audit`)
				var atAnswer string // the audit entries when the answer began
				w := env.serveWatched(t, tc.request(v), func() { atAnswer = scalar(t, env.st, `SELECT count(*) FROM audit`) })
				checkAnswer(t, w, want.status, v.expand(want.body))
				// checkAnswer has no body to compare a list's answer with:
				// no read answers with the other team's things, as the
				// database has them.
				otherTeam := teamOf(t, env, env.bob)
				if c.other {
					otherTeam = teamOf(t, env, env.alice)
				}
				for s, what := range teamStrings(t, env.st, otherTeam) {
					if read && strings.Contains(w.Body.String(), s) {
						t.Errorf("the answer has the other team's %s %q: %s", what, s, w.Body)
					}
				}
				after := dbState(t, env.st)
				if w.Code >= 300 {
					sameState(t, "a refusal", before, after)
					wantDB(t, env.st, audit, `SELECT count(*) FROM audit`)
					return
				}
				if c.other {
					sameState(t, "another team's member", before, after, teamA...)
				} else {
					sameState(t, "a member", before, after, teamB...)
				}
				if read {
					sameState(t, "a read", before, after)
				}
				if rc.effect != "" {
					wantDB(t, env.st, v.expand(rc.want), v.expand(rc.effect))
				}
				checkAuditEntry(t, env, v, me, rc, read || rc.pattern == "POST /v1/auth/logout" || rc.pattern == "POST /v1/user/team/webhooks/{id}/test", audit)
				if all := scalar(t, env.st, `SELECT count(*) FROM audit`); atAnswer != all {
					t.Errorf("audit entries: %s when the answer began, %s after it: the entry must commit before the answer", atAnswer, all)
				}
			})
		}
	}
	shared.t = t
}

// teamStrings are the strings that name a team's things in an answer,
// each with what it names: its devices' uids and names, its firmwares'
// md5 and sha256 (a device's and the library's), its members' and
// invitees' emails, its commands' ids and its webhooks' URLs.
func teamStrings(tb testing.TB, st *store.Store, teamID string) map[string]string {
	tb.Helper()
	return queryMap(tb, storeReader(st), `SELECT uid, 'device uid' FROM devices WHERE team_id = ?1
		UNION ALL SELECT name, 'device name' FROM devices WHERE team_id = ?1
		UNION ALL SELECT f.md5, 'firmware md5' FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.team_id = ?1
		UNION ALL SELECT f.sha256, 'firmware sha256' FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.team_id = ?1
		UNION ALL SELECT md5, 'library md5' FROM library_firmwares WHERE team_id = ?1
		UNION ALL SELECT sha256, 'library sha256' FROM library_firmwares WHERE team_id = ?1
		UNION ALL SELECT email, 'member email' FROM users WHERE team_id = ?1
		UNION ALL SELECT email, 'invitee email' FROM invites WHERE team_id = ?1
		UNION ALL SELECT id, 'command id' FROM commands WHERE team_id = ?1
		UNION ALL SELECT url, 'webhook URL' FROM webhooks WHERE team_id = ?1`, teamID)
}

// checkAuditEntry checks that a successful read added no audit entry and
// a write exactly one: rc's action (the route's), by me, on rc.device,
// with rc.detail, where {new_<thing>} is the newest row of that thing.
func checkAuditEntry(t *testing.T, env *testEnv, v apiVars, me testUser, rc roleCase, read bool, before string) {
	t.Helper()
	n, _ := strconv.Atoi(before)
	if read {
		wantDB(t, env.st, before, `SELECT count(*) FROM audit`)
		return
	}
	wantDB(t, env.st, strconv.Itoa(n+1), `SELECT count(*) FROM audit`)
	for thing, q := range map[string]string{"user": `SELECT max(id) FROM (SELECT id FROM users UNION ALL SELECT id FROM invites)`, "token": `SELECT max(id) FROM tokens`,
		"device": `SELECT uid FROM devices ORDER BY id DESC LIMIT 1`, "command": `SELECT id FROM commands ORDER BY seq DESC LIMIT 1`,
		"rollout": `SELECT max(id) FROM rollouts`, "firmware": `SELECT max(id) FROM firmwares`, "webhook": `SELECT max(id) FROM webhooks`} {
		v["new_"+thing] = scalar(t, env.st, q)
	}
	device := "<nil>"
	if rc.device != "" {
		device = v.expand(rc.device)
	}
	wantDB(t, env.st, fmt.Sprintf("%s|%d|%s|%s", auditAction(rc.pattern), me.id, device, apiJSONText(t, v.expand(rc.detail))),
		`SELECT action || '|' || actor_id || '|' || coalesce(device_uid, '<nil>') || '|' || detail FROM audit ORDER BY id DESC LIMIT 1`)
}

// apiJSONText is s as compact JSON, as the audit log stores it.
func apiJSONText(tb testing.TB, s string) string {
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		tb.Fatalf("bad JSON %s: %v", s, err)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// auditAction is the action the audit log records for a route, from the
// contract's list (docs/api.md, "Team, members and the audit log"), written here once more so that a route
// wired to the wrong action fails.
func auditAction(pattern string) string {
	for _, a := range []struct{ action, pattern string }{
		{"team.update", "PATCH /v1/user/team"}, {"member.invite", "POST /v1/user/team/members"},
		{"member.invite", "POST /v1/user/team/members/{id}/invite"}, {"member.reset", "POST /v1/user/team/members/{id}/reset"},
		{"member.reset_revoke", "DELETE /v1/user/team/members/{id}/reset"},
		{"member.update", "PATCH /v1/user/team/members/{id}"}, {"member.delete", "DELETE /v1/user/team/members/{id}"},
		{"token.create", "POST /v1/user/tokens"}, {"token.delete", "DELETE /v1/user/tokens/{id}"},
		{"device.create", "POST /v1/user/devices"}, {"device.update", "PATCH /v1/user/devices/{uid}"},
		{"device.delete", "DELETE /v1/user/devices/{uid}"}, {"device.credentials", "POST /v1/user/devices/{uid}/credentials"},
		{"button.create", "POST /v1/user/devices/{uid}/command-buttons"}, {"button.delete", "DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}"},
		{"rollout.create", "POST /v1/user/rollouts"}, {"rollout.pause", "POST /v1/user/rollouts/{id}/pause"},
		{"rollout.resume", "POST /v1/user/rollouts/{id}/resume"}, {"rollout.cancel", "POST /v1/user/rollouts/{id}/cancel"},
		{"rollout.revert", "POST /v1/user/rollouts/{id}/revert"},
		{"firmware.upload", "POST /v1/user/devices/{uid}/firmwares"}, {"firmware.update", "PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}"},
		{"firmware.delete", "DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}"},
		{"firmware.upload", "POST /v1/user/firmwares"}, {"firmware.delete", "DELETE /v1/user/firmwares/{sha256}"}, {"firmware.set_target", "POST /v1/user/devices/{uid}/firmwares/set-target"},
		{"webhook.create", "POST /v1/user/team/webhooks"}, {"webhook.update", "PATCH /v1/user/team/webhooks/{id}"},
		{"webhook.delete", "DELETE /v1/user/team/webhooks/{id}"},
	} {
		if a.pattern == pattern {
			return a.action
		}
	}
	return "command.send" // reboot, wifi-reset, ota, commands, a button's send
}

// teamVars adds Ada (admin) and Vic (viewer) to alice's team and Bea
// (admin) to bob's, as {ada}, {vic}, {bea} (ids) and {ada_token}.
func teamVars(t *testing.T, env *testEnv, v apiVars) {
	for key, m := range map[string]testUser{"ada": env.addMember("Ada", "admin", env.alice),
		"vic": env.addMember("Vic", "viewer", env.alice), "bea": env.addMember("Bea", "admin", env.bob)} {
		v[key], v[key+"_token"] = strconv.FormatInt(m.id, 10), m.token
	}
}

// apiMember is a Member object made at {now} that never logged in.
func apiMember(id, name, role string) string {
	return fmt.Sprintf(`{"id":%s,"name":%q,"email":%q,"role":%q,"last_login_at":null,"created_at":"{now}","pending":false,"reset_pending":false}`,
		id, name, strings.ToLower(name)+"@example.com", role)
}

// apiInvited is apiMember for a member whose invite is pending.
func apiInvited(id, name, role string) string {
	return strings.Replace(apiMember(id, name, role), `"pending":false`, `"pending":true`, 1)
}

// inviteURL matches an invite link and captures its secret.
var inviteURL = regexp.MustCompile(`^http://devicehub\.test/#/invite/([A-Za-z0-9]{40})$`)

// TestTeamMembersAPI: the team and its members, as an admin sees and
// changes them; other teams' members are not found, and the last admin
// who can log in stays. An invite answers the same whether or not its
// email has an account, and claims nothing; a team has at most
// -max-members members, invites included.
func TestTeamMembersAPI(t *testing.T) {
	t.Parallel()
	team := func(name string, members ...string) string {
		return `{"data":{"id":{alice_id},"name":"` + name + `","members":[` + strings.Join(members, ",") + `]}}`
	}
	members := []string{apiMember("{alice_id}", "Alice", "user"), apiMember("{ada}", "Ada", "admin"), apiMember("{vic}", "Vic", "viewer")}
	memberBody := func(id, name, role string) string { return `{"data":` + apiMember(id, name, role) + `}` }
	const notFound, needsAdmin = `{"message":"Member not found."}`, `{"message":"The team needs at least one admin."}`
	// invited checks the answer to an invite of name (its email named
	// after it) as role to alice's team: the member invited, with a new id
	// unless id names the one they were invited under before, and the
	// link; only the secret's SHA-256 is stored, and no account is made.
	invited := func(name, role, id string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			var got struct {
				Data      model.Member
				InviteURL string `json:"invite_url"`
			}
			must(t, json.Unmarshal(w.Body.Bytes(), &got))
			m := inviteURL.FindStringSubmatch(got.InviteURL)
			if m == nil {
				t.Fatalf("invite_url %q, want http://devicehub.test/#/invite/<40 alphanumerics>", got.InviteURL)
			}
			wantID := fmt.Sprint(got.Data.ID)
			if id != "" {
				wantID = v[id]
			} else if n, _ := strconv.Atoi(scalar(t, env.st, `SELECT max(id) FROM users`)); got.Data.ID <= int64(n) {
				t.Errorf("member id %d, want one no user has had (users up to %d)", got.Data.ID, n)
			}
			if want := fmt.Sprintf(`{"data":%s,"invite_url":%q}`, apiInvited(wantID, name, role), got.InviteURL); !jsonEqual(t, w.Body.Bytes(), []byte(v.expand(want))) {
				t.Errorf("body:\ngot  %s\nwant %s", w.Body, v.expand(want))
			}
			email := strings.ToLower(name) + "@example.com"
			wantDB(t, env.st, fmt.Sprintf("%d|%s|%s|%s", got.Data.ID, role, strings.ToUpper(sha256Hex([]byte(m[1]))), "2026-11-28T12:00:00.000000Z"),
				`SELECT id || '|' || role || '|' || hex(secret_hash) || '|' || expires_at FROM invites WHERE team_id = ? AND email = ?`, v["alice_id"], email)
			wantDB(t, env.st, "0", `SELECT count(*) FROM invites WHERE instr(secret_hash, ?) > 0`, m[1])
			wantDB(t, env.st, "0", `SELECT count(*) FROM users WHERE team_id = ? AND email = ? AND id = ?`, v["alice_id"], email, got.Data.ID)
		}
	}
	// inviteFirst has an admin invite someone before the case, as {<key>}
	// (their member id) and {<key>_secret}.
	inviteFirst := func(key, token, email, role string) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			v[key], v[key+"_secret"] = inviteAs(t, env, v[token], email, role)
		}
	}
	limit := func(members int) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{Members: members})) }
	}
	const atLimit = `{"message":"Your team has reached its limit of %d members, invites included."}`
	role := func(id, want string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			wantDB(t, env.st, want, `SELECT coalesce((SELECT role FROM users WHERE id = ?), 'gone')`, v[id])
		}
	}
	removed := func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
		wantDB(t, env.st, "gone 0 1", `SELECT coalesce((SELECT role FROM users WHERE id = ?1), 'gone') || ' ' ||
			(SELECT count(*) FROM tokens WHERE user_id = ?1) || ' ' || (SELECT count(*) FROM devices WHERE team_id = ?2)`, v["vic"], v["alice_id"])
		apiWantStatus(t, env, "GET", "/v1/auth/me", v["vic_token"], 401)
	}
	promoteVic := func(t *testing.T, env *testEnv, v apiVars) {
		env.want(t, 200, "PATCH", "/v1/user/team/members/"+v["vic"], v["ada_token"], `{"role":"admin"}`)
	}
	const carol = `{"email":"carol@example.com","name":"Carol","role":"viewer"}`
	tests := []apiCase{
		call("get as viewer", "GET", "/v1/user/team", "{vic_token}", "", 200, team("Alice's team", members...)),
		call("get as bob", "GET", "/v1/user/team", "{bob_token}", "", 200,
			`{"data":{"id":{bob_id},"name":"Bob's team","members":[`+apiMember("{bob_id}", "Bob", "user")+","+apiMember("{bea}", "Bea", "admin")+`]}}`),
		call("rename", "PATCH", "/v1/user/team", "{ada_token}", `{"name":"Greenhouse"}`, 200, team("Greenhouse", members...)),
		call("rename without name", "PATCH", "/v1/user/team", "{ada_token}", `{}`, 422, apiFieldError("name", "The name field is required.")),
		call("rename too long", "PATCH", "/v1/user/team", "{ada_token}", apiField("name", strings.Repeat("n", 256)), 422,
			apiFieldError("name", "The name field must not be greater than 255 characters.")),

		call("invite", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").then(invited("Carol", "viewer", "")),
		call("invite as user by default", "POST", "/v1/user/team/members", "{ada_token}", `{"email":"carol@example.com","name":"Carol"}`, 201, "").
			then(invited("Carol", "user", "")),
		call("invite an email with an account in another team", "POST", "/v1/user/team/members", "{ada_token}", `{"email":"bob@example.com","name":"Bob"}`, 201, "").
			then(allOf(invited("Bob", "user", ""), func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, v["bob_id"]+" Bob", `SELECT team_id || ' ' || name FROM users WHERE email = 'bob@example.com'`)
			})),
		call("invite a member's email in other case", "POST", "/v1/user/team/members", "{ada_token}", `{"email":"VIC@example.com","name":"Vic"}`, 201, "").
			then(invited("Vic", "user", "")),
		call("invite an email another team invited", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").
			after(inviteFirst("bobs_carol", "bea_token", "carol@example.com", "admin")).then(allOf(invited("Carol", "viewer", ""),
			func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, v["bob_id"]+" admin", `SELECT team_id || ' ' || role FROM invites WHERE id = ?`, v["bobs_carol"])
			})),
		call("invite again: a new link, the same id", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").
			after(inviteFirst("carol", "ada_token", "Carol@example.com", "admin")).then(invited("Carol", "viewer", "carol")),
		call("invite at the member limit", "POST", "/v1/user/team/members", "{ada_token}", carol, 422, fmt.Sprintf(atLimit, 3)).after(limit(3)),
		call("invite at the member limit, invites included", "POST", "/v1/user/team/members", "{ada_token}", carol, 422, fmt.Sprintf(atLimit, 4)).
			after(allSetups(inviteFirst("dave", "ada_token", "dave@example.com", "user"), limit(4))),
		call("invite again at the member limit", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").
			after(allSetups(inviteFirst("carol", "ada_token", "carol@example.com", "user"), limit(4))).then(invited("Carol", "viewer", "carol")),
		call("invite under the member limit, an expired invite not counted", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").
			after(allSetups(inviteFirst("dave", "ada_token", "dave@example.com", "user"), expire("dave"), limit(4))).then(invited("Carol", "viewer", "")),
		call("invite, no member limit", "POST", "/v1/user/team/members", "{ada_token}", carol, 201, "").after(limit(0)).then(invited("Carol", "viewer", "")),
		call("get lists members invited, not those expired", "GET", "/v1/user/team", "{vic_token}", "", 200,
			team("Alice's team", append(members, `{"id":{carol},"name":"New","email":"carol@example.com","role":"user","last_login_at":null,"created_at":"{now}","pending":true,"reset_pending":false}`)...)).
			after(allSetups(inviteFirst("dave", "ada_token", "dave@example.com", "user"), expire("dave"),
				inviteFirst("carol", "ada_token", "carol@example.com", "user"))),
		call("invite a bad email", "POST", "/v1/user/team/members", "{ada_token}", `{"email":"Carol <carol@example.com>","name":"Carol"}`, 422,
			apiFieldError("email", "The email field must be a valid email address.")),
		call("invite a bad role", "POST", "/v1/user/team/members", "{ada_token}", `{"email":"carol@example.com","name":"Carol","role":"owner"}`, 422,
			apiFieldError("role", "The role field must be one of: user, admin, viewer.")),

		call("promote", "PATCH", "/v1/user/team/members/{vic}", "{ada_token}", `{"role":"admin"}`, 200, memberBody("{vic}", "Vic", "admin")).then(role("vic", "admin")),
		call("change without role", "PATCH", "/v1/user/team/members/{vic}", "{ada_token}", `{}`, 422, apiFieldError("role", "The role field is required.")),
		call("demote the last admin", "PATCH", "/v1/user/team/members/{ada}", "{ada_token}", `{"role":"user"}`, 422, needsAdmin),
		call("demote the last admin, another invited as admin", "PATCH", "/v1/user/team/members/{ada}", "{ada_token}", `{"role":"user"}`, 422, needsAdmin).
			after(inviteFirst("dave", "ada_token", "dave@example.com", "admin")),
		call("change a member invited", "PATCH", "/v1/user/team/members/{carol}", "{ada_token}", `{"role":"admin"}`, 200,
			`{"data":{"id":{carol},"name":"New","email":"carol@example.com","role":"admin","last_login_at":null,"created_at":"{now}","pending":true,"reset_pending":false}}`).after(inviteFirst("carol", "ada_token", "carol@example.com", "user")).
			then(func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, "admin", `SELECT role FROM invites WHERE id = ?`, v["carol"])
			}),
		call("change another team's member invited", "PATCH", "/v1/user/team/members/{carol}", "{ada_token}", `{"role":"admin"}`, 404, notFound).
			after(inviteFirst("carol", "bea_token", "carol@example.com", "user")),
		call("demote an admin of two", "PATCH", "/v1/user/team/members/{ada}", "{ada_token}", `{"role":"viewer"}`, 200,
			memberBody("{ada}", "Ada", "viewer")).after(promoteVic).then(allOf(role("ada", "viewer"),
			func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) { // at once
				checkAnswer(t, env.request("PATCH", "/v1/user/team", v["ada_token"], `{"name":"x"}`), 403, apiForbidden)
			})),
		call("change another team's member", "PATCH", "/v1/user/team/members/{bea}", "{ada_token}", `{"role":"user"}`, 404, notFound),
		call("change an unknown member", "PATCH", "/v1/user/team/members/999", "{ada_token}", `{"role":"user"}`, 404, notFound),
		call("change a member that is no number", "PATCH", "/v1/user/team/members/x", "{ada_token}", `{"role":"user"}`, 404, notFound),

		call("remove", "DELETE", "/v1/user/team/members/{vic}", "{ada_token}", "", 200, `{"message":"Member removed."}`).then(removed),
		call("remove the last admin", "DELETE", "/v1/user/team/members/{ada}", "{ada_token}", "", 422, needsAdmin),
		call("remove the last admin, another invited as admin", "DELETE", "/v1/user/team/members/{ada}", "{ada_token}", "", 422, needsAdmin).
			after(inviteFirst("dave", "ada_token", "dave@example.com", "admin")),
		call("remove a member invited", "DELETE", "/v1/user/team/members/{carol}", "{ada_token}", "", 200, `{"message":"Member removed."}`).
			after(inviteFirst("carol", "ada_token", "carol@example.com", "user")).
			then(func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, "0", `SELECT count(*) FROM invites`)
				checkAnswer(t, redeem(env, "192.0.2.1:1", v["carol_secret"], "carol-password"), 422, "")
				// The audit log tells a revoked invite from a member removed.
				wantDB(t, env.st, `{"email":"carol@example.com","member_id":`+v["carol"]+`,"name":"New","pending":true}`,
					`SELECT detail FROM audit WHERE action = 'member.delete' ORDER BY id DESC LIMIT 1`)
			}),
		call("remove another team's member invited", "DELETE", "/v1/user/team/members/{carol}", "{ada_token}", "", 404, notFound).
			after(inviteFirst("carol", "bea_token", "carol@example.com", "user")),
		call("remove oneself, another admin left", "DELETE", "/v1/user/team/members/{ada}", "{ada_token}", "", 200,
			`{"message":"Member removed."}`).after(promoteVic).then(role("ada", "gone")),
		call("remove another team's member", "DELETE", "/v1/user/team/members/{bea}", "{ada_token}", "", 404, notFound),
		call("remove an unknown member", "DELETE", "/v1/user/team/members/999", "{ada_token}", "", 404, notFound),
	}
	runAPICases(t, teamVars, tests)
}

// invite has ada invite email to alice's team and returns the secret.
func invite(t *testing.T, env *testEnv, v apiVars, email string) string {
	t.Helper()
	_, secret := inviteAs(t, env, v["ada_token"], email, "user")
	return secret
}

// inviteAs has the admin with that token invite email as "New" with
// that role, and returns the member's id and the link's secret.
func inviteAs(t *testing.T, env *testEnv, token, email, role string) (id, secret string) {
	t.Helper()
	w := env.want(t, 201, "POST", "/v1/user/team/members", token, map[string]string{"email": email, "name": "New", "role": role})
	var got struct {
		Data      model.Member
		InviteURL string `json:"invite_url"`
	}
	must(t, json.Unmarshal(w.Body.Bytes(), &got))
	return strconv.FormatInt(got.Data.ID, 10), inviteURL.FindStringSubmatch(got.InviteURL)[1]
}

// expire makes the invite of the member {key} expire a second ago.
func expire(key string) setupFunc {
	return func(t *testing.T, env *testEnv, v apiVars) {
		mustExec(t, env.st, `UPDATE invites SET expires_at = ? WHERE id = ?`,
			env.clock.now().Add(-time.Second).UTC().Format(store.TimeFormat), v[key])
	}
}

// allSetups runs each setup in turn.
func allSetups(setups ...setupFunc) setupFunc {
	return func(t *testing.T, env *testEnv, v apiVars) {
		for _, f := range setups {
			f(t, env, v)
		}
	}
}

// redeem sends POST /v1/auth/invite from addr.
func redeem(env *testEnv, addr, secret, password string) *httptest.ResponseRecorder {
	body := apiJSON(map[string]string{"invite": secret, "password": password, "token_name": "laptop"})
	req := newRequest("POST", "/v1/auth/invite", "", "application/json", strings.NewReader(body))
	req.RemoteAddr = addr
	return env.serve(env.t, req)
}

// TestTeamInvite: an invite link sets the member's password once and
// logs them in as a login does, within 7 days; it is throttled by the
// login's limiter.
func TestTeamInvite(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	const ip, otherIP = "192.0.2.1:1234", "198.51.100.7:4321"
	const invalid = `{"message":"This invitation is invalid or has expired."}`
	carol, secret := inviteAs(t, env, v["ada_token"], "carol@example.com", "user")
	checkAnswer(t, redeem(env, otherIP, secret, "short"), 422, apiFieldError("password", "The password field must be at least 8 characters."))

	w := redeem(env, otherIP, secret, "carol-password")
	checkAnswer(t, w, 200, "")
	var login struct {
		TokenType string `json:"token_type"`
		Token     string
		User      json.RawMessage
	}
	must(t, json.Unmarshal(w.Body.Bytes(), &login))
	// The member's id is the one the invite answered with (docs/api.md, "Team, members and the audit log").
	wantDB(t, env.st, carol, `SELECT id FROM users WHERE email = 'carol@example.com'`)
	if want := `{"id":` + carol + `,"name":"New","email":"carol@example.com","role":"user"}`; login.TokenType != "Bearer" || !jsonEqual(t, login.User, []byte(want)) {
		t.Errorf("answer: got %s, want a login's with user %s", w.Body, want)
	}
	checkNewToken(t, env, login.Token, carol, "laptop")
	wantDB(t, env.st, apiNow+" 0", `SELECT last_login_at || ' ' || (SELECT count(*) FROM invites) FROM users WHERE id = ?`, carol)
	if w := env.want(t, 200, "GET", "/v1/user/devices", login.Token, nil); !strings.Contains(w.Body.String(), env.alice.device) {
		t.Errorf("the new member does not see the team's device: %s", w.Body)
	}
	apiWantStatus(t, env, "POST", "/v1/auth/login", "", 422) // no body: the password is what logs in
	if w := loginFrom(env, otherIP, "carol@example.com", "carol-password"); w.Code != 200 {
		t.Errorf("login with the password the invite set: got %d %s", w.Code, w.Body)
	}

	// Used once; valid until 7 days have passed. A refusal changes nothing.
	refused := func(secret string) {
		t.Helper()
		before := dbState(t, env.st)
		checkAnswer(t, redeem(env, otherIP, secret, "other-password"), 422, invalid)
		sameState(t, "a refused invite", before, dbState(t, env.st))
	}
	refused(secret)
	late, inTime := invite(t, env, v, "dave@example.com"), invite(t, env, v, "erin@example.com")
	env.clock.advance(inviteValidity - time.Second)
	checkAnswer(t, redeem(env, otherIP, inTime, "erin-password"), 200, "")
	env.clock.advance(time.Second)
	refused(late)
	refused(strings.Repeat("x", 40))
	wantDB(t, env.st, "0", `SELECT count(*) FROM users WHERE email = 'dave@example.com'`)
	// An expired invite is no member, and goes at the next prune.
	if w := env.want(t, 200, "GET", "/v1/user/team", v["ada_token"], nil); strings.Contains(w.Body.String(), "dave@") {
		t.Errorf("an expired invite is listed: %s", w.Body)
	}
	must(t, env.st.PruneInvites(context.Background()))
	wantDB(t, env.st, "0", `SELECT count(*) FROM invites WHERE email = 'dave@example.com'`)

	// Five failures per address a minute, as a login; then even a good
	// invite waits, and the failures count against the address's logins.
	good := invite(t, env, v, "fred@example.com")
	for range 5 {
		checkAnswer(t, redeem(env, ip, late, "dave-password"), 422, invalid)
	}
	w = redeem(env, ip, good, "fred-password")
	checkAnswer(t, w, 429, `{"message":"Too Many Attempts."}`)
	if got := w.Header().Get("Retry-After"); got != "60" {
		t.Errorf("Retry-After: got %q, want 60", got)
	}
	for i := range maxAttemptsPerAddr - 5 {
		checkAnswer(t, loginFrom(env, ip, fmt.Sprintf("nobody%d@example.com", i/5), "x"), 422, "")
	}
	checkAnswer(t, loginFrom(env, ip, "alice@example.com", "alice-password"), 429, "")
	checkAnswer(t, redeem(env, otherIP, good, "fred-password"), 200, "")
}

// TestInviteClaimsNothing: two teams may invite the same email; the link
// used first makes the account, and any other link of that email then
// answers as invalid, as does the link of an email that had an account
// when it was invited. Before, the second team's invite was a 422 that
// told its admin the email had an account, and the first team's pending
// invite kept the email from its real team.
func TestInviteClaimsNothing(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	const invalid = `{"message":"This invitation is invalid or has expired."}`
	_, bobs := inviteAs(t, env, v["ada_token"], "bob@example.com", "user")
	_, alices := inviteAs(t, env, v["ada_token"], "carol@example.com", "admin")
	id, beas := inviteAs(t, env, v["bea_token"], "carol@example.com", "user")
	before := dbState(t, env.st)
	checkAnswer(t, redeem(env, "192.0.2.1:1", bobs, "bob-password-2"), 422, invalid)
	sameState(t, "an invite of an email with an account", before, dbState(t, env.st))

	checkAnswer(t, redeem(env, "192.0.2.1:1", beas, "carol-password"), 200, "")
	wantDB(t, env.st, id+" "+v["bob_id"]+" user", `SELECT id || ' ' || team_id || ' ' || role FROM users WHERE email = 'carol@example.com'`)
	before = dbState(t, env.st)
	checkAnswer(t, redeem(env, "192.0.2.1:1", alices, "carol-password-2"), 422, invalid)
	sameState(t, "a second team's invite of an email with an account by now", before, dbState(t, env.st))
	if w := loginFrom(env, "192.0.2.1:1", "carol@example.com", "carol-password"); w.Code != 200 {
		t.Errorf("carol's login: got %d %s", w.Code, w.Body)
	}
}
