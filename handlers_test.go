package main

// Table-driven tests of the REST API through the real router, one table per
// endpoint group. A case runs on a fresh testEnv (alice and bob, one device
// each) unless its table says otherwise, and checks the status, the exact
// body and the database afterwards. Two invariants hold for every case
// (runCase):
//
//   - an error answer leaves the database and the firmware files as they were;
//   - a request never changes the other user's rows (the other user is bob,
//     or alice when the request carries bob's token).
//
// TestEveryRouteRefuses covers, for every route, the answers that do not
// depend on the endpoint: no token, another user's or an unknown device, a
// body past 64 KiB, malformed JSON. The group tables hold the rest.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// apiNow is the fake clock's start as the API renders timestamps.
const apiNow = "2026-11-21T12:00:00.000000Z"

// Answers that many cases expect.
const (
	apiUnauthenticated = `{"message":"Unauthenticated."}`
	apiDeviceNotFound  = `{"message":"Device not found."}`
	apiTooLarge        = `{"message":"The request body is too large."}`
	apiNotAllowed      = `{"message":"Method not allowed."}`
	apiBadJSON         = `{"message":"The body field must be a valid JSON object.","errors":{"body":["The body field must be a valid JSON object."]}}`
)

// apiVars holds the values that table entries name in braces: {alice} and
// {bob} (device uids), {alice_token}, {alice_token_id}, {alice_secret},
// {alice_id} (and bob's), {now}, plus whatever a table's fixture adds.
type apiVars map[string]string

func newAPIVars(env *testEnv) apiVars {
	v := apiVars{"now": apiNow}
	for name, u := range map[string]testUser{"alice": env.alice, "bob": env.bob} {
		id, secret, _ := strings.Cut(u.token, "|")
		v[name] = u.device
		v[name+"_id"] = strconv.FormatInt(u.id, 10)
		v[name+"_token"] = u.token
		v[name+"_token_id"] = id
		v[name+"_secret"] = secret
	}
	return v
}

// expand replaces every {name} in s by its value.
func (v apiVars) expand(s string) string {
	for k, val := range v {
		s = strings.ReplaceAll(s, "{"+k+"}", val)
	}
	return s
}

type (
	setupFunc = func(t *testing.T, env *testEnv, v apiVars)
	checkFunc = func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder)
)

// apiCase is one request and what must follow from it. path, token, authz,
// body and wantBody may name apiVars in braces.
type apiCase struct {
	name       string
	setup      setupFunc // state beyond the table's fixture
	method     string
	path       string
	token      string            // sent as "Authorization: Bearer <token>"
	authz      string            // a raw Authorization header instead
	body       string            // a JSON body (Content-Type: application/json); none when empty
	form       map[string]string // a multipart upload when form or file is set
	file       []byte            // the upload's "file" part; none when nil
	unsized    bool              // hide the body's length, as a chunked request does
	wantStatus int
	wantBody   string // the exact JSON body; when empty, check looks at the body
	check      checkFunc
}

// runAPICases runs each case on a fresh testEnv prepared by fixture, the
// cases in parallel: they share nothing.
func runAPICases(t *testing.T, fixture setupFunc, tests []apiCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, nil)
			v := newAPIVars(env)
			if fixture != nil {
				fixture(t, env, v)
			}
			runCase(t, env, v, tt)
		})
	}
}

// runSharedCases runs the cases one after the other on one env: for
// tables whose cases all leave the state as they found it.
func runSharedCases(t *testing.T, env *testEnv, v apiVars, tests []apiCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env.t = t
			runCase(t, env, v, tt)
		})
	}
	env.t = t
}

// runCase prepares, sends and checks one case, and that every firmware
// row still has its file and every file a row.
func runCase(t *testing.T, env *testEnv, v apiVars, tt apiCase) {
	t.Helper()
	if tt.setup != nil {
		tt.setup(t, env, v)
	}
	before := dbState(t, env.st)
	w := env.serve(t, tt.request(v))
	checkAnswer(t, w, tt.wantStatus, v.expand(tt.wantBody))
	after := dbState(t, env.st)
	checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st))
	if w.Code >= 400 {
		sameState(t, "an error answer", before, after)
	} else {
		other := env.bob.id
		if v.expand(tt.token) == env.bob.token {
			other = env.alice.id
		}
		sameState(t, "a request", before, after, other)
	}
	if tt.check != nil {
		tt.check(t, env, v, w)
	}
}

func (tt apiCase) request(v apiVars) *http.Request {
	var body io.Reader
	contentType := ""
	switch {
	case tt.form != nil || tt.file != nil:
		b, ct := multipartForm(tt.form, tt.file)
		body, contentType = bytes.NewReader(b), ct
	case tt.body != "":
		body, contentType = strings.NewReader(v.expand(tt.body)), "application/json"
	}
	if tt.unsized {
		body = io.MultiReader(body) // hides the length from httptest.NewRequest
	}
	authz := v.expand(tt.authz)
	if authz == "" && tt.token != "" {
		authz = "Bearer " + v.expand(tt.token)
	}
	return newRequest(tt.method, v.expand(tt.path), authz, contentType, body)
}

// call is the case of one request with a token and a JSON body (either
// "" for none); after and then give it a setup and a check.
func call(name, method, path, token, body string, wantStatus int, wantBody string) apiCase {
	return apiCase{name: name, method: method, path: path, token: token, body: body, wantStatus: wantStatus, wantBody: wantBody}
}

func (tt apiCase) after(setup setupFunc) apiCase { tt.setup = setup; return tt }
func (tt apiCase) then(check checkFunc) apiCase  { tt.check = check; return tt }

// checkAnswer checks the status, the headers every answer carries, and,
// when wantBody is set, the exact JSON body.
func checkAnswer(t *testing.T, w *httptest.ResponseRecorder, wantStatus int, wantBody string) {
	t.Helper()
	if w.Code != wantStatus {
		t.Errorf("status: got %d, want %d (body %s)", w.Code, wantStatus, w.Body)
	}
	if got := w.Header().Get("Content-Type"); got != "application/json" {
		t.Errorf("Content-Type: got %q, want application/json", got)
	}
	if got := w.Header().Get("X-Content-Type-Options"); got != "nosniff" {
		t.Errorf("X-Content-Type-Options: got %q, want nosniff", got)
	}
	if !json.Valid(w.Body.Bytes()) {
		t.Errorf("body is not JSON: %q", w.Body)
		return
	}
	if wantBody != "" && !jsonEqual(t, w.Body.Bytes(), []byte(wantBody)) {
		t.Errorf("body:\ngot  %s\nwant %s", strings.TrimSpace(w.Body.String()), wantBody)
	}
}

// allowIs checks a 405's Allow header.
func allowIs(want string) checkFunc {
	return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
		if got := w.Header().Get("Allow"); got != want {
			t.Errorf("Allow: got %q, want %q", got, want)
		}
	}
}

// allOf is a check that runs each of checks.
func allOf(checks ...checkFunc) checkFunc {
	return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
		t.Helper()
		for _, c := range checks {
			c(t, env, v, w)
		}
	}
}

// apiJSON is v as JSON text.
func apiJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// apiField is a JSON body {"<field>": value}.
func apiField(field string, value any) string { return apiJSON(map[string]any{field: value}) }

// apiSizedBody is a JSON object {"<field>":"xxx…"} of exactly size bytes.
func apiSizedBody(field string, size int) string {
	frame := len(`{"` + field + `":""}`)
	return `{"` + field + `":"` + strings.Repeat("x", size-frame) + `"}`
}

// apiFieldError is a Laravel-style 422 body for one problem with one field.
func apiFieldError(field, msg string) string {
	return apiJSON(map[string]any{"message": msg, "errors": map[string][]string{field: {msg}}})
}

// apiDetail is the detail JSON of a fresh esp32/devkit device;
// description is JSON (null or a string).
func apiDetail(uid, name, description string) string {
	return fmt.Sprintf(`{"uid":%q,"name":%s,"description":%s,"status":"pending","is_online":false,
		"public_ip":null,"local_ip":null,"port":1883,"last_rssi":null,"first_seen_at":null,"last_seen_at":null,
		"last_ota_at":null,"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},
		"board_variant":null,"current_firmware":null,"target_firmware":null,"meta":{"mqtt_port":1883},"ota":null}`,
		uid, apiJSON(name), description)
}

// apiSummary is the list item of a fresh esp32/devkit device.
func apiSummary(uid, name string) string {
	return fmt.Sprintf(`{"uid":%q,"name":%s,"status":"pending","last_seen_at":null,
		"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},"board_variant":null,"current_firmware":null}`,
		uid, apiJSON(name))
}

// apiFirmwareJSON is a Firmware object created at {now}; version and notes
// are JSON (null or a string), id, md5, sha256 and size may be {vars}.
func apiFirmwareJSON(id, name, version, notes, md5sum, sha, size string, isTarget bool) string {
	return fmt.Sprintf(`{"id":%s,"name":%s,"version":%s,"notes":%s,"md5":%q,"sha256":%q,"size":%s,"created_at":"{now}","is_current":false,"is_target":%t}`,
		id, apiJSON(name), version, notes, md5sum, sha, size, isTarget)
}

// apiUpload uploads a firmware for u and returns its id as text.
func apiUpload(env *testEnv, u testUser, name string, file []byte) string {
	id, _ := env.uploadOK(u, map[string]string{"name": name}, file)
	return strconv.FormatInt(id, 10)
}

// apiAddButton creates a command button on u's device.
func apiAddButton(t *testing.T, env *testEnv, u testUser, b model.CommandButton) {
	t.Helper()
	must(t, env.st.CreateButton(context.Background(), env.deviceRef(u), b, nil))
}

// apiAddToken issues another token for the user.
func apiAddToken(t *testing.T, env *testEnv, userID int64) string {
	t.Helper()
	_, tok, err := issueToken(context.Background(), env.st, userID, "second", nil, nil)
	must(t, err)
	return tok
}

