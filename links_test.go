package main

import (
	"devicehub/internal/model"
	"encoding/json"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// resetURL matches a password-reset link and captures its secret.
var resetURL = regexp.MustCompile(`^http://devicehub\.test/#/reset/([A-Za-z0-9]{40})$`)

// postLink sends a JSON body with no token to a link route (…/info, or
// a redeem).
func postLink(env *testEnv, path string, body map[string]string) (int, string) {
	w := env.serve(env.t, newRequest("POST", path, "", "application/json", strings.NewReader(apiJSON(body))))
	return w.Code, strings.TrimSpace(w.Body.String())
}

// TestMemberLinks: an admin's new link for a pending invite (the old one
// stops working), the invite's landing info, and password-reset links:
// info, once-only use that ends the member's other sessions, 24 h.
func TestMemberLinks(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	const invalidInvite = `{"message":"This invitation is invalid or has expired."}`
	const invalidReset = `{"message":"This password reset link is invalid or has expired."}`

	// A new invite link replaces the old; the landing info names the team
	// and who invited.
	carol, oldSecret := inviteAs(t, env, v["ada_token"], "carol@example.com", "user")
	w := env.want(t, 200, "POST", "/v1/user/team/members/"+carol+"/invite", v["ada_token"], nil)
	var again struct {
		Data      model.Member
		InviteURL string `json:"invite_url"`
	}
	must(t, json.Unmarshal(w.Body.Bytes(), &again))
	newSecret := inviteURL.FindStringSubmatch(again.InviteURL)
	if newSecret == nil || !again.Data.Pending {
		t.Fatalf("reinvite: %s", w.Body)
	}
	code, body := postLink(env, "/v1/auth/invite/info", map[string]string{"invite": oldSecret})
	checkBody(t, "the old link's info", code, body, 422, invalidInvite)
	code, body = postLink(env, "/v1/auth/invite/info", map[string]string{"invite": newSecret[1]})
	checkBody(t, "the new link's info", code, body, 200,
		v.expand(`{"data":{"team":"Alice's team","invited_by":{"id":{ada},"name":"Ada"},"name":"New","email":"carol@example.com"}}`))
	if w := redeem(env, "192.0.2.1:1", oldSecret, "carol-password"); w.Code != 422 {
		t.Errorf("redeem the old link: got %d, want 422", w.Code)
	}
	if w := redeem(env, "192.0.2.1:1", newSecret[1], "carol-password"); w.Code != 200 {
		t.Errorf("redeem the new link: got %d %s, want 200", w.Code, w.Body)
	}
	code, body = postLink(env, "/v1/auth/invite/info", map[string]string{"invite": newSecret[1]})
	checkBody(t, "a used link's info", code, body, 422, invalidInvite)
	checkBody(t, "a new link for a member who joined", env.request("POST", "/v1/user/team/members/"+carol+"/invite", v["ada_token"], nil).Code,
		"", 422, "")
	checkBody(t, "a new link for another team's member", env.request("POST", "/v1/user/team/members/"+v["bea"]+"/invite", v["ada_token"], nil).Code,
		"", 404, "")

	// A reset link: info, then a new password that ends the other sessions.
	w = env.want(t, 200, "POST", "/v1/user/team/members/"+v["vic"]+"/reset", v["ada_token"], nil)
	var reset struct {
		Data     model.Member
		ResetURL string `json:"reset_url"`
	}
	must(t, json.Unmarshal(w.Body.Bytes(), &reset))
	secret := resetURL.FindStringSubmatch(reset.ResetURL)
	if secret == nil || reset.Data.Name != "Vic" {
		t.Fatalf("reset: %s", w.Body)
	}
	wantDB(t, env.st, strings.ToUpper(sha256Hex([]byte(secret[1]))), `SELECT hex(secret_hash) FROM password_resets WHERE user_id = ?`, v["vic"])
	code, body = postLink(env, "/v1/auth/reset/info", map[string]string{"reset": secret[1]})
	checkBody(t, "the reset link's info", code, body, 200, `{"data":{"team":"Alice's team","invited_by":null,"name":"Vic","email":"vic@example.com"}}`)
	code, body = postLink(env, "/v1/auth/reset", map[string]string{"reset": secret[1], "password": "short", "token_name": "phone"})
	checkBody(t, "a short password", code, body, 422, apiFieldError("password", "The password field must be at least 8 characters."))
	code, body = postLink(env, "/v1/auth/reset", map[string]string{"reset": secret[1], "password": "vic-new-password", "token_name": "phone"})
	if code != 200 || !strings.Contains(body, `"token_type":"Bearer"`) {
		t.Fatalf("reset: got %d %s, want a login's answer", code, body)
	}
	wantDB(t, env.st, "1", `SELECT count(*) FROM tokens WHERE user_id = ?`, v["vic"]) // the new one only
	if w := env.request("GET", "/v1/auth/me", v["vic_token"], nil); w.Code != 401 {
		t.Errorf("vic's old token after the reset: got %d, want 401", w.Code)
	}
	checkLogin(t, env, "vic@example.com", "vic-new-password", 200)
	code, body = postLink(env, "/v1/auth/reset", map[string]string{"reset": secret[1], "password": "vic-third-password", "token_name": "x"})
	checkBody(t, "a used reset link", code, body, 422, invalidReset)

	// A reset link works 24 hours; a pending member has none.
	w = env.want(t, 200, "POST", "/v1/user/team/members/"+v["ada"]+"/reset", v["ada_token"], nil)
	must(t, json.Unmarshal(w.Body.Bytes(), &reset))
	env.clock.advance(24*time.Hour + time.Second)
	code, body = postLink(env, "/v1/auth/reset/info", map[string]string{"reset": resetURL.FindStringSubmatch(reset.ResetURL)[1]})
	checkBody(t, "an expired reset link", code, body, 422, invalidReset)
	pending, _ := inviteAs(t, env, v["ada_token"], "dave@example.com", "user")
	checkBody(t, "a reset link for a pending member", env.request("POST", "/v1/user/team/members/"+pending+"/reset", v["ada_token"], nil).Code,
		"", 404, "")
}

// checkBody checks a status, and a body unless want is "".
func checkBody(t *testing.T, what string, code int, body string, wantCode int, want string) {
	t.Helper()
	if code != wantCode || want != "" && !jsonEqual(t, []byte(body), []byte(want)) {
		t.Errorf("%s: got %d %s, want %d %s", what, code, body, wantCode, want)
	}
}

// checkLogin logs in and checks the status.
func checkLogin(t *testing.T, env *testEnv, email, password string, want int) {
	t.Helper()
	w := env.request("POST", "/v1/auth/login", "", map[string]string{"email": email, "password": password, "token_name": "t"})
	if w.Code != want {
		t.Errorf("login %s: got %d %s, want %d", email, w.Code, w.Body, want)
	}
}

// resetLink has the admin with that token make a reset link for the
// member id, and returns its secret.
func resetLink(t *testing.T, env *testEnv, token, id string) string {
	t.Helper()
	w := env.want(t, 200, "POST", "/v1/user/team/members/"+id+"/reset", token, nil)
	var got struct {
		ResetURL string `json:"reset_url"`
	}
	must(t, json.Unmarshal(w.Body.Bytes(), &got))
	return resetURL.FindStringSubmatch(got.ResetURL)[1]
}

// TestLinksEndWithTheirMaker: the invites and reset links an admin made
// end when they lose the admin role or are removed, in that change's
// transaction; the team's page shows a member's pending reset link, and
// an admin revokes it. Before, a removed admin kept a reset link of
// another admin and logged in as them with it, and an invite made by a
// removed admin still made a new admin.
func TestLinksEndWithTheirMaker(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	const invalidInvite = `{"message":"This invitation is invalid or has expired."}`
	const invalidReset = `{"message":"This password reset link is invalid or has expired."}`
	ada := v["ada_token"]
	for _, end := range []struct {
		name, method, body string
	}{{"demoted", "PATCH", `{"role":"user"}`}, {"removed", "DELETE", ""}} {
		maker := env.addMember("Maker"+end.name, "admin", env.alice)
		makerID := strconv.FormatInt(maker.id, 10)
		reset := resetLink(t, env, maker.token, v["ada"])
		_, invite := inviteAs(t, env, maker.token, end.name+"@example.com", "admin")
		kept := resetLink(t, env, ada, v["vic"]) // another admin's link stays
		wantDB(t, env.st, "1 1", `SELECT (SELECT count(*) FROM password_resets WHERE created_by = ?1) || ' ' ||
			(SELECT count(*) FROM invites WHERE invited_by = ?1)`, makerID)
		var body any
		if end.body != "" {
			body = end.body
		}
		env.want(t, 200, end.method, "/v1/user/team/members/"+makerID, ada, body)
		wantDB(t, env.st, "0 0", `SELECT (SELECT count(*) FROM password_resets WHERE user_id = ?1) || ' ' ||
			(SELECT count(*) FROM invites WHERE email = ?2)`, v["ada"], end.name+"@example.com")
		code, got := postLink(env, "/v1/auth/reset", map[string]string{"reset": reset, "password": "maker-password", "token_name": "x"})
		checkBody(t, end.name+": the maker's reset link", code, got, 422, invalidReset)
		code, got = postLink(env, "/v1/auth/invite/info", map[string]string{"invite": invite})
		checkBody(t, end.name+": the maker's invite", code, got, 422, invalidInvite)
		code, got = postLink(env, "/v1/auth/reset/info", map[string]string{"reset": kept})
		checkBody(t, end.name+": another admin's link", code, got, 200, "")
		env.clock.advance(time.Minute) // the throttle's window: these were failures
	}

	// The team's page shows Vic's pending link; an admin revokes it, once.
	// A reset link that expired is pending no more.
	pending := func(want string) {
		t.Helper()
		w := env.want(t, 200, "GET", "/v1/user/team", env.alice.token, nil)
		if !strings.Contains(w.Body.String(), v.expand(want)) {
			t.Errorf("team page: got %s, want %s", w.Body, v.expand(want))
		}
	}
	pending(`"email":"vic@example.com","role":"viewer","last_login_at":null,"created_at":"{now}","pending":false,"reset_pending":true}`)
	pending(`"email":"ada@example.com","role":"admin","last_login_at":null,"created_at":"{now}","pending":false,"reset_pending":false}`)
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+v["vic"]+"/reset", env.alice.token, nil), 403, apiForbidden)
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+v["vic"]+"/reset", v["bea_token"], nil), 404, `{"message":"Member not found."}`)
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+v["vic"]+"/reset", ada, nil), 200, `{"message":"Password reset link revoked."}`)
	wantDB(t, env.st, "0", `SELECT count(*) FROM password_resets WHERE user_id = ?`, v["vic"])
	pending(`"email":"vic@example.com","role":"viewer","last_login_at":null,"created_at":"{now}","pending":false,"reset_pending":false}`)
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+v["vic"]+"/reset", ada, nil), 404,
		`{"message":"The member has no pending password reset link."}`)
	invited, _ := inviteAs(t, env, ada, "dora@example.com", "user")
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+invited+"/reset", ada, nil), 404, `{"message":"Member not found."}`)
	resetLink(t, env, ada, v["vic"])
	env.clock.advance(resetValidity)
	pending(`"email":"vic@example.com","role":"viewer","last_login_at":null,"created_at":"{now}","pending":false,"reset_pending":false}`)
	checkAnswer(t, env.request("DELETE", "/v1/user/team/members/"+v["vic"]+"/reset", ada, nil), 404,
		`{"message":"The member has no pending password reset link."}`)
}

