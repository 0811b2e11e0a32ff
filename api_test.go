package main

// Table-driven tests of the REST API through the real router, one table per
// endpoint group. Every case runs on a fresh testEnv (alice and bob, one
// device each) and checks the status, the exact body and the database
// afterwards. Two invariants hold for every case (runAPICases):
//
//   - an error response leaves the database and the firmware files as they were;
//   - a request never changes the other user's rows (the other user is bob,
//     or alice when the request carries bob's token).

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime/multipart"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// apiNow is the fake clock's start as the API renders timestamps.
const apiNow = "2026-11-21T12:00:00.000000Z"

// Messages of README: API used by many cases.
const (
	apiUnauthenticated = `{"message":"Unauthenticated."}`
	apiDeviceNotFound  = `{"message":"Device not found."}`
	apiTooLarge        = `{"message":"The request body is too large."}`
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

// apiCase is one request and what must follow from it. path, token, authz,
// body and wantBody may name apiVars in braces.
type apiCase struct {
	name       string
	setup      func(t *testing.T, env *testEnv, v apiVars) // state beyond the table's fixture
	method     string
	path       string
	token      string            // sent as "Authorization: Bearer <token>"
	authz      string            // a raw Authorization header instead
	body       string            // a JSON body (Content-Type: application/json); none when empty
	form       map[string]string // a multipart upload when form or file is set
	file       []byte            // the upload's "file" part; none when nil
	wantStatus int
	wantBody   string // the exact JSON body; when empty, check looks at the body
	check      func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder)
}

// runAPICases runs each case on a fresh testEnv prepared by fixture.
func runAPICases(t *testing.T, fixture func(t *testing.T, env *testEnv, v apiVars), tests []apiCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil)
			v := newAPIVars(env)
			if fixture != nil {
				fixture(t, env, v)
			}
			if tt.setup != nil {
				tt.setup(t, env, v)
			}
			before := apiState(t, env)
			w := tt.send(t, env, v)
			apiCheckResponse(t, w, tt.wantStatus, v.expand(tt.wantBody))
			after := apiState(t, env)
			if w.Code >= 400 {
				apiSameState(t, "an error response", before, after)
			} else {
				other := env.bob.id
				if v.expand(tt.token) == env.bob.token {
					other = env.alice.id
				}
				apiSameState(t, "the other user's rows", apiOnly(before, other), apiOnly(after, other))
			}
			if tt.check != nil {
				tt.check(t, env, v, w)
			}
		})
	}
}

func (tt apiCase) send(t *testing.T, env *testEnv, v apiVars) *httptest.ResponseRecorder {
	t.Helper()
	var body io.Reader
	contentType := ""
	switch {
	case tt.form != nil || tt.file != nil:
		b, ct := apiMultipart(t, tt.form, tt.file)
		body, contentType = bytes.NewReader(b), ct
	case tt.body != "":
		body, contentType = strings.NewReader(v.expand(tt.body)), "application/json"
	}
	authz := v.expand(tt.authz)
	if authz == "" && tt.token != "" {
		authz = "Bearer " + v.expand(tt.token)
	}
	return apiSend(env, tt.method, v.expand(tt.path), authz, contentType, body)
}

// apiSend sends one request through the real router.
func apiSend(env *testEnv, method, path, authz, contentType string, body io.Reader) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, body)
	req.Header.Set("Accept", "application/json")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if authz != "" {
		req.Header.Set("Authorization", authz)
	}
	w := httptest.NewRecorder()
	env.srv.ServeHTTP(w, req)
	recordResponse(env.t, req, w)
	return w
}

// apiMultipart builds a firmware upload form; file nil leaves out the file part.
func apiMultipart(t *testing.T, fields map[string]string, file []byte) ([]byte, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := mw.WriteField(k, fields[k]); err != nil {
			t.Fatal(err)
		}
	}
	if file != nil {
		fw, err := mw.CreateFormFile("file", "firmware.bin")
		if err != nil {
			t.Fatal(err)
		}
		fw.Write(file)
	}
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), mw.FormDataContentType()
}