// checkNewToken checks a token an answer handed out: <id>|<40
// alphanumerics>, stored for that user and name as the SHA-256 of its
// secret only, and working; it returns its id.
func checkNewToken(t *testing.T, env *testEnv, tok, userID, name string) string {
	t.Helper()
	m := regexp.MustCompile(`^([0-9]+)\|([A-Za-z0-9]{40})$`).FindStringSubmatch(tok)
	if m == nil {
		t.Fatalf("token %q is not <id>|<40 alphanumerics>", tok)
	}
	wantDB(t, env.st, userID+" "+name+" "+strings.ToUpper(sha256Hex([]byte(m[2]))),
		`SELECT user_id || ' ' || name || ' ' || hex(secret_hash) FROM tokens WHERE id = ?`, m[1])
	apiWantStatus(t, env, "GET", "/v1/auth/me", tok, 200)
	return m[1]
}

// apiWantStatus sends a request and checks only its status.
func apiWantStatus(t *testing.T, env *testEnv, method, path, token string, want int) {
	t.Helper()
	if w := env.request(method, path, token, nil); w.Code != want {
		t.Errorf("%s %s: got %d, want %d (%s)", method, path, w.Code, want, w.Body)
	}
}

// TestEveryRouteRefuses: every route under /v1 but the public ones answers 401
// without a token; every route of a device answers 404 for the other
// user's device and an unknown uid, before it reads the body; every JSON
// body route answers 413 past 64 KiB and 422 to malformed JSON.
func TestEveryRouteRefuses(t *testing.T) {
	t.Parallel()
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		for _, u := range []testUser{env.alice, env.bob} {
			apiAddButton(t, env, u, model.CommandButton{ID: "led", Label: "LED", Payload: json.RawMessage(`{}`)})
			env.setStatus(u.device, "online")
		}
		v["a_fw"] = apiUpload(env, env.alice, "a", []byte("\xe9alice's firmware"))
		v["b_fw"] = apiUpload(env, env.bob, "b", []byte("\xe9bob's firmware"))
	}
	var tests []apiCase
	for _, rt := range (&server{}).routes() {
		method, pattern, _ := strings.Cut(rt.pattern, " ")
		if !strings.HasPrefix(pattern, "/v1/") || slices.Contains([]string{"POST /v1/auth/login", "POST /v1/auth/invite", "POST /v1/auth/invite/info",
			"POST /v1/auth/reset", "POST /v1/auth/reset/info", "GET /v1/openapi.json"}, rt.pattern) {
			continue // not the API, or public
		}
		path := func(who string) string {
			return strings.NewReplacer("{uid}", "{"+who+"}", "{buttonId}", "led", "{firmware_id}", "{"+who[:1]+"_fw}", "{id}", "1").Replace(pattern)
		}
		tests = append(tests, apiCase{name: rt.pattern + " without token", method: method, path: path("alice"),
			wantStatus: 401, wantBody: apiUnauthenticated})
		if strings.Contains(pattern, "{uid}") {
			for _, c := range []struct{ name, path string }{{"bob's device", path("bob")}, {"unknown device", strings.ReplaceAll(path("bob"), "{bob}", "esp32_nosuchdevice")}} {
				tests = append(tests, apiCase{name: rt.pattern + " on " + c.name, method: method, path: c.path, token: "{alice_token}",
					body: `{"name":`, wantStatus: 404, wantBody: apiDeviceNotFound})
			}
		}
	}
	for _, r := range []struct{ method, path, field string }{
		{"POST", "/v1/auth/login", "email"},
		{"POST", "/v1/user/tokens", "name"},
		{"PATCH", "/v1/user/devices/{alice}", "description"},
		{"POST", "/v1/user/devices/{alice}/commands", "payload"},
		{"POST", "/v1/user/devices/{alice}/command-buttons", "label"},
		{"PATCH", "/v1/user/devices/{alice}/firmwares/{a_fw}", "notes"},
		{"POST", "/v1/user/devices/{alice}/firmwares/set-target", "md5"},
	} {
		c := apiCase{method: r.method, path: r.path, token: "{alice_token}", body: apiSizedBody(r.field, maxJSONBody+1), wantStatus: 413, wantBody: apiTooLarge}
		sized, unsized, malformed := c, c, c
		sized.name, unsized.name, malformed.name = r.method+" "+r.path+" body over 64 KiB", r.method+" "+r.path+" unannounced body over 64 KiB", r.method+" "+r.path+" malformed JSON"
		unsized.unsized = true
		malformed.body, malformed.wantStatus, malformed.wantBody = `{"`+r.field+`":`, 422, apiBadJSON
		tests = append(tests, sized, unsized, malformed)
	}
	runAPICases(t, fixture, tests)
}

func TestAuthAPI(t *testing.T) {
	t.Parallel()
	const creds = `{"message":"The provided credentials are incorrect.","errors":{"email":["The provided credentials are incorrect."]}}`
	const missing = `{"message":"The email field is required. (and 2 more errors)","errors":{"email":["The email field is required."],
		"password":["The password field is required."],"token_name":["The token name field is required."]}}`
	login := func(email, password string) string {
		return apiJSON(map[string]string{"email": email, "password": password, "token_name": "laptop"})
	}
	me := func(name, email, lastLogin string) string {
		return fmt.Sprintf(`{"data":{"id":{%s_id},"name":%q,"email":%q,"role":"user","email_verified_at":null,"last_login_at":%s}}`,
			strings.ToLower(name), name, email, lastLogin)
	}
	// loggedIn checks a successful login of alice or bob and the token it
	// returned.
	loggedIn := func(who, name string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			user := map[string]testUser{"alice": env.alice, "bob": env.bob}[who]
			var got map[string]json.RawMessage
			must(t, json.Unmarshal(w.Body.Bytes(), &got))
			if len(got) != 3 || string(got["token_type"]) != `"Bearer"` {
				t.Errorf("login answer: got %s, want token_type \"Bearer\", token, user", w.Body)
			}
			wantUser := fmt.Sprintf(`{"id":%d,"name":%q,"email":%q,"role":"user"}`, user.id, name, user.email)
			if !jsonEqual(t, got["user"], []byte(wantUser)) {
				t.Errorf("user: got %s, want %s", got["user"], wantUser)
			}
			var tok string
			json.Unmarshal(got["token"], &tok)
			checkNewToken(t, env, tok, strconv.FormatInt(user.id, 10), "laptop")
			wantDB(t, env.st, apiNow, `SELECT last_login_at FROM users WHERE id = ?`, user.id)
			apiWantStatus(t, env, "GET", "/v1/auth/me", user.token, 200) // the old token still works
		}
	}
	// logoutKeeps checks that the presenting token is gone and every
	// other token, the user's second one included, still works.
	logoutKeeps := func(gone string, kept ...string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			wantDB(t, env.st, "<no row>", `SELECT id FROM tokens WHERE id = ?`, v[gone+"_id"])
			apiWantStatus(t, env, "GET", "/v1/auth/me", v[gone], 401)
			for _, k := range kept {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v[k], 200)
			}
		}
	}
	secondTokens := func(t *testing.T, env *testEnv, v apiVars) {
		v["alice_token2"] = apiAddToken(t, env, env.alice.id)
		v["bob_token2"] = apiAddToken(t, env, env.bob.id)
	}
	post := func(name, body string, wantStatus int, wantBody string) apiCase {
		return call(name, "POST", "/v1/auth/login", "", body, wantStatus, wantBody)
	}
	const loggedOut = `{"message":"Logged out."}`

	tests := []apiCase{
		// POST /v1/auth/login
		post("login", login("alice@example.com", "alice-password"), 200, "").then(loggedIn("alice", "Alice")),
		// bob's token only marks him as the acting user: login ignores it.
		call("login bob", "POST", "/v1/auth/login", "{bob_token}", login("bob@example.com", "bob-password"), 200, "").then(loggedIn("bob", "Bob")),
		post("login email in other case", login(" Alice@Example.COM", "alice-password"), 200, "").then(loggedIn("alice", "Alice")),
		post("login wrong password", login("alice@example.com", "alice-passwort"), 422, creds),
		post("login other user's password", login("alice@example.com", "bob-password"), 422, creds),
		post("login unknown email", login("carol@example.com", "alice-password"), 422, creds),
		post("login missing fields", `{}`, 422, missing),
		post("login without body", "", 422, missing),
		post("login missing token name", `{"email":"alice@example.com","password":"alice-password"}`,
			422, apiFieldError("token_name", "The token name field is required.")),
		post("login email not a string", `{"email":["alice@example.com"],"password":"alice-password","token_name":"x"}`,
			422, apiFieldError("email", "The email field must be a string.")),
		post("login password not a string", `{"email":"alice@example.com","password":12345678,"token_name":"x"}`,
			422, apiFieldError("password", "The password field must be a string.")),
		post("login token name too long", apiJSON(map[string]string{"email": "alice@example.com", "password": "alice-password", "token_name": strings.Repeat("t", 256)}),
			422, apiFieldError("token_name", "The token name field must not be greater than 255 characters.")),
		post("login password of 1025 characters", login("alice@example.com", strings.Repeat("p", 1025)),
			422, apiFieldError("password", "The password field must not be greater than 1024 characters.")),
		post("login JSON array", `["alice@example.com"]`, 422, apiBadJSON),

		// GET /v1/auth/me (token parsing is TestTokens)
		call("me", "GET", "/v1/auth/me", "{alice_token}", "", 200, me("Alice", "alice@example.com", "null")).then(
			func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, apiNow, `SELECT last_used_at FROM tokens WHERE id = ?`, v["alice_token_id"])
				wantDB(t, env.st, "<nil>", `SELECT last_used_at FROM tokens WHERE id = ?`, v["bob_token_id"])
			}),
		call("me as bob", "GET", "/v1/auth/me", "{bob_token}", "", 200, me("Bob", "bob@example.com", "null")),
		call("me after login", "GET", "/v1/auth/me", "{alice_token}", "", 200, me("Alice", "alice@example.com", `"2026-11-21T11:00:00.000000Z"`)).after(
			func(t *testing.T, env *testEnv, v apiVars) {
				env.clock.advance(-time.Hour)
				if w := env.request("POST", "/v1/auth/login", "", login("alice@example.com", "alice-password")); w.Code != 200 {
					t.Fatalf("login: got %d, want 200", w.Code)
				}
				env.clock.advance(time.Hour)
			}),
		call("me logged-out token", "GET", "/v1/auth/me", "{alice_token}", "", 401, apiUnauthenticated).after(
			func(t *testing.T, env *testEnv, v apiVars) {
				apiWantStatus(t, env, "POST", "/v1/auth/logout", env.alice.token, 200)
			}),

		// POST /v1/auth/logout
		call("logout", "POST", "/v1/auth/logout", "{alice_token}", "", 200, loggedOut).after(secondTokens).
			then(logoutKeeps("alice_token", "alice_token2", "bob_token", "bob_token2")),
		call("logout bob", "POST", "/v1/auth/logout", "{bob_token}", "", 200, loggedOut).after(secondTokens).
			then(logoutKeeps("bob_token", "bob_token2", "alice_token", "alice_token2")),
		call("logout with GET", "GET", "/v1/auth/logout", "{alice_token}", "", 405, apiNotAllowed),
	}
	runAPICases(t, nil, tests)
}