// TestLinkInfoTellsNoAccount: a link's info answers alike whether or not
// its email has an account anywhere; only a redeem, with a password,
// tells (as invalid). Both info routes are throttled as a login is, on
// the client's address. Before, an admin learnt whether any email had an
// account from the info of an invite they made, unthrottled.
func TestLinkInfoTellsNoAccount(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	_, taken := inviteAs(t, env, v["ada_token"], "bob@example.com", "user")
	_, free := inviteAs(t, env, v["ada_token"], "nobody@example.com", "user")
	info := func(addr, field, secret string) *httptest.ResponseRecorder {
		req := newRequest("POST", "/v1/auth/"+field+"/info", "", "application/json", strings.NewReader(apiJSON(map[string]string{field: secret})))
		req.RemoteAddr = addr
		return env.serve(t, req)
	}
	const addr = "203.0.113.9:1"
	for secret, email := range map[string]string{taken: "bob@example.com", free: "nobody@example.com"} {
		checkAnswer(t, info(addr, "invite", secret), 200, v.expand(`{"data":{"team":"Alice's team","invited_by":{"id":{ada},"name":"Ada"},"name":"New","email":"`+email+`"}}`))
	}
	checkAnswer(t, redeem(env, addr, taken, "a-password"), 422, `{"message":"This invitation is invalid or has expired."}`)

	// Four more failures (five with the redeem's) fill the address's
	// window: then even a good link waits, on both info routes and the
	// login; another address is not held.
	for i := range 4 {
		field := []string{"invite", "reset"}[i%2]
		checkAnswer(t, info(addr, field, strings.Repeat("x", 40)), 422, "")
	}
	checkAnswer(t, info(addr, "invite", free), 429, `{"message":"Too Many Attempts."}`)
	checkAnswer(t, info(addr, "reset", strings.Repeat("y", 40)), 429, `{"message":"Too Many Attempts."}`)
	checkAnswer(t, redeem(env, addr, free, "a-password"), 429, "")
	checkAnswer(t, info("198.51.100.3:1", "invite", free), 200, "")
}