// apiCheckResponse checks the status, the headers every response carries,
// and, when wantBody is set, the exact JSON body.
func apiCheckResponse(t *testing.T, w *httptest.ResponseRecorder, wantStatus int, wantBody string) {
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

// apiState dumps every row a request could change, by the id of the user
// who owns it (0: platforms, boards and the files under the firmware
// directory, tmp included). tokens.last_used_at is left out: every
// authenticated request may touch it.
func apiState(t *testing.T, env *testEnv) map[int64][]string {
	t.Helper()
	state := map[int64][]string{}
	for _, q := range []string{
		`SELECT id, 'user', * FROM users`,
		`SELECT user_id, 'token', id, name, hex(secret_hash), created_at FROM tokens`,
		`SELECT owner_id, 'device', * FROM devices`,
		`SELECT d.owner_id, 'firmware', f.* FROM firmwares f JOIN devices d ON d.id = f.device_id`,
		`SELECT d.owner_id, 'button', b.* FROM command_buttons b JOIN devices d ON d.id = b.device_id`,
		`SELECT 0, 'platform', * FROM platforms`,
		`SELECT 0, 'board', * FROM boards`,
	} {
		rows, err := env.st.db.Query(q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		cols, err := rows.Columns()
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			if err := rows.Scan(ptrs...); err != nil {
				t.Fatal(err)
			}
			owner, _ := strconv.ParseInt(fmt.Sprint(vals[0]), 10, 64)
			parts := make([]string, len(vals)-1)
			for i, val := range vals[1:] {
				if b, ok := val.([]byte); ok {
					val = string(b)
				}
				parts[i] = fmt.Sprint(val)
			}
			state[owner] = append(state[owner], strings.Join(parts, " | "))
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
	}
	err := filepath.WalkDir(env.st.fwDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(env.st.fwDir, p)
		state[0] = append(state[0], fmt.Sprintf("file | %s | %d | %x", rel, len(data), md5.Sum(data)))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for k := range state {
		sort.Strings(state[k])
	}
	return state
}

// apiOnly is the part of a state that one user owns.
func apiOnly(state map[int64][]string, owner int64) map[int64][]string {
	return map[int64][]string{owner: state[owner]}
}

// apiSameState fails unless before and after hold the same rows.
func apiSameState(t *testing.T, what string, before, after map[int64][]string) {
	t.Helper()
	owners := map[int64]bool{}
	for k := range before {
		owners[k] = true
	}
	for k := range after {
		owners[k] = true
	}
	for owner := range owners {
		if !slices.Equal(before[owner], after[owner]) {
			t.Errorf("%s changed the data of owner %d:\nbefore %q\nafter  %q", what, owner, before[owner], after[owner])
		}
	}
}

// apiScalar runs a one-value query and returns the value as text: "<nil>"
// for NULL, "<no row>" when there is no row.
func apiScalar(t *testing.T, env *testEnv, query string, args ...any) string {
	t.Helper()
	var v any
	err := env.st.db.QueryRow(query, args...).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return "<no row>"
	}
	if err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	if b, ok := v.([]byte); ok {
		return string(b)
	}
	return fmt.Sprint(v)
}

// apiWantDB checks a one-value query's result.
func apiWantDB(t *testing.T, env *testEnv, want, query string, args ...any) {
	t.Helper()
	if got := apiScalar(t, env, query, args...); got != want {
		t.Errorf("%s %v: got %q, want %q", query, args, got, want)
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
func apiField(field string, value any) string {
	return apiJSON(map[string]any{field: value})
}

// apiSizedBody is a JSON object {"<field>":"xxx…"} of exactly size bytes.
func apiSizedBody(field string, size int) string {
	frame := len(`{"` + field + `":""}`)
	return `{"` + field + `":"` + strings.Repeat("x", size-frame) + `"}`
}

// apiFieldError is a Laravel-style 422 body for one problem with one field.
func apiFieldError(field, msg string) string {
	return apiJSON(map[string]any{"message": msg, "errors": map[string][]string{field: {msg}}})
}

func apiMD5(b []byte) string {
	sum := md5.Sum(b)
	return hex.EncodeToString(sum[:])
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
		"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},"board_variant":null}`,
		uid, apiJSON(name))
}

// apiFirmwareJSON is a Firmware object created at {now}; version and notes
// are JSON (null or a string), id, md5, sha256 and size may be {vars}.
func apiFirmwareJSON(id, name, version, notes, md5sum, sha, size string, isTarget bool) string {
	return fmt.Sprintf(`{"id":%s,"name":%s,"version":%s,"notes":%s,"md5":%q,"sha256":%q,"size":%s,"created_at":"{now}","is_current":false,"is_target":%t}`,
		id, apiJSON(name), version, notes, md5sum, sha, size, isTarget)
}

// apiDeviceID is the internal id of the user's device.
func apiDeviceID(t *testing.T, env *testEnv, u testUser) int64 {
	t.Helper()
	return env.device(u).id
}

// apiUploadOK uploads a firmware through the API and returns its id.
func apiUploadOK(t *testing.T, env *testEnv, u testUser, fields map[string]string, content []byte) string {
	t.Helper()
	w := env.upload(u.device, u.token, fields, content)
	if w.Code != 201 {
		t.Fatalf("upload: got %d, want 201: %s", w.Code, w.Body)
	}
	data, _ := decode(t, w)["data"].(map[string]any)
	return fmt.Sprint(data["id"])
}

// apiSetTarget assigns the device's firmware with that md5 as its target.
func apiSetTarget(t *testing.T, env *testEnv, u testUser, md5sum string) {
	t.Helper()
	if err := env.st.setTarget(context.Background(), apiDeviceID(t, env, u), md5sum); err != nil {
		t.Fatalf("setTarget: %v", err)
	}
}

// apiAddToken issues another token for the user.
func apiAddToken(t *testing.T, env *testEnv, userID int64) string {
	t.Helper()
	tok, err := issueToken(context.Background(), env.st, userID, "second", false)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// apiWantStatus sends a request and checks only its status.
func apiWantStatus(t *testing.T, env *testEnv, method, path, token string, want int) {
	t.Helper()
	w := env.request(method, path, token, nil)
	if w.Code != want {
		t.Errorf("%s %s: got %d, want %d (%s)", method, path, w.Code, want, w.Body)
	}
}

// ---- auth ----

func TestAuthAPI(t *testing.T) {
	const creds = `{"message":"The provided credentials are incorrect.","errors":{"email":["The provided credentials are incorrect."]}}`
	login := func(email, password string) string {
		return apiJSON(map[string]string{"email": email, "password": password, "token_name": "laptop"})
	}
	me := func(name, email, lastLogin string) string {
		return fmt.Sprintf(`{"data":{"id":{%s_id},"name":%q,"email":%q,"role":"user","email_verified_at":null,"last_login_at":%s}}`,
			strings.ToLower(name), name, email, lastLogin)
	}
	// loggedIn checks a successful login of u and the token it returned.
	loggedIn := func(u func(env *testEnv) testUser, name string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			user := u(env)
			var got map[string]json.RawMessage
			if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
				t.Fatal(err)
			}
			if len(got) != 3 {
				t.Errorf("login response has %d fields, want token_type, token, user: %s", len(got), w.Body)
			}
			if string(got["token_type"]) != `"Bearer"` {
				t.Errorf("token_type: got %s, want \"Bearer\"", got["token_type"])
			}
			wantUser := fmt.Sprintf(`{"id":%d,"name":%q,"email":%q,"role":"user"}`, user.id, name, user.email)
			if !jsonEqual(t, got["user"], []byte(wantUser)) {
				t.Errorf("user: got %s, want %s", got["user"], wantUser)
			}
			var tok string
			json.Unmarshal(got["token"], &tok)
			m := regexp.MustCompile(`^([0-9]+)\|([A-Za-z0-9]{40})$`).FindStringSubmatch(tok)
			if m == nil {
				t.Fatalf("token %q is not <id>|<40 alphanumerics>", tok)
			}
			sum := sha256.Sum256([]byte(m[2]))
			apiWantDB(t, env, fmt.Sprintf("%d laptop %X", user.id, sum[:]),
				`SELECT user_id || ' ' || name || ' ' || hex(secret_hash) FROM tokens WHERE id = ?`, m[1])
			apiWantDB(t, env, apiNow, `SELECT last_login_at FROM users WHERE id = ?`, user.id)
			// The new token works, and the old one still does.
			for _, tk := range []string{tok, user.token} {
				if w := env.request("GET", "/v1/auth/me", tk, nil); w.Code != 200 {
					t.Errorf("GET /v1/auth/me with %q: got %d, want 200", tk, w.Code)
				}
			}
		}
	}
	alice := func(env *testEnv) testUser { return env.alice }
	bob := func(env *testEnv) testUser { return env.bob }
	// tokenGone checks that the token {<name>} no longer authenticates.
	tokenGone := func(name string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			apiWantDB(t, env, "<no row>", `SELECT id FROM tokens WHERE id = ?`, v[name+"_id"])
			apiWantStatus(t, env, "GET", "/v1/auth/me", v[name], 401)
		}
	}
	// logoutKeeps checks that the presenting token is gone and every
	// other token, the user's second one included, still works.
	logoutKeeps := func(gone string, kept ...string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			tokenGone(gone)(t, env, v, w)
			for _, k := range kept {
				apiWantStatus(t, env, "GET", "/v1/auth/me", v[k], 200)
			}
		}
	}
	secondTokens := func(t *testing.T, env *testEnv, v apiVars) {
		v["alice_token2"] = apiAddToken(t, env, env.alice.id)
		v["bob_token2"] = apiAddToken(t, env, env.bob.id)
	}

	tests := []apiCase{
		// POST /v1/auth/login
		{name: "login", method: "POST", path: "/v1/auth/login", body: login("alice@example.com", "alice-password"),
			wantStatus: 200, check: loggedIn(alice, "Alice")},
		{name: "login bob", method: "POST", path: "/v1/auth/login", body: login("bob@example.com", "bob-password"),
			token:      "{bob_token}", // only marks bob as the acting user: login ignores it
			wantStatus: 200, check: loggedIn(bob, "Bob")},
		{name: "login email in other case", method: "POST", path: "/v1/auth/login", body: login(" Alice@Example.COM", "alice-password"),
			wantStatus: 200, check: loggedIn(alice, "Alice")},
		{name: "login wrong password", method: "POST", path: "/v1/auth/login", body: login("alice@example.com", "alice-passwort"),
			wantStatus: 422, wantBody: creds},
		{name: "login other user's password", method: "POST", path: "/v1/auth/login", body: login("alice@example.com", "bob-password"),
			wantStatus: 422, wantBody: creds},
		{name: "login unknown email", method: "POST", path: "/v1/auth/login", body: login("carol@example.com", "alice-password"),
			wantStatus: 422, wantBody: creds},
		{name: "login missing fields", method: "POST", path: "/v1/auth/login", body: `{}`, wantStatus: 422,
			wantBody: `{"message":"The email field is required. (and 2 more errors)","errors":{"email":["The email field is required."],
				"password":["The password field is required."],"token_name":["The token name field is required."]}}`},
		{name: "login without body", method: "POST", path: "/v1/auth/login", wantStatus: 422,
			wantBody: `{"message":"The email field is required. (and 2 more errors)","errors":{"email":["The email field is required."],
				"password":["The password field is required."],"token_name":["The token name field is required."]}}`},
		{name: "login missing token name", method: "POST", path: "/v1/auth/login",
			body: `{"email":"alice@example.com","password":"alice-password"}`, wantStatus: 422,
			wantBody: apiFieldError("token_name", "The token name field is required.")},
		{name: "login email not a string", method: "POST", path: "/v1/auth/login",
			body: `{"email":["alice@example.com"],"password":"alice-password","token_name":"x"}`, wantStatus: 422,
			wantBody: apiFieldError("email", "The email field must be a string.")},
		{name: "login password not a string", method: "POST", path: "/v1/auth/login",
			body: `{"email":"alice@example.com","password":12345678,"token_name":"x"}`, wantStatus: 422,
			wantBody: apiFieldError("password", "The password field must be a string.")},
		{name: "login token name too long", method: "POST", path: "/v1/auth/login",
			body:       apiJSON(map[string]string{"email": "alice@example.com", "password": "alice-password", "token_name": strings.Repeat("t", 256)}),
			wantStatus: 422, wantBody: apiFieldError("token_name", "The token name field must not be greater than 255 characters.")},
		{name: "login malformed JSON", method: "POST", path: "/v1/auth/login", body: `{"email":"alice@example.com",`,
			wantStatus: 422, wantBody: apiBadJSON},
		{name: "login JSON array", method: "POST", path: "/v1/auth/login", body: `["alice@example.com"]`,
			wantStatus: 422, wantBody: apiBadJSON},
		{name: "login body over 64 KiB", method: "POST", path: "/v1/auth/login", body: apiSizedBody("email", maxJSONBody+1),
			wantStatus: 413, wantBody: apiTooLarge},

		// GET /v1/auth/me
		{name: "me", method: "GET", path: "/v1/auth/me", token: "{alice_token}",
			wantStatus: 200, wantBody: me("Alice", "alice@example.com", "null"),
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				apiWantDB(t, env, apiNow, `SELECT last_used_at FROM tokens WHERE id = ?`, v["alice_token_id"])
				apiWantDB(t, env, "<nil>", `SELECT last_used_at FROM tokens WHERE id = ?`, v["bob_token_id"])
			}},
		{name: "me as bob", method: "GET", path: "/v1/auth/me", token: "{bob_token}",
			wantStatus: 200, wantBody: me("Bob", "bob@example.com", "null")},
		{name: "me after login", method: "GET", path: "/v1/auth/me", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				env.clock.advance(-time.Hour)
				if w := env.request("POST", "/v1/auth/login", "", login("alice@example.com", "alice-password")); w.Code != 200 {
					t.Fatalf("login: got %d, want 200", w.Code)
				}
				env.clock.advance(time.Hour)
			},
			wantStatus: 200, wantBody: me("Alice", "alice@example.com", `"2026-11-21T11:00:00.000000Z"`)},
		{name: "me token without id prefix", method: "GET", path: "/v1/auth/me", token: "{alice_secret}",
			wantStatus: 200, wantBody: me("Alice", "alice@example.com", "null")},
		{name: "me without Authorization", method: "GET", path: "/v1/auth/me", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me empty bearer", method: "GET", path: "/v1/auth/me", authz: "Bearer ", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me other scheme", method: "GET", path: "/v1/auth/me", authz: "Token {alice_token}", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me token without scheme", method: "GET", path: "/v1/auth/me", authz: "{alice_token}", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me unknown token", method: "GET", path: "/v1/auth/me", token: "999|" + strings.Repeat("a", 40), wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me garbage token", method: "GET", path: "/v1/auth/me", token: "not-a-token", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me alice's id with bob's secret", method: "GET", path: "/v1/auth/me", token: "{alice_token_id}|{bob_secret}",
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me token id without secret", method: "GET", path: "/v1/auth/me", token: "{alice_token_id}|",
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me deleted token", method: "GET", path: "/v1/auth/me", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				id, _ := strconv.ParseInt(v["alice_token_id"], 10, 64)
				if err := env.st.deleteToken(context.Background(), id); err != nil {
					t.Fatal(err)
				}
			},
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me logged-out token", method: "GET", path: "/v1/auth/me", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				if w := env.request("POST", "/v1/auth/logout", env.alice.token, nil); w.Code != 200 {
					t.Fatalf("logout: got %d, want 200", w.Code)
				}
			},
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "me token of a deleted user", method: "GET", path: "/v1/auth/me", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				if _, err := env.st.wdb.Exec(`DELETE FROM users WHERE id = ?`, env.alice.id); err != nil {
					t.Fatal(err)
				}
			},
			wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/auth/logout
		{name: "logout", method: "POST", path: "/v1/auth/logout", token: "{alice_token}", setup: secondTokens,
			wantStatus: 200, wantBody: `{"message":"Logged out."}`,
			check: logoutKeeps("alice_token", "alice_token2", "bob_token", "bob_token2")},
		{name: "logout bob", method: "POST", path: "/v1/auth/logout", token: "{bob_token}", setup: secondTokens,
			wantStatus: 200, wantBody: `{"message":"Logged out."}`,
			check: logoutKeeps("bob_token", "bob_token2", "alice_token", "alice_token2")},
		{name: "logout without token", method: "POST", path: "/v1/auth/logout", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "logout with wrong secret", method: "POST", path: "/v1/auth/logout", token: "{alice_token_id}|{bob_secret}",
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "logout with GET", method: "GET", path: "/v1/auth/logout", token: "{alice_token}",
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`},
	}
	runAPICases(t, nil, tests)
}

// TestLoginThrottle: five failed logins a minute per email and client
// address; the sixth try is a 429 with Retry-After, even with the right
// password, until the minute is over.
func TestLoginThrottle(t *testing.T) {
	env := newTestEnv(t, nil)
	attempt := func(email, password, addr string) *httptest.ResponseRecorder {
		t.Helper()
		req := httptest.NewRequest("POST", "/v1/auth/login",
			strings.NewReader(apiJSON(map[string]string{"email": email, "password": password, "token_name": "t"})))
		req.Header.Set("Content-Type", "application/json")
		req.RemoteAddr = addr
		w := httptest.NewRecorder()
		env.srv.ServeHTTP(w, req)
		recordResponse(t, req, w)
		return w
	}
	const ip, otherIP = "192.0.2.1:1234", "198.51.100.7:4321"
	tokens := func() string { return apiScalar(t, env, `SELECT count(*) FROM tokens WHERE user_id = ?`, env.alice.id) }
	const creds = `{"message":"The provided credentials are incorrect.","errors":{"email":["The provided credentials are incorrect."]}}`
	const tooMany = `{"message":"Too Many Attempts."}`

	for i, email := range []string{"alice@example.com", "ALICE@example.com", "alice@example.com", "Alice@Example.com", "alice@example.com"} {
		w := attempt(email, "wrong", ip)
		apiCheckResponse(t, w, 422, creds)
		if got := w.Header().Get("Retry-After"); got != "" {
			t.Errorf("failure %d: Retry-After %q, want none", i+1, got)
		}
	}
	w := attempt("alice@example.com", "alice-password", ip)
	apiCheckResponse(t, w, 429, tooMany)
	if got := w.Header().Get("Retry-After"); got != "60" {
		t.Errorf("Retry-After: got %q, want 60", got)
	}
	if got := tokens(); got != "1" {
		t.Errorf("alice's tokens after a throttled login: got %s, want 1", got)
	}
	apiWantDB(t, env, "<nil>", `SELECT last_login_at FROM users WHERE id = ?`, env.alice.id)

	// Other keys are not throttled: another email, another address.
	apiCheckResponse(t, attempt("bob@example.com", "bob-password", ip), 200, "")
	apiCheckResponse(t, attempt("alice@example.com", "alice-password", otherIP), 200, "")

	env.clock.advance(30 * time.Second)
	w = attempt("alice@example.com", "alice-password", ip)
	apiCheckResponse(t, w, 429, tooMany)
	if got := w.Header().Get("Retry-After"); got != "30" {
		t.Errorf("Retry-After after 30 s: got %q, want 30", got)
	}

	env.clock.advance(30 * time.Second)
	apiCheckResponse(t, attempt("alice@example.com", "alice-password", ip), 200, "")
	if got := tokens(); got != "3" {
		t.Errorf("alice's tokens: got %s, want 3 (fixture, other address, after the minute)", got)
	}

	// An unknown email is throttled the same way.
	for range 5 {
		apiCheckResponse(t, attempt("nobody@example.com", "x", ip), 422, creds)
	}
	apiCheckResponse(t, attempt("nobody@example.com", "x", ip), 429, tooMany)
}

// TestTokenLastUsed: a token's use is recorded, at most once a minute.
func TestTokenLastUsed(t *testing.T) {
	env := newTestEnv(t, nil)
	id, _, _ := strings.Cut(env.alice.token, "|")
	lastUsed := func() string { return apiScalar(t, env, `SELECT last_used_at FROM tokens WHERE id = ?`, id) }
	if got := lastUsed(); got != "<nil>" {
		t.Fatalf("last_used_at before use: got %q, want NULL", got)
	}
	apiWantStatus(t, env, "GET", "/v1/user/devices", env.alice.token, 200)
	if got := lastUsed(); got != apiNow {
		t.Errorf("last_used_at after use: got %q, want %q", got, apiNow)
	}
	env.clock.advance(30 * time.Second)
	apiWantStatus(t, env, "GET", "/v1/auth/me", env.alice.token, 200)
	if got := lastUsed(); got != apiNow {
		t.Errorf("last_used_at 30 s later: got %q, want %q (written at most once a minute)", got, apiNow)
	}
	env.clock.advance(31 * time.Second)
	apiWantStatus(t, env, "GET", "/v1/auth/me", env.alice.token, 200)
	if got, want := lastUsed(), "2026-11-21T12:01:01.000000Z"; got != want {
		t.Errorf("last_used_at 61 s later: got %q, want %q", got, want)
	}
	// A failed authentication is not a use.
	env.clock.advance(time.Hour)
	_, bobSecret, _ := strings.Cut(env.bob.token, "|")
	apiWantStatus(t, env, "GET", "/v1/auth/me", id+"|"+bobSecret, 401)
	if got, want := lastUsed(), "2026-11-21T12:01:01.000000Z"; got != want {
		t.Errorf("last_used_at after a wrong secret: got %q, want %q", got, want)
	}
	apiWantDB(t, env, "<nil>", `SELECT last_used_at FROM tokens WHERE user_id = ?`, env.bob.id)
}

// ---- devices ----

func TestDevicesAPI(t *testing.T) {
	aliceDetail := func(name, description string) string {
		return `{"data":` + apiDetail("{alice}", name, description) + `}`
	}
	// deviceIs checks alice's device row: name and description ("<nil>": NULL).
	deviceIs := func(name, description string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			apiWantDB(t, env, name, `SELECT name FROM devices WHERE uid = ?`, env.alice.device)
			apiWantDB(t, env, description, `SELECT description FROM devices WHERE uid = ?`, env.alice.device)
		}
	}
	unchanged := deviceIs("Alice's device", "<nil>")
	long := func(n int) string { return strings.Repeat("n", n) }
	patch := func(name string, body string, wantStatus int, wantBody string, check func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder)) apiCase {
		return apiCase{name: name, method: "PATCH", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			body: body, wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	describe := func(t *testing.T, env *testEnv, v apiVars) {
		desc := "On the shelf"
		if _, err := env.st.updateDevice(context.Background(), env.alice.id, env.alice.device, deviceUpdate{description: &desc}); err != nil {
			t.Fatal(err)
		}
	}

	tests := []apiCase{
		// GET /v1/user/devices
		{name: "list", method: "GET", path: "/v1/user/devices", token: "{alice_token}",
			wantStatus: 200, wantBody: `{"data":[` + apiSummary("{alice}", "Alice's device") + `]}`},
		{name: "list as bob", method: "GET", path: "/v1/user/devices", token: "{bob_token}",
			wantStatus: 200, wantBody: `{"data":[` + apiSummary("{bob}", "Bob's device") + `]}`},
		{name: "list two devices", method: "GET", path: "/v1/user/devices", token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				uid, err := env.st.createDevice(context.Background(), "alice@example.com", "esp32", "devkit", "Garage", 1883)
				if err != nil {
					t.Fatal(err)
				}
				v["alice2"] = uid
			},
			wantStatus: 200, wantBody: `{"data":[` + apiSummary("{alice}", "Alice's device") + `,` + apiSummary("{alice2}", "Garage") + `]}`},
		{name: "list without devices", method: "GET", path: "/v1/user/devices", token: "{carol_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				id, err := env.st.createUser(context.Background(), "Carol", "carol@example.com", "user", "x")
				if err != nil {
					t.Fatal(err)
				}
				v["carol_token"] = apiAddToken(t, env, id)
			},
			wantStatus: 200, wantBody: `{"data":[]}`},
		{name: "list without token", method: "GET", path: "/v1/user/devices", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "list with bad token", method: "GET", path: "/v1/user/devices", token: "{alice_token_id}|x", wantStatus: 401, wantBody: apiUnauthenticated},

		// GET /v1/user/devices/{uid}
		{name: "get", method: "GET", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			wantStatus: 200, wantBody: aliceDetail("Alice's device", "null")},
		{name: "get as bob", method: "GET", path: "/v1/user/devices/{bob}", token: "{bob_token}",
			wantStatus: 200, wantBody: `{"data":` + apiDetail("{bob}", "Bob's device", "null") + `}`},
		{name: "get bob's device", method: "GET", path: "/v1/user/devices/{bob}", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "get unknown device", method: "GET", path: "/v1/user/devices/esp32_nosuchdevice", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "get without token", method: "GET", path: "/v1/user/devices/{alice}", wantStatus: 401, wantBody: apiUnauthenticated},

		// PATCH /v1/user/devices/{uid}
		patch("patch name and description", `{"name":"Kitchen","description":"By the window"}`,
			200, aliceDetail("Kitchen", `"By the window"`), deviceIs("Kitchen", "By the window")),
		patch("patch description only", `{"description":"By the window"}`,
			200, aliceDetail("Alice's device", `"By the window"`), deviceIs("Alice's device", "By the window")),
		patch("patch name only", `{"name":"Kitchen"}`, 200, aliceDetail("Kitchen", "null"), deviceIs("Kitchen", "<nil>")),
		{name: "patch name keeps description", method: "PATCH", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			setup: describe, body: `{"name":"Kitchen"}`,
			wantStatus: 200, wantBody: aliceDetail("Kitchen", `"On the shelf"`), check: deviceIs("Kitchen", "On the shelf")},
		{name: "patch description null clears it", method: "PATCH", path: "/v1/user/devices/{alice}", token: "{alice_token}",
			setup: describe, body: `{"description":null}`,
			wantStatus: 200, wantBody: aliceDetail("Alice's device", "null"), check: unchanged},
		patch("patch empty object", `{}`, 200, aliceDetail("Alice's device", "null"), unchanged),
		patch("patch name of 255 characters", apiField("name", long(255)), 200, aliceDetail(long(255), "null"), deviceIs(long(255), "<nil>")),
		patch("patch name of 255 non-ASCII characters", apiField("name", strings.Repeat("é", 255)),
			200, aliceDetail(strings.Repeat("é", 255), "null"), deviceIs(strings.Repeat("é", 255), "<nil>")),
		patch("patch description of 2000 characters", apiField("description", long(2000)),
			200, aliceDetail("Alice's device", apiJSON(long(2000))), deviceIs("Alice's device", long(2000))),
		{name: "patch as bob", method: "PATCH", path: "/v1/user/devices/{bob}", token: "{bob_token}", body: `{"name":"Bob's lab"}`,
			wantStatus: 200, wantBody: `{"data":` + apiDetail("{bob}", "Bob's lab", "null") + `}`,
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				apiWantDB(t, env, "Bob's lab", `SELECT name FROM devices WHERE uid = ?`, env.bob.device)
			}},
		{name: "patch bob's device", method: "PATCH", path: "/v1/user/devices/{bob}", token: "{alice_token}",
			body: `{"name":"Mine now","description":"x"}`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "patch bob's device with invalid body", method: "PATCH", path: "/v1/user/devices/{bob}", token: "{alice_token}",
			body: `{"name":`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "patch unknown device", method: "PATCH", path: "/v1/user/devices/esp32_nosuchdevice", token: "{alice_token}",
			body: `{"name":"x"}`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "patch without token", method: "PATCH", path: "/v1/user/devices/{alice}", body: `{"name":"x"}`,
			wantStatus: 401, wantBody: apiUnauthenticated},
		patch("patch name empty", `{"name":""}`, 422, apiFieldError("name", "The name field is required."), unchanged),
		patch("patch name blank", `{"name":"   "}`, 422, apiFieldError("name", "The name field is required."), unchanged),
		patch("patch name null", `{"name":null}`, 422, apiFieldError("name", "The name field is required."), unchanged),
		patch("patch name of 256 characters", apiField("name", long(256)),
			422, apiFieldError("name", "The name field must not be greater than 255 characters."), unchanged),
		patch("patch description of 2001 characters", apiField("description", long(2001)),
			422, apiFieldError("description", "The description field must not be greater than 2000 characters."), unchanged),
		patch("patch name not a string", `{"name":42}`, 422, apiFieldError("name", "The name field must be a string."), unchanged),
		patch("patch description not a string", `{"description":["x"]}`,
			422, apiFieldError("description", "The description field must be a string."), unchanged),
		patch("patch with two errors", fmt.Sprintf(`{"name":42,"description":%q}`, long(2001)), 422,
			`{"message":"The name field must be a string. (and 1 more error)","errors":{"name":["The name field must be a string."],
				"description":["The description field must not be greater than 2000 characters."]}}`, unchanged),
		patch("patch valid name with invalid description", fmt.Sprintf(`{"name":"Kitchen","description":%q}`, long(2001)),
			422, apiFieldError("description", "The description field must not be greater than 2000 characters."), unchanged),
		patch("patch malformed JSON", `{"name":"Kitchen"`, 422, apiBadJSON, unchanged),
		patch("patch JSON array", `["Kitchen"]`, 422, apiBadJSON, unchanged),
		patch("patch JSON null", `null`, 422, apiBadJSON, unchanged),
		patch("patch JSON string", `"Kitchen"`, 422, apiBadJSON, unchanged),
		patch("patch trailing data", `{"name":"Kitchen"} {}`, 422, apiBadJSON, unchanged),
		patch("patch body over 64 KiB", apiSizedBody("description", maxJSONBody+1), 413, apiTooLarge, unchanged),
		patch("patch body of exactly 64 KiB", apiSizedBody("description", maxJSONBody),
			422, apiFieldError("description", "The description field must not be greater than 2000 characters."), unchanged),
		{name: "patch with PUT", method: "PUT", path: "/v1/user/devices/{alice}", token: "{alice_token}", body: `{"name":"x"}`,
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`, check: unchanged},
	}
	runAPICases(t, nil, tests)
}