// TestTokens is the one table of token parsing and checking: exactly
// "Bearer <a live token>" authenticates, as its user; anything else is a
// plain 401, never a 500. FuzzBearerToken checks the same on mutations.
func TestTokens(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	v["second"] = apiAddToken(t, env, env.alice.id)
	v["logged_out"] = apiAddToken(t, env, env.alice.id)
	apiWantStatus(t, env, "POST", "/v1/auth/logout", v["logged_out"], 200)
	carol := env.addUser("Carol", "carol@example.com", "carol-password")
	mustExec(t, env.st, `DELETE FROM users WHERE id = ?`, carol.id)
	v["carol_token"] = carol.token
	v["short"] = v["alice_secret"][:39]
	alice := `{"data":{"id":{alice_id},"name":"Alice","email":"alice@example.com","role":"user","email_verified_at":null,"last_login_at":null}}`
	bob := `{"data":{"id":{bob_id},"name":"Bob","email":"bob@example.com","role":"user","email_verified_at":null,"last_login_at":null}}`
	tests := []struct{ name, authz, wantBody string }{
		{"alice's token", "Bearer {alice_token}", alice},
		{"bob's token", "Bearer {bob_token}", bob},
		{"alice's second token", "Bearer {second}", alice},
		{"secret without id, looked up by hash", "Bearer {alice_secret}", alice},
		{"no header", "", ""},
		{"scheme only", "Bearer", ""},
		{"empty token", "Bearer ", ""},
		{"no scheme", "{alice_token}", ""},
		{"other scheme", "Token {alice_token}", ""},
		{"basic auth", "Basic YWxpY2U6YWxpY2UtcGFzc3dvcmQ=", ""},
		{"lower-case scheme", "bearer {alice_token}", ""},
		{"upper-case scheme", "BEARER {alice_token}", ""},
		{"two spaces", "Bearer  {alice_token}", ""},
		{"tab", "Bearer\t{alice_token}", ""},
		{"leading space", " Bearer {alice_token}", ""},
		{"trailing garbage", "Bearer {alice_token}x", ""},
		{"trailing space and garbage", "Bearer {alice_token} x", ""},
		{"trailing NUL", "Bearer {alice_token}\x00", ""},
		{"two tokens", "Bearer {alice_token},Bearer {bob_token}", ""},
		{"logged-out token", "Bearer {logged_out}", ""},
		{"deleted user's token", "Bearer {carol_token}", ""},
		{"unknown id", "Bearer 999|{alice_secret}", ""},
		{"alice's id with bob's secret", "Bearer {alice_token_id}|{bob_secret}", ""},
		{"secret one short", "Bearer {alice_token_id}|{short}", ""},
		{"id without secret", "Bearer {alice_token_id}|", ""},
		{"id alone", "Bearer {alice_token_id}", ""},
		{"empty id", "Bearer |{alice_secret}", ""},
		{"non-numeric id", "Bearer abc|{alice_secret}", ""},
		{"leading zero id", "Bearer 0{alice_token_id}|{alice_secret}", ""},
		{"plus sign", "Bearer +{alice_token_id}|{alice_secret}", ""},
		{"negative id", "Bearer -{alice_token_id}|{alice_secret}", ""},
		{"id overflows", "Bearer 99999999999999999999|{alice_secret}", ""},
		{"two bars", "Bearer {alice_token}|{alice_secret}", ""},
		{"secret and id swapped", "Bearer {alice_secret}|{alice_token_id}", ""},
		{"whole token hashed", "Bearer x{alice_token}", ""},
		{"not a token", "Bearer not-a-token", ""},
		{"unicode", "Bearer \u00e9|\u00e9", ""},
	}
	var cases []apiCase
	for _, tt := range tests {
		c := apiCase{name: tt.name, method: "GET", path: "/v1/auth/me", authz: tt.authz, wantStatus: 200, wantBody: tt.wantBody}
		if tt.wantBody == "" {
			c.wantStatus, c.wantBody = 401, apiUnauthenticated
		}
		cases = append(cases, c)
	}
	runSharedCases(t, env, v, cases)
}

// TestLoginThrottle: five failed logins a minute per email and client
// address; the sixth try is a 429 with Retry-After, even with the right
// password, until the minute is over. Other emails and addresses are not
// held up, and an unknown email is throttled the same way. An IPv6 client
// is one /64.
func TestLoginThrottle(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	const creds = `{"message":"The provided credentials are incorrect.","errors":{"email":["The provided credentials are incorrect."]}}`
	const tooMany = `{"message":"Too Many Attempts."}`
	const ip, otherIP = "192.0.2.1:1234", "198.51.100.7:4321"
	steps := []struct {
		after                    time.Duration // since the step before
		email, password, addr    string
		wantStatus               int
		wantBody, wantRetryAfter string
	}{
		{0, "alice@example.com", "wrong", ip, 422, creds, ""},
		{0, "ALICE@example.com", "wrong", ip, 422, creds, ""},
		{0, "alice@example.com", "wrong", ip, 422, creds, ""},
		{0, "Alice@Example.com", "wrong", ip, 422, creds, ""},
		{0, "alice@example.com", "wrong", ip, 422, creds, ""},
		{0, "alice@example.com", "alice-password", ip, 429, tooMany, "60"},
		{0, "bob@example.com", "bob-password", ip, 200, "", ""},
		{0, "alice@example.com", "alice-password", otherIP, 200, "", ""},
		{30 * time.Second, "alice@example.com", "alice-password", ip, 429, tooMany, "30"},
		{30 * time.Second, "alice@example.com", "alice-password", ip, 200, "", ""},
		{0, "nobody@example.com", "x", ip, 422, creds, ""},
		{0, "nobody@example.com", "x", ip, 422, creds, ""},
		{0, "nobody@example.com", "x", ip, 422, creds, ""},
		{0, "nobody@example.com", "x", ip, 422, creds, ""},
		{0, "nobody@example.com", "x", ip, 422, creds, ""},
		{0, "nobody@example.com", "x", ip, 429, tooMany, "60"},
		// An IPv6 client is counted by its /64, which one host can step through.
		{0, "alice@example.com", "wrong", "[2001:db8:1:2::1]:4000", 422, creds, ""},
		{0, "alice@example.com", "wrong", "[2001:db8:1:2::2]:4000", 422, creds, ""},
		{0, "alice@example.com", "wrong", "[2001:db8:1:2::3]:4000", 422, creds, ""},
		{0, "alice@example.com", "wrong", "[2001:db8:1:2::4]:4000", 422, creds, ""},
		{0, "alice@example.com", "wrong", "[2001:db8:1:2::5]:4000", 422, creds, ""},
		{0, "alice@example.com", "alice-password", "[2001:db8:1:2:ffff::6]:4000", 429, tooMany, "60"},
		{0, "alice@example.com", "alice-password", "[2001:db8:1:3::1]:4000", 200, "", ""},
	}
	var last string // the token of alice's last login let through
	for i, s := range steps {
		env.clock.advance(s.after)
		w := loginFrom(env, s.addr, s.email, s.password)
		checkAnswer(t, w, s.wantStatus, s.wantBody)
		if got := w.Header().Get("Retry-After"); got != s.wantRetryAfter {
			t.Errorf("step %d: Retry-After %q, want %q", i, got, s.wantRetryAfter)
		}
		if w.Code == 200 && s.email == env.alice.email {
			last, _ = decode(t, w)["token"].(string)
		}
	}
	// The fixture's and the last login's (each login replaced the one
	// before, of the same name); a throttled login made none.
	wantDB(t, env.st, "2 "+strings.SplitN(last, "|", 2)[0], `SELECT count(*) || ' ' || max(id) FROM tokens WHERE user_id = ?`, env.alice.id)
}

// TestTokenLastUsed: a token's use is recorded, at most once a minute.
func TestTokenLastUsed(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	id, _, _ := strings.Cut(env.alice.token, "|")
	_, bobSecret, _ := strings.Cut(env.bob.token, "|")
	lastUsed := func(want string) {
		t.Helper()
		wantDB(t, env.st, want, `SELECT last_used_at FROM tokens WHERE id = ?`, id)
	}
	lastUsed("<nil>")
	apiWantStatus(t, env, "GET", "/v1/user/devices", env.alice.token, 200)
	lastUsed(apiNow)
	env.clock.advance(30 * time.Second)
	apiWantStatus(t, env, "GET", "/v1/auth/me", env.alice.token, 200)
	lastUsed(apiNow) // written at most once a minute
	env.clock.advance(31 * time.Second)
	apiWantStatus(t, env, "GET", "/v1/auth/me", env.alice.token, 200)
	lastUsed("2026-11-21T12:01:01.000000Z")
	// A failed authentication is not a use.
	env.clock.advance(time.Hour)
	apiWantStatus(t, env, "GET", "/v1/auth/me", id+"|"+bobSecret, 401)
	lastUsed("2026-11-21T12:01:01.000000Z")
	wantDB(t, env.st, "<nil>", `SELECT last_used_at FROM tokens WHERE user_id = ?`, env.bob.id)
}

