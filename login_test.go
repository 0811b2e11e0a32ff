package main

import (
	"fmt"
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
				if n > maxFailuresPerAddr {
					t.Errorf("flooding address %s: %d answers before it was refused for the minute, want at most %d", addrs[i], n, maxFailuresPerAddr)
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
	for i := range maxKnownPerEmail + 1 {
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