// TestJSONBodyLimit: JSON bodies up to 64 KiB are read, larger ones are a
// 413, also when the client does not announce the length.
func TestJSONBodyLimit(t *testing.T) {
	tests := []struct {
		name       string
		size       int
		chunked    bool
		wantStatus int
	}{
		{"exactly 64 KiB", maxJSONBody, false, 422},
		{"64 KiB and one byte", maxJSONBody + 1, false, 413},
		{"exactly 64 KiB, unannounced length", maxJSONBody, true, 422},
		{"64 KiB and one byte, unannounced length", maxJSONBody + 1, true, 413},
		{"1 MiB, unannounced length", 1 << 20, true, 413},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil)
			before := apiState(t, env)
			var body io.Reader = strings.NewReader(apiSizedBody("description", tt.size))
			if tt.chunked {
				body = io.MultiReader(body) // hides the length from httptest.NewRequest
			}
			w := apiSend(env, "PATCH", "/v1/user/devices/"+env.alice.device, "Bearer "+env.alice.token, "application/json", body)
			want := apiTooLarge
			if tt.wantStatus == 422 {
				want = apiFieldError("description", "The description field must not be greater than 2000 characters.")
			}
			apiCheckResponse(t, w, tt.wantStatus, want)
			apiSameState(t, "a rejected body", before, apiState(t, env))
		})
	}
}