func TestDevicesAPI(t *testing.T) {
	t.Parallel()
	aliceDetail := func(name, description string) string {
		return `{"data":` + apiDetail("{alice}", name, description) + `}`
	}
	// deviceIs checks alice's device row: name and description ("<nil>": NULL).
	deviceIs := func(name, description string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			wantDB(t, env.st, name+" | "+description, `SELECT name || ' | ' || COALESCE(description, '<nil>') FROM devices WHERE uid = ?`, env.alice.device)
		}
	}
	unchanged := deviceIs("Alice's device", "<nil>")
	long := func(n int) string { return strings.Repeat("n", n) }
	patch := func(name string, body string, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "PATCH", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			body: body, wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	describe := func(t *testing.T, env *testEnv, v apiVars) {
		desc := "On the shelf"
		_, err := env.st.UpdateDevice(context.Background(), env.alice.id, env.alice.device, store.DeviceUpdate{Description: &desc}, nil)
		must(t, err)
	}
	// exec runs SQL on alice's device ({alice} and {fw_md5} expanded).
	exec := func(sql string) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			mustExec(t, env.st, v.expand(sql))
		}
	}
	reported := exec(`UPDATE devices SET status = 'online', local_ip = '10.0.0.2', public_ip = '203.0.113.9', last_rssi = -61.5,
		first_seen_at = '2026-11-21T11:00:00.000000Z', last_seen_at = '2026-11-21T11:59:00.000000Z',
		current_md5 = '0123456789abcdef0123456789abcdef', current_version = 'from the device' WHERE uid = '{alice}'`)
	runsTarget := func(t *testing.T, env *testEnv, v apiVars) {
		id, sum := env.uploadOK(env.alice, map[string]string{"name": "blink", "version": "1.1"}, []byte("\xe9blink"))
		v["fw_id"], v["fw_md5"], v["fw_sha"] = strconv.FormatInt(id, 10), sum, sha256Hex([]byte("\xe9blink"))
		env.setTarget(env.alice, sum)
		exec(`UPDATE devices SET current_md5 = '{fw_md5}', current_version = 'ignored', last_ota_at = '{now}' WHERE uid = '{alice}'`)(t, env, v)
	}
	descTooLong := apiFieldError("description", "The description field must not be greater than 2000 characters.")
	const platform = `"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},"board_variant":null`
	const fwOne = `{"id":{fw_id},"name":"blink","version":"1.1","notes":null,"md5":"{fw_md5}","sha256":"{fw_sha}","size":6,"created_at":"{now}"}`

	tests := []apiCase{
		// GET /v1/user/devices
		call("list", "GET", "/v1/user/devices", "{alice_token}", "", 200, `{"data":[`+apiSummary("{alice}", "Alice's device")+`]}`),
		call("list as bob", "GET", "/v1/user/devices", "{bob_token}", "", 200, `{"data":[`+apiSummary("{bob}", "Bob's device")+`]}`),
		{name: "list two devices", method: "GET", path: "/v1/user/devices", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				uid, err := createDeviceOf(context.Background(), env.st, "alice@example.com", "esp32", "devkit", "Garage")
				must(t, err)
				v["alice2"] = uid
			},
			wantStatus: 200, wantBody: `{"data":[` + apiSummary("{alice}", "Alice's device") + `,` + apiSummary("{alice2}", "Garage") + `]}`},
		{name: "list without devices", method: "GET", path: "/v1/user/devices", token: "{carol_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				id, err := env.st.CreateUser(context.Background(), "Carol", "carol@example.com", "user", "x", "")
				must(t, err)
				v["carol_token"] = apiAddToken(t, env, id)
			},
			wantStatus: 200, wantBody: `{"data":[]}`},
		call("list of a device that reported", "GET", "/v1/user/devices", "{alice_token}", "", 200,
			`{"data":[{"uid":"{alice}","name":"Alice's device","status":"online","last_seen_at":"2026-11-21T11:59:00.000000Z",`+platform+`,`+
				`"current_firmware":{"id":null,"name":null,"version":"from the device","notes":null,"md5":"0123456789abcdef0123456789abcdef","sha256":null,"size":null,"created_at":null}}]}`).after(reported),
		call("list of a device running an uploaded firmware", "GET", "/v1/user/devices", "{alice_token}", "", 200,
			`{"data":[{"uid":"{alice}","name":"Alice's device","status":"pending","last_seen_at":null,`+platform+`,"current_firmware":`+fwOne+`}]}`).after(runsTarget),

		// GET /v1/user/devices/{uid}
		call("get", "GET", "/v1/user/devices/{alice}", "{alice_token}", "", 200, aliceDetail("Alice's device", "null")),
		call("get as bob", "GET", "/v1/user/devices/{bob}", "{bob_token}", "", 200, `{"data":`+apiDetail("{bob}", "Bob's device", "null")+`}`),
		{name: "get a device that reported an unknown firmware", method: "GET", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			setup: reported, wantStatus: 200, wantBody: `{"data":{"uid":"{alice}","name":"Alice's device","status":"online",
				"last_seen_at":"2026-11-21T11:59:00.000000Z",` + platform + `,"description":null,"is_online":true,"public_ip":"203.0.113.9",
				"local_ip":"10.0.0.2","port":1883,"last_rssi":-61.5,"first_seen_at":"2026-11-21T11:00:00.000000Z","last_ota_at":null,
				"current_firmware":{"id":null,"name":null,"version":"from the device","notes":null,"md5":"0123456789abcdef0123456789abcdef","sha256":null,"size":null,"created_at":null},
				"target_firmware":null,"meta":{"mqtt_port":1883},"ota":null}}`},
		{name: "get a device running its target", method: "GET", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			setup: runsTarget, wantStatus: 200, wantBody: `{"data":{"uid":"{alice}","name":"Alice's device","status":"pending",
				"last_seen_at":null,` + platform + `,"description":null,"is_online":false,"public_ip":null,"local_ip":null,"port":1883,
				"last_rssi":null,"first_seen_at":null,"last_ota_at":"{now}","current_firmware":` + fwOne + `,"target_firmware":` + fwOne + `,
				"meta":{"mqtt_port":1883},"ota":null}}`},

		// PATCH /v1/user/devices/{uid}
		patch("patch name and description", `{"name":"Kitchen","description":"By the window"}`,
			200, aliceDetail("Kitchen", `"By the window"`), deviceIs("Kitchen", "By the window")),
		patch("patch description only", `{"description":"By the window"}`,
			200, aliceDetail("Alice's device", `"By the window"`), deviceIs("Alice's device", "By the window")),
		patch("patch name only", `{"name":"Kitchen"}`, 200, aliceDetail("Kitchen", "null"), deviceIs("Kitchen", "<nil>")),
		call("patch name keeps description", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", `{"name":"Kitchen"}`, 200,
			aliceDetail("Kitchen", `"On the shelf"`)).after(describe).then(deviceIs("Kitchen", "On the shelf")),
		call("patch description null clears it", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", `{"description":null}`, 200,
			aliceDetail("Alice's device", "null")).after(describe).then(unchanged),
		patch("patch empty object", `{}`, 200, aliceDetail("Alice's device", "null"), unchanged),
		patch("patch without body", "", 200, aliceDetail("Alice's device", "null"), unchanged),
		patch("patch name of 255 characters", apiField("name", long(255)), 200, aliceDetail(long(255), "null"), deviceIs(long(255), "<nil>")),
		patch("patch name of 255 non-ASCII characters", apiField("name", strings.Repeat("é", 255)),
			200, aliceDetail(strings.Repeat("é", 255), "null"), deviceIs(strings.Repeat("é", 255), "<nil>")),
		patch("patch description of 2000 characters", apiField("description", long(2000)),
			200, aliceDetail("Alice's device", apiJSON(long(2000))), deviceIs("Alice's device", long(2000))),
		{name: "patch as bob", method: "PATCH", path: "/v1/user/devices/{bob}", token: "{bob_token}", body: `{"name":"Bob's lab"}`,
			wantStatus: 200, wantBody: `{"data":` + apiDetail("{bob}", "Bob's lab", "null") + `}`,
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, "Bob's lab", `SELECT name FROM devices WHERE uid = ?`, env.bob.device)
			}},
		patch("patch name empty", `{"name":""}`, 422, apiFieldError("name", "The name field is required."), nil),
		patch("patch name blank", `{"name":"   "}`, 422, apiFieldError("name", "The name field is required."), nil),
		patch("patch name null", `{"name":null}`, 422, apiFieldError("name", "The name field is required."), nil),
		patch("patch name of 256 characters", apiField("name", long(256)),
			422, apiFieldError("name", "The name field must not be greater than 255 characters."), nil),
		patch("patch description of 2001 characters", apiField("description", long(2001)),
			422, descTooLong, nil),
		patch("patch name not a string", `{"name":42}`, 422, apiFieldError("name", "The name field must be a string."), nil),
		patch("patch description not a string", `{"description":["x"]}`,
			422, apiFieldError("description", "The description field must be a string."), nil),
		patch("patch with two errors", fmt.Sprintf(`{"name":42,"description":%q}`, long(2001)), 422,
			`{"message":"The name field must be a string. (and 1 more error)","errors":{"name":["The name field must be a string."],
				"description":["The description field must not be greater than 2000 characters."]}}`, nil),
		patch("patch valid name with invalid description", fmt.Sprintf(`{"name":"Kitchen","description":%q}`, long(2001)),
			422, descTooLong, nil),
		patch("patch JSON array", `["Kitchen"]`, 422, apiBadJSON, nil),
		patch("patch JSON null", `null`, 422, apiBadJSON, nil),
		patch("patch JSON string", `"Kitchen"`, 422, apiBadJSON, nil),
		patch("patch trailing data", `{"name":"Kitchen"} {}`, 422, apiBadJSON, nil),
		patch("patch body of exactly 64 KiB", apiSizedBody("description", maxJSONBody), 422, descTooLong, nil),
		{name: "patch 1 MiB body of unannounced length", method: "PATCH", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			body: apiSizedBody("description", 1<<20), unsized: true, wantStatus: 413, wantBody: apiTooLarge},
		call("patch with PUT", "PUT", "/v1/user/devices/{alice}", "{alice_token}", `{"name":"x"}`, 405, apiNotAllowed),
	}
	runAPICases(t, nil, tests)
}

