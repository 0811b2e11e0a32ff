package main

import (
	"context"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// heldLogin is a server option that holds the next login once its
// password is checked, before its token is stored (passwordChecked),
// until release is closed; held is closed when it is held.
type heldLogin struct {
	armed         atomic.Bool
	held, release chan struct{}
	answer        chan *httptest.ResponseRecorder
}

func newHeldLogin() *heldLogin {
	return &heldLogin{held: make(chan struct{}), release: make(chan struct{}), answer: make(chan *httptest.ResponseRecorder, 1)}
}

func (h *heldLogin) option(_ *testEnv, o *serverOptions) {
	o.passwordChecked = func() {
		if h.armed.CompareAndSwap(true, false) {
			close(h.held)
			<-h.release
		}
	}
}

// start sends a login in the background and returns once it is held.
func (h *heldLogin) start(env *testEnv, addr, email, password string) {
	h.armed.Store(true)
	go func() { h.answer <- loginFrom(env, addr, email, password) }()
	<-h.held
}

// finish releases the login and returns its answer.
func (h *heldLogin) finish() *httptest.ResponseRecorder {
	close(h.release)
	return <-h.answer
}

const wrongPassword = `{"message":"The provided credentials are incorrect.","errors":{"email":["The provided credentials are incorrect."]}}`

// TestLoginLosesToPasswordChange: a login that checked the old password
// while the password changed (a reset link redeemed, or 'devicehub user
// passwd') is answered as a wrong password, and stores no token. Before,
// it issued a token made after the reset, which the reset did not end.
func TestLoginLosesToPasswordChange(t *testing.T) {
	t.Parallel()
	for _, change := range []struct {
		name string
		do   func(t *testing.T, env *testEnv, v apiVars)
	}{
		{"a reset", func(t *testing.T, env *testEnv, v apiVars) {
			secret := resetLink(t, env, v["ada_token"], v["alice_id"])
			code, body := postLink(env, "/v1/auth/reset", map[string]string{"reset": secret, "password": "alice-new-password", "token_name": "reset"})
			checkBody(t, "the reset", code, body, 200, "")
		}},
		{"user passwd", func(t *testing.T, env *testEnv, v apiVars) {
			hash, err := hashPassword("alice-new-password", testIterations)
			must(t, err)
			_, err = env.st.SetPassword(context.Background(), "alice@example.com", hash)
			must(t, err)
		}},
	} {
		t.Run(change.name, func(t *testing.T) {
			t.Parallel()
			h := newHeldLogin()
			env := newTestEnv(t, nil, h.option)
			v := newAPIVars(env)
			teamVars(t, env, v)
			h.start(env, "192.0.2.50:1", "alice@example.com", "alice-password")
			change.do(t, env, v)
			tokens := scalar(t, env.st, `SELECT count(*) FROM tokens WHERE user_id = ?`, env.alice.id)
			checkAnswer(t, h.finish(), 422, wrongPassword)
			wantDB(t, env.st, tokens, `SELECT count(*) FROM tokens WHERE user_id = ?`, env.alice.id)
			wantDB(t, env.st, "0", `SELECT count(*) FROM tokens WHERE user_id = ? AND name = 't'`, env.alice.id)
			wantDB(t, env.st, "0", `SELECT count(*) FROM known_clients WHERE user_id = ?`, env.alice.id)
			checkLogin(t, env, "alice@example.com", "alice-new-password", 200)
		})
	}
}

// TestPasswordChangeEndsWhatTheOldOpened: a reset, an invite's first
// password and 'devicehub user passwd' each end the user's tokens, known
// clients (in the store and in the login throttle's memory) and reset
// link; a member removed leaves the throttle's memory too. Before, a reset left the known clients, which kept their place in
// the login queue for 30 days.
func TestPasswordChangeEndsWhatTheOldOpened(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	const addr = "198.51.100.20:1"
	knownAs := func(email string, want bool) {
		t.Helper()
		ip, _, _ := strings.Cut(addr, ":")
		if got := env.srv.limiter.isKnown(email, throttleAddr(ip), env.clock.now()); got != want {
			t.Errorf("%s known at %s in the throttle: got %v, want %v", email, addr, got, want)
		}
	}
	known := func(want bool) { t.Helper(); knownAs("alice@example.com", want) }
	checkAnswer(t, loginFrom(env, addr, "alice@example.com", "alice-password"), 200, "")
	wantDB(t, env.st, "1", `SELECT count(*) FROM known_clients WHERE user_id = ?`, env.alice.id)
	known(true)
	secret := resetLink(t, env, v["ada_token"], v["alice_id"])
	code, body := postLink(env, "/v1/auth/reset", map[string]string{"reset": secret, "password": "alice-new-password", "token_name": "reset"})
	checkBody(t, "the reset", code, body, 200, "")
	wantDB(t, env.st, "1 0 0 1", `SELECT count(*) || ' ' || (SELECT count(*) FROM known_clients WHERE user_id = ?1) || ' ' ||
		(SELECT count(*) FROM password_resets WHERE user_id = ?1) || ' ' || (SELECT password_version FROM users WHERE id = ?1)
		FROM tokens WHERE user_id = ?1`, env.alice.id)
	known(false)

	// 'user passwd' ends the reset link too.
	checkAnswer(t, loginFrom(env, addr, "alice@example.com", "alice-new-password"), 200, "")
	resetLink(t, env, v["ada_token"], v["alice_id"])
	hash, err := hashPassword("alice-third-password", testIterations)
	must(t, err)
	revoked, err := env.st.SetPassword(context.Background(), "alice@example.com", hash)
	if err != nil || revoked != 2 {
		t.Errorf("user passwd: got %d tokens revoked, %v; want 2", revoked, err)
	}
	wantDB(t, env.st, "0 0 0 2", `SELECT count(*) || ' ' || (SELECT count(*) FROM known_clients WHERE user_id = ?1) || ' ' ||
		(SELECT count(*) FROM password_resets WHERE user_id = ?1) || ' ' || (SELECT password_version FROM users WHERE id = ?1)
		FROM tokens WHERE user_id = ?1`, env.alice.id)

	// An invite's first password is a change too: version 1.
	_, invite := inviteAs(t, env, v["ada_token"], "carol@example.com", "user")
	checkAnswer(t, redeem(env, addr, invite, "carol-password"), 200, "")
	wantDB(t, env.st, "1", `SELECT password_version FROM users WHERE email = 'carol@example.com'`)

	// A member removed is forgotten too.
	checkAnswer(t, loginFrom(env, addr, "vic@example.com", "Vic-password"), 200, "")
	knownAs("vic@example.com", true)
	env.want(t, 200, "DELETE", "/v1/user/team/members/"+v["vic"], v["ada_token"], nil)
	knownAs("vic@example.com", false)
}