// ---- command buttons ----

func TestCommandButtonsAPI(t *testing.T) {
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		ctx := context.Background()
		for _, b := range []struct {
			u testUser
			b commandButton
		}{
			{env.alice, commandButton{ID: "led-on", Label: "LED on", Payload: json.RawMessage(`{"cmd":"led","on":true}`), Confirm: true}},
			{env.bob, commandButton{ID: "led-on", Label: "Bob's LED", Payload: json.RawMessage(`{"cmd":"bob"}`)}},
			{env.bob, commandButton{ID: "bob-only", Label: "Bob only", Payload: json.RawMessage(`{}`)}},
		} {
			if err := env.st.createButton(ctx, apiDeviceID(t, env, b.u), b.b); err != nil {
				t.Fatal(err)
			}
		}
	}
	const aliceLED = `{"id":"led-on","label":"LED on","payload":{"cmd":"led","on":true},"confirm":true}`
	const path = "/v1/user/devices/{alice}/command-buttons"
	// buttons checks the ids, labels, payload texts and confirm flags of
	// the user's buttons, in order.
	buttons := func(who string, want ...string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			got := apiScalar(t, env, `SELECT COALESCE(group_concat(b.id || ' ' || b.label || ' ' || b.payload || ' ' || b.confirm, '; '), '')
				FROM (SELECT * FROM command_buttons ORDER BY seq) b JOIN devices d ON d.id = b.device_id WHERE d.uid = ?`, v[who])
			if w := strings.Join(want, "; "); got != w {
				t.Errorf("%s's buttons: got %q, want %q", who, got, w)
			}
		}
	}
	aliceOnly := buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`)
	create := func(name, body string, wantStatus int, wantBody string) apiCase {
		c := apiCase{name: name, method: "POST", path: path, token: "{alice_token}", body: body,
			wantStatus: wantStatus, wantBody: wantBody}
		if wantStatus != 201 {
			c.check = aliceOnly
		}
		return c
	}
	created := func(data string) string {
		return `{"message":"Command button created.","device_uid":"{alice}","data":` + data + `}`
	}
	idPattern := "The id field may only contain letters, digits, dots, underscores and dashes."
	id64 := strings.Repeat("a", 64)

	tests := []apiCase{
		// GET /v1/user/devices/{uid}/command-buttons
		{name: "list", method: "GET", path: path, token: "{alice_token}", wantStatus: 200, wantBody: `{"data":[` + aliceLED + `]}`},
		{name: "list as bob", method: "GET", path: "/v1/user/devices/{bob}/command-buttons", token: "{bob_token}", wantStatus: 200,
			wantBody: `{"data":[{"id":"led-on","label":"Bob's LED","payload":{"cmd":"bob"},"confirm":false},
				{"id":"bob-only","label":"Bob only","payload":{},"confirm":false}]}`},
		{name: "list empty", method: "GET", path: path, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				if err := env.st.deleteButton(context.Background(), apiDeviceID(t, env, env.alice), "led-on"); err != nil {
					t.Fatal(err)
				}
			},
			wantStatus: 200, wantBody: `{"data":[]}`},
		{name: "list bob's device", method: "GET", path: "/v1/user/devices/{bob}/command-buttons", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "list unknown device", method: "GET", path: "/v1/user/devices/esp32_nosuchdevice/command-buttons", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "list without token", method: "GET", path: path, wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/user/devices/{uid}/command-buttons
		{name: "create", method: "POST", path: path, token: "{alice_token}",
			body:       `{"id":"fan.high_2-X","label":"Fan high","payload":{"cmd":"fan","speed":3},"confirm":false}`,
			wantStatus: 201, wantBody: created(`{"id":"fan.high_2-X","label":"Fan high","payload":{"cmd":"fan","speed":3},"confirm":false}`),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `fan.high_2-X Fan high {"cmd":"fan","speed":3} 0`)},
		{name: "create with confirm", method: "POST", path: path, token: "{alice_token}",
			body:       `{"id":"reset","label":"Factory reset","payload":{"cmd":"factory_reset"},"confirm":true}`,
			wantStatus: 201, wantBody: created(`{"id":"reset","label":"Factory reset","payload":{"cmd":"factory_reset"},"confirm":true}`),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `reset Factory reset {"cmd":"factory_reset"} 1`)},
		{name: "create without confirm", method: "POST", path: path, token: "{alice_token}",
			body:       `{"id":"b","label":"B","payload":{}}`,
			wantStatus: 201, wantBody: created(`{"id":"b","label":"B","payload":{},"confirm":false}`),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `b B {} 0`)},
		{name: "create keeps the payload as sent", method: "POST", path: path, token: "{alice_token}",
			body:       `{"id":"raw","label":"Raw","payload":{ "z" : 1, "a" : {"b": [1, 2.50, "x", null]} }}`,
			wantStatus: 201, wantBody: created(`{"id":"raw","label":"Raw","payload":{"z":1,"a":{"b":[1,2.5,"x",null]}},"confirm":false}`),
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				if !strings.Contains(w.Body.String(), `"payload":{"z":1,"a":{"b":[1,2.50,"x",null]}}`) {
					t.Errorf("response payload not verbatim: %s", w.Body)
				}
				buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `raw Raw {"z":1,"a":{"b":[1,2.50,"x",null]}} 0`)(t, env, v, w)
			}},
		{name: "create id that bob uses", method: "POST", path: path, token: "{alice_token}",
			body:       `{"id":"bob-only","label":"Mine","payload":{"x":1}}`,
			wantStatus: 201, wantBody: created(`{"id":"bob-only","label":"Mine","payload":{"x":1},"confirm":false}`),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `bob-only Mine {"x":1} 0`)},
		{name: "create id of 64 characters", method: "POST", path: path, token: "{alice_token}",
			body:       fmt.Sprintf(`{"id":%q,"label":"L","payload":{}}`, id64),
			wantStatus: 201, wantBody: created(fmt.Sprintf(`{"id":%q,"label":"L","payload":{},"confirm":false}`, id64)),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, id64+` L {} 0`)},
		{name: "create label of 255 characters", method: "POST", path: path, token: "{alice_token}",
			body:       fmt.Sprintf(`{"id":"l","label":%q,"payload":{}}`, strings.Repeat("é", 255)),
			wantStatus: 201, wantBody: created(fmt.Sprintf(`{"id":"l","label":%q,"payload":{},"confirm":false}`, strings.Repeat("é", 255))),
			check: buttons("alice", `led-on LED on {"cmd":"led","on":true} 1`, `l `+strings.Repeat("é", 255)+` {} 0`)},
		{name: "create as bob", method: "POST", path: "/v1/user/devices/{bob}/command-buttons", token: "{bob_token}",
			body:       `{"id":"new","label":"New","payload":{"n":1}}`,
			wantStatus: 201, wantBody: `{"message":"Command button created.","device_uid":"{bob}","data":{"id":"new","label":"New","payload":{"n":1},"confirm":false}}`,
			check: buttons("bob", `led-on Bob's LED {"cmd":"bob"} 0`, `bob-only Bob only {} 0`, `new New {"n":1} 0`)},
		create("create duplicate id", `{"id":"led-on","label":"Again","payload":{}}`,
			422, `{"message":"A command button with this id already exists."}`),
		{name: "create on bob's device", method: "POST", path: "/v1/user/devices/{bob}/command-buttons", token: "{alice_token}",
			body: `{"id":"evil","label":"Evil","payload":{}}`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "create on unknown device", method: "POST", path: "/v1/user/devices/esp32_nosuchdevice/command-buttons", token: "{alice_token}",
			body: `{"id":"x","label":"X","payload":{}}`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "create without token", method: "POST", path: path, body: `{"id":"x","label":"X","payload":{}}`,
			wantStatus: 401, wantBody: apiUnauthenticated},
		create("create id missing", `{"label":"X","payload":{}}`, 422, apiFieldError("id", "The id field is required.")),
		create("create id empty", `{"id":"","label":"X","payload":{}}`, 422, apiFieldError("id", "The id field is required.")),
		create("create id of 65 characters", fmt.Sprintf(`{"id":%q,"label":"X","payload":{}}`, id64+"a"),
			422, apiFieldError("id", "The id field must not be greater than 64 characters.")),
		create("create id with a space", `{"id":"led on","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id dot", `{"id":".","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id dot dot", `{"id":"..","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id with a slash", `{"id":"a/b","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id with a non-ASCII letter", `{"id":"lëd","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id with a newline", `{"id":"led\n","label":"X","payload":{}}`, 422, apiFieldError("id", idPattern)),
		create("create id not a string", `{"id":7,"label":"X","payload":{}}`, 422, apiFieldError("id", "The id field must be a string.")),
		create("create label missing", `{"id":"x","payload":{}}`, 422, apiFieldError("label", "The label field is required.")),
		create("create label of 256 characters", fmt.Sprintf(`{"id":"x","label":%q,"payload":{}}`, strings.Repeat("l", 256)),
			422, apiFieldError("label", "The label field must not be greater than 255 characters.")),
		create("create payload missing", `{"id":"x","label":"X"}`, 422, apiFieldError("payload", "The payload field is required.")),
		create("create payload null", `{"id":"x","label":"X","payload":null}`, 422, apiFieldError("payload", "The payload field is required.")),
		create("create payload array", `{"id":"x","label":"X","payload":[{"cmd":"x"}]}`,
			422, apiFieldError("payload", "The payload field must be a JSON object.")),
		create("create payload string", `{"id":"x","label":"X","payload":"{\"cmd\":\"x\"}"}`,
			422, apiFieldError("payload", "The payload field must be a JSON object.")),
		create("create payload number", `{"id":"x","label":"X","payload":1}`,
			422, apiFieldError("payload", "The payload field must be a JSON object.")),
		create("create confirm not a boolean", `{"id":"x","label":"X","payload":{},"confirm":"yes"}`,
			422, apiFieldError("confirm", "The confirm field must be true or false.")),
		create("create everything missing", `{}`, 422, `{"message":"The id field is required. (and 2 more errors)",
			"errors":{"id":["The id field is required."],"label":["The label field is required."],"payload":["The payload field is required."]}}`),
		create("create malformed JSON", `{"id":"x","label":"X","payload":{}`, 422, apiBadJSON),
		create("create body over 64 KiB", apiSizedBody("label", maxJSONBody+1), 413, apiTooLarge),

		// DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}
		{name: "delete", method: "DELETE", path: path + "/led-on", token: "{alice_token}",
			wantStatus: 200, wantBody: `{"message":"Command button deleted.","device_uid":"{alice}"}`, check: buttons("alice")},
		{name: "delete as bob", method: "DELETE", path: "/v1/user/devices/{bob}/command-buttons/led-on", token: "{bob_token}",
			wantStatus: 200, wantBody: `{"message":"Command button deleted.","device_uid":"{bob}"}`,
			check: buttons("bob", `bob-only Bob only {} 0`)},
		{name: "delete unknown button", method: "DELETE", path: path + "/nope", token: "{alice_token}",
			wantStatus: 404, wantBody: `{"message":"Command button not found."}`, check: aliceOnly},
		{name: "delete bob's button id on own device", method: "DELETE", path: path + "/bob-only", token: "{alice_token}",
			wantStatus: 404, wantBody: `{"message":"Command button not found."}`, check: aliceOnly},
		{name: "delete on bob's device", method: "DELETE", path: "/v1/user/devices/{bob}/command-buttons/led-on", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "delete on unknown device", method: "DELETE", path: "/v1/user/devices/esp32_nosuchdevice/command-buttons/led-on", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "delete without token", method: "DELETE", path: path + "/led-on", wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "get one button", method: "GET", path: path + "/led-on", token: "{alice_token}",
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`},
	}
	runAPICases(t, fixture, tests)
}

// ---- firmwares ----

func TestFirmwaresAPI(t *testing.T) {
	aliceBytes := []byte("\xe9alice firmware 1.0\x00\x01\x02\xff")
	bobBytes := []byte("\xe9bob firmware 7\x00\xfe")
	newBytes := []byte("\xe9a new build\x00\x10\x20")
	maxBytes := bytes.Repeat([]byte{0xE9, 0x32, 0x00, 0x7F}, maxFirmwareSize/4)
	tooBig := append(bytes.Clone(maxBytes), 0x01)
	newMD5 := apiMD5(newBytes)

	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		v["a_fw"] = apiUploadOK(t, env, env.alice, map[string]string{"name": "alpha", "version": "1.0", "notes": "first build"}, aliceBytes)
		v["b_fw"] = apiUploadOK(t, env, env.bob, map[string]string{"name": "beta"}, bobBytes)
		v["a_md5"], v["b_md5"] = apiMD5(aliceBytes), apiMD5(bobBytes)
		v["a_MD5"], v["b_MD5"] = strings.ToUpper(v["a_md5"]), strings.ToUpper(v["b_md5"])
		v["a_size"], v["b_size"] = strconv.Itoa(len(aliceBytes)), strconv.Itoa(len(bobBytes))
		v["a_sha256"], v["b_sha256"] = sha256Hex(aliceBytes), sha256Hex(bobBytes)
	}
	alpha := func(isTarget bool) string {
		return apiFirmwareJSON("{a_fw}", "alpha", `"1.0"`, `"first build"`, "{a_md5}", "{a_sha256}", "{a_size}", isTarget)
	}
	beta := apiFirmwareJSON("{b_fw}", "beta", "null", "null", "{b_md5}", "{b_sha256}", "{b_size}", false)
	setTarget := func(t *testing.T, env *testEnv, v apiVars) { apiSetTarget(t, env, env.alice, v["a_md5"]) }

	// files checks the firmware rows of the user's device (name, version,
	// notes, md5, size) and that each has its file on disk, named by the
	// row's sha256, with the right bytes.
	files := func(who string, want ...string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			got := apiScalar(t, env, `SELECT COALESCE(group_concat(f.name || ' ' || COALESCE(f.version, '-') || ' ' || COALESCE(f.notes, '-')
				|| ' ' || f.md5 || ' ' || f.size, '; '), '')
				FROM (SELECT * FROM firmwares ORDER BY id) f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, v[who])
			if w := v.expand(strings.Join(want, "; ")); got != w {
				t.Errorf("%s's firmwares: got %q, want %q", who, got, w)
			}
			rows, err := env.st.db.Query(`SELECT f.md5, f.sha256, f.size FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, v[who])
			if err != nil {
				t.Fatal(err)
			}
			defer rows.Close()
			for rows.Next() {
				var sum, sha string
				var size int
				rows.Scan(&sum, &sha, &size)
				data, err := os.ReadFile(env.st.firmwarePath(sha))
				if err != nil {
					t.Errorf("file of firmware %s: %v", sum, err)
				} else if apiMD5(data) != sum || sha256Hex(data) != sha || len(data) != size {
					t.Errorf("file of firmware %s: md5 %s, sha256 %s, %d bytes; want sha256 %s, %d bytes",
						sum, apiMD5(data), sha256Hex(data), len(data), sha, size)
				}
			}
		}
	}
	// gone checks that no file with that sha256 is stored.
	gone := func(shaVar string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			sum := v.expand(shaVar)
			if _, err := os.Stat(env.st.firmwarePath(sum)); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("firmware file %s: got %v, want it removed", sum, err)
			}
		}
	}
	both := func(checks ...func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder)) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			for _, c := range checks {
				c(t, env, v, w)
			}
		}
	}
	aliceAlpha := files("alice", "alpha 1.0 first build {a_md5} {a_size}")
	bobBeta := files("bob", "beta - - {b_md5} {b_size}")
	// target checks the target firmware id of the user's device.
	target := func(who, want string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			apiWantDB(t, env, v.expand(want), `SELECT target_firmware_id FROM devices WHERE uid = ?`, v[who])
		}
	}

	const list = "/v1/user/devices/{alice}/firmwares"
	const one = list + "/{a_fw}"
	const setTargetPath = list + "/set-target"
	const notFound = `{"message":"Firmware not found."}`
	const md5NotFound = `{"message":"Firmware with the provided md5 was not found for this device."}`
	upload := func(name string, form map[string]string, file []byte, wantStatus int, wantBody string,
		check func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder)) apiCase {
		return apiCase{name: name, method: "POST", path: list, token: "{alice_token}", form: form, file: file,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	patch := func(name, ref, body string, wantStatus int, wantBody string,
		check func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder)) apiCase {
		return apiCase{name: name, method: "PATCH", path: list + "/" + ref, token: "{alice_token}", body: body,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	gamma := map[string]string{"name": "gamma", "version": "2.0", "notes": "faster"}
	uploaded := func(id, name, version, notes, sum, sha string, size int) string {
		return `{"data":` + apiFirmwareJSON(id, name, version, notes, sum, sha, strconv.Itoa(size), false) + `}`
	}

	tests := []apiCase{
		// GET /v1/user/devices/{uid}/firmwares
		{name: "list", method: "GET", path: list, token: "{alice_token}", wantStatus: 200, wantBody: `{"data":[` + alpha(false) + `]}`},
		{name: "list as bob", method: "GET", path: "/v1/user/devices/{bob}/firmwares", token: "{bob_token}",
			wantStatus: 200, wantBody: `{"data":[` + beta + `]}`},
		{name: "list newest first", method: "GET", path: list, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				v["new_fw"] = apiUploadOK(t, env, env.alice, map[string]string{"name": "gamma"}, newBytes)
			},
			wantStatus: 200, wantBody: `{"data":[` + apiFirmwareJSON("{new_fw}", "gamma", "null", "null", newMD5, sha256Hex(newBytes), strconv.Itoa(len(newBytes)), false) +
				`,` + alpha(false) + `]}`},
		{name: "list shows the target", method: "GET", path: list, token: "{alice_token}", setup: setTarget,
			wantStatus: 200, wantBody: `{"data":[` + alpha(true) + `]}`},
		{name: "list empty", method: "GET", path: list, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				if err := env.st.deleteFirmware(context.Background(), apiDeviceID(t, env, env.alice), v["a_fw"]); err != nil {
					t.Fatal(err)
				}
			},
			wantStatus: 200, wantBody: `{"data":[]}`},
		{name: "list bob's device", method: "GET", path: "/v1/user/devices/{bob}/firmwares", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "list unknown device", method: "GET", path: "/v1/user/devices/esp32_nosuchdevice/firmwares", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "list without token", method: "GET", path: list, wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/user/devices/{uid}/firmwares
		upload("upload", gamma, newBytes, 201, uploaded("3", "gamma", `"2.0"`, `"faster"`, newMD5, sha256Hex(newBytes), len(newBytes)),
			files("alice", "alpha 1.0 first build {a_md5} {a_size}", "gamma 2.0 faster "+newMD5+" "+strconv.Itoa(len(newBytes)))),
		upload("upload without version and notes", map[string]string{"name": "gamma"}, newBytes,
			201, uploaded("3", "gamma", "null", "null", newMD5, sha256Hex(newBytes), len(newBytes)),
			files("alice", "alpha 1.0 first build {a_md5} {a_size}", "gamma - - "+newMD5+" "+strconv.Itoa(len(newBytes)))),
		upload("upload with empty version and notes", map[string]string{"name": "gamma", "version": "", "notes": ""}, newBytes,
			201, uploaded("3", "gamma", "null", "null", newMD5, sha256Hex(newBytes), len(newBytes)), nil),
		upload("upload of exactly 4 MiB", map[string]string{"name": "max"}, maxBytes,
			201, uploaded("3", "max", "null", "null", apiMD5(maxBytes), sha256Hex(maxBytes), maxFirmwareSize),
			files("alice", "alpha 1.0 first build {a_md5} {a_size}", "max - - "+apiMD5(maxBytes)+" 4194304")),
		upload("upload of bob's bytes", map[string]string{"name": "copy"}, bobBytes,
			201, uploaded("3", "copy", "null", "null", apiMD5(bobBytes), sha256Hex(bobBytes), len(bobBytes)),
			both(files("alice", "alpha 1.0 first build {a_md5} {a_size}", "copy - - {b_md5} {b_size}"), bobBeta)),
		upload("upload notes of 2000 characters", map[string]string{"name": "n", "notes": strings.Repeat("n", 2000)}, newBytes,
			201, uploaded("3", "n", "null", apiJSON(strings.Repeat("n", 2000)), newMD5, sha256Hex(newBytes), len(newBytes)), nil),
		{name: "upload as bob", method: "POST", path: "/v1/user/devices/{bob}/firmwares", token: "{bob_token}",
			form: gamma, file: newBytes, wantStatus: 201,
			wantBody: uploaded("3", "gamma", `"2.0"`, `"faster"`, newMD5, sha256Hex(newBytes), len(newBytes)),
			check:    files("bob", "beta - - {b_md5} {b_size}", "gamma 2.0 faster "+newMD5+" "+strconv.Itoa(len(newBytes)))},
		upload("upload duplicate", map[string]string{"name": "again"}, aliceBytes,
			422, `{"message":"This firmware file is already uploaded."}`, aliceAlpha),
		upload("upload of 4 MiB and one byte", map[string]string{"name": "big"}, tooBig,
			422, apiFieldError("file", "The file field must not be greater than 4096 kilobytes."), both(aliceAlpha, gone(sha256Hex(tooBig)))),
		upload("upload empty file", map[string]string{"name": "empty"}, []byte{},
			422, apiFieldError("file", "The file field must not be empty."), aliceAlpha),
		upload("upload without file", map[string]string{"name": "nofile"}, nil,
			422, apiFieldError("file", "The file field is required."), aliceAlpha),
		upload("upload without name", map[string]string{"version": "2.0"}, newBytes,
			422, apiFieldError("name", "The name field is required."), both(aliceAlpha, gone(sha256Hex(newBytes)))),
		upload("upload blank name", map[string]string{"name": "  "}, newBytes,
			422, apiFieldError("name", "The name field is required."), aliceAlpha),
		upload("upload without name and file", map[string]string{"notes": "x"}, nil, 422,
			`{"message":"The name field is required. (and 1 more error)","errors":{"name":["The name field is required."],"file":["The file field is required."]}}`,
			aliceAlpha),
		upload("upload name of 256 characters", map[string]string{"name": strings.Repeat("n", 256)}, newBytes,
			422, apiFieldError("name", "The name field must not be greater than 255 characters."), aliceAlpha),
		upload("upload version of 256 characters", map[string]string{"name": "n", "version": strings.Repeat("v", 256)}, newBytes,
			422, apiFieldError("version", "The version field must not be greater than 255 characters."), aliceAlpha),
		upload("upload notes of 2001 characters", map[string]string{"name": "n", "notes": strings.Repeat("n", 2001)}, newBytes,
			422, apiFieldError("notes", "The notes field must not be greater than 2000 characters."), aliceAlpha),
		{name: "upload as JSON", method: "POST", path: list, token: "{alice_token}", body: `{"name":"json"}`,
			wantStatus: 422, wantBody: apiFieldError("file", "The file field is required."), check: aliceAlpha},
		{name: "upload to bob's device", method: "POST", path: "/v1/user/devices/{bob}/firmwares", token: "{alice_token}",
			form: gamma, file: newBytes, wantStatus: 404, wantBody: apiDeviceNotFound, check: both(bobBeta, gone(sha256Hex(newBytes)))},
		{name: "upload to unknown device", method: "POST", path: "/v1/user/devices/esp32_nosuchdevice/firmwares", token: "{alice_token}",
			form: gamma, file: newBytes, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "upload without token", method: "POST", path: list, form: gamma, file: newBytes,
			wantStatus: 401, wantBody: apiUnauthenticated},

		// PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}
		patch("patch by id", "{a_fw}", `{"name":"alpha 2","version":"1.1","notes":"fixed"}`, 200,
			`{"data":`+apiFirmwareJSON("{a_fw}", "alpha 2", `"1.1"`, `"fixed"`, "{a_md5}", "{a_sha256}", "{a_size}", false)+`}`,
			files("alice", "alpha 2 1.1 fixed {a_md5} {a_size}")),
		patch("patch by md5", "{a_md5}", `{"name":"by md5"}`, 200,
			`{"data":`+apiFirmwareJSON("{a_fw}", "by md5", `"1.0"`, `"first build"`, "{a_md5}", "{a_sha256}", "{a_size}", false)+`}`,
			files("alice", "by md5 1.0 first build {a_md5} {a_size}")),
		patch("patch by upper-case md5", "{a_MD5}", `{"version":"1.0.1"}`, 200,
			`{"data":`+apiFirmwareJSON("{a_fw}", "alpha", `"1.0.1"`, `"first build"`, "{a_md5}", "{a_sha256}", "{a_size}", false)+`}`,
			files("alice", "alpha 1.0.1 first build {a_md5} {a_size}")),
		patch("patch clears version and notes", "{a_fw}", `{"version":null,"notes":""}`, 200,
			`{"data":`+apiFirmwareJSON("{a_fw}", "alpha", "null", "null", "{a_md5}", "{a_sha256}", "{a_size}", false)+`}`,
			files("alice", "alpha - - {a_md5} {a_size}")),
		patch("patch empty object", "{a_fw}", `{}`, 200, `{"data":`+alpha(false)+`}`, aliceAlpha),
		{name: "patch the target", method: "PATCH", path: one, token: "{alice_token}", setup: setTarget, body: `{"name":"live"}`,
			wantStatus: 200, wantBody: `{"data":` + apiFirmwareJSON("{a_fw}", "live", `"1.0"`, `"first build"`, "{a_md5}", "{a_sha256}", "{a_size}", true) + `}`},
		{name: "patch as bob", method: "PATCH", path: "/v1/user/devices/{bob}/firmwares/{b_fw}", token: "{bob_token}",
			body:       `{"notes":"bob's notes"}`,
			wantStatus: 200, wantBody: `{"data":` + apiFirmwareJSON("{b_fw}", "beta", "null", `"bob's notes"`, "{b_md5}", "{b_sha256}", "{b_size}", false) + `}`,
			check: files("bob", "beta - bob's notes {b_md5} {b_size}")},
		patch("patch bob's firmware id", "{b_fw}", `{"name":"stolen"}`, 404, notFound, bobBeta),
		patch("patch bob's firmware md5", "{b_md5}", `{"name":"stolen"}`, 404, notFound, bobBeta),
		{name: "patch on bob's device", method: "PATCH", path: "/v1/user/devices/{bob}/firmwares/{b_fw}", token: "{alice_token}",
			body: `{"name":"stolen"}`, wantStatus: 404, wantBody: apiDeviceNotFound, check: bobBeta},
		patch("patch unknown id", "999", `{"name":"x"}`, 404, notFound, aliceAlpha),
		patch("patch unknown md5", newMD5, `{"name":"x"}`, 404, notFound, aliceAlpha),
		patch("patch id zero", "0", `{"name":"x"}`, 404, notFound, aliceAlpha),
		patch("patch not an id", "alpha", `{"name":"x"}`, 404, notFound, aliceAlpha),
		{name: "patch without token", method: "PATCH", path: one, body: `{"name":"x"}`, wantStatus: 401, wantBody: apiUnauthenticated},
		patch("patch name empty", "{a_fw}", `{"name":""}`, 422, apiFieldError("name", "The name field is required."), aliceAlpha),
		patch("patch name null", "{a_fw}", `{"name":null}`, 422, apiFieldError("name", "The name field is required."), aliceAlpha),
		patch("patch name of 256 characters", "{a_fw}", apiField("name", strings.Repeat("n", 256)),
			422, apiFieldError("name", "The name field must not be greater than 255 characters."), aliceAlpha),
		patch("patch notes of 2001 characters", "{a_fw}", apiField("notes", strings.Repeat("n", 2001)),
			422, apiFieldError("notes", "The notes field must not be greater than 2000 characters."), aliceAlpha),
		patch("patch version not a string", "{a_fw}", `{"version":1.1}`, 422, apiFieldError("version", "The version field must be a string."), aliceAlpha),
		patch("patch malformed JSON", "{a_fw}", `{"name":`, 422, apiBadJSON, aliceAlpha),
		patch("patch body over 64 KiB", "{a_fw}", apiSizedBody("notes", maxJSONBody+1), 413, apiTooLarge, aliceAlpha),

		// DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}
		{name: "delete by id", method: "DELETE", path: one, token: "{alice_token}",
			wantStatus: 200, wantBody: `{"message":"Firmware deleted."}`, check: both(files("alice"), gone("{a_sha256}"))},
		{name: "delete by md5", method: "DELETE", path: list + "/{a_md5}", token: "{alice_token}",
			wantStatus: 200, wantBody: `{"message":"Firmware deleted."}`, check: both(files("alice"), gone("{a_sha256}"))},
		{name: "delete by upper-case md5", method: "DELETE", path: list + "/{a_MD5}", token: "{alice_token}",
			wantStatus: 200, wantBody: `{"message":"Firmware deleted."}`, check: both(files("alice"), gone("{a_sha256}"))},
		{name: "delete as bob", method: "DELETE", path: "/v1/user/devices/{bob}/firmwares/{b_fw}", token: "{bob_token}",
			wantStatus: 200, wantBody: `{"message":"Firmware deleted."}`, check: both(files("bob"), gone("{b_sha256}"), aliceAlpha)},
		{name: "delete keeps a file bob's firmware shares", method: "DELETE", path: one, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				apiUploadOK(t, env, env.bob, map[string]string{"name": "alice's copy"}, aliceBytes)
			},
			wantStatus: 200, wantBody: `{"message":"Firmware deleted."}`,
			check: both(files("alice"), files("bob", "beta - - {b_md5} {b_size}", "alice's copy - - {a_md5} {a_size}"))},
		{name: "delete the target", method: "DELETE", path: one, token: "{alice_token}", setup: setTarget,
			wantStatus: 422, wantBody: `{"message":"Cannot delete firmware while it is assigned to any device."}`,
			check: both(aliceAlpha, target("alice", "{a_fw}"))},
		{name: "delete the target by md5", method: "DELETE", path: list + "/{a_MD5}", token: "{alice_token}", setup: setTarget,
			wantStatus: 422, wantBody: `{"message":"Cannot delete firmware while it is assigned to any device."}`, check: aliceAlpha},
		{name: "delete bob's firmware id", method: "DELETE", path: list + "/{b_fw}", token: "{alice_token}",
			wantStatus: 404, wantBody: notFound, check: bobBeta},
		{name: "delete bob's firmware md5", method: "DELETE", path: list + "/{b_md5}", token: "{alice_token}",
			wantStatus: 404, wantBody: notFound, check: bobBeta},
		{name: "delete on bob's device", method: "DELETE", path: "/v1/user/devices/{bob}/firmwares/{b_fw}", token: "{alice_token}",
			wantStatus: 404, wantBody: apiDeviceNotFound, check: bobBeta},
		{name: "delete unknown id", method: "DELETE", path: list + "/999", token: "{alice_token}",
			wantStatus: 404, wantBody: notFound, check: aliceAlpha},
		{name: "delete without token", method: "DELETE", path: one, wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/user/devices/{uid}/firmwares/set-target
		{name: "set-target", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"{a_md5}"}`,
			wantStatus: 200, wantBody: `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"{a_md5}"}`,
			check: func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
				target("alice", "{a_fw}")(t, env, v, w)
				r := env.request("GET", v.expand("/v1/user/devices/{alice}"), env.alice.token, nil)
				got, _ := json.Marshal(decode(t, r)["data"].(map[string]any)["target_firmware"])
				want := v.expand(`{"id":{a_fw},"name":"alpha","version":"1.0","notes":"first build","md5":"{a_md5}","sha256":"{a_sha256}","size":{a_size},"created_at":"{now}"}`)
				if !jsonEqual(t, got, []byte(want)) {
					t.Errorf("target_firmware: got %s, want %s", got, want)
				}
			}},
		{name: "set-target upper-case md5", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"{a_MD5}"}`,
			wantStatus: 200, wantBody: `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"{a_md5}"}`,
			check: target("alice", "{a_fw}")},
		{name: "set-target replaces the target", method: "POST", path: setTargetPath, token: "{alice_token}",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				v["new_fw"] = apiUploadOK(t, env, env.alice, map[string]string{"name": "gamma"}, newBytes)
				setTarget(t, env, v)
			},
			body:       `{"md5":"` + newMD5 + `"}`,
			wantStatus: 200, wantBody: `{"message":"Firmware assigned to device.","device_uid":"{alice}","md5":"` + newMD5 + `"}`,
			check: target("alice", "{new_fw}")},
		{name: "set-target as bob", method: "POST", path: "/v1/user/devices/{bob}/firmwares/set-target", token: "{bob_token}",
			body:       `{"md5":"{b_md5}"}`,
			wantStatus: 200, wantBody: `{"message":"Firmware assigned to device.","device_uid":"{bob}","md5":"{b_md5}"}`,
			check: both(target("bob", "{b_fw}"), target("alice", "<nil>"))},
		{name: "set-target unknown md5", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"` + newMD5 + `"}`,
			wantStatus: 422, wantBody: md5NotFound, check: target("alice", "<nil>")},
		{name: "set-target bob's md5", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"{b_md5}"}`,
			wantStatus: 422, wantBody: md5NotFound, check: target("alice", "<nil>")},
		{name: "set-target not an md5", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"alpha"}`,
			wantStatus: 422, wantBody: md5NotFound},
		{name: "set-target firmware id instead of md5", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"{a_fw}"}`,
			wantStatus: 422, wantBody: md5NotFound},
		{name: "set-target on bob's device", method: "POST", path: "/v1/user/devices/{bob}/firmwares/set-target", token: "{alice_token}",
			body: `{"md5":"{b_md5}"}`, wantStatus: 404, wantBody: apiDeviceNotFound, check: target("bob", "<nil>")},
		{name: "set-target on unknown device", method: "POST", path: "/v1/user/devices/esp32_nosuchdevice/firmwares/set-target", token: "{alice_token}",
			body: `{"md5":"{a_md5}"}`, wantStatus: 404, wantBody: apiDeviceNotFound},
		{name: "set-target without token", method: "POST", path: setTargetPath, body: `{"md5":"{a_md5}"}`,
			wantStatus: 401, wantBody: apiUnauthenticated},
		{name: "set-target md5 missing", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{}`,
			wantStatus: 422, wantBody: apiFieldError("md5", "The md5 field is required.")},
		{name: "set-target md5 not a string", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":123}`,
			wantStatus: 422, wantBody: apiFieldError("md5", "The md5 field must be a string.")},
		{name: "set-target malformed JSON", method: "POST", path: setTargetPath, token: "{alice_token}", body: `{"md5":"{a_md5}"`,
			wantStatus: 422, wantBody: apiBadJSON},
		{name: "set-target body over 64 KiB", method: "POST", path: setTargetPath, token: "{alice_token}",
			body: apiSizedBody("md5", maxJSONBody+1), wantStatus: 413, wantBody: apiTooLarge},
		{name: "set-target with GET", method: "GET", path: setTargetPath, token: "{alice_token}",
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`},
	}
	runAPICases(t, fixture, tests)
}

// TestFirmwareSharedFile: two devices of one user with the same bytes
// share one file, which goes only with the last row.
func TestFirmwareSharedFile(t *testing.T) {
	env := newTestEnv(t, nil)
	ctx := context.Background()
	uid2, err := env.st.createDevice(ctx, env.alice.email, "esp32", "devkit", "Second", 1883)
	if err != nil {
		t.Fatal(err)
	}
	second := env.alice
	second.device = uid2
	content := []byte("\xe9shared firmware bytes\x00\x01")
	sum := apiMD5(content)
	path := env.st.firmwarePath(sha256Hex(content))
	fileIs := func(when string, want []byte) {
		t.Helper()
		got, err := os.ReadFile(path)
		switch {
		case want == nil && !errors.Is(err, fs.ErrNotExist):
			t.Errorf("%s: file %s: got %v, want it removed", when, path, err)
		case want != nil && err != nil:
			t.Errorf("%s: file %s: %v", when, path, err)
		case want != nil && !bytes.Equal(got, want):
			t.Errorf("%s: file has %d bytes, want the %d uploaded", when, len(got), len(want))
		}
	}
	id1 := apiUploadOK(t, env, env.alice, map[string]string{"name": "one"}, content)
	fileIs("after the first upload", content)
	id2 := apiUploadOK(t, env, second, map[string]string{"name": "two"}, content)
	fileIs("after the second upload", content)
	if id1 == id2 {
		t.Fatalf("both uploads got id %s", id1)
	}

	w := env.request("DELETE", "/v1/user/devices/"+env.alice.device+"/firmwares/"+id1, env.alice.token, nil)
	apiCheckResponse(t, w, 200, `{"message":"Firmware deleted."}`)
	fileIs("after deleting the first row", content)
	apiWantDB(t, env, "1", `SELECT count(*) FROM firmwares WHERE md5 = ?`, sum)

	w = env.request("DELETE", "/v1/user/devices/"+uid2+"/firmwares/"+sum, env.alice.token, nil)
	apiCheckResponse(t, w, 200, `{"message":"Firmware deleted."}`)
	fileIs("after deleting the last row", nil)
	apiWantDB(t, env, "0", `SELECT count(*) FROM firmwares WHERE md5 = ?`, sum)

	// Uploading the bytes again stores them again.
	apiUploadOK(t, env, env.alice, map[string]string{"name": "again"}, content)
	fileIs("after uploading again", content)
}

// TestFirmwareTargetFlow walks the spec's firmware flow: upload, keep the
// md5, assign, and delete only what is not assigned.
func TestFirmwareTargetFlow(t *testing.T) {
	env := newTestEnv(t, nil)
	a := env.alice
	base := "/v1/user/devices/" + a.device + "/firmwares"
	one, two := []byte("\xe9build one"), []byte("\xe9build two")
	id1 := apiUploadOK(t, env, a, map[string]string{"name": "one"}, one)
	id2 := apiUploadOK(t, env, a, map[string]string{"name": "two"}, two)

	w := env.request("POST", base+"/set-target", a.token, map[string]string{"md5": apiMD5(one)})
	apiCheckResponse(t, w, 200, fmt.Sprintf(`{"message":"Firmware assigned to device.","device_uid":%q,"md5":%q}`, a.device, apiMD5(one)))
	w = env.request("DELETE", base+"/"+id1, a.token, nil)
	apiCheckResponse(t, w, 422, `{"message":"Cannot delete firmware while it is assigned to any device."}`)

	w = env.request("POST", base+"/set-target", a.token, map[string]string{"md5": apiMD5(two)})
	apiCheckResponse(t, w, 200, "")
	w = env.request("DELETE", base+"/"+id1, a.token, nil)
	apiCheckResponse(t, w, 200, `{"message":"Firmware deleted."}`)
	w = env.request("DELETE", base+"/"+id2, a.token, nil)
	apiCheckResponse(t, w, 422, `{"message":"Cannot delete firmware while it is assigned to any device."}`)

	w = env.request("GET", base, a.token, nil)
	want := `{"data":[` + apiFirmwareJSON(id2, "two", "null", "null", apiMD5(two), sha256Hex(two), "10", true) + `]}`
	apiCheckResponse(t, w, 200, strings.ReplaceAll(want, "{now}", apiNow))
	if _, err := os.Stat(env.st.firmwarePath(sha256Hex(one))); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("file of the deleted firmware: got %v, want it removed", err)
	}
}

// ---- commands without a broker ----

// apiDownLink is a device link whose broker connection is down. It counts
// publish calls, which must not happen.
type apiDownLink struct{ published atomic.Int64 }

func (l *apiDownLink) connected() bool { return false }

func (l *apiDownLink) publish(uid, _ string, payload []byte) error {
	l.published.Add(1)
	return errors.New("not connected")
}

// TestCommandsWithoutBroker: the command endpoints answer in the order
// 404 (device, then button) → 422 body → 422 no OTA target → 422 device
// not online → 503 no broker connection, and never 200 without a broker.
func TestCommandsWithoutBroker(t *testing.T) {
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		for _, u := range []testUser{env.alice, env.bob} {
			b := commandButton{ID: "led", Label: "LED", Payload: json.RawMessage(`{"cmd":"led"}`)}
			if err := env.st.createButton(context.Background(), apiDeviceID(t, env, u), b); err != nil {
				t.Fatal(err)
			}
		}
		if err := env.st.createButton(context.Background(), apiDeviceID(t, env, env.bob),
			commandButton{ID: "bob-only", Label: "B", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
		v["a_md5"] = apiMD5([]byte("\xe9alice ota"))
		v["b_md5"] = apiMD5([]byte("\xe9bob ota"))
		apiUploadOK(t, env, env.alice, map[string]string{"name": "a"}, []byte("\xe9alice ota"))
		apiUploadOK(t, env, env.bob, map[string]string{"name": "b"}, []byte("\xe9bob ota"))
	}
	type setupFunc = func(*testing.T, *testEnv, apiVars)
	status := func(who, s string) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) { env.setStatus(v[who], s) }
	}
	targets := func(t *testing.T, env *testEnv, v apiVars) {
		apiSetTarget(t, env, env.alice, v["a_md5"])
		apiSetTarget(t, env, env.bob, v["b_md5"])
	}
	downLink := func(t *testing.T, env *testEnv, v apiVars) { env.srv.link = &apiDownLink{} }
	all := func(fs ...setupFunc) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			for _, f := range fs {
				if f != nil {
					f(t, env, v)
				}
			}
		}
	}
	nothingPublished := func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
		if n := env.srv.link.(*apiDownLink).published.Load(); n != 0 {
			t.Errorf("publish called %d times, want 0", n)
		}
	}
	const offline = `{"message":"Device is offline."}`
	const reconnecting = `{"message":"Device is reconnecting."}`
	const unavailable = `{"message":"The device link is unavailable. Try again later."}`
	const assignFirst = `{"message":"Assign firmware first to trigger OTA."}`
	const buttonNotFound = `{"message":"Command button not found."}`

	endpoints := []struct {
		name, path, body string
		ready            setupFunc // what the request needs besides an online device, for alice and bob
	}{
		{"reboot", "/reboot", "", nil},
		{"wifi-reset", "/wifi-reset", "", nil},
		{"ota", "/ota", "", targets},
		{"commands", "/commands", `{"payload":{"cmd":"blink","times":3}}`, nil},
		{"button send", "/command-buttons/led/send", "", nil},
	}
	var tests []apiCase
	for _, ep := range endpoints {
		c := func(name, who, token string, setup setupFunc, wantStatus int, wantBody string) apiCase {
			return apiCase{name: ep.name + ": " + name, setup: all(ep.ready, setup), method: "POST",
				path: "/v1/user/devices/" + who + ep.path, token: token, body: ep.body, wantStatus: wantStatus, wantBody: wantBody}
		}
		down := c("online, broker connection down", "{alice}", "{alice_token}", all(status("alice", "online"), downLink), 503, unavailable)
		down.check = nothingPublished
		tests = append(tests,
			c("bob's online device", "{bob}", "{alice_token}", status("bob", "online"), 404, apiDeviceNotFound),
			c("unknown device", "esp32_nosuchdevice", "{alice_token}", nil, 404, apiDeviceNotFound),
			c("without token", "{alice}", "", status("alice", "online"), 401, apiUnauthenticated),
			c("bob's token on alice's device", "{alice}", "{bob_token}", status("alice", "online"), 404, apiDeviceNotFound),
			c("pending device", "{alice}", "{alice_token}", nil, 422, offline),
			c("offline device", "{alice}", "{alice_token}", status("alice", "offline"), 422, offline),
			c("reconnecting device", "{alice}", "{alice_token}", status("alice", "reconnecting"), 422, reconnecting),
			c("online, no broker", "{alice}", "{alice_token}", status("alice", "online"), 503, unavailable),
			c("bob online, no broker", "{bob}", "{bob_token}", status("bob", "online"), 503, unavailable),
			c("unknown status word", "{alice}", "{alice_token}", status("alice", "sleeping"), 422, offline),
			down,
		)
	}
	commands := func(name, who, body string, setup setupFunc, wantStatus int, wantBody string) apiCase {
		return apiCase{name: "commands: " + name, setup: setup, method: "POST", path: "/v1/user/devices/" + who + "/commands",
			token: "{alice_token}", body: body, wantStatus: wantStatus, wantBody: wantBody}
	}
	ota := func(name, who string, setup setupFunc, wantStatus int, wantBody string) apiCase {
		return apiCase{name: "ota: " + name, setup: setup, method: "POST", path: "/v1/user/devices/" + who + "/ota",
			token: "{alice_token}", wantStatus: wantStatus, wantBody: wantBody}
	}
	send := func(name, who, button string, setup setupFunc, wantStatus int, wantBody string) apiCase {
		return apiCase{name: "button send: " + name, setup: setup, method: "POST",
			path:  "/v1/user/devices/" + who + "/command-buttons/" + button + "/send",
			token: "{alice_token}", wantStatus: wantStatus, wantBody: wantBody}
	}
	online := status("alice", "online")
	tests = append(tests,
		commands("payload array", "{alice}", `{"payload":["reboot"]}`, online, 422, apiFieldError("payload", "The payload field must be a JSON object.")),
		commands("payload string", "{alice}", `{"payload":"reboot"}`, online, 422, apiFieldError("payload", "The payload field must be a JSON object.")),
		commands("payload missing", "{alice}", `{"cmd":"reboot"}`, online, 422, apiFieldError("payload", "The payload field is required.")),
		commands("no body", "{alice}", "", online, 422, apiFieldError("payload", "The payload field is required.")),
		commands("malformed JSON", "{alice}", `{"payload":{}`, online, 422, apiBadJSON),
		commands("body over 64 KiB", "{alice}", apiSizedBody("payload", maxJSONBody+1), online, 413, apiTooLarge),
		commands("invalid payload to an offline device", "{alice}", `{"payload":1}`, status("alice", "offline"),
			422, apiFieldError("payload", "The payload field must be a JSON object.")),
		commands("invalid payload to bob's device", "{bob}", `{"payload":1}`, status("bob", "online"), 404, apiDeviceNotFound),
		ota("no target, online", "{alice}", online, 422, assignFirst),
		ota("no target, offline", "{alice}", status("alice", "offline"), 422, assignFirst),
		ota("no target, pending", "{alice}", nil, 422, assignFirst),
		ota("no target, bob's device", "{bob}", status("bob", "online"), 404, apiDeviceNotFound),
		ota("only bob has a target", "{alice}", all(online, func(t *testing.T, env *testEnv, v apiVars) {
			apiSetTarget(t, env, env.bob, v["b_md5"])
		}), 422, assignFirst),
		send("unknown button", "{alice}", "nope", online, 404, buttonNotFound),
		send("bob's button id", "{alice}", "bob-only", online, 404, buttonNotFound),
		send("unknown button, offline device", "{alice}", "nope", status("alice", "offline"), 404, buttonNotFound),
		send("unknown button, bob's device", "{bob}", "nope", status("bob", "online"), 404, apiDeviceNotFound),
		apiCase{name: "reboot with GET", method: "GET", path: "/v1/user/devices/{alice}/reboot", token: "{alice_token}",
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`},
	)
	runAPICases(t, fixture, tests)
}

