package main

// Table tests of the token endpoints through the real router, as in
// handlers_test.go: each case on a fresh testEnv, the exact body, the
// database afterwards, and the other user's rows untouched.

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
			`{"message":"You have reached the limit of 2 tokens. Delete a token first."}`).after(func(t *testing.T, env *testEnv, v apiVars) { env.st.limits.tokens = 2 }),
		call("create under the token limit", "POST", path, "{alice_token}", `{"name":"third"}`, 201, "").
			after(func(t *testing.T, env *testEnv, v apiVars) { env.st.limits.tokens = 3 }).then(created("third")),
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
