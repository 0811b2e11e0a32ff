package main

import (
	"devicehub/internal/store"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// startFlood sends wrong passwords for made-up emails from each of addrs,
// one request at a time per address and again at once after each answer,
// until stop closes or the address is refused for the rest of the minute.
// full closes at the first 429 for a busy pool (Retry-After 1): from then
// on the flood holds every place open to it. wait returns, once the flood
// is over, how many answers each address got before it was refused for the
// minute.
func startFlood(t *testing.T, env *testEnv, addrs []string, stop <-chan struct{}) (full <-chan struct{}, wait func() []int) {
	busy := make(chan struct{})
	var once sync.Once
	answers := make([]int, len(addrs))
	var wg sync.WaitGroup
	for i, addr := range addrs {
		wg.Go(func() {
			for ; ; answers[i]++ {
				select {
				case <-stop:
					return
				default:
				}
				w := loginFrom(env, addr, fmt.Sprintf("made-up-%d-%d@example.com", i, answers[i]), "guess")
				switch {
				case w.Code == 429 && w.Header().Get("Retry-After") == "1":
					once.Do(func() { close(busy) })
				case w.Code == 429:
					return
				case w.Code != 422:
					t.Errorf("flood from %s: got %d %s, want 422 or 429", addr, w.Code, w.Body)
					return
				}
			}
		})
	}
	return busy, func() []int { wg.Wait(); return answers }
}

// TestLoginFloodKnownClient: while 24 addresses send wrong passwords as
// fast as they are answered, from 24 /64s of one IPv6 /56 or from 24 IPv4
// /16s, a client that logged in before from its address logs in again.
// Against the /56, whose pending checks are bounded, a new client gets in
// too. A 429 for a busy pool counts against its address like a failed
// check, so that no address gets more than 50 answers a minute. Before,
// the pool was the flood's: every other login got a 429, and a refused
// address could send again at once, as often as it liked.
func TestLoginFloodKnownClient(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		addr      func(i int) string
		newGetsIn bool
	}{
		{"24 /64s of one /56", func(i int) string { return fmt.Sprintf("[2001:db8:0:1%02x::1]:4000", i) }, true},
		{"24 IPv4 /16s", func(i int) string { return fmt.Sprintf("100.%d.0.1:4000", 64+i) }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil, slowPasswords(t, 100*time.Millisecond))
			env.srv.dummyHash() // made now, not by the flood's first login
			const home = "203.0.113.5"
			if w := loginFrom(env, home+":1000", env.alice.email, env.alice.password); w.Code != 200 {
				t.Fatalf("alice's first login: got %d %s, want 200", w.Code, w.Body)
			}
			addrs := make([]string, 24)
			for i := range addrs {
				addrs[i] = tt.addr(i)
			}
			stop := make(chan struct{})
			full, wait := startFlood(t, env, addrs, stop)
			select {
			case <-full:
			case <-time.After(20 * time.Second):
				close(stop)
				wait()
				t.Fatal("the flood got no 429 for a busy pool in 20 s")
			}
			known := loginFrom(env, home+":2000", env.alice.email, env.alice.password)
			fresh := loginFrom(env, "192.0.2.99:1000", env.bob.email, env.bob.password)
			if known.Code != 200 {
				t.Errorf("alice, known at her address, during the flood: got %d %s, want 200", known.Code, known.Body)
			}
			if tt.newGetsIn && fresh.Code != 200 {
				t.Errorf("bob, new at his address, during the flood: got %d %s, want 200", fresh.Code, fresh.Body)
			}
			t.Logf("during the flood: alice (known) %d, bob (new) %d", known.Code, fresh.Code)
			close(stop)
			for i, n := range wait() {
				if n > maxAttemptsPerAddr {
					t.Errorf("flooding address %s: %d answers before it was refused for the minute, want at most %d", addrs[i], n, maxAttemptsPerAddr)
				}
			}
		})
	}
}