// ---- routing ----

func TestRouting(t *testing.T) {
	const notFound = `{"message":"Not found."}`
	const notAllowed = `{"message":"Method not allowed."}`
	allow := func(want string) func(*testing.T, *testEnv, apiVars, *httptest.ResponseRecorder) {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			if got := w.Header().Get("Allow"); got != want {
				t.Errorf("Allow: got %q, want %q", got, want)
			}
		}
	}
	tests := []apiCase{
		{name: "unknown route", method: "GET", path: "/v1/nope", wantStatus: 404, wantBody: notFound},
		{name: "unknown route with token", method: "GET", path: "/v1/nope", token: "{alice_token}", wantStatus: 404, wantBody: notFound},
		{name: "unknown route without version", method: "GET", path: "/user/devices", token: "{alice_token}", wantStatus: 404, wantBody: notFound},
		{name: "unknown device sub-route", method: "POST", path: "/v1/user/devices/{alice}/selfdestruct", token: "{alice_token}",
			wantStatus: 404, wantBody: notFound},
		{name: "POST to a GET route", method: "POST", path: "/v1/auth/me", token: "{alice_token}", wantStatus: 405, wantBody: notAllowed,
			check: allow("GET")},
		{name: "GET to a POST route", method: "GET", path: "/v1/auth/login", wantStatus: 405, wantBody: notAllowed, check: allow("POST")},
		{name: "DELETE a device", method: "DELETE", path: "/v1/user/devices/{alice}", token: "{alice_token}", wantStatus: 405, wantBody: notAllowed,
			check: allow("GET, PATCH")},
		{name: "POST the device list", method: "POST", path: "/v1/user/devices", token: "{alice_token}", body: `{}`,
			wantStatus: 405, wantBody: notAllowed},
		{name: "PUT a firmware", method: "PUT", path: "/v1/user/devices/{alice}/firmwares/1", token: "{alice_token}",
			wantStatus: 405, wantBody: notAllowed, check: allow("PATCH, DELETE")},
		{name: "device list with a trailing slash", method: "GET", path: "/v1/user/devices/", token: "{alice_token}",
			wantStatus: 404, wantBody: notFound},
		{name: "health", method: "GET", path: "/healthz", wantStatus: 200, wantBody: `{"status":"ok","mqtt":"disconnected"}`},
		{name: "health with the broker connection down", method: "GET", path: "/healthz",
			setup:      func(t *testing.T, env *testEnv, v apiVars) { env.srv.link = &apiDownLink{} },
			wantStatus: 200, wantBody: `{"status":"ok","mqtt":"disconnected"}`},
	}
	runAPICases(t, nil, tests)
}