func TestCommandButtonsAPI(t *testing.T) {
	t.Parallel()
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		apiAddButton(t, env, env.alice, model.CommandButton{ID: "led-on", Label: "LED on", Payload: json.RawMessage(`{"cmd":"led","on":true}`), Confirm: true})
		apiAddButton(t, env, env.bob, model.CommandButton{ID: "led-on", Label: "Bob's LED", Payload: json.RawMessage(`{"cmd":"bob"}`)})
		apiAddButton(t, env, env.bob, model.CommandButton{ID: "bob-only", Label: "Bob only", Payload: json.RawMessage(`{}`)})
	}
	const aliceLED = `{"id":"led-on","label":"LED on","payload":{"cmd":"led","on":true},"confirm":true}`
	const path = "/v1/user/devices/{alice}/command-buttons"
	const buttonNotFound = `{"message":"Command button not found."}`
	// buttons checks the ids, labels, payload texts and confirm flags of
	// the user's buttons, in order; alice's first, led-on, is implied.
	buttons := func(who string, want ...string) checkFunc {
		if who == "alice" {
			want = append([]string{`led-on LED on {"cmd":"led","on":true} 1`}, want...)
		}
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			wantDB(t, env.st, strings.Join(want, "; "), `SELECT COALESCE(group_concat(b.id || ' ' || b.label || ' ' || b.payload || ' ' || b.confirm, '; '), '')
				FROM (SELECT * FROM command_buttons ORDER BY seq) b JOIN devices d ON d.id = b.device_id WHERE d.uid = ?`, v[who])
		}
	}
	create := func(name, body string, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "POST", path: path, token: "{alice_token}", body: body,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	created := func(data string) string {
		return `{"message":"Command button created.","device_uid":"{alice}","data":` + data + `}`
	}
	idPattern := "The id field may only contain letters, digits, dots, underscores and dashes."
	id64 := strings.Repeat("a", 64)
	bad := func(name, body, field, msg string) apiCase {
		return create(name, body, 422, apiFieldError(field, msg), nil)
	}

	tests := []apiCase{
		// GET /v1/user/devices/{uid}/command-buttons
		{name: "list", method: "GET", path: path, token: "{alice_token}", wantStatus: 200, wantBody: `{"data":[` + aliceLED + `]}`},
		{name: "list as bob", method: "GET", path: "/v1/user/devices/{bob}/command-buttons", token: "{bob_token}", wantStatus: 200,
			wantBody: `{"data":[{"id":"led-on","label":"Bob's LED","payload":{"cmd":"bob"},"confirm":false},
				{"id":"bob-only","label":"Bob only","payload":{},"confirm":false}]}`},
		{name: "list empty", method: "GET", path: path, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				must(t, env.st.DeleteButton(context.Background(), env.deviceRef(env.alice), "led-on", nil))
			},
			wantStatus: 200, wantBody: `{"data":[]}`},

		// POST /v1/user/devices/{uid}/command-buttons
		create("create", `{"id":"fan.high_2-X","label":"Fan high","payload":{"cmd":"fan","speed":3},"confirm":false}`,
			201, created(`{"id":"fan.high_2-X","label":"Fan high","payload":{"cmd":"fan","speed":3},"confirm":false}`),
			buttons("alice", `fan.high_2-X Fan high {"cmd":"fan","speed":3} 0`)),
		create("create with confirm", `{"id":"reset","label":"Factory reset","payload":{"cmd":"factory_reset"},"confirm":true}`,
			201, created(`{"id":"reset","label":"Factory reset","payload":{"cmd":"factory_reset"},"confirm":true}`),
			buttons("alice", `reset Factory reset {"cmd":"factory_reset"} 1`)),
		create("create without confirm", `{"id":"b","label":"B","payload":{}}`,
			201, created(`{"id":"b","label":"B","payload":{},"confirm":false}`), buttons("alice", `b B {} 0`)),
		create("create keeps the payload as sent", `{"id":"raw","label":"Raw","payload":{ "z" : 1, "a" : {"b": [1, 2.50, "x", null]} }}`,
			201, created(`{"id":"raw","label":"Raw","payload":{"z":1,"a":{"b":[1,2.5,"x",null]}},"confirm":false}`),
			func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				if !strings.Contains(w.Body.String(), `"payload":{"z":1,"a":{"b":[1,2.50,"x",null]}}`) {
					t.Errorf("answer's payload not verbatim: %s", w.Body)
				}
				buttons("alice", `raw Raw {"z":1,"a":{"b":[1,2.50,"x",null]}} 0`)(t, env, v, w)
			}),
		create("create id that bob uses", `{"id":"bob-only","label":"Mine","payload":{"x":1}}`,
			201, created(`{"id":"bob-only","label":"Mine","payload":{"x":1},"confirm":false}`), buttons("alice", `bob-only Mine {"x":1} 0`)),
		create("create id of 64 characters", fmt.Sprintf(`{"id":%q,"label":"L","payload":{}}`, id64),
			201, created(fmt.Sprintf(`{"id":%q,"label":"L","payload":{},"confirm":false}`, id64)), buttons("alice", id64+` L {} 0`)),
		create("create label of 255 characters", fmt.Sprintf(`{"id":"l","label":%q,"payload":{}}`, strings.Repeat("é", 255)),
			201, created(fmt.Sprintf(`{"id":"l","label":%q,"payload":{},"confirm":false}`, strings.Repeat("é", 255))),
			buttons("alice", `l `+strings.Repeat("é", 255)+` {} 0`)),
		call("create as bob", "POST", "/v1/user/devices/{bob}/command-buttons", "{bob_token}", `{"id":"new","label":"New","payload":{"n":1}}`, 201,
			`{"message":"Command button created.","device_uid":"{bob}","data":{"id":"new","label":"New","payload":{"n":1},"confirm":false}}`).
			then(buttons("bob", `led-on Bob's LED {"cmd":"bob"} 0`, `bob-only Bob only {} 0`, `new New {"n":1} 0`)),
		create("create duplicate id", `{"id":"led-on","label":"Again","payload":{}}`,
			422, `{"message":"A command button with this id already exists."}`, nil),
		bad("create id missing", `{"label":"X","payload":{}}`, "id", "The id field is required."),
		bad("create id empty", `{"id":"","label":"X","payload":{}}`, "id", "The id field is required."),
		bad("create id of 65 characters", fmt.Sprintf(`{"id":%q,"label":"X","payload":{}}`, id64+"a"), "id", "The id field must not be greater than 64 characters."),
		bad("create id with a space", `{"id":"led on","label":"X","payload":{}}`, "id", idPattern),
		bad("create id dot", `{"id":".","label":"X","payload":{}}`, "id", idPattern),
		bad("create id dot dot", `{"id":"..","label":"X","payload":{}}`, "id", idPattern),
		bad("create id with a slash", `{"id":"a/b","label":"X","payload":{}}`, "id", idPattern),
		bad("create id with a non-ASCII letter", `{"id":"lëd","label":"X","payload":{}}`, "id", idPattern),
		bad("create id with a newline", `{"id":"led\n","label":"X","payload":{}}`, "id", "The id field must not contain control characters or bidirectional overrides."),
		bad("create id not a string", `{"id":7,"label":"X","payload":{}}`, "id", "The id field must be a string."),
		bad("create label missing", `{"id":"x","payload":{}}`, "label", "The label field is required."),
		bad("create label of 256 characters", fmt.Sprintf(`{"id":"x","label":%q,"payload":{}}`, strings.Repeat("l", 256)),
			"label", "The label field must not be greater than 255 characters."),
		bad("create payload missing", `{"id":"x","label":"X"}`, "payload", "The payload field is required."),
		bad("create payload null", `{"id":"x","label":"X","payload":null}`, "payload", "The payload field is required."),
		bad("create payload array", `{"id":"x","label":"X","payload":[{"cmd":"x"}]}`, "payload", "The payload field must be a JSON object."),
		bad("create payload string", `{"id":"x","label":"X","payload":"{\"cmd\":\"x\"}"}`, "payload", "The payload field must be a JSON object."),
		bad("create payload number", `{"id":"x","label":"X","payload":1}`, "payload", "The payload field must be a JSON object."),
		bad("create confirm not a boolean", `{"id":"x","label":"X","payload":{},"confirm":"yes"}`, "confirm", "The confirm field must be true or false."),
		create("create everything missing", `{}`, 422, `{"message":"The id field is required. (and 2 more errors)",
			"errors":{"id":["The id field is required."],"label":["The label field is required."],"payload":["The payload field is required."]}}`, nil),

		// DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}
		{name: "delete", method: "DELETE", path: path + "/led-on", token: "{alice_token}",
			wantStatus: 200, wantBody: `{"message":"Command button deleted.","device_uid":"{alice}"}`,
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				wantDB(t, env.st, "0", `SELECT count(*) FROM command_buttons WHERE device_id = ?`, env.device(env.alice).ID)
			}},
		call("delete as bob", "DELETE", "/v1/user/devices/{bob}/command-buttons/led-on", "{bob_token}", "", 200,
			`{"message":"Command button deleted.","device_uid":"{bob}"}`).then(buttons("bob", `bob-only Bob only {} 0`)),
		{name: "delete unknown button", method: "DELETE", path: path + "/nope", token: "{alice_token}", wantStatus: 404, wantBody: buttonNotFound},
		call("delete bob's button id on own device", "DELETE", path+"/bob-only", "{alice_token}", "", 404, buttonNotFound),
		{name: "get one button", method: "GET", path: path + "/led-on", token: "{alice_token}", wantStatus: 405, wantBody: apiNotAllowed},
	}
	runAPICases(t, fixture, tests)
}