// TestKnownClients: an email is known at a client address (an IPv6
// client by its /64) once it passed a password check there, for 30 days,
// at its 8 most recent addresses; a failed check or another email makes
// nothing known. Known, a wrong password is still refused.
func TestKnownClients(t *testing.T) {
	t.Parallel()
	l := newLoginLimiter()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	login := func(email, ip string, outcome checkOutcome) {
		t.Helper()
		a, _ := l.reserve(email, ip, now)
		if a == nil {
			t.Fatalf("login for %s from %s refused", email, ip)
		}
		l.finish(a, outcome, now)
	}
	known := func(email, ip string) bool {
		a, _ := l.reserve(email, ip, now)
		l.finish(a, checkNotRun, now)
		return a.known
	}
	login("a@example.com", "2001:db8::1", checkPassed)
	login("a@example.com", "192.0.2.1", checkFailed)
	for i := range store.MaxKnownPerEmail + 1 {
		login("b@example.com", fmt.Sprintf("198.51.100.%d", i), checkPassed)
	}
	steps := []struct {
		after     time.Duration
		email, ip string
		want      bool
	}{
		{0, "a@example.com", "2001:db8::1", true},
		{0, "a@example.com", "2001:db8::ffff:2", true}, // the same /64
		{0, "a@example.com", "2001:db8:0:1::1", false},
		{0, "a@example.com", "192.0.2.1", false}, // a failed check
		{0, "c@example.com", "2001:db8::1", false},
		{0, "b@example.com", "198.51.100.0", false}, // the oldest of 9
		{0, "b@example.com", "198.51.100.1", true},
		{knownFor - time.Second, "a@example.com", "2001:db8::1", true},
		{time.Second, "a@example.com", "2001:db8::1", false},
	}
	for i, s := range steps {
		now = now.Add(s.after)
		if got := known(s.email, s.ip); got != s.want {
			t.Errorf("step %d: %s from %s known %v, want %v", i, s.email, s.ip, got, s.want)
		}
	}

	env := newTestEnv(t, nil)
	for _, tt := range []struct {
		password string
		want     int
	}{{env.alice.password, 200}, {"wrong", 422}} {
		if w := loginFrom(env, "192.0.2.1:1000", env.alice.email, tt.password); w.Code != tt.want {
			t.Errorf("alice from her address, password %q: got %d, want %d", tt.password, w.Code, tt.want)
		}
	}
	// A restart remembers: a new server on the same store loads them.
	restarted := newTestServer(t, testOptions(env.st, nil, env.log))
	for _, tt := range []struct {
		email, ip string
		want      bool
	}{{env.alice.email, "192.0.2.1", true}, {env.bob.email, "192.0.2.1", false}} {
		a, _ := restarted.limiter.reserve(tt.email, tt.ip, env.clock.now())
		if a.known != tt.want {
			t.Errorf("after a restart, %s from %s known %v, want %v", tt.email, tt.ip, a.known, tt.want)
		}
	}
}

// tryCheck reserves a login's password check for email from ip and takes
// its place in the pool, as handleLogin does; nil when refused.
func tryCheck(env *testEnv, email, ip string) *loginCheck {
	c, err := env.srv.admitCheck(env.srv.limiter.reserve(email, ip, env.clock.now()))
	if err != nil {
		return nil
	}
	return c
}

// TestCorrectLoginLoops (issue 28, finding 1): accounts of the attacker's
// own, known at each of their addresses, log in correctly in loops, every
// address with as many checks at once as it may have, each check holding
// its place for a second. Every 5 s a known client (alice, at home) and a
// new client from another block (bob, from a new address each time) log
// in: both always find a place, and no account passes more than 20 checks
// a minute. Against 16 blocks (more than a botnet-free attacker has), a
// new client may find the pool full, but a known client still gets in.
// Before, correct logins counted toward no limit, known clients skipped
// the block limits and could take every place: the known victim got 429
// nine times in ten, a new client every time.
func TestCorrectLoginLoops(t *testing.T) {
	t.Parallel()
	addrs := func(n int, format string) []string {
		list := make([]string, n)
		for i := range list {
			list[i] = fmt.Sprintf(format, i+1)
		}
		return list
	}
	tests := []struct {
		name      string
		accounts  int
		addrs     []string
		newGetsIn bool
	}{
		{"3 accounts, 15 addresses of one /24", 3, addrs(15, "192.0.2.%d"), true},
		{"1 account, 16 /64s of one /56", 1, addrs(16, "2001:db8:0:1%02x::1"), true},
		{"1 account, 16 /24s", 1, addrs(16, "100.64.%d.1"), false},
	}
	const home = "203.0.113.5"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil)
			login := func(email, ip string) bool {
				c := tryCheck(env, email, ip)
				if c != nil {
					c.end(checkPassed)
				}
				return c != nil
			}
			accounts := make([]string, tt.accounts)
			for i := range accounts {
				accounts[i] = fmt.Sprintf("attacker-%d@example.com", i)
				for _, ip := range tt.addrs {
					if !login(accounts[i], ip) {
						t.Fatalf("%s's first login from %s refused", accounts[i], ip)
					}
				}
			}
			if !login(env.alice.email, home) {
				t.Fatal("alice's first login refused")
			}
			env.clock.advance(loginWindow)
			passed := map[string]int{} // per account, in this minute
			for round := range 2 * 60 {
				var held []*loginCheck
				for _, ip := range tt.addrs {
					for _, a := range accounts {
						for range maxChecksPerAddr {
							if c := tryCheck(env, a, ip); c != nil {
								held = append(held, c)
							}
						}
					}
				}
				if round%5 == 0 {
					if !login(env.alice.email, home) {
						t.Errorf("second %d: alice, known at her address, refused beside %d checks of the attack", round, len(held))
					}
					if !login(env.bob.email, fmt.Sprintf("198.51.100.%d", round/5+1)) && tt.newGetsIn {
						t.Errorf("second %d: bob, new, from another block, refused beside %d checks of the attack", round, len(held))
					}
				}
				for _, c := range held {
					passed[c.attempt.email]++
					c.end(checkPassed)
				}
				env.clock.advance(time.Second)
				if round%60 == 59 {
					t.Logf("minute %d: the attack's checks passed per account: %v", round/60+1, passed)
					for a, n := range passed {
						if n > maxSuccessesPerEmail {
							t.Errorf("minute %d: %s passed %d checks, want at most %d", round/60+1, a, n, maxSuccessesPerEmail)
						}
					}
					clear(passed)
				}
			}
		})
	}
}

