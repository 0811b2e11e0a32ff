package main

// Tests for the second hardening round (issue 12): each one reproduces an
// attack that got through and checks that it no longer does.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
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

// startServer serves env's API on a loopback port as serve does: the
// service's http.Server with the given read deadline, behind the
// connection limit.
func startServer(t *testing.T, env *testEnv, readTimeout time.Duration, maxConns int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := newHTTPServer(env.srv, testLogger(t), readTimeout)
	go srv.Serve(limitListener(ln, maxConns))
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// trickle opens a connection, sends head and then one byte of body every
// interval until the server hangs up or stop closes. It returns when the
// connection ends, and how long after it opened: the server's answer and
// close, or stop.
func trickle(addr, head string, interval time.Duration, stop <-chan struct{}) (time.Duration, error) {
	start := time.Now()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if _, err := io.WriteString(c, head); err != nil {
		return 0, err
	}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		io.Copy(io.Discard, c) // the answer, if any, then EOF or reset
	}()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		if _, err := c.Write([]byte("x")); err != nil {
			<-closed
			return time.Since(start), nil
		}
		select {
		case <-closed:
			return time.Since(start), nil
		case <-stop:
			return time.Since(start), errors.New("still open")
		case <-tick.C:
		}
	}
}

// TestSlowBodyCutOff (issue 12, finding 3): 500 connections that each
// trickle a login body, one byte every 5 s, do not stop other clients, and
// each is cut off after the short read deadline, not the 15 minutes an
// upload may take.
func TestSlowBodyCutOff(t *testing.T) {
	env := newTestEnv(t, nil)
	const readTimeout = time.Second
	addr := startServer(t, env, readTimeout, 1024)
	const slow = 500
	head := "POST /v1/auth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
	stop := make(chan struct{})
	held := make(chan time.Duration, slow)
	errs := make(chan error, slow)
	for range slow {
		go func() {
			d, err := trickle(addr, head, 5*time.Second, stop)
			if err != nil {
				errs <- err
				return
			}
			held <- d
		}()
	}
	// Others are served meanwhile.
	client := &http.Client{Timeout: 5 * time.Second}
	for i := range 20 {
		req, _ := http.NewRequest("GET", "http://"+addr+"/v1/auth/me", nil)
		req.Header.Set("Authorization", "Bearer "+env.alice.token)
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d beside %d slow bodies: %v", i, slow, err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 || time.Since(start) > time.Second {
			t.Errorf("request %d beside %d slow bodies: got %d after %v, want 200 within 1s", i, slow, resp.StatusCode, time.Since(start))
		}
	}
	timeout := time.After(readTimeout + 5*time.Second)
	var longest time.Duration
	for i := range slow {
		select {
		case d := <-held:
			longest = max(longest, d)
		case err := <-errs:
			t.Fatalf("slow connection %d: %v", i, err)
		case <-timeout:
			close(stop)
			t.Fatalf("%d of %d slow connections still open %v after the read deadline", slow-i, slow, 5*time.Second)
		}
	}
	t.Logf("%d slow bodies: all cut off, the last after %v", slow, longest.Round(time.Millisecond))
	if longest < readTimeout {
		t.Errorf("a slow connection ended after %v, before the read deadline %v", longest, readTimeout)
	}
}

// TestUploadReadDeadline (issue 12, finding 3): an authenticated firmware
// upload may take longer than the short read deadline; any other slow
// request, an upload without a token or a PATCH, is cut off after it.
func TestUploadReadDeadline(t *testing.T) {
	env := newTestEnv(t, nil)
	const readTimeout = time.Second
	addr := startServer(t, env, readTimeout, 1024)
	body, contentType := apiMultipart(t, map[string]string{"name": "slow"}, []byte("firmware bytes"))
	upload := func(token string) string {
		return fmt.Sprintf("POST /v1/user/devices/%s/firmwares HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"+
			"Content-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", env.alice.device, token, contentType, len(body))
	}
	patch := `{"name":"slowly renamed"}`
	tests := []struct {
		name, head string
		body       []byte
		wantStatus string // the answer's status code, "" when the server hangs up without one
	}{
		{"upload", upload(env.alice.token), body, "201"},
		{"upload without a valid token", upload("1|" + strings.Repeat("x", 40)), body, "401"},
		{"patch", fmt.Sprintf("PATCH /v1/user/devices/%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"+
			"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", env.alice.device, env.alice.token, len(patch)),
			[]byte(patch), "400"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			io.WriteString(c, tt.head)
			// The body in 5 pieces over 2.5 s: past the read deadline.
			type result struct {
				text string
				took time.Duration
			}
			start := time.Now()
			answer := make(chan result, 1)
			go func() {
				b, _ := io.ReadAll(c)
				answer <- result{string(b), time.Since(start)}
			}()
			piece := (len(tt.body) + 4) / 5
			var res result
		send:
			for off := 0; ; off += piece {
				select {
				case res = <-answer:
					break send
				case <-time.After(500 * time.Millisecond):
				}
				if off < len(tt.body) {
					c.Write(tt.body[off:min(off+piece, len(tt.body))])
				}
			}
			got, took := res.text, res.took
			status := ""
			if f := strings.Fields(got); len(f) > 1 {
				status = f[1]
			}
			if status != tt.wantStatus {
				t.Errorf("got status %q after %v (%.60q), want %q", status, took.Round(time.Millisecond), got, tt.wantStatus)
			}
			if tt.wantStatus != "201" && took > readTimeout+time.Second {
				t.Errorf("answered after %v, want it cut off at the read deadline (%v)", took, readTimeout)
			}
		})
	}
	apiWantDB(t, env, "slow", `SELECT group_concat(name) FROM firmwares`)
	apiWantDB(t, env, "Alice's device", `SELECT name FROM devices WHERE uid = ?`, env.alice.device)
}