func TestFirmwaresAPI(t *testing.T) {
	t.Parallel()
	aliceBytes := []byte("\xe9alice firmware 1.0\x00\x01\x02\xff") // ESP images: 0xE9 first
	bobBytes := []byte("\xe9bob firmware 7\x00\xfe")
	newBytes := []byte("\xe9a new build\x00\x10\x20")
	maxBytes := bytes.Repeat([]byte{0xE9, 0x32, 0x00, 0x7F}, store.MaxFirmwareSize/4)
	tooBig := append(bytes.Clone(maxBytes), 0x01)
	newMD5, newSize := md5Hex(newBytes), strconv.Itoa(len(newBytes))

	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		id, _ := env.uploadOK(env.alice, map[string]string{"name": "alpha", "version": "1.0", "notes": "first build"}, aliceBytes)
		v["a_fw"] = strconv.FormatInt(id, 10)
		v["b_fw"] = apiUpload(env, env.bob, "beta", bobBytes)
		v["a_md5"], v["b_md5"] = md5Hex(aliceBytes), md5Hex(bobBytes)
		v["a_MD5"], v["b_MD5"] = strings.ToUpper(v["a_md5"]), strings.ToUpper(v["b_md5"])
		v["a_size"], v["b_size"] = strconv.Itoa(len(aliceBytes)), strconv.Itoa(len(bobBytes))
		v["a_sha"], v["b_sha"] = sha256Hex(aliceBytes), sha256Hex(bobBytes)
	}
	alpha := func(isTarget bool) string {
		return apiFirmwareJSON("{a_fw}", "alpha", `"1.0"`, `"first build"`, "{a_md5}", "{a_sha}", "{a_size}", isTarget)
	}
	beta := apiFirmwareJSON("{b_fw}", "beta", "null", "null", "{b_md5}", "{b_sha}", "{b_size}", false)
	setTarget := func(t *testing.T, env *testEnv, v apiVars) { env.setTarget(env.alice, v["a_md5"]) }

	// files checks the firmware rows of the user's device (name, version,
	// notes, md5, size; runCase checks their files). alice's alpha is
	// implied unless the list starts with "-".
	files := func(who string, want ...string) checkFunc {
		if who == "alice" && (len(want) == 0 || want[0] != "-") {
			want = append([]string{"alpha 1.0 first build {a_md5} {a_size}"}, want...)
		}
		want = slices.DeleteFunc(want, func(s string) bool { return s == "-" })
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			wantDB(t, env.st, v.expand(strings.Join(want, "; ")), `SELECT COALESCE(group_concat(f.name || ' ' || COALESCE(f.version, '-')
				|| ' ' || COALESCE(f.notes, '-') || ' ' || f.md5 || ' ' || f.size, '; '), '')
				FROM (SELECT * FROM firmwares ORDER BY id) f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, v[who])
		}
	}
	// target checks the target firmware id of the user's device.
	target := func(who, want string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			wantDB(t, env.st, v.expand(want), `SELECT target_firmware_id FROM devices WHERE uid = ?`, v[who])
		}
	}

	const list = "/v1/user/devices/{alice}/firmwares"
	const one = list + "/{a_fw}"
	const setTargetPath = list + "/set-target"
	const notFound = `{"message":"Firmware not found."}`
	const md5NotFound = `{"message":"Firmware with the provided md5 was not found for this device."}`
	const assigned = `{"message":"Cannot delete firmware while it is assigned to any device."}`
	const deleted = `{"message":"Firmware deleted."}`
	upload := func(name string, form map[string]string, file []byte, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "POST", path: list, token: "{alice_token}", form: form, file: file,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	patch := func(name, ref, body string, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "PATCH", path: list + "/" + ref, token: "{alice_token}", body: body,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	del := func(name, ref string, setup setupFunc, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "DELETE", path: list + "/" + ref, token: "{alice_token}", setup: setup,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	assign := func(name, md5 string, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"` + md5 + `"}`,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	patched := func(name, version, notes string, isTarget bool) string {
		return `{"data":` + apiFirmwareJSON("{a_fw}", name, version, notes, "{a_md5}", "{a_sha}", "{a_size}", isTarget) + `}`
	}
	gamma := map[string]string{"name": "gamma", "version": "2.0", "notes": "faster"}
	uploaded := func(name, version, notes string, file []byte) string {
		return `{"data":` + apiFirmwareJSON("3", name, version, notes, md5Hex(file), sha256Hex(file), strconv.Itoa(len(file)), false) + `}`
	}
	fieldErr := func(field, msg string) string { return apiFieldError(field, "The "+field+" field "+msg) }

	tests := []apiCase{
		// GET /v1/user/devices/{uid}/firmwares
		{name: "list", method: "GET", path: list, token: "{alice_token}", wantStatus: 200, wantBody: `{"data":[` + alpha(false) + `]}`},
		call("list as bob", "GET", "/v1/user/devices/{bob}/firmwares", "{bob_token}", "", 200, `{"data":[`+beta+`]}`),
		call("list newest first", "GET", list, "{alice_token}", "", 200,
			`{"data":[`+apiFirmwareJSON("3", "gamma", "null", "null", newMD5, sha256Hex(newBytes), newSize, false)+`,`+alpha(false)+`]}`).
			after(func(t *testing.T, env *testEnv, v apiVars) { apiUpload(env, env.alice, "gamma", newBytes) }),
		call("list shows the target", "GET", list, "{alice_token}", "", 200, `{"data":[`+alpha(true)+`]}`).after(setTarget),

		// POST /v1/user/devices/{uid}/firmwares
		upload("upload", gamma, newBytes, 201, uploaded("gamma", `"2.0"`, `"faster"`, newBytes),
			files("alice", "gamma 2.0 faster "+newMD5+" "+newSize)),
		upload("upload without version and notes", map[string]string{"name": "gamma"}, newBytes,
			201, uploaded("gamma", "null", "null", newBytes), files("alice", "gamma - - "+newMD5+" "+newSize)),
		upload("upload with empty version and notes", map[string]string{"name": "gamma", "version": "", "notes": ""}, newBytes,
			201, uploaded("gamma", "null", "null", newBytes), nil),
		upload("upload of exactly 4 MiB", map[string]string{"name": "max"}, maxBytes,
			201, uploaded("max", "null", "null", maxBytes), files("alice", "max - - "+md5Hex(maxBytes)+" 4194304")),
		upload("upload of bob's bytes", map[string]string{"name": "copy"}, bobBytes,
			201, uploaded("copy", "null", "null", bobBytes),
			allOf(files("alice", "copy - - {b_md5} {b_size}"), files("bob", "beta - - {b_md5} {b_size}"))),
		upload("upload notes of 2000 characters", map[string]string{"name": "n", "notes": strings.Repeat("n", 2000)}, newBytes,
			201, uploaded("n", "null", apiJSON(strings.Repeat("n", 2000)), newBytes), nil),
		{name: "upload as bob", method: "POST", path: "/v1/user/devices/{bob}/firmwares", token: "{bob_token}",
			form: gamma, file: newBytes, wantStatus: 201, wantBody: uploaded("gamma", `"2.0"`, `"faster"`, newBytes),
			check: files("bob", "beta - - {b_md5} {b_size}", "gamma 2.0 faster "+newMD5+" "+newSize)},
		upload("upload duplicate", map[string]string{"name": "again"}, aliceBytes, 422, `{"message":"This firmware file is already uploaded."}`, nil),
		upload("upload of 4 MiB and one byte", map[string]string{"name": "big"}, tooBig,
			422, fieldErr("file", "must not be greater than 4096 kilobytes."), nil),
		upload("upload empty file", map[string]string{"name": "empty"}, []byte{}, 422, fieldErr("file", "must not be empty."), nil),
		upload("upload without file", map[string]string{"name": "nofile"}, nil, 422, fieldErr("file", "is required."), nil),
		upload("upload without name", map[string]string{"version": "2.0"}, newBytes, 422, fieldErr("name", "is required."), nil),
		upload("upload blank name", map[string]string{"name": "  "}, newBytes, 422, fieldErr("name", "is required."), nil),
		upload("upload without name and file", map[string]string{"notes": "x"}, nil, 422,
			`{"message":"The name field is required. (and 1 more error)","errors":{"name":["The name field is required."],"file":["The file field is required."]}}`, nil),
		upload("upload name of 256 characters", map[string]string{"name": strings.Repeat("n", 256)}, newBytes,
			422, fieldErr("name", "must not be greater than 255 characters."), nil),
		upload("upload version of 256 characters", map[string]string{"name": "n", "version": strings.Repeat("v", 256)}, newBytes,
			422, fieldErr("version", "must not be greater than 255 characters."), nil),
		upload("upload notes of 2001 characters", map[string]string{"name": "n", "notes": strings.Repeat("n", 2001)}, newBytes,
			422, fieldErr("notes", "must not be greater than 2000 characters."), nil),
		call("upload as JSON", "POST", list, "{alice_token}", `{"name":"json"}`, 422, fieldErr("file", "is required.")),

		// PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}
		patch("patch by id", "{a_fw}", `{"name":"alpha 2","version":"1.1","notes":"fixed"}`, 200,
			patched("alpha 2", `"1.1"`, `"fixed"`, false), files("alice", "-", "alpha 2 1.1 fixed {a_md5} {a_size}")),
		patch("patch by md5", "{a_md5}", `{"name":"by md5"}`, 200,
			patched("by md5", `"1.0"`, `"first build"`, false), files("alice", "-", "by md5 1.0 first build {a_md5} {a_size}")),
		patch("patch by upper-case md5", "{a_MD5}", `{"version":"1.0.1"}`, 200,
			patched("alpha", `"1.0.1"`, `"first build"`, false), files("alice", "-", "alpha 1.0.1 first build {a_md5} {a_size}")),
		patch("patch clears version and notes", "{a_fw}", `{"version":null,"notes":""}`, 200,
			patched("alpha", "null", "null", false), files("alice", "-", "alpha - - {a_md5} {a_size}")),
		patch("patch empty object", "{a_fw}", `{}`, 200, `{"data":`+alpha(false)+`}`, files("alice")),
		call("patch the target", "PATCH", one, "{alice_token}", `{"name":"live"}`, 200, patched("live", `"1.0"`, `"first build"`, true)).after(setTarget),
		call("patch as bob", "PATCH", "/v1/user/devices/{bob}/firmwares/{b_fw}", "{bob_token}", `{"notes":"bob's notes"}`, 200,
			`{"data":`+apiFirmwareJSON("{b_fw}", "beta", "null", `"bob's notes"`, "{b_md5}", "{b_sha}", "{b_size}", false)+`}`).
			then(files("bob", "beta - bob's notes {b_md5} {b_size}")),
		patch("patch bob's firmware id", "{b_fw}", `{"name":"stolen"}`, 404, notFound, nil),
		patch("patch bob's firmware md5", "{b_md5}", `{"name":"stolen"}`, 404, notFound, nil),
		patch("patch unknown id", "999", `{"name":"x"}`, 404, notFound, nil),
		patch("patch unknown md5", newMD5, `{"name":"x"}`, 404, notFound, nil),
		patch("patch id zero", "0", `{"name":"x"}`, 404, notFound, nil),
		patch("patch not an id", "alpha", `{"name":"x"}`, 404, notFound, nil),
		patch("patch name empty", "{a_fw}", `{"name":""}`, 422, fieldErr("name", "is required."), nil),
		patch("patch name null", "{a_fw}", `{"name":null}`, 422, fieldErr("name", "is required."), nil),
		patch("patch name of 256 characters", "{a_fw}", apiField("name", strings.Repeat("n", 256)),
			422, fieldErr("name", "must not be greater than 255 characters."), nil),
		patch("patch notes of 2001 characters", "{a_fw}", apiField("notes", strings.Repeat("n", 2001)),
			422, fieldErr("notes", "must not be greater than 2000 characters."), nil),
		patch("patch version not a string", "{a_fw}", `{"version":1.1}`, 422, fieldErr("version", "must be a string."), nil),

		// DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}
		del("delete by id", "{a_fw}", nil, 200, deleted, files("alice", "-")),
		del("delete by md5", "{a_md5}", nil, 200, deleted, files("alice", "-")),
		del("delete by upper-case md5", "{a_MD5}", nil, 200, deleted, files("alice", "-")),
		call("delete as bob", "DELETE", "/v1/user/devices/{bob}/firmwares/{b_fw}", "{bob_token}", "", 200, deleted).then(allOf(files("bob"), files("alice"))),
		del("delete keeps a file bob's firmware shares", "{a_fw}",
			func(t *testing.T, env *testEnv, v apiVars) { apiUpload(env, env.bob, "alice's copy", aliceBytes) },
			200, deleted, allOf(files("alice", "-"), files("bob", "beta - - {b_md5} {b_size}", "alice's copy - - {a_md5} {a_size}"))),
		del("delete the target", "{a_fw}", setTarget, 422, assigned, target("alice", "{a_fw}")),
		del("delete the target by md5", "{a_MD5}", setTarget, 422, assigned, nil),
		del("delete bob's firmware id", "{b_fw}", nil, 404, notFound, nil),
		del("delete bob's firmware md5", "{b_md5}", nil, 404, notFound, nil),
		del("delete unknown id", "999", nil, 404, notFound, nil),

		// POST /v1/user/devices/{uid}/firmwares/set-target
		assign("set-target", "{a_md5}", 200, `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"{a_md5}"}`,
			func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				target("alice", "{a_fw}")(t, env, v, w)
				got, _ := json.Marshal(env.device(env.alice).TargetFirmware)
				want := v.expand(`{"id":{a_fw},"name":"alpha","version":"1.0","notes":"first build","md5":"{a_md5}","sha256":"{a_sha}","size":{a_size},"created_at":"{now}"}`)
				if !jsonEqual(t, got, []byte(want)) {
					t.Errorf("target_firmware: got %s, want %s", got, want)
				}
			}),
		assign("set-target upper-case md5", " {a_MD5} ", 200, `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"{a_md5}"}`,
			target("alice", "{a_fw}")),
		{name: "set-target replaces the target", method: "POST", path: setTargetPath, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				v["new_fw"] = apiUpload(env, env.alice, "gamma", newBytes)
				setTarget(t, env, v)
			},
			body:       `{"md5":"` + newMD5 + `"}`,
			wantStatus: 200, wantBody: `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"` + newMD5 + `"}`,
			check: target("alice", "{new_fw}")},
		call("set-target as bob", "POST", "/v1/user/devices/{bob}/firmwares/set-target", "{bob_token}", `{"md5":"{b_md5}"}`, 200,
			`{"message":"Firmware assigned to device.","device_uid":"{bob}","md5":"{b_md5}"}`).then(allOf(target("bob", "{b_fw}"), target("alice", "<nil>"))),
		assign("set-target unknown md5", newMD5, 422, md5NotFound, nil),
		assign("set-target bob's md5", "{b_md5}", 422, md5NotFound, nil),
		assign("set-target not an md5", "alpha", 422, md5NotFound, nil),
		assign("set-target firmware id instead of md5", "{a_fw}", 422, md5NotFound, nil),
		call("set-target md5 missing", "POST", setTargetPath, "{alice_token}", `{}`, 422, fieldErr("md5", "is required.")),
		call("set-target md5 not a string", "POST", setTargetPath, "{alice_token}", `{"md5":123}`, 422, fieldErr("md5", "must be a string.")),
		{name: "set-target with GET", method: "GET", path: setTargetPath, token: "{alice_token}", wantStatus: 405, wantBody: apiNotAllowed},
	}
	runAPICases(t, fixture, tests)
}