// TestLoginSuccessBounds: at most 20 passed checks a minute per email,
// from any address, and passed checks count toward the 50 a minute per
// client address. Before, a correct password was never counted.
func TestLoginSuccessBounds(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	const ip, otherIP = "192.0.2.1:1234", "198.51.100.7:4321"
	const tooMany = `{"message":"Too Many Attempts."}`
	want := func(step string, w *httptest.ResponseRecorder, status int, retryAfter string) {
		t.Helper()
		if w.Code != status || w.Header().Get("Retry-After") != retryAfter {
			t.Errorf("%s: got %d, Retry-After %q (%s); want %d, %q", step, w.Code, w.Header().Get("Retry-After"), w.Body, status, retryAfter)
		}
	}
	for i := range maxSuccessesPerEmail {
		want(fmt.Sprintf("alice's login %d", i+1), loginFrom(env, ip, env.alice.email, env.alice.password), 200, "")
	}
	env.clock.advance(15 * time.Second)
	want("alice's next login", loginFrom(env, ip, env.alice.email, env.alice.password), 429, "45")
	want("alice's next login from another address", loginFrom(env, otherIP, env.alice.email, env.alice.password), 429, "45")
	checkAnswer(t, loginFrom(env, otherIP, env.alice.email, env.alice.password), 429, tooMany)
	for i := range maxSuccessesPerEmail {
		want(fmt.Sprintf("bob's login %d", i+1), loginFrom(env, ip, env.bob.email, env.bob.password), 200, "")
	}
	for i := range maxAttemptsPerAddr - 2*maxSuccessesPerEmail {
		want(fmt.Sprintf("wrong password %d", i+1), loginFrom(env, ip, fmt.Sprintf("nobody-%d@example.com", i/5), "x"), 422, "")
	}
	want("a check past 50 from one address", loginFrom(env, ip, "somebody@example.com", "x"), 429, "45")
	want("a check from another address", loginFrom(env, otherIP, "somebody@example.com", "x"), 422, "")
	env.clock.advance(45 * time.Second)
	want("alice a minute after her first login", loginFrom(env, otherIP, env.alice.email, env.alice.password), 200, "")
}

// TestLoginReplacesTokenOfItsName: a login replaces the user's older
// tokens of the token_name it gives, so a client that logs in again keeps
// one token; the user's tokens of other names, and other users' of that
// name, stay.
func TestLoginReplacesTokenOfItsName(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	a := env.alice
	login := func(user testUser, name string) string {
		t.Helper()
		body := apiJSON(map[string]string{"email": user.email, "password": user.password, "token_name": name})
		tok, _ := decode(t, env.want(t, 200, "POST", "/v1/auth/login", "", body))["token"].(string)
		return tok
	}
	bobs := login(env.bob, "docs-walk")
	first := login(a, "docs-walk")
	env.clock.advance(time.Minute)
	second := login(a, "docs-walk")
	phone := login(a, "phone")
	apiWantStatus(t, env, "GET", "/v1/auth/me", first, 401)
	for _, tok := range []string{second, phone, a.token, bobs} {
		apiWantStatus(t, env, "GET", "/v1/auth/me", tok, 200)
	}
	wantDB(t, env.st, "docs-walk phone test", `SELECT group_concat(name, ' ') FROM (SELECT name FROM tokens WHERE user_id = ? ORDER BY name)`, a.id)
	wantDB(t, env.st, strings.SplitN(second, "|", 2)[0], `SELECT id FROM tokens WHERE user_id = ? AND name = 'docs-walk'`, a.id)
}
