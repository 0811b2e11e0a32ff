package main

// Table tests of the token endpoints (README: API tokens) through the real router,
// in the style of api_test.go: each case on a fresh testEnv, the exact
// body, the database afterwards, and the other user's rows untouched.

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestTokensAPI(t *testing.T) {
	// fixture: alice has a second token, "phone", made a minute after
	// her first ("test") and used then ({later}); bob has his one token.
	// The requests come two minutes later ({now}).
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		env.clock.advance(time.Minute)
		_, phone, err := issueToken(t.Context(), env.st, env.alice.id, "phone", false)
		must(t, err)
		apiWantStatus(t, env, "GET", "/v1/auth/me", phone, 200) // used, and now in the read cache
		v["phone"] = phone
		v["phone_id"], _, _ = strings.Cut(phone, "|")
		v["later"] = env.clock.now().Format(timeFormat)
		env.clock.advance(2 * time.Minute) // past tokenTouchInterval: the next use is recorded
		v["now"] = env.clock.now().Format(timeFormat)
	}
	const tokenNotFound = `{"message":"Token not found."}`
	const deleted = `{"message":"Token deleted."}`
	aliceFirst := `{"id":{alice_token_id},"name":"test","last_used_at":"{now}","created_at":"` + apiNow + `","current":true}`
	alicePhone := `{"id":{phone_id},"name":"phone","last_used_at":"{later}","created_at":"{later}","current":false}`
	// tokens checks the ids of the user's tokens, oldest first.
	tokens := func(user string, want ...string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			for i := range want {
				want[i] = v.expand(want[i])
			}
			wantDB(t, env.st, strings.Join(want, ","), `SELECT COALESCE(group_concat(id), '') FROM (SELECT id FROM tokens WHERE user_id = ? ORDER BY id)`, v[user+"_id"])
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
		{name: "list", method: "GET", path: path, token: "{alice_token}",
			wantStatus: 200, wantBody: `{"data":[` + aliceFirst + `,` + alicePhone + `]}`},
		{name: "list with the other token", method: "GET", path: path, token: "{phone}", wantStatus: 200,
			wantBody: `{"data":[{"id":{alice_token_id},"name":"test","last_used_at":null,"created_at":"` + apiNow + `","current":false},
				{"id":{phone_id},"name":"phone","last_used_at":"{now}","created_at":"{later}","current":true}]}`},
		{name: "list as bob", method: "GET", path: path, token: "{bob_token}", wantStatus: 200,
			wantBody: `{"data":[{"id":{bob_token_id},"name":"test","last_used_at":"{now}","created_at":"` + apiNow + `","current":true}]}`},
		{name: "list without token", method: "GET", path: path, wantStatus: 401, wantBody: apiUnauthenticated},

		// POST /v1/user/tokens
		{name: "create", method: "POST", path: path, token: "{alice_token}", body: `{"name":"CI runner"}`,
			wantStatus: 201, check: created("CI runner")},
		{name: "create with a long name", method: "POST", path: path, token: "{alice_token}", body: apiField("name", strings.Repeat("é", 255)),
			wantStatus: 201, check: created(strings.Repeat("é", 255))},
		{name: "create without name", method: "POST", path: path, token: "{alice_token}", body: `{}`,
			wantStatus: 422, wantBody: apiFieldError("name", "The name field is required.")},
		{name: "create without body", method: "POST", path: path, token: "{alice_token}",
			wantStatus: 422, wantBody: apiFieldError("name", "The name field is required.")},
		{name: "create with a blank name", method: "POST", path: path, token: "{alice_token}", body: `{"name":"  "}`,
			wantStatus: 422, wantBody: apiFieldError("name", "The name field is required.")},
		{name: "create with a name too long", method: "POST", path: path, token: "{alice_token}", body: apiField("name", strings.Repeat("x", 256)),
			wantStatus: 422, wantBody: apiFieldError("name", "The name field must not be greater than 255 characters.")},
		{name: "create with a name not a string", method: "POST", path: path, token: "{alice_token}", body: `{"name":7}`,
			wantStatus: 422, wantBody: apiFieldError("name", "The name field must be a string.")},
		{name: "create with a name not UTF-8", method: "POST", path: path, token: "{alice_token}", body: "{\"name\":\"\xff\"}",
			wantStatus: 422, wantBody: apiFieldError("name", "The name field must be valid UTF-8.")},
		{name: "create with malformed JSON", method: "POST", path: path, token: "{alice_token}", body: `{"name":`,
			wantStatus: 422, wantBody: apiBadJSON},
		{name: "create at the token limit",
			setup:  func(t *testing.T, env *testEnv, v apiVars) { env.st.limits.tokens = 2 },
			method: "POST", path: path, token: "{alice_token}", body: `{"name":"third"}`,
			wantStatus: 422, wantBody: `{"message":"You have reached the limit of 2 tokens. Delete a token first."}`},
		{name: "create under the token limit",
			setup:  func(t *testing.T, env *testEnv, v apiVars) { env.st.limits.tokens = 3 },
			method: "POST", path: path, token: "{alice_token}", body: `{"name":"third"}`,
			wantStatus: 201, check: created("third")},
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
		{name: "wrong method", method: "PATCH", path: path + "/{phone_id}", token: "{alice_token}",
			wantStatus: 405, wantBody: `{"message":"Method not allowed."}`, check: allowIs("DELETE")},
	})
}
