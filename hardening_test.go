package main

// Tests for the second hardening round (issue 12): each one reproduces an
// attack that got through and checks that it no longer does.

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// loginFrom sends a login through the real router from the client address
// addr ("host:port").
func loginFrom(env *testEnv, addr, email, password string) *httptest.ResponseRecorder {
	body := apiJSON(map[string]string{"email": email, "password": password, "token_name": "t"})
	req := httptest.NewRequest("POST", "/v1/auth/login", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.RemoteAddr = addr
	w := httptest.NewRecorder()
	env.srv.ServeHTTP(w, req)
	return w
}

// slowPasswords makes every password check of env (alice's, bob's and the
// dummy hash of unknown emails) take about perCheck on this machine, as a
// production hash does, so that tests can see requests wait for hashing.
// It returns the work factor used.
func slowPasswords(t *testing.T, env *testEnv, perCheck time.Duration) int {
	t.Helper()
	const probe = 20_000
	h, err := hashPassword("probe", probe)
	if err != nil {
		t.Fatal(err)
	}
	fastest := time.Hour
	for range 3 {
		start := time.Now()
		checkPassword(h, "probe")
		fastest = min(fastest, time.Since(start))
	}
	iterations := max(int(float64(probe)*float64(perCheck)/float64(fastest)), 1000)
	env.srv.iterations = iterations // the dummy hash is made on the first login
	for _, u := range []testUser{env.alice, env.bob} {
		h, err := hashPassword(u.password, iterations)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := env.st.wdb.Exec(`UPDATE users SET password_hash = ? WHERE id = ?`, h, u.id); err != nil {
			t.Fatal(err)
		}
	}
	return iterations
}

// loginAnswer is one login's status, Retry-After header and duration.
type loginAnswer struct {
	status     int
	retryAfter string
	took       time.Duration
}

// concurrentLogins sends the logins all at once, each from its address,
// and returns their answers in the same order.
func concurrentLogins(env *testEnv, addrs, emails, passwords []string) []loginAnswer {
	answers := make([]loginAnswer, len(emails))
	var start, done sync.WaitGroup
	start.Add(1)
	for i := range emails {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			t0 := time.Now()
			w := loginFrom(env, addrs[i], emails[i], passwords[i])
			answers[i] = loginAnswer{w.Code, w.Header().Get("Retry-After"), time.Since(t0)}
		}()
	}
	start.Done()
	done.Wait()
	return answers
}

// repeat is n copies of s.
func repeat(s string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = s
	}
	return out
}

// countStatus counts the answers per status.
func countStatus(answers []loginAnswer) map[int]int {
	n := map[int]int{}
	for _, a := range answers {
		n[a.status]++
	}
	return n
}

// TestLoginThrottleParallel (issue 12, finding 1): 41 concurrent logins
// for one email from one address, 40 wrong passwords and the right one.
// At most 5 password checks fail (422); every other answer is a 429 with
// Retry-After, and a success is allowed only if it got one of the slots.
func TestLoginThrottleParallel(t *testing.T) {
	env := newTestEnv(t, nil)
	slowPasswords(t, env, 20*time.Millisecond)
	passwords := append(repeat("wrong", 40), env.alice.password)
	answers := concurrentLogins(env, repeat("192.0.2.1:1234", 41), repeat(env.alice.email, 41), passwords)
	n := countStatus(answers)
	t.Logf("41 parallel logins: %d × 422, %d × 429, %d × 200", n[422], n[429], n[200])
	if n[422] > 5 {
		t.Errorf("%d password checks failed (422), want at most 5", n[422])
	}
	if n[422]+n[429]+n[200] != 41 {
		t.Errorf("answers %v, want only 422, 429 and 200", n)
	}
	for i, a := range answers {
		if a.status == 429 && a.retryAfter == "" {
			t.Errorf("login %d: 429 without Retry-After", i)
		}
	}
	if answers[40].status == 200 && n[422] > 4 {
		t.Errorf("the right password got 200 and %d wrong ones were checked: more than 5 checks", n[422])
	}
}

// TestLoginFloodOtherAddress (issue 12, finding 2): while 80 concurrent
// logins for made-up emails come from one address, a login from another
// address is answered, with success, within a second.
func TestLoginFloodOtherAddress(t *testing.T) {
	env := newTestEnv(t, nil)
	perCheck := 50 * time.Millisecond
	slowPasswords(t, env, perCheck)
	emails := make([]string, 80)
	for i := range emails {
		emails[i] = fmt.Sprintf("made-up-%d@example.com", i)
	}
	flood := make(chan []loginAnswer)
	go func() { flood <- concurrentLogins(env, repeat("192.0.2.1:1234", 80), emails, repeat("guess", 80)) }()
	time.Sleep(2 * perCheck) // the flood is queued and hashing

	start := time.Now()
	w := loginFrom(env, "198.51.100.7:4321", env.alice.email, env.alice.password)
	took := time.Since(start)
	answers := <-flood
	n := countStatus(answers)
	t.Logf("a real login during a flood of 80 took %v (%d × 422, %d × 429 in the flood)", took.Round(time.Millisecond), n[422], n[429])
	if w.Code != 200 {
		t.Errorf("login from another address during the flood: got %d %s, want 200", w.Code, w.Body)
	}
	if took > time.Second {
		t.Errorf("login from another address during the flood took %v, want at most 1s", took)
	}
	if n[422]+n[429] != 80 {
		t.Errorf("flood answers %v, want only 422 and 429", n)
	}
	for i, a := range answers {
		if a.status == 429 && a.retryAfter == "" {
			t.Errorf("flood login %d: 429 without Retry-After", i)
		}
	}
}