// TestMaxConns (issue 12, finding 3): past -max-conns open connections, a
// new one waits until one closes.
func TestMaxConns(t *testing.T) {
	env := newTestEnv(t, nil)
	const maxConns = 20
	addr := startServer(t, env, 10*time.Second, maxConns)
	var stalled []net.Conn
	for range maxConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n") // never finished
		stalled = append(stalled, c)
	}
	time.Sleep(100 * time.Millisecond) // the server has accepted them
	get := func(timeout time.Duration) error {
		client := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := client.Get("http://" + addr + "/healthz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		return nil
	}
	if err := get(500 * time.Millisecond); err == nil {
		t.Errorf("a request beside %d open connections was served, want it to wait", maxConns)
	}
	stalled[0].Close()
	if err := get(2 * time.Second); err != nil {
		t.Errorf("a request after one of %d connections closed: %v, want it served", maxConns, err)
	}
}

// serveInProcess runs 'devicehub serve' in this process on a free loopback
// port with the data directory dir and the extra args, and returns its
// address, its log, and a function that stops it and returns run's error.
func serveInProcess(t *testing.T, dir string, args ...string) (addr string, log *syncBuffer, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	log = &syncBuffer{}
	done := make(chan error, 1)
	args = append([]string{"serve", "-addr", "127.0.0.1:0", "-data", dir, "-mqtt", "tcp://127.0.0.1:1"}, args...)
	go func() {
		done <- run(ctx, args, func(string) string { return "" }, strings.NewReader(""), io.Discard, log)
	}()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("serve did not stop")
			}
		})
		return err
	}
	t.Cleanup(func() { stop() })
	listening := regexp.MustCompile(`msg=listening addr=(127\.0\.0\.1:[0-9]+)`)
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if m := listening.FindStringSubmatch(log.String()); m != nil {
			return m[1], log, stop
		}
		select {
		case err := <-done:
			t.Fatalf("serve returned before listening: %v\n%s", err, log)
		default:
		}
	}
	t.Fatalf("serve did not listen:\n%s", log)
	return "", nil, nil
}

// TestDataFileModes (issue 12, finding 4): with a umask that lets others
// read new files, and a data directory that already exists with mode 755,
// every file the program creates in it is readable by its owner only, a
// database file an older version left readable is tightened, and so is the
// directory, to 700, with a log line that says so.
func TestDataFileModes(t *testing.T) {
	defer syscall.Umask(syscall.Umask(0o022))
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// An empty database file left world-readable, as an older version made it.
	if err := os.WriteFile(filepath.Join(dir, "devicehub.db"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	_, stderr, err := cliRun(t, nil, "modes password\n", "user", "add", "-data", dir, "-email", "m@example.com", "-name", "M")
	if err != nil {
		t.Fatalf("user add: %v", err)
	}
	if !strings.Contains(stderr, "tightened") || !strings.Contains(stderr, "0755") {
		t.Errorf("user add's log %q: want a line saying the data directory (0755) was tightened", stderr)
	}
	uid, _, err := cliRun(t, nil, "", "device", "add", "-data", dir, "-owner", "m@example.com", "-platform", "esp32", "-board", "devkit")
	if err != nil {
		t.Fatalf("device add: %v", err)
	}
	tok, _, err := cliRun(t, nil, "", "token", "create", "-data", dir, "-email", "m@example.com", "-name", "modes")
	if err != nil {
		t.Fatalf("token create: %v", err)
	}
	addr, _, stop := serveInProcess(t, dir)
	body, contentType := apiMultipart(t, map[string]string{"name": "fw"}, []byte{0xE9, 1, 2, 3})
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/user/devices/"+strings.TrimSpace(uid)+"/firmwares", bytes.NewReader(body))
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(tok))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 201 {
		t.Fatalf("upload: got %d, want 201", resp.StatusCode)
	}
	checkModes := func(when string, want ...string) {
		t.Helper()
		seen := map[string]bool{}
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				t.Fatal(err)
			}
			info, err := d.Info()
			if err != nil {
				t.Fatal(err)
			}
			rel, _ := filepath.Rel(dir, p)
			seen[rel] = true
			wantMode := fs.FileMode(0o600)
			if d.IsDir() {
				wantMode = 0o700
			}
			if info.Mode().Perm() != wantMode {
				t.Errorf("%s: %s has mode %04o, want %04o", when, rel, info.Mode().Perm(), wantMode)
			}
			return nil
		})
		for _, name := range want {
			if !seen[name] {
				t.Errorf("%s: no %s in the data directory (have %v)", when, name, seen)
			}
		}
	}
	checkModes("while serving", ".", "devicehub.db", "devicehub.db-wal", "devicehub.db-shm", "ota.key", "firmware", "firmware/tmp")
	if err := stop(); err != nil {
		t.Fatalf("serve: %v", err)
	}
	checkModes("after serving", ".", "devicehub.db", "ota.key", "firmware", "firmware/tmp")
	fw, _ := filepath.Glob(filepath.Join(dir, "firmware", "*.bin"))
	if len(fw) != 1 {
		t.Errorf("firmware files %v, want the one uploaded", fw)
	}
}