// TestUploadFileBeforeRow: an upload's file is moved into place before its
// row is added, so a move that fails (here a directory stands where the
// file must go) leaves no row: a 500, and the state as it was.
func TestUploadFileBeforeRow(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	file := []byte("\xe9firmware that cannot be moved into place")
	must(t, os.Mkdir(firmwarePath(env.st, sha256Hex(file)), 0o700))
	before := dbState(t, env.st)
	checkAnswer(t, env.upload(env.alice, map[string]string{"name": "x"}, file), 500, `{"message":"Server Error."}`)
	sameState(t, "a failed upload", before, dbState(t, env.st))
	if !strings.Contains(env.logs.Take(), "store firmware file") {
		t.Error("the failed move was not logged")
	}
}

// TestCommandsWithoutBroker: the command endpoints answer in the order
// 404 (device, then button) → 422 body → 422 no OTA target → 422 device
// not online → 503 no broker connection, and never publish without one;
// a publish the link refuses (not connected) is a 503 too, and its
// command record is taken back.
// One env serves the whole table: every case sets alice's device status,
// the link and her OTA target, and changes nothing.
func TestCommandsWithoutBroker(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	for _, u := range []testUser{env.alice, env.bob} {
		apiAddButton(t, env, u, model.CommandButton{ID: "led", Label: "LED", Payload: json.RawMessage(`{"cmd":"led"}`)})
	}
	apiAddButton(t, env, env.bob, model.CommandButton{ID: "bob-only", Label: "B", Payload: json.RawMessage(`{}`)})
	_, aliceMD5 := env.uploadOK(env.alice, map[string]string{"name": "a"}, []byte("\xe9alice ota"))
	_, bobMD5 := env.uploadOK(env.bob, map[string]string{"name": "b"}, []byte("\xe9bob ota"))
	env.setTarget(env.bob, bobMD5)
	env.setStatus(env.bob.device, "online")
	down, refusing := &recordingLink{down: true}, &recordingLink{err: mqttlink.ErrNotPublished}
	// state sets alice's device status, the link (nil: no broker) and
	// whether her device has an OTA target.
	state := func(status string, link deviceLink, target bool) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			// A word the database refuses (its CHECK constraint) is written
			// past the check: a device with it must be refused all the same.
			unchecked := !slices.Contains(model.DeviceStatuses, model.DeviceStatus(status))
			if unchecked {
				mustExec(t, env.st, `PRAGMA ignore_check_constraints = ON`)
			}
			env.setStatus(env.alice.device, status)
			if unchecked {
				mustExec(t, env.st, `PRAGMA ignore_check_constraints = OFF`)
			}
			env.rebuild(withLink(link))
			mustExec(t, env.st, `UPDATE devices SET target_firmware_id = NULL WHERE uid = ?`, env.alice.device)
			if target {
				env.setTarget(env.alice, aliceMD5)
			}
		}
	}
	const (
		offline      = `{"message":"Device is offline."}`
		reconnecting = `{"message":"Device is reconnecting."}`
		unavailable  = `{"message":"The device link is unavailable. Try again later."}`
		assignFirst  = `{"message":"Assign firmware first to trigger OTA."}`
		noButton     = `{"message":"Command button not found."}`
	)
	notObject := apiFieldError("payload", "The payload field must be a JSON object.")
	var tests []apiCase
	add := func(name, path, body string, setup setupFunc, token string, wantStatus int, wantBody string) {
		tests = append(tests, apiCase{name: name, setup: setup, method: "POST", path: "/v1/user/devices/" + path,
			token: token, body: body, wantStatus: wantStatus, wantBody: wantBody})
	}
	for _, ep := range []struct{ name, path, body string }{
		{"reboot", "/reboot", ""},
		{"wifi-reset", "/wifi-reset", ""},
		{"ota", "/ota", ""},
		{"commands", "/commands", `{"payload":{"cmd":"blink","times":3}}`},
		{"button send", "/command-buttons/led/send", ""},
	} {
		c := func(name, who, token string, setup setupFunc, wantStatus int, wantBody string) {
			add(ep.name+": "+name, who+ep.path, ep.body, setup, token, wantStatus, wantBody)
		}
		c("bob's online device", "{bob}", "{alice_token}", state("online", nil, true), 404, apiDeviceNotFound)
		c("unknown device", "esp32_nosuchdevice", "{alice_token}", state("online", nil, true), 404, apiDeviceNotFound)
		c("pending device", "{alice}", "{alice_token}", state("pending", down, true), 422, offline)
		c("offline device", "{alice}", "{alice_token}", state("offline", down, true), 422, offline)
		c("reconnecting device", "{alice}", "{alice_token}", state("reconnecting", down, true), 422, reconnecting)
		c("unknown status word", "{alice}", "{alice_token}", state("sleeping", down, true), 422, offline)
		c("online, no broker", "{alice}", "{alice_token}", state("online", nil, true), 503, unavailable)
		c("online, broker connection down", "{alice}", "{alice_token}", state("online", down, true), 503, unavailable)
		c("bob online, no broker", "{bob}", "{bob_token}", state("online", nil, true), 503, unavailable)
		c("online, the publish refused", "{alice}", "{alice_token}", state("online", refusing, true), 503, unavailable)
	}
	online := state("online", down, true)
	add("commands: payload array", "{alice}/commands", `{"payload":["reboot"]}`, online, "{alice_token}", 422, notObject)
	add("commands: payload string", "{alice}/commands", `{"payload":"reboot"}`, online, "{alice_token}", 422, notObject)
	add("commands: payload missing", "{alice}/commands", `{"cmd":"reboot"}`, online, "{alice_token}",
		422, apiFieldError("payload", "The payload field is required."))
	add("commands: invalid payload to an offline device", "{alice}/commands", `{"payload":1}`, state("offline", down, true), "{alice_token}", 422, notObject)
	add("ota: no target, online", "{alice}/ota", "", state("online", down, false), "{alice_token}", 422, assignFirst)
	add("ota: no target, offline", "{alice}/ota", "", state("offline", down, false), "{alice_token}", 422, assignFirst)
	add("button send: unknown button", "{alice}/command-buttons/nope/send", "", online, "{alice_token}", 404, noButton)
	add("button send: bob's button id", "{alice}/command-buttons/bob-only/send", "", online, "{alice_token}", 404, noButton)
	add("reboot?wait=5: the publish refused", "{alice}/reboot?wait=5", "", state("online", refusing, true), "{alice_token}", 503, unavailable)
	add("button send: unknown button, offline device", "{alice}/command-buttons/nope/send", "", state("offline", down, true), "{alice_token}", 404, noButton)
	for i := range tests {
		tests[i].check = func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			if sent := down.take(); len(sent) != 0 {
				t.Errorf("published %q, want nothing", sent)
			}
		}
	}
	runSharedCases(t, env, v, tests)
}