// TestNonCanonicalPaths: a path the router cleans (double slash, dot
// segments) is redirected to its clean form or refused, and like every
// response (README: API) the answer has a JSON body.
func TestNonCanonicalPaths(t *testing.T) {
	env := newTestEnv(t, nil)
	uid := env.alice.device
	tests := []struct {
		name, method, path, clean string
	}{
		{"double slash", "GET", "/v1//auth/me", "/v1/auth/me"},
		{"dot segment", "GET", "/v1/./user/devices", "/v1/user/devices"},
		{"dot-dot segment", "POST", "/v1/user/devices/" + uid + "/command-buttons/../reboot", "/v1/user/devices/" + uid + "/reboot"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := apiState(t, env)
			w := env.request(tt.method, tt.path, env.alice.token, nil)
			switch w.Code {
			case 301, 302, 307, 308:
				if got := w.Header().Get("Location"); got != tt.clean {
					t.Errorf("Location: got %q, want %q", got, tt.clean)
				}
			case 404:
			default:
				t.Errorf("status: got %d, want a redirect to %s or 404", w.Code, tt.clean)
			}
			apiCheckResponse(t, w, w.Code, "")
			if m, ok := decodeIfJSON(w.Body.Bytes())["message"].(string); !ok || m == "" {
				t.Errorf("body %q has no message", w.Body)
			}
			apiSameState(t, "a non-canonical path", before, apiState(t, env))
		})
	}
}

// decodeIfJSON is the JSON object in b, or nil.
func decodeIfJSON(b []byte) map[string]any {
	var v map[string]any
	json.Unmarshal(b, &v)
	return v
}