func TestRouting(t *testing.T) {
	t.Parallel()
	const notFound = `{"message":"Not found."}`
	get := func(name, path string, wantStatus int, wantBody string) apiCase {
		return apiCase{name: name, method: "GET", path: path, token: "{alice_token}", wantStatus: wantStatus, wantBody: wantBody}
	}
	tests := []apiCase{
		get("unknown route", "/v1/nope", 404, notFound),
		get("unknown route without version", "/user/devices", 404, notFound),
		get("device list with a trailing slash", "/v1/user/devices/", 404, notFound),
		// The mux would redirect these to their clean form; a device's
		// updater follows no redirects.
		get("double slash", "/v1//auth/me", 404, notFound),
		get("dot segment", "/v1/./user/devices", 404, notFound),
		call("dot-dot segment", "POST", "/v1/user/devices/{alice}/command-buttons/../reboot", "{alice_token}", "", 404, notFound),
		call("unknown device sub-route", "POST", "/v1/user/devices/{alice}/selfdestruct", "{alice_token}", "", 404, notFound),
		call("POST to a GET route", "POST", "/v1/auth/me", "{alice_token}", "", 405, apiNotAllowed).then(allowIs("GET")),
		{name: "GET to a POST route", method: "GET", path: "/v1/auth/login", wantStatus: 405, wantBody: apiNotAllowed, check: allowIs("POST")},
		call("PUT a device", "PUT", "/v1/user/devices/{alice}", "{alice_token}", "", 405, apiNotAllowed).then(allowIs("GET, PATCH, DELETE")),
		call("PUT a firmware", "PUT", "/v1/user/devices/{alice}/firmwares/1", "{alice_token}", "", 405, apiNotAllowed).then(allowIs("PATCH, DELETE")),
		get("health", "/healthz", 200, `{"status":"ok","mqtt":"disconnected"}`),
		call("health with the broker connection down", "GET", "/healthz", "", "", 200, `{"status":"ok","mqtt":"disconnected"}`).
			after(func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withLink(&recordingLink{down: true})) }),
		call("health with the broker connected", "GET", "/healthz", "", "", 200, `{"status":"ok","mqtt":"connected"}`).
			after(func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withLink(&recordingLink{})) }),
	}
	runAPICases(t, nil, tests)
}

func TestTokensAPI(t *testing.T) {
	t.Parallel()
	// fixture: alice has a second token, "phone", made a minute after
	// her first ("test") and used then ({later}); bob has his one token.
	// The requests come two minutes later ({now}).
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		env.clock.advance(time.Minute)
		_, phone, err := issueToken(t.Context(), env.st, env.alice.id, "phone", nil, nil)
		must(t, err)
		apiWantStatus(t, env, "GET", "/v1/auth/me", phone, 200) // used, and now in the read cache
		v["phone"] = phone
		v["phone_id"], _, _ = strings.Cut(phone, "|")
		v["later"] = env.clock.now().Format(store.TimeFormat)
		env.clock.advance(2 * time.Minute) // past tokenTouchInterval: the next use is recorded
		v["now"] = env.clock.now().Format(store.TimeFormat)
	}
	const tokenNotFound = `{"message":"Token not found."}`
	const deleted = `{"message":"Token deleted."}`
	aliceFirst := `{"id":{alice_token_id},"name":"test","last_used_at":"{now}","created_at":"` + apiNow + `","current":true}`
	alicePhone := `{"id":{phone_id},"name":"phone","last_used_at":"{later}","created_at":"{later}","current":false}`
	// tokens checks the ids of the user's tokens, oldest first.
	tokens := func(user string, want ...string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			ids := make([]string, len(want))
			for i, id := range want {
				ids[i] = v.expand(id)
			}
			wantDB(t, env.st, strings.Join(ids, ","), `SELECT COALESCE(group_concat(id), '') FROM (SELECT id FROM tokens WHERE user_id = ? ORDER BY id)`, v[user+"_id"])
		}
	}
	// refused checks that each token {name} is refused now: on the very
	// next request, although it was in the read cache.
	refused := func(names ...string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			for _, name := range names {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v[name], 401)
			}
		}
	}
	// created checks a 201's new token: its fields, that only the SHA-256
	// of its secret is stored, and that it works.
	created := func(name string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			var got struct {
				Data map[string]json.RawMessage `json:"data"`
			}
			must(t, json.Unmarshal(w.Body.Bytes(), &got))
			var tok string
			json.Unmarshal(got.Data["token"], &tok)
			id := checkNewToken(t, env, tok, v["alice_id"], name)
			want := fmt.Sprintf(`{"id":%s,"name":%s,"last_used_at":null,"created_at":%q,"current":false,"token":%q}`,
				id, apiJSON(name), v["now"], tok)
			if !jsonEqual(t, w.Body.Bytes(), []byte(`{"data":`+want+`}`)) {
				t.Errorf("body:\ngot  %s\nwant {\"data\":%s}", w.Body, want)
			}
			tokens("alice", "{alice_token_id}", "{phone_id}", id)(t, env, v, w)
		}
	}
	const path = "/v1/user/tokens"

	runAPICases(t, fixture, []apiCase{
		// GET /v1/user/tokens
		call("list", "GET", path, "{alice_token}", "", 200, `{"data":[`+aliceFirst+`,`+alicePhone+`]}`),
		{name: "list with the other token", method: "GET", path: path, token: "{phone}", wantStatus: 200,
			wantBody: `{"data":[{"id":{alice_token_id},"name":"test","last_used_at":null,"created_at":"` + apiNow + `","current":false},
				{"id":{phone_id},"name":"phone","last_used_at":"{now}","created_at":"{later}","current":true}]}`},
		call("list as bob", "GET", path, "{bob_token}", "", 200,
			`{"data":[{"id":{bob_token_id},"name":"test","last_used_at":"{now}","created_at":"`+apiNow+`","current":true}]}`),
		{name: "list without token", method: "GET", path: path, wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/user/tokens
		call("create", "POST", path, "{alice_token}", `{"name":"CI runner"}`, 201, "").then(created("CI runner")),
		call("create with a long name", "POST", path, "{alice_token}", apiField("name", strings.Repeat("é", 255)), 201, "").then(created(strings.Repeat("é", 255))),
		call("create without name", "POST", path, "{alice_token}", `{}`, 422, apiFieldError("name", "The name field is required.")),
		call("create without body", "POST", path, "{alice_token}", "", 422, apiFieldError("name", "The name field is required.")),
		call("create with a blank name", "POST", path, "{alice_token}", `{"name":"  "}`, 422, apiFieldError("name", "The name field is required.")),
		call("create with a name too long", "POST", path, "{alice_token}", apiField("name", strings.Repeat("x", 256)), 422,
			apiFieldError("name", "The name field must not be greater than 255 characters.")),
		call("create with a name not a string", "POST", path, "{alice_token}", `{"name":7}`, 422, apiFieldError("name", "The name field must be a string.")),
		call("create with a name not UTF-8", "POST", path, "{alice_token}", "{\"name\":\"\xff\"}", 422, apiFieldError("name", "The name field must be valid UTF-8.")),
		call("create with malformed JSON", "POST", path, "{alice_token}", `{"name":`, 422, apiBadJSON),
		call("create at the token limit", "POST", path, "{alice_token}", `{"name":"third"}`, 422,
			`{"message":"You have reached the limit of 2 tokens. Delete a token first."}`).after(func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{Tokens: 2})) }),
		call("create under the token limit", "POST", path, "{alice_token}", `{"name":"third"}`, 201, "").
			after(func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{Tokens: 3})) }).then(created("third")),
		{name: "create without token", method: "POST", path: path, body: `{"name":"x"}`, wantStatus: 401, wantBody: apiUnauthenticated},

		// DELETE /v1/user/tokens/{id}
		{name: "delete another token", method: "DELETE", path: path + "/{phone_id}", token: "{alice_token}",
			wantStatus: 200, wantBody: deleted,
			check: allOf(tokens("alice", "{alice_token_id}"), refused("phone"), func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v["alice_token"], 200)
			})},
		{name: "delete the current token", method: "DELETE", path: path + "/{alice_token_id}", token: "{alice_token}",
			wantStatus: 200, wantBody: deleted,
			check: allOf(tokens("alice", "{phone_id}"), refused("alice_token"), func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v["phone"], 200)
			})},
		{name: "delete bob's token", method: "DELETE", path: path + "/{bob_token_id}", token: "{alice_token}",
			wantStatus: 404, wantBody: tokenNotFound,
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v["bob_token"], 200)
			}},
		{name: "delete an unknown token", method: "DELETE", path: path + "/99999", token: "{alice_token}", wantStatus: 404, wantBody: tokenNotFound},
		{name: "delete id 0", method: "DELETE", path: path + "/0", token: "{alice_token}", wantStatus: 404, wantBody: tokenNotFound},
		{name: "delete a leading-zero id", method: "DELETE", path: path + "/0{phone_id}", token: "{alice_token}", wantStatus: 404, wantBody: tokenNotFound},
		{name: "delete a non-numeric id", method: "DELETE", path: path + "/phone", token: "{alice_token}", wantStatus: 404, wantBody: tokenNotFound},
		{name: "delete a whole token", method: "DELETE", path: path + "/{phone}", token: "{alice_token}", wantStatus: 404, wantBody: tokenNotFound},
		{name: "delete without token", method: "DELETE", path: path + "/{phone_id}", wantStatus: 401, wantBody: apiUnauthenticated},
		call("wrong method", "PATCH", path+"/{phone_id}", "{alice_token}", "", 405, `{"message":"Method not allowed."}`).then(allowIs("DELETE")),
	})
}
