package main

// Tests for the second hardening round: each one reproduces an
// attack that got through and checks that it no longer does.

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
)

// loginFrom sends a login through the real router from the client address
// addr ("host:port").
func loginFrom(env *testEnv, addr, email, password string, xff ...string) *httptest.ResponseRecorder {
	body := apiJSON(map[string]string{"email": email, "password": password, "token_name": "t"})
	req := newRequest("POST", "/v1/auth/login", "", "application/json", strings.NewReader(body))
	req.RemoteAddr = addr
	req.Header["X-Forwarded-For"] = xff
	return env.serve(env.t, req)
}

// slowPasswords makes every password check of an env (alice's, bob's and
// the dummy hash of unknown emails) take about perCheck on this machine,
// as a production hash does, so that tests can see requests wait for
// hashing.
func slowPasswords(t *testing.T, perCheck time.Duration) envOption {
	t.Helper()
	const probe = 20_000
	h, err := hashPassword("probe", probe)
	must(t, err)
	fastest := time.Hour
	for range 3 {
		start := time.Now()
		checkPassword(h, "probe")
		fastest = min(fastest, time.Since(start))
	}
	iterations := max(int(float64(probe)*float64(perCheck)/float64(fastest)), 1000)
	return func(_ *testEnv, o *serverOptions) { o.iterations = iterations } // addUser hashes with them too
}

// loginAnswer is one login's status, Retry-After header and duration.
type loginAnswer struct {
	status          int
	tooManyAttempts string
	took            time.Duration
}

// concurrentLogins sends the logins all at once, each from its address,
// and returns their answers in the same order.
func concurrentLogins(env *testEnv, addrs, emails, passwords []string) []loginAnswer {
	answers := make([]loginAnswer, len(emails))
	start := make(chan struct{})
	var done sync.WaitGroup
	for i := range emails {
		done.Go(func() {
			<-start
			t0 := time.Now()
			w := loginFrom(env, addrs[i], emails[i], passwords[i])
			answers[i] = loginAnswer{w.Code, w.Header().Get("Retry-After"), time.Since(t0)}
		})
	}
	close(start)
	done.Wait()
	return answers
}

// checkLoginAnswers fails unless every answer has one of the statuses
// want and every 429 has a Retry-After (of tooManyAttempts, when not empty);
// it returns the count per status.
func checkLoginAnswers(t *testing.T, answers []loginAnswer, tooManyAttempts string, want ...int) map[int]int {
	t.Helper()
	n := map[int]int{}
	for _, a := range answers {
		n[a.status]++
	}
	for i, a := range answers {
		if !slices.Contains(want, a.status) {
			t.Errorf("login %d: status %d, want one of %v (all: %v)", i, a.status, want, n)
		}
		if a.status == 429 && (a.tooManyAttempts == "" || tooManyAttempts != "" && a.tooManyAttempts != tooManyAttempts) {
			t.Errorf("login %d: 429 with Retry-After %q, want %q", i, a.tooManyAttempts, cmp.Or(tooManyAttempts, "a value"))
		}
	}
	return n
}

// tookRange is how long the quickest and the slowest answer with status took.
func tookRange(answers []loginAnswer, status int) (r struct{ first, last time.Duration }) {
	r.first = time.Hour
	for _, a := range answers {
		if a.status == status {
			r.first, r.last = min(r.first, a.took), max(r.last, a.took)
		}
	}
	return r
}

// TestLoginThrottleParallel: 41 concurrent logins
// for one email from one address, 40 wrong passwords and the right one.
// At most 5 password checks fail (422); every other answer is a 429 with
// Retry-After, and a success is allowed only if it got one of the slots.
func TestLoginThrottleParallel(t *testing.T) {
	// Not parallel: its count of checks holds when the 41 logins all
	// arrive before the first check ends (a success frees its place).
	env := newTestEnv(t, nil, slowPasswords(t, 20*time.Millisecond))
	passwords := append(slices.Repeat([]string{"wrong"}, 40), env.alice.password)
	answers := concurrentLogins(env, slices.Repeat([]string{"192.0.2.1:1234"}, 41), slices.Repeat([]string{env.alice.email}, 41), passwords)
	n := checkLoginAnswers(t, answers, "", 422, 429, 200)
	t.Logf("41 parallel logins: %d × 422, %d × 429, %d × 200", n[422], n[429], n[200])
	if n[422] > 5 {
		t.Errorf("%d password checks failed (422), want at most 5", n[422])
	}
	if answers[40].status == 200 && n[422] > 4 {
		t.Errorf("the right password got 200 and %d wrong ones were checked: more than 5 checks", n[422])
	}
}

// TestLoginFloodOtherAddress: while 80 concurrent
// logins for made-up emails come from one address, a login from another
// address is answered, with success, within a second.
func TestLoginFloodOtherAddress(t *testing.T) {
	// Not parallel: it times a login beside a flood (at most 1 s), with
	// password checks calibrated to this machine when idle.
	perCheck := 50 * time.Millisecond
	env := newTestEnv(t, nil, slowPasswords(t, perCheck))
	emails := make([]string, 80)
	for i := range emails {
		emails[i] = fmt.Sprintf("made-up-%d@example.com", i)
	}
	flood := make(chan []loginAnswer)
	go func() {
		flood <- concurrentLogins(env, slices.Repeat([]string{"192.0.2.1:1234"}, 80), emails, slices.Repeat([]string{"guess"}, 80))
	}()
	time.Sleep(2 * perCheck) // the flood is queued and hashing

	start := time.Now()
	w := loginFrom(env, "198.51.100.7:4321", env.alice.email, env.alice.password)
	took := time.Since(start)
	n := checkLoginAnswers(t, <-flood, "", 422, 429)
	t.Logf("a real login during a flood of 80 took %v (%d × 422, %d × 429 in the flood)", took.Round(time.Millisecond), n[422], n[429])
	if w.Code != 200 {
		t.Errorf("login from another address during the flood: got %d %s, want 200", w.Code, w.Body)
	}
	if took > time.Second {
		t.Errorf("login from another address during the flood took %v, want at most 1s", took)
	}
}

// TestLoginHashQueueBounded: password checks run on hashWorkers() workers
// with at most hashQueue more waiting, and a login that finds the queue
// full is answered 429 with Retry-After at once. 60 logins at once from 60
// addresses in 60 /24s, each check slow: no more than the places open to
// new clients (workers+queue less knownPlaces) are checked (422), every
// other one is refused before the first check has ended (without waiting
// for a worker), and the rest of the API answers meanwhile.
func TestLoginHashQueueBounded(t *testing.T) {
	// Not parallel: it times the refusals against the first password
	// check, and an API call (at most 1 s), with checks calibrated to
	// this machine when idle.
	perCheck := 200 * time.Millisecond
	env := newTestEnv(t, nil, slowPasswords(t, perCheck))
	env.srv.dummyHash() // made now, not by the burst's first login
	const logins = 60
	admitted := hashWorkers() + hashQueue - knownPlaces
	addrs, emails := make([]string, logins), make([]string, logins)
	for i := range logins {
		addrs[i] = fmt.Sprintf("192.0.%d.1:1234", i+1)
		emails[i] = fmt.Sprintf("made-up-%d@example.com", i)
	}
	burst := make(chan []loginAnswer)
	go func() { burst <- concurrentLogins(env, addrs, emails, slices.Repeat([]string{"guess"}, logins)) }()
	time.Sleep(perCheck / 2) // the burst is queued and hashing

	start := time.Now()
	w := env.request("GET", "/v1/auth/me", env.alice.token, nil)
	apiTook := time.Since(start)
	answers := <-burst
	n := checkLoginAnswers(t, answers, "1", 422, 429)
	firstChecked, lastRefused := tookRange(answers, 422).first, tookRange(answers, 429).last
	t.Logf("%d logins at once, %d places: %d × 422, %d × 429; 429s within %v, the first check ended after %v; /v1/auth/me meanwhile took %v",
		logins, admitted, n[422], n[429], lastRefused.Round(time.Microsecond),
		firstChecked.Round(time.Millisecond), apiTook.Round(time.Millisecond))
	if n[422] > admitted {
		t.Errorf("%d password checks ran (422), want at most the %d places open to new clients", n[422], admitted)
	}
	if n[429] < logins-admitted {
		t.Errorf("%d logins refused (429), want at least %d", n[429], logins-admitted)
	}
	if lastRefused >= firstChecked {
		t.Errorf("a 429 came after %v, want every one at once: before the first check ended (%v)", lastRefused, firstChecked)
	}
	if w.Code != 200 || apiTook > time.Second {
		t.Errorf("GET /v1/auth/me during the burst: %d after %v, want 200 within 1s", w.Code, apiTook)
	}
}

// TestLoginThrottlePerAddress: at most maxAttemptsPerAddr (50) password
// checks may fail a minute per client address, whatever the email. The next
// check from that address, even with the right password, is a 429 with
// Retry-After until the minute is over; another address is unaffected, and a
// request refused as malformed (no check) does not count.
func TestLoginThrottlePerAddress(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	const attacker, other = "192.0.2.1:1234", "198.51.100.7:4321"
	malformed := func() {
		t.Helper()
		w := loginFrom(env, attacker, env.alice.email, "")
		if body := decode(t, w); w.Code != 422 || body["errors"].(map[string]any)["password"] == nil {
			t.Fatalf("login without a password: got %d %v, want 422 on password", w.Code, body)
		}
	}
	guess := func(i int) *httptest.ResponseRecorder {
		return loginFrom(env, attacker, fmt.Sprintf("guess-%d@example.com", i), "wrong")
	}
	for i := range maxAttemptsPerAddr {
		if i == maxAttemptsPerAddr/2 {
			env.clock.advance(20 * time.Second)
		}
		if i >= maxAttemptsPerAddr-5 {
			malformed()
		}
		if w := guess(i); w.Code != 422 {
			t.Fatalf("check %d from one address: got %d %s, want 422", i+1, w.Code, w.Body)
		}
	}
	w := loginFrom(env, attacker, env.alice.email, env.alice.password)
	if w.Code != 429 || w.Header().Get("Retry-After") != "40" {
		t.Errorf("check %d from one address, the right password: got %d, Retry-After %q; want 429, 40 (the minute's rest)",
			maxAttemptsPerAddr+1, w.Code, w.Header().Get("Retry-After"))
	}
	if w := loginFrom(env, other, "guess-0@example.com", "wrong"); w.Code != 422 {
		t.Errorf("a wrong password from another address: got %d, want 422 (checked)", w.Code)
	}
	if w := loginFrom(env, other, env.alice.email, env.alice.password); w.Code != 200 {
		t.Errorf("the right password from another address: got %d %s, want 200", w.Code, w.Body)
	}
	env.clock.advance(39 * time.Second)
	if w := guess(0); w.Code != 429 {
		t.Errorf("a check a second before the minute is over: got %d, want 429", w.Code)
	}
	env.clock.advance(time.Second)
	if w := loginFrom(env, attacker, env.alice.email, env.alice.password); w.Code != 200 {
		t.Errorf("the right password from that address a minute later: got %d %s, want 200", w.Code, w.Body)
	}
}

// startServer serves env's API on a loopback port as serve does: the
// service's http.Server with the given read deadline, behind the
// connection limits with at most maxConns connections.
func startServer(t testing.TB, env *testEnv, readTimeout time.Duration, maxConns int) string {
	return startServerWith(t, env, readTimeout, newConnLimits(maxConns), nil)
}

// startServerWith is startServer with the connection limits lim and hook
// as a ConnState hook, which the limits call after their own.
func startServerWith(t testing.TB, env *testEnv, readTimeout time.Duration, lim connLimits, hook func(net.Conn, http.ConnState)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	srv := newHTTPServer(env.srv, env.log, readTimeout)
	srv.ConnState = hook
	go srv.Serve(limitConns(srv, ln, lim))
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// trickle opens a connection and sends head, then body a piece of piece
// bytes at a time, one every interval, until the server answers and
// hangs up, or stop closes. It returns the answer and how long after the
// connection opened it ended.
func trickle(addr, head string, body []byte, piece int, interval time.Duration, stop <-chan struct{}) (string, time.Duration, error) {
	start := time.Now()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return "", 0, err
	}
	defer c.Close()
	if _, err := io.WriteString(c, head); err != nil {
		return "", 0, err
	}
	answer := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(c) // the answer, if any, then EOF or reset
		answer <- string(b)
	}()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		next := body[:min(piece, len(body))]
		body = body[len(next):]
		c.Write(next) // fails once the server hung up: the answer tells
		select {
		case a := <-answer:
			return a, time.Since(start), nil
		case <-stop:
			return "", time.Since(start), errors.New("still open")
		case <-tick.C:
		}
	}
}

// TestSlowBodyCutOff: 500 connections that each trickle a login body, one
// byte every 5 s, do not stop other clients, and each is cut off after the
// short read deadline, not the 15 minutes an upload may take.
func TestSlowBodyCutOff(t *testing.T) {
	// Not parallel: it times answers beside 500 slow connections (at
	// most 1 s each).
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
			_, d, err := trickle(addr, head, bytes.Repeat([]byte("x"), 100), 1, 5*time.Second, stop)
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

// TestUploadReadDeadline: an authenticated firmware
// upload may take longer than the short read deadline; any other slow
// request, an upload without a token or a PATCH, is cut off after it.
func TestUploadReadDeadline(t *testing.T) {
	// Not parallel: it times the cut-off at the read deadline (at most 1
	// s late).
	env := newTestEnv(t, nil)
	const readTimeout = time.Second
	addr := startServer(t, env, readTimeout, 1024)
	body, contentType := multipartForm(map[string]string{"name": "slow"}, []byte("\xe9firmware bytes"))
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
			// The body in 5 pieces over 2 s: past the read deadline.
			got, took, err := trickle(addr, tt.head, tt.body, (len(tt.body)+4)/5, 500*time.Millisecond, nil)
			must(t, err)
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
	wantDB(t, env.st, "slow", `SELECT group_concat(name) FROM firmwares`)
	wantDB(t, env.st, "Alice's device", `SELECT name FROM devices WHERE uid = ?`, env.alice.device)
}

// TestDataFileModes: with a umask that lets others
// read new files, and a data directory that already exists with mode 755,
// every file the program creates in it is readable by its owner only, a
// database file an older version left readable is tightened, and so is the
// directory, to 700, with a log line that says so.
func TestDataFileModes(t *testing.T) {
	// Not parallel: it sets the process's umask.
	defer syscall.Umask(syscall.Umask(0o022))
	dir := filepath.Join(t.TempDir(), "data")
	must(t, os.Mkdir(dir, 0o755))
	// An empty database file left world-readable, as an older version made it.
	must(t, os.WriteFile(filepath.Join(dir, "devicehub.db"), nil, 0o644))
	_, stderr, err := cliRun(t, nil, "modes password\n", "user", "add", "-data", dir, "-email", "m@example.com", "-name", "M")
	must(t, err)
	if !strings.Contains(stderr, "tightened") || !strings.Contains(stderr, "0755") {
		t.Errorf("user add's log %q: want a line saying the data directory (0755) was tightened", stderr)
	}
	uid := cliOK(t, "", "device", "add", "-data", dir, "-owner", "m@example.com", "-platform", "esp32", "-board", "devkit")
	tok := cliOK(t, "", "token", "create", "-data", dir, "-email", "m@example.com", "-name", "modes")
	base, _, stop := serveInProcess(t, nil, "-data", dir)
	c := &liveClient{base: base, token: strings.TrimSpace(tok), hc: http.DefaultClient}
	body, contentType := multipartForm(map[string]string{"name": "fw"}, []byte{0xE9, 1, 2, 3})
	c.want(t, 201, "POST", "/v1/user/devices/"+strings.TrimSpace(uid)+"/firmwares", contentType, body)
	checkOwnerOnly(t, dir, "while serving", ".", "devicehub.db", "devicehub.db-wal", "devicehub.db-shm", "ota.key", "firmware", "firmware/tmp")
	if err := stop(); err != nil {
		t.Fatalf("serve: %v", err)
	}
	checkOwnerOnly(t, dir, "after serving", ".", "devicehub.db", "ota.key", "firmware", "firmware/tmp")
	fw, _ := filepath.Glob(filepath.Join(dir, "firmware", "*.bin"))
	if len(fw) != 1 {
		t.Errorf("firmware files %v, want the one uploaded", fw)
	}
}

// TestQuotasAPI: firmwares and buttons per device,
// firmware bytes per user (a file counted once per row), tokens per user:
// a write over a limit is a 422 whose message names the limit and changes
// nothing; under it, or with the limit 0, the write goes through.
func TestQuotasAPI(t *testing.T) {
	t.Parallel()
	limits := func(q store.Quotas) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(q)) }
	}
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		// alice: 2 firmwares (600 KiB and 100 KiB) and 2 buttons on her
		// device, and a second device; bob: 900 KiB.
		apiUpload(env, env.alice, "a", otaFirmware(600<<10, 1))
		apiUpload(env, env.alice, "b", otaFirmware(100<<10, 2))
		apiUpload(env, env.bob, "bob", otaFirmware(900<<10, 3))
		for _, id := range []string{"one", "two"} {
			apiAddButton(t, env, env.alice, model.CommandButton{ID: id, Label: id, Payload: json.RawMessage(`{}`)})
		}
		v["alice2"] = addDevice(t, env, env.alice, "esp32").device
	}
	buttons := "/v1/user/devices/{alice}/command-buttons"
	button := `{"id":"three","label":"Three","payload":{"cmd":"x"}}`
	const tooManyFirmwares = `{"message":"This device has reached its limit of 2 firmwares."}`
	const tooManyButtons = `{"message":"This device has reached its limit of 2 command buttons."}`
	const tooManyBytes = `{"message":"This upload would pass your team's firmware storage limit of 1 MiB."}`
	count := func(want, query string, args ...string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			vals := make([]any, len(args))
			for i, a := range args {
				vals[i] = v.expand(a)
			}
			wantDB(t, env.st, want, query, vals...)
		}
	}
	firmwaresOf := `SELECT count(*) FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`
	buttonsOf := `SELECT count(*) FROM command_buttons b JOIN devices d ON d.id = b.device_id WHERE d.uid = ?`

	// upload sends a firmware named c to the device of who ("alice",
	// "alice2" or "bob"), with its owner's token, under the limits q.
	upload := func(name string, q store.Quotas, who string, file []byte, wantStatus int, wantBody string) apiCase {
		return apiCase{name: name, setup: limits(q), method: "POST", path: "/v1/user/devices/{" + who + "}/firmwares",
			token: "{" + strings.TrimSuffix(who, "2") + "_token}", form: map[string]string{"name": "c"}, file: file, wantStatus: wantStatus, wantBody: wantBody}
	}

	runAPICases(t, fixture, []apiCase{
		upload("firmware at the device limit", store.Quotas{Firmwares: 2}, "alice", otaFirmware(10, 4), 422, tooManyFirmwares),
		upload("firmware under the device limit", store.Quotas{Firmwares: 3}, "alice", otaFirmware(10, 4), 201, "").then(count("3", firmwaresOf, "{alice}")),
		upload("firmware limit is per device", store.Quotas{Firmwares: 2}, "alice2", otaFirmware(10, 4), 201, "").then(count("1", firmwaresOf, "{alice2}")),
		upload("firmware past the user's bytes", store.Quotas{FirmwareMiB: 1}, "alice2", otaFirmware(325<<10, 4), 422, tooManyBytes),
		upload("firmware filling the user's bytes exactly", store.Quotas{FirmwareMiB: 1}, "alice2", otaFirmware(324<<10, 4), 201, "").then(count("1", firmwaresOf, "{alice2}")),
		upload("a shared file counts once per row", store.Quotas{FirmwareMiB: 1}, "alice2", otaFirmware(600<<10, 1), 422, tooManyBytes),
		upload("another user's bytes do not count", store.Quotas{FirmwareMiB: 1}, "bob", otaFirmware(124<<10, 4), 201, "").then(count("2", firmwaresOf, "{bob}")),
		upload("no firmware limits", store.Quotas{}, "alice", otaFirmware(1<<20, 4), 201, "").then(count("3", firmwaresOf, "{alice}")),

		call("button at the device limit", "POST", buttons, "{alice_token}", button, 422, tooManyButtons).after(limits(store.Quotas{Buttons: 2})),
		call("button under the device limit", "POST", buttons, "{alice_token}", button, 201, "").after(limits(store.Quotas{Buttons: 3})).
			then(count("3", buttonsOf, "{alice}")),
		call("button limit is per device", "POST", "/v1/user/devices/{alice2}/command-buttons", "{alice_token}", button, 201, "").
			after(limits(store.Quotas{Buttons: 2})).then(count("1", buttonsOf, "{alice2}")),
		call("no button limit", "POST", buttons, "{alice_token}", button, 201, "").after(limits(store.Quotas{})).then(count("3", buttonsOf, "{alice}")),
	})
}

// TestTeamStorageAPI: a team adds at most -max-devices devices through
// the API, however many the operator's CLI gave it, and its buttons'
// payloads stay within -max-team-data-mib: past either, a 422 whose
// message names the limit, and nothing changes; another team, or no
// limit, is not held back. Before, creating devices and buttons never
// answered 422: three devices with 100 buttons of 62 KiB each took 17 MB.
func TestTeamStorageAPI(t *testing.T) {
	t.Parallel()
	limits := func(q store.Quotas) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(q)) }
	}
	// cli gives alice's team n more devices, as 'device add' does.
	cli := func(n int) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			for range n {
				addDevice(t, env, env.alice, "esp32")
			}
		}
	}
	// buttons gives alice's device n buttons of 62 KiB (and 100 bytes).
	pad := strings.Repeat("x", 62<<10)
	buttons := func(n int) setupFunc {
		return func(t *testing.T, env *testEnv, v apiVars) {
			for i := range n {
				apiAddButton(t, env, env.alice, model.CommandButton{ID: fmt.Sprint("b", i), Label: "B",
					Payload: json.RawMessage(`{"pad":"` + pad + `"}`)})
			}
		}
	}
	devices := `SELECT count(*) FROM devices WHERE team_id = ?`
	device := `{"platform":"esp32","board":"devkit"}`
	button := apiJSON(map[string]any{"id": "new", "label": "New", "payload": map[string]string{"pad": pad}})
	const tooManyDevices = `{"message":"Your team has reached its limit of 3 devices."}`
	const tooMuchData = `{"message":"This button would pass your team's limit of 1 MiB of buttons and command history."}`
	count := func(want, query, who string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			wantDB(t, env.st, want, query, v.expand(who))
		}
	}
	runAPICases(t, func(t *testing.T, env *testEnv, v apiVars) {
		v["alice2"] = addDevice(t, env, env.alice, "esp32").device
	}, []apiCase{
		call("device under the team's limit", "POST", "/v1/user/devices", "{alice_token}", device, 201, "").
			after(limits(store.Quotas{Devices: 3})).then(count("3", devices, "{alice_id}")),
		call("device at the team's limit", "POST", "/v1/user/devices", "{alice_token}", device, 422, tooManyDevices).
			after(allSetups(cli(1), limits(store.Quotas{Devices: 3}))),
		call("device past the limit by the CLI", "POST", "/v1/user/devices", "{alice_token}", device, 422, tooManyDevices).
			after(allSetups(cli(3), limits(store.Quotas{Devices: 3}))),
		call("device limit is per team", "POST", "/v1/user/devices", "{bob_token}", device, 201, "").
			after(allSetups(cli(1), limits(store.Quotas{Devices: 3}))).then(count("2", devices, "{bob_id}")),
		call("no device limit", "POST", "/v1/user/devices", "{alice_token}", device, 201, "").
			after(allSetups(cli(3), limits(store.Quotas{}))).then(count("6", devices, "{alice_id}")),

		call("button under the team's data", "POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", button, 201, "").
			after(allSetups(buttons(15), limits(store.Quotas{TeamDataMiB: 1}))),
		call("button past the team's data", "POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", button, 422, tooMuchData).
			after(allSetups(buttons(16), limits(store.Quotas{TeamDataMiB: 1}))),
		call("button past the team's data, on another device", "POST", "/v1/user/devices/{alice2}/command-buttons", "{alice_token}", button, 422, tooMuchData).
			after(allSetups(buttons(16), limits(store.Quotas{TeamDataMiB: 1}))),
		call("team data is per team", "POST", "/v1/user/devices/{bob}/command-buttons", "{bob_token}", button, 201, "").
			after(allSetups(buttons(16), limits(store.Quotas{TeamDataMiB: 1}))),
		call("no team data limit", "POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", button, 201, "").
			after(allSetups(buttons(16), limits(store.Quotas{}))),
	})
}

// teamBytes is what the team's JSON weighs as the store counts it, and
// as its rows sum up; a test that changes them checks the two agree.
func teamBytes(t *testing.T, env *testEnv, teamID int64) (counted, summed int64) {
	t.Helper()
	must(t, storeReader(env.st).QueryRow(`SELECT button_bytes + command_bytes FROM teams WHERE id = ?`, teamID).Scan(&counted))
	must(t, storeReader(env.st).QueryRow(`SELECT
		(SELECT coalesce(sum(octet_length(b.payload)), 0) FROM devices d JOIN command_buttons b ON b.device_id = d.id WHERE d.team_id = ?1) +
		(SELECT coalesce(sum(octet_length(c.payload) + coalesce(octet_length(c.result), 0)), 0)
			FROM devices d JOIN commands c ON c.device_id = d.id WHERE d.team_id = ?1)`, teamID).Scan(&summed))
	if counted != summed {
		t.Errorf("team %d's JSON counted %d bytes, its rows hold %d", teamID, counted, summed)
	}
	return counted, summed
}

// TestTeamDataTrimsCommands: past -max-team-data-mib a team's oldest
// finished commands are deleted, down to a 64th under it, whether a
// new command, a device's result or a new button took it there; a new
// command is never refused for it; unfinished commands, and the command
// of a rollout's running device, stay; another team's stay. What a team
// weighs is counted as its rows change, device deletes included.
func TestTeamDataTrimsCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := newTestEnv(t, &recordingLink{})
	a, b := env.alice, env.bob
	env.setStatus(a.device, "online")
	env.setStatus(b.device, "online")
	a2 := addDevice(t, env, a, "esp32")
	env.setStatus(a2.device, "online")
	const limit = 1 << 20
	env.rebuild(withQuotas(store.Quotas{TeamDataMiB: 1}))
	ok := true
	finish := func(u testUser, id string, result string) {
		t.Helper()
		_, err := env.st.ApplyDeviceMessages(ctx, nil, []mqttlink.Result{{UID: u.device, ID: id, Result: wire.Result{OK: &ok, Value: json.RawMessage(result)}}})
		must(t, err)
	}
	pad := func(n int) string { return strings.Repeat("x", n) }
	bobs := sendOK(t, env, b, "/commands", `{"payload":{"pad":"`+pad(60<<10)+`"}}`)
	finish(b, bobs, `{"done":true}`)

	// 40 commands of 62 KiB, each timed out before the next: the oldest go.
	var sent []string
	for i := range 40 {
		u := []testUser{a, a2}[i%2]
		sent = append(sent, sendOK(t, env, u, "/commands", `{"payload":{"n":`+fmt.Sprint(i)+`,"pad":"`+pad(62<<10)+`"}}`))
		env.clock.advance(defaultCommandTimeout)
		_, err := env.st.ExpireCommands(ctx, env.clock.now())
		must(t, err)
		if used, _ := teamBytes(t, env, a.id); used > limit {
			t.Fatalf("after command %d the team keeps %d bytes, past the limit of %d", i, used, limit)
		}
	}
	kept := strings.Split(scalar(t, env.st, `SELECT group_concat(id) FROM (SELECT c.id FROM commands c
		JOIN devices d ON d.id = c.device_id WHERE d.team_id = ? ORDER BY c.seq)`, a.id), ",")
	if want := sent[len(sent)-len(kept):]; !slices.Equal(kept, want) || len(kept) < 13 || len(kept) > 16 {
		t.Errorf("kept %d commands %v, want the newest 13 to 16 of %v", len(kept), kept, sent)
	}
	wantDB(t, env.st, "1", `SELECT count(*) FROM commands WHERE id = ?`, bobs)
	teamBytes(t, env, b.id)

	// Unfinished commands stay, and so does a rollout's running one;
	// results that take the team past its limit make room too.
	running := sendOK(t, env, a, "/commands", `{"payload":{"ota":"`+pad(62<<10)+`"}}`)
	finish(a, running, `{}`)
	mustExec(t, env.st, `INSERT INTO rollouts (team_id, md5, sha256, state, batch_size, max_failures, created_at, updated_at)
		VALUES (?, 'm', 's', 'running', 1, 0, 't', 't')`, a.id)
	mustExec(t, env.st, `INSERT INTO rollout_devices (rollout_id, position, device_id, state, command_id)
		VALUES (last_insert_rowid(), 0, (SELECT id FROM devices WHERE uid = ?), 'running', ?)`, a.device, running)
	mustExec(t, env.st, `UPDATE commands SET seq = -1 WHERE id = ?`, running) // the oldest of all
	var open []string
	for range 20 {
		open = append(open, sendOK(t, env, a2, "/commands", `{"payload":{}}`))
	}
	var results []mqttlink.Result
	for _, id := range open {
		results = append(results, mqttlink.Result{UID: a2.device, ID: id, Result: wire.Result{OK: &ok, Value: json.RawMessage(`{"log":"` + pad(15<<10) + `"}`)}})
	}
	_, err := env.st.ApplyDeviceMessages(ctx, nil, results)
	must(t, err)
	for _, id := range append(open, running) {
		wantDB(t, env.st, "1", `SELECT count(*) FROM commands WHERE id = ?`, id)
	}
	if used, _ := teamBytes(t, env, a.id); used > limit {
		t.Errorf("after results the team keeps %d bytes, past the limit of %d", used, limit)
	}

	// Buttons make room among the commands; deletes are counted.
	for _, id := range []string{"big", "bigger"} {
		apiAddButton(t, env, a, model.CommandButton{ID: id, Label: "Big", Payload: json.RawMessage(`{"pad":"` + pad(62<<10) + `"}`)})
	}
	if used, _ := teamBytes(t, env, a.id); used > limit {
		t.Errorf("after buttons the team keeps %d bytes, past the limit of %d", used, limit)
	}
	env.want(t, 200, "DELETE", "/v1/user/devices/"+a.device+"/command-buttons/big", a.token, nil)
	teamBytes(t, env, a.id)
	env.want(t, 200, "DELETE", "/v1/user/devices/"+a2.device, a.token, nil)
	teamBytes(t, env, a.id)
}

// TestLoginAtTokenLimit: a login at the token limit deletes the user's least
// recently used token (a never used one by its age), which is refused from
// then on; the other tokens and other users' are untouched.
func TestLoginAtTokenLimit(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withQuotas(store.Quotas{Tokens: 3}))
	a := env.alice
	older := apiAddToken(t, env, a.id) // created after the fixture's token
	env.clock.advance(time.Minute)
	newer := apiAddToken(t, env, a.id)
	env.clock.advance(time.Minute)
	// The fixture's token is the oldest, but used now: older is the least
	// recently used.
	apiWantStatus(t, env, "GET", "/v1/auth/me", a.token, 200)
	inUse := func() { // the tokens in use keep working
		t.Helper()
		apiWantStatus(t, env, "GET", "/v1/auth/me", a.token, 200)
		apiWantStatus(t, env, "GET", "/v1/auth/me", newer, 200)
	}
	bobBefore := scalar(t, env.st, `SELECT group_concat(id) FROM tokens WHERE user_id = ?`, env.bob.id)
	// Each login names its token apart: a login replaces the tokens of
	// its own name (TestLoginReplacesTokenOfItsName), not the others.
	logins := 0
	login := func() *httptest.ResponseRecorder {
		logins++
		body := apiJSON(map[string]string{"email": a.email, "password": a.password, "token_name": fmt.Sprint("login ", logins)})
		return env.request("POST", "/v1/auth/login", "", body)
	}

	w := login()
	checkAnswer(t, w, 200, "")
	loggedIn, _ := decode(t, w)["token"].(string)
	wantDB(t, env.st, "3", `SELECT count(*) FROM tokens WHERE user_id = ?`, a.id)
	apiWantStatus(t, env, "GET", "/v1/auth/me", older, 401)
	wantDB(t, env.st, bobBefore, `SELECT group_concat(id) FROM tokens WHERE user_id = ?`, env.bob.id)

	// A never used token goes by its age: the login's token, made a
	// before the others were used again.
	env.clock.advance(2 * time.Minute)
	inUse()
	w = login()
	checkAnswer(t, w, 200, "")
	unused, _ := decode(t, w)["token"].(string)
	apiWantStatus(t, env, "GET", "/v1/auth/me", loggedIn, 401)
	inUse()

	// A token never used goes before used ones, even ones used no more
	// recently than it was made: a flood of logins recycles its own tokens,
	// not the one an integration is using.
	env.clock.advance(2 * time.Minute)
	checkAnswer(t, login(), 200, "")
	apiWantStatus(t, env, "GET", "/v1/auth/me", unused, 401)
	inUse()
}

const apiDiskFull = `{"message":"The server's disk is full: nothing was saved. Try again later."}`

// TestDiskFull: on a data directory whose disk fills
// up (a 2 MiB tmpfs), an upload and a database write are answered 507 and
// leave nothing behind: no row, no firmware file, no temporary file. Once
// there is room again, writes succeed.
func TestDiskFull(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=2m,mode=0700"); err != nil {
		t.Skipf("cannot mount a small tmpfs here (%v); TestDiskFullAnswers covers the answers without one", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	env := newTestEnvIn(t, dir, nil)
	a := env.alice
	// nothingLeft checks that the refused writes left no trace.
	nothingLeft := func(when string) {
		t.Helper()
		wantDB(t, env.st, "0", `SELECT count(*) FROM firmwares`)
		wantDB(t, env.st, "0", `SELECT count(*) FROM command_buttons`)
		for _, pattern := range []string{"firmware/*.bin", "firmware/tmp/*"} {
			if files, _ := filepath.Glob(filepath.Join(dir, pattern)); len(files) > 0 {
				t.Errorf("%s: files left: %v", when, files)
			}
		}
	}

	checkAnswer(t, env.upload(a, map[string]string{"name": "big"}, otaFirmware(store.MaxFirmwareSize, 1)), 507, apiDiskFull)
	nothingLeft("after the upload")

	filler, err := os.Create(filepath.Join(dir, "filler"))
	must(t, err)
	for err == nil {
		_, err = filler.Write(make([]byte, 4096))
	}
	if filler.Close(); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("fill the disk: %v", err)
	}
	button := apiJSON(map[string]any{"id": "big", "label": "Big", "payload": map[string]string{"blob": strings.Repeat("x", 60<<10)}})
	checkAnswer(t, env.request("POST", "/v1/user/devices/"+a.device+"/command-buttons", a.token, button), 507, apiDiskFull)
	checkAnswer(t, env.upload(a, map[string]string{"name": "small"}, otaFirmware(1000, 2)), 507, apiDiskFull)
	nothingLeft("on a full disk")
	apiWantStatus(t, env, "GET", "/v1/user/devices/"+a.device, a.token, 200)

	must(t, os.Remove(filler.Name()))
	checkAnswer(t, env.request("POST", "/v1/user/devices/"+a.device+"/command-buttons", a.token, button), 201, "")
	checkAnswer(t, env.upload(a, map[string]string{"name": "small"}, otaFirmware(1000, 2)), 201, "")
}

// TestDiskFullAnswers: the full-disk answer without a
// small disk. SQLite refusing to grow the database (max_page_count, which
// fails as SQLITE_FULL exactly like a full disk) is a 507 that changes
// nothing, and a file write that fails with ENOSPC (/dev/full) is a 507.
func TestDiskFullAnswers(t *testing.T) {
	t.Parallel()
	button := apiJSON(map[string]any{"id": "big", "label": "Big", "payload": map[string]string{"blob": strings.Repeat("x", 60<<10)}})
	runAPICases(t, nil, []apiCase{
		{name: "database cannot grow",
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				var pages int
				must(t, storeWriter(env.st).QueryRow(`PRAGMA page_count`).Scan(&pages))
				// The writer is one connection: the limit holds for every write.
				mustExec(t, env.st, fmt.Sprintf(`PRAGMA max_page_count = %d`, pages))
			},
			method: "POST", path: "/v1/user/devices/{alice}/command-buttons", token: "{alice_token}", body: button,
			wantStatus: 507, wantBody: apiDiskFull},
	})

	devFull, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
	if err != nil {
		t.Skipf("no /dev/full: %v", err)
	}
	defer devFull.Close()
	_, _, err = hashToTemp(devFull, bytes.NewReader(otaFirmware(1<<16, 1)), store.MaxFirmwareSize)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("writing an upload to /dev/full: got %v, want ENOSPC", err)
	}
	env := newTestEnv(t, nil)
	w := httptest.NewRecorder()
	env.srv.writeError(w, httptest.NewRequest("POST", "/v1/user/devices/x/firmwares", nil), fmt.Errorf("upload: %w", err))
	if w.Code != 507 || !jsonEqual(t, w.Body.Bytes(), []byte(apiDiskFull)) {
		t.Errorf("ENOSPC: got %d %s, want 507 %s", w.Code, w.Body, apiDiskFull)
	}
}

// TestLimitConfig: each limit's flag, its environment variable (which
// the flag overrides) and default; 0 is allowed and means
// no limit; anything but a whole number is a usage error. The same for
// -trusted-proxies, whose items must be CIDRs or addresses.
func TestLimitConfig(t *testing.T) {
	t.Parallel()
	defaults := store.Quotas{Firmwares: 20, Buttons: 100, FirmwareMiB: 256, LibraryFiles: 200, Tokens: 100, Members: 100, Devices: 10000, TeamDataMiB: 64, Webhooks: 10, AuditDays: 90, HistoryDays: 30}
	tests := []struct {
		name      string
		env       map[string]string
		args      []string
		wantConns int
		want      store.Quotas
		wantErr   string
		// wantProxies is the trusted proxies as printed; "" is none.
		wantProxies string
	}{
		{name: "defaults", wantConns: 1024, want: defaults},
		{name: "environment", env: map[string]string{"DEVICEHUB_MAX_CONNS": "10", "DEVICEHUB_MAX_FIRMWARES": "1",
			"DEVICEHUB_MAX_BUTTONS": "2", "DEVICEHUB_MAX_FIRMWARE_MIB": "3", "DEVICEHUB_MAX_TOKENS": "4", "DEVICEHUB_MAX_MEMBERS": "6", "DEVICEHUB_AUDIT_DAYS": "5", "DEVICEHUB_HISTORY_DAYS": "7",
			"DEVICEHUB_MAX_DEVICES": "8", "DEVICEHUB_MAX_TEAM_DATA_MIB": "9", "DEVICEHUB_MAX_LIBRARY_FILES": "11", "DEVICEHUB_MAX_WEBHOOKS": "12"},
			wantConns: 10, want: store.Quotas{Firmwares: 1, Buttons: 2, FirmwareMiB: 3, LibraryFiles: 11, Tokens: 4, Members: 6, Devices: 8, TeamDataMiB: 9, Webhooks: 12, AuditDays: 5, HistoryDays: 7}},
		{name: "flags over environment", env: map[string]string{"DEVICEHUB_MAX_CONNS": "10", "DEVICEHUB_MAX_TOKENS": "4", "DEVICEHUB_HISTORY_DAYS": "7"},
			args: []string{"-max-conns", "0", "-max-firmwares", "0", "-max-buttons", "5", "-max-firmware-mib", "0", "-max-tokens", "7", "-max-members", "0", "-audit-days", "0", "-history-days", "0",
				"-max-devices", "0", "-max-team-data-mib", "0", "-max-library-files", "0", "-max-webhooks", "0"},
			wantConns: 0, want: store.Quotas{Buttons: 5, Tokens: 7}},
		{name: "bad history days", env: map[string]string{"DEVICEHUB_HISTORY_DAYS": "-1"}, wantErr: "$DEVICEHUB_HISTORY_DAYS"},
		{name: "negative flag", args: []string{"-max-buttons", "-1"}, wantErr: "-max-buttons"},
		{name: "not a number", args: []string{"-max-conns", "many"}, wantErr: "-max-conns"},
		{name: "bad environment", env: map[string]string{"DEVICEHUB_MAX_FIRMWARE_MIB": "1.5"}, wantErr: "$DEVICEHUB_MAX_FIRMWARE_MIB"},
		{name: "trusted proxies", env: map[string]string{"DEVICEHUB_TRUSTED_PROXIES": "192.0.2.0/24"},
			args: []string{"-trusted-proxies", "10.0.0.0/8, 2001:db8::1"}, wantConns: 1024, want: defaults,
			wantProxies: "[10.0.0.0/8 2001:db8::1/128]"},
		{name: "trusted proxies from the environment", env: map[string]string{"DEVICEHUB_TRUSTED_PROXIES": "192.0.2.7/24"},
			wantConns: 1024, want: defaults, wantProxies: "[192.0.2.0/24]"},
		{name: "bad trusted proxy", args: []string{"-trusted-proxies", "10.0.0.0/8,proxy.example"}, wantErr: "proxy.example"},
		{name: "bad trusted proxy in the environment", env: map[string]string{"DEVICEHUB_TRUSTED_PROXIES": "x"}, wantErr: "$DEVICEHUB_TRUSTED_PROXIES"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := &cli{}
			c.fs = newFlagSet("serve", &c.cfg, func(k string) string { return tt.env[k] }, io.Discard)
			err := c.parse(tt.args)
			if tt.wantErr != "" {
				if !errors.As(err, new(usageError)) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("got %v, want a usage error naming %s", err, tt.wantErr)
				}
				return
			}
			must(t, err)
			if c.cfg.maxConns != tt.wantConns || c.cfg.limits != tt.want {
				t.Errorf("got max-conns %d, limits %+v; want %d, %+v", c.cfg.maxConns, c.cfg.limits, tt.wantConns, tt.want)
			}
			proxies := ""
			if c.cfg.trustedProxies != nil {
				proxies = fmt.Sprint(c.cfg.trustedProxies)
			}
			if proxies != tt.wantProxies {
				t.Errorf("trusted proxies: got %q, want %q", proxies, tt.wantProxies)
			}
		})
	}
}

// TestLimitsApplied: the configured limits reach the program's writes: the
// CLI's 'token create' at -max-tokens, and the served API at -max-buttons
// and -max-devices, which the CLI's 'device add' is not held to.
func TestLimitsApplied(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cliOK(t, "pw\n", "user", "add", "-data", dir, "-email", "l@example.com", "-name", "L")
	uid := cliOK(t, "", "device", "add", "-data", dir, "-owner", "l@example.com", "-platform", "esp32", "-board", "devkit")
	tok := cliOK(t, "", "token", "create", "-data", dir, "-email", "l@example.com", "-name", "one", "-max-tokens", "1")
	_, _, err := cliRun(t, map[string]string{"DEVICEHUB_MAX_TOKENS": "1"}, "", "token", "create", "-data", dir, "-email", "l@example.com", "-name", "two")
	if err == nil || !strings.Contains(err.Error(), "limit of 1 tokens") {
		t.Errorf("second token at DEVICEHUB_MAX_TOKENS=1: got %v, want the limit named", err)
	}

	// The operator's CLI adds devices past -max-devices; the API does not.
	cliOKIn(t, map[string]string{"DEVICEHUB_MAX_DEVICES": "1"}, "", "device", "add", "-data", dir, "-owner", "l@example.com", "-platform", "esp32", "-board", "devkit")

	base, _, _ := serveInProcess(t, nil, "-data", dir, "-max-buttons", "1", "-max-devices", "2")
	c := &liveClient{base: base, token: strings.TrimSpace(tok), hc: http.DefaultClient}
	path := "/v1/user/devices/" + strings.TrimSpace(uid) + "/command-buttons"
	c.want(t, 201, "POST", path, "application/json", []byte(`{"id":"one","label":"B","payload":{}}`))
	c.want(t, 422, "POST", path, "application/json", []byte(`{"id":"two","label":"B","payload":{}}`))
	c.want(t, 422, "POST", "/v1/user/devices", "application/json", []byte(`{"platform":"esp32","board":"devkit"}`))
}

// TestClientIP: X-Forwarded-For is believed only from a trusted proxy, and
// then the client is the right-most address that is not a trusted proxy.
func TestClientIP(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		trusted string // -trusted-proxies
		peer    string // RemoteAddr
		xff     []string
		want    string
	}{
		{"no proxies trusted", "", "10.0.0.1:80", []string{"203.0.113.7"}, "10.0.0.1"},
		{"untrusted peer", "10.0.0.0/8", "192.0.2.1:80", []string{"203.0.113.7"}, "192.0.2.1"},
		{"trusted peer", "10.0.0.0/8", "10.0.0.1:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"trusted peer, no header", "10.0.0.0/8", "10.0.0.1:80", nil, "10.0.0.1"},
		{"trusted peer, empty header", "10.0.0.0/8", "10.0.0.1:80", []string{""}, "10.0.0.1"},
		{"client-sent addresses are ignored", "10.0.0.0/8", "10.0.0.1:80", []string{"198.51.100.1, 203.0.113.7"}, "203.0.113.7"},
		{"chain of trusted proxies", "10.0.0.0/8", "10.0.0.1:80", []string{"198.51.100.1, 203.0.113.7, 10.0.0.2"}, "203.0.113.7"},
		{"several header lines", "10.0.0.0/8", "10.0.0.1:80", []string{"198.51.100.1", "203.0.113.7,10.0.0.2"}, "203.0.113.7"},
		{"every hop trusted", "10.0.0.0/8", "10.0.0.1:80", []string{"10.0.0.3, 10.0.0.2"}, "10.0.0.3"},
		{"garbage where the proxy's hop should be", "10.0.0.0/8", "10.0.0.1:80", []string{"203.0.113.7, not-an-address"}, "10.0.0.1"},
		{"garbage behind a trusted hop", "10.0.0.0/8", "10.0.0.1:80", []string{"not-an-address, 10.0.0.2"}, "10.0.0.2"},
		{"hop with a port", "10.0.0.0/8", "10.0.0.1:80", []string{"203.0.113.7:4711"}, "203.0.113.7"},
		{"IPv6 hop with a port", "10.0.0.0/8", "10.0.0.1:80", []string{"[2001:db8::7]:4711"}, "2001:db8::7"},
		{"single trusted address", "10.0.0.1", "10.0.0.1:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"single address, another peer", "10.0.0.1", "10.0.0.2:80", []string{"203.0.113.7"}, "10.0.0.2"},
		{"IPv6 proxy", "::1/128", "[::1]:80", []string{"2001:db8::1"}, "2001:db8::1"},
		{"IPv4-mapped peer", "10.0.0.0/8", "[::ffff:10.0.0.1]:80", []string{"203.0.113.7"}, "203.0.113.7"},
		{"IPv4-mapped hop", "10.0.0.0/8", "10.0.0.1:80", []string{"::ffff:203.0.113.7"}, "203.0.113.7"},
		{"two ranges", "10.0.0.0/8, 172.16.0.0/12", "10.0.0.1:80", []string{"203.0.113.7, 172.16.5.5"}, "203.0.113.7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			proxies, err := parseTrustedProxies(tt.trusted)
			must(t, err)
			s := &server{trustedProxies: proxies}
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = tt.peer
			for _, v := range tt.xff {
				r.Header.Add("X-Forwarded-For", v)
			}
			if got := s.clientIP(r); got != tt.want {
				t.Errorf("got %q, want %q", got, tt.want)
			}
		})
	}
	for _, bad := range []string{"nonsense", "10.0.0.0/33", "10.0.0.0/8,,", "10.0.0.0/8 192.168.0.0/16"} {
		if _, err := parseTrustedProxies(bad); err == nil {
			t.Errorf("parseTrustedProxies(%q): got no error", bad)
		}
	}
}

// TestLoginBehindProxy: behind a trusted proxy, one client's wrong passwords
// do not lock out another client's login to the same account; a client that
// is not a proxy cannot dodge the throttle by sending X-Forwarded-For.
func TestLoginBehindProxy(t *testing.T) {
	t.Parallel()
	proxies, err := parseTrustedProxies("10.0.0.1")
	must(t, err)
	env := newTestEnv(t, nil, func(_ *testEnv, o *serverOptions) { o.trustedProxies = proxies })
	login := func(peer, xff, password string) int { return loginFrom(env, peer, env.alice.email, password, xff).Code }
	for i := range 5 {
		if got := login("10.0.0.1:5000", "203.0.113.66", "wrong"); got != 422 {
			t.Fatalf("attacker's guess %d: got %d, want 422", i+1, got)
		}
	}
	if got := login("10.0.0.1:5000", "203.0.113.66", "wrong"); got != 429 {
		t.Errorf("attacker's sixth guess: got %d, want 429", got)
	}
	if got := login("10.0.0.1:5001", "203.0.113.7", env.alice.password); got != 200 {
		t.Errorf("alice behind the same proxy: got %d, want 200", got)
	}
	for i := range 6 {
		want := 422
		if i == 5 {
			want = 429
		}
		if got := login("192.0.2.9:5000", fmt.Sprintf("198.51.100.%d", i), "wrong"); got != want {
			t.Errorf("direct guess %d with a made-up X-Forwarded-For: got %d, want %d", i+1, got, want)
		}
	}
}

// TestAmbiguousJSON: what two JSON parsers on a device could read differently
// is refused with a 422 field error, and changes nothing: a key twice in a
// payload object (at any depth, escaped or not) or in the body itself, bytes
// that are not UTF-8, and escaped UTF-16 surrogates without their pair; in
// command and button payloads and in every text field.
func TestAmbiguousJSON(t *testing.T) {
	t.Parallel()
	const dupPayload = "The payload field must not contain duplicate keys."
	const utf8Payload = "The payload field must be valid UTF-8."
	const dupBody = "The body field must not contain duplicate keys."
	utf8Err := func(field string) string {
		return apiFieldError(field, "The "+strings.ReplaceAll(field, "_", " ")+" field must be valid UTF-8.")
	}
	const offline = `{"message":"Device is offline."}` // a valid command, refused only for the device's state
	commands := "/v1/user/devices/{alice}/commands"
	buttons := "/v1/user/devices/{alice}/command-buttons"
	command := func(name, payload string, wantStatus int, wantBody string) apiCase {
		return apiCase{name: "command: " + name, method: "POST", path: commands, token: "{alice_token}",
			body: `{"payload":` + payload + `}`, wantStatus: wantStatus, wantBody: wantBody}
	}
	button := func(name, payload string, wantStatus int, wantBody string) apiCase {
		return apiCase{name: "button: " + name, method: "POST", path: buttons, token: "{alice_token}",
			body: `{"id":"b","label":"B","payload":` + payload + `}`, wantStatus: wantStatus, wantBody: wantBody}
	}
	tests := []apiCase{
		command("duplicate key", `{"cmd":"a","cmd":"b"}`, 422, apiFieldError("payload", dupPayload)),
		command("duplicate key, escaped", `{"cmd":"a","c\u006dd":"b"}`, 422, apiFieldError("payload", dupPayload)),
		command("duplicate key, nested", `{"cmd":"a","args":{"n":1,"m":{"x":1,"x":1}}}`, 422, apiFieldError("payload", dupPayload)),
		command("duplicate key, in an array", `{"cmd":"a","list":[1,{"x":1,"x":2}]}`, 422, apiFieldError("payload", dupPayload)),
		command("invalid UTF-8 in a value", "{\"cmd\":\"a\xff\"}", 422, apiFieldError("payload", utf8Payload)),
		command("invalid UTF-8 in a key", "{\"c\xc3md\":\"a\"}", 422, apiFieldError("payload", utf8Payload)),
		command("lone high surrogate", `{"cmd":"\ud800"}`, 422, apiFieldError("payload", utf8Payload)),
		command("lone low surrogate", `{"cmd":"\udc00x"}`, 422, apiFieldError("payload", utf8Payload)),
		command("surrogates reversed", `{"cmd":"\ude00\ud83d"}`, 422, apiFieldError("payload", utf8Payload)),
		command("payload twice in the body", `{"cmd":"a"},"payload":{"cmd":"b"}`, 422, apiFieldError("body", dupBody)),
		command("same keys in different objects", `{"x":{"a":1},"y":{"a":1},"a":[{"a":1},{"a":2}]}`, 422, offline),
		command("surrogate pair", `{"emoji":"\ud83d\ude00","raw":"😀"}`, 422, offline),
		command("escaped backslash before u", `{"path":"C:\\ud800"}`, 422, offline),

		button("duplicate key", `{"cmd":"a","cmd":"b"}`, 422, apiFieldError("payload", dupPayload)),
		button("duplicate key, nested", `{"a":[{"b":{"c":1,"c":2}}]}`, 422, apiFieldError("payload", dupPayload)),
		button("invalid UTF-8", "{\"cmd\":\"\xed\xa0\x80\"}", 422, apiFieldError("payload", utf8Payload)), // a surrogate in UTF-8 form
		button("lone surrogate", `{"cmd":"\udbff"}`, 422, apiFieldError("payload", utf8Payload)),
		button("valid", `{"emoji":"\ud83d\ude00"}`, 201, ""),

		call("button label", "POST", buttons, "{alice_token}", "{\"id\":\"b\",\"label\":\"L\xff\",\"payload\":{}}", 422, utf8Err("label")),
		call("button label, lone surrogate", "POST", buttons, "{alice_token}", `{"id":"b","label":"L\ud800","payload":{}}`, 422, utf8Err("label")),
		call("button id", "POST", buttons, "{alice_token}", "{\"id\":\"b\xff\",\"label\":\"L\",\"payload\":{}}", 422, utf8Err("id")),
		call("button, key twice", "POST", buttons, "{alice_token}", `{"id":"b","label":"L","label":"M","payload":{}}`, 422, apiFieldError("body", dupBody)),
		call("device name", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", "{\"name\":\"\xc0\xaf\"}", 422, utf8Err("name")),
		call("device description", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", `{"description":"\udfff"}`, 422, utf8Err("description")),
		call("device, key twice", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", `{"name":"a","name":"b"}`, 422, apiFieldError("body", dupBody)),
		call("firmware version", "PATCH", "/v1/user/devices/{alice}/firmwares/{fw}", "{alice_token}", "{\"version\":\"1.0\xff\"}", 422, utf8Err("version")),
		call("firmware notes", "PATCH", "/v1/user/devices/{alice}/firmwares/{fw}", "{alice_token}", "{\"notes\":\"\xff\"}", 422, utf8Err("notes")),
		{name: "upload name", method: "POST", path: "/v1/user/devices/{alice}/firmwares", token: "{alice_token}",
			form: map[string]string{"name": "fw\xff"}, file: otaFirmware(100, 9), wantStatus: 422, wantBody: utf8Err("name")},
		{name: "upload notes", method: "POST", path: "/v1/user/devices/{alice}/firmwares", token: "{alice_token}",
			form: map[string]string{"name": "fw", "notes": "\xfe"}, file: otaFirmware(100, 9), wantStatus: 422, wantBody: utf8Err("notes")},
		call("set-target md5", "POST", "/v1/user/devices/{alice}/firmwares/set-target", "{alice_token}", "{\"md5\":\"\xff\"}", 422, utf8Err("md5")),
		call("login token name", "POST", "/v1/auth/login", "", "{\"email\":\"alice@example.com\",\"password\":\"alice-password\",\"token_name\":\"t\xff\"}", 422,
			utf8Err("token_name")),
		call("login email", "POST", "/v1/auth/login", "", `{"email":"alice@example.com\ud800","password":"alice-password","token_name":"t"}`, 422, utf8Err("email")),
		call("login, email twice", "POST", "/v1/auth/login", "",
			`{"email":"bob@example.com","email":"alice@example.com","password":"alice-password","token_name":"t"}`, 422, apiFieldError("body", dupBody)),
	}
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		v["fw"] = apiUpload(env, env.alice, "fw", otaFirmware(100, 1))
	}
	runAPICases(t, fixture, tests)
}

// TestTextRefusesHiddenCharacters: every text field (names, descriptions,
// labels, keys, versions, notes, token names; JSON and form fields) refuses
// a C0 or C1 control character, DEL, or a bidirectional embedding,
// override or isolate with a 422 field error, and changes nothing; other
// text, accents, emoji and right-to-left scripts included, goes through.
// Before, a team name with a newline and escape sequences forged a row of
// 'user list' and cleared the operator's terminal.
func TestTextRefusesHiddenCharacters(t *testing.T) {
	t.Parallel()
	hidden := []string{"\n", "\r", "\t", "\x00", "\x1b[2J", "\x7f", "\u0085", "\u009b", "\u202a", "\u202e", "\u2066", "\u2069"}
	refused := func(field string) string {
		msg := "The " + strings.ReplaceAll(field, "_", " ") + " field must not contain control characters or bidirectional overrides."
		return apiFieldError(field, msg)
	}
	type target struct {
		name, method, path, token string
		body                      func(v string) map[string]any // a JSON body; nil: a form
		form                      func(v string) map[string]string
		field                     string
		ok                        int // the answer to a plain value
	}
	targets := []target{
		{"device name", "POST", "/v1/user/devices", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"platform": "esp32", "board": "devkit", "name": v}
		}, nil, "name", 201},
		{"device description", "POST", "/v1/user/devices", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"platform": "esp32", "board": "devkit", "description": v}
		}, nil, "description", 201},
		{"platform key", "POST", "/v1/user/devices", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"platform": "esp32" + v, "board": "devkit"}
		}, nil, "platform", 0},
		{"new name", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", func(v string) map[string]any { return map[string]any{"name": v} }, nil, "name", 200},
		{"new description", "PATCH", "/v1/user/devices/{alice}", "{alice_token}", func(v string) map[string]any { return map[string]any{"description": v} }, nil, "description", 200},
		{"button label", "POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"id": "b", "label": v, "payload": map[string]any{}}
		}, nil, "label", 201},
		{"button id", "POST", "/v1/user/devices/{alice}/command-buttons", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"id": "b" + v, "label": "B", "payload": map[string]any{}}
		}, nil, "id", 0},
		{"team name", "PATCH", "/v1/user/team", "{ada_token}", func(v string) map[string]any { return map[string]any{"name": v} }, nil, "name", 200},
		{"member name", "POST", "/v1/user/team/members", "{ada_token}", func(v string) map[string]any {
			return map[string]any{"email": "new@example.com", "name": v}
		}, nil, "name", 201},
		{"token name", "POST", "/v1/user/tokens", "{alice_token}", func(v string) map[string]any { return map[string]any{"name": v} }, nil, "name", 201},
		{"login token name", "POST", "/v1/auth/login", "", func(v string) map[string]any {
			return map[string]any{"email": "alice@example.com", "password": "alice-password", "token_name": v}
		}, nil, "token_name", 200},
		{"rollout name", "POST", "/v1/user/rollouts", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"md5": "{fw_md5}", "device_uids": []string{"{alice}"}, "name": v}
		}, nil, "name", 201},
		{"firmware version", "PATCH", "/v1/user/devices/{alice}/firmwares/{fw}", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"version": v}
		}, nil, "version", 200},
		{"firmware notes", "PATCH", "/v1/user/devices/{alice}/firmwares/{fw}", "{alice_token}", func(v string) map[string]any {
			return map[string]any{"notes": v}
		}, nil, "notes", 200},
		{"upload name", "POST", "/v1/user/devices/{alice}/firmwares", "{alice_token}", nil, func(v string) map[string]string {
			return map[string]string{"name": v}
		}, "name", 201},
		{"upload version", "POST", "/v1/user/devices/{alice}/firmwares", "{alice_token}", nil, func(v string) map[string]string {
			return map[string]string{"name": "fw", "version": v}
		}, "version", 201},
		{"upload notes", "POST", "/v1/user/devices/{alice}/firmwares", "{alice_token}", nil, func(v string) map[string]string {
			return map[string]string{"name": "fw", "notes": v}
		}, "notes", 201},
	}
	request := func(tg target, name, value string, wantStatus int, wantBody string) apiCase {
		c := apiCase{name: tg.name + ": " + name, method: tg.method, path: tg.path, token: tg.token, wantStatus: wantStatus, wantBody: wantBody}
		if tg.form != nil {
			c.form, c.file = tg.form(value), otaFirmware(100, 9)
		} else {
			c.body = apiJSON(tg.body(value))
		}
		return c
	}
	var tests []apiCase
	for i, tg := range targets {
		// Every character in one field, every field with one of them.
		chars := []string{hidden[i%len(hidden)]}
		if i == 0 {
			chars = hidden
		}
		for _, c := range chars {
			tests = append(tests, request(tg, fmt.Sprintf("%q", c), "Name"+c+"x", 422, refused(tg.field)))
		}
		if tg.ok != 0 {
			tests = append(tests, request(tg, "plain text", "Küche ☕ \u05e9\u05dc\u05d5\u05dd \u200d", tg.ok, ""))
		}
	}
	tests = append(tests, call("search", "GET", "/v1/user/devices?q=a%1b", "{alice_token}", "", 422, refused("q")))
	runAPICases(t, func(t *testing.T, env *testEnv, v apiVars) {
		teamVars(t, env, v)
		file := otaFirmware(100, 1)
		v["fw"], v["fw_md5"] = apiUpload(env, env.alice, "fw", file), md5Hex(file)
	}, tests)
}

// TestUnknownEmailCostsTheSame: an unknown email is checked against a hash
// of the same work factor as a real user's, so timing does not tell.
func TestUnknownEmailCostsTheSame(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	if got := strings.Split(env.srv.dummyHash(), "$")[1]; got != fmt.Sprint(testIterations) {
		t.Errorf("dummy hash work factor %s, want %d (the users')", got, testIterations)
	}
}

// TestPendingMemberCostsTheSame: a member invited who has not set a
// password yet logs in as an unknown email does: refused, after the same
// password work, so that timing does not tell invited emails apart. The
// bound is a floor: a loaded machine only makes the check slower.
func TestPendingMemberCostsTheSame(t *testing.T) {
	// Not parallel: it times a login against password checks calibrated
	// to this machine when idle.
	const perCheck = 200 * time.Millisecond
	env := newTestEnv(t, nil, slowPasswords(t, perCheck))
	env.srv.dummyHash() // made now, not by the first login
	ada := env.addMember("Ada", "admin", env.alice)
	w := env.want(t, 201, "POST", "/v1/user/team/members", ada.token, `{"email":"carol@example.com","name":"Carol"}`)
	if !inviteURL.MatchString(decode(t, w)["invite_url"].(string)) {
		t.Fatalf("no invite link: %s", w.Body)
	}
	for _, password := range []string{"", "x"} {
		start := time.Now()
		checkAnswer(t, loginFrom(env, "192.0.2.1:1", "carol@example.com", password+"carol-password"), 422, "")
		if took := time.Since(start); took < perCheck/4 {
			t.Errorf("login of a member without a password took %v, want a password check's work (about %v)", took, perCheck)
		}
	}
}

// TestSlowClients: 500 connections that never finish their headers do not
// stop anyone else from being served, and the server hangs up on them
// after ReadHeaderTimeout (10 s); over-long headers are refused.
func TestSlowClients(t *testing.T) {
	t.Parallel() // it waits out the header timeout
	env := newTestEnv(t, nil)
	addr := startServer(t, env, requestReadTimeout, 0)
	conns := make([]net.Conn, 500)
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		defer c.Close()
		fmt.Fprintf(c, "GET /v1/auth/me HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
		conns[i] = c
	}
	stalled := time.Now()
	c := &liveClient{base: "http://" + addr, token: env.alice.token, hc: &http.Client{Timeout: 10 * time.Second}}
	for range 20 {
		c.want(t, 200, "GET", "/v1/auth/me", "", nil)
	}
	req, _ := http.NewRequest("GET", "http://"+addr+"/healthz", nil)
	req.Header.Set("X-Padding", strings.Repeat("a", 24<<10))
	if resp, err := c.hc.Do(req); err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("24 KiB header: got %v %v, want 431", resp, err)
	}

	last := conns[len(conns)-1]
	last.SetReadDeadline(stalled.Add(15 * time.Second))
	_, err := last.Read(make([]byte, 1))
	if waited := time.Since(stalled); errors.Is(err, os.ErrDeadlineExceeded) || waited < 8*time.Second {
		t.Errorf("a connection that never finished its headers: got %v after %v, want it closed after about 10 s", err, waited.Round(time.Second))
	}
}

// sendHuge writes a request with a 100 MiB body to addr, in 64 KiB pieces,
// and reads the answer at the same time. It returns the status line and
// how many body bytes had been written when the answer arrived.
func sendHuge(t *testing.T, addr, head, first string, chunked bool) (string, int64) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	must(t, err)
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	var sent atomic.Int64
	answered := make(chan struct{})
	go func() {
		piece := []byte(strings.Repeat("a", 64<<10))
		if _, err := io.WriteString(c, head); err != nil {
			return
		}
		if first != "" {
			if chunked {
				first = fmt.Sprintf("%x\r\n%s\r\n", len(first), first)
			}
			if _, err := io.WriteString(c, first); err != nil {
				return
			}
		}
		for sent.Load() < 100<<20 {
			select {
			case <-answered:
				return
			default:
			}
			var err error
			if chunked {
				_, err = fmt.Fprintf(c, "%x\r\n%s\r\n", len(piece), piece)
			} else {
				_, err = c.Write(piece)
			}
			if err != nil {
				return // the server hung up: what we want
			}
			sent.Add(int64(len(piece)))
		}
	}()
	line, err := bufio.NewReader(c).ReadString('\n')
	n := sent.Load()
	close(answered)
	if err != nil {
		t.Fatalf("no answer: %v (after %d bytes)", err, n)
	}
	return strings.TrimSpace(line), n
}

// TestHugeBodyCutOff: a 100 MiB body is refused with 413 long before it has
// been sent, whether its length is declared or it comes chunked.
func TestHugeBodyCutOff(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	addr := startServer(t, env, requestReadTimeout, 0)
	auth := "Authorization: Bearer " + env.alice.token + "\r\n"
	fw := "/v1/user/devices/" + env.alice.device + "/firmwares"
	tests := []struct {
		name    string
		head    string
		first   string // the body's first bytes
		chunked bool
	}{
		{"login, declared", "POST /v1/auth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n\r\n", "", false},
		{"login, chunked", "POST /v1/auth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", "", true},
		{"patch, chunked", "PATCH /v1/user/devices/" + env.alice.device + " HTTP/1.1\r\nHost: x\r\n" + auth + "Transfer-Encoding: chunked\r\n\r\n", "", true},
		{"upload, declared", "POST " + fw + " HTTP/1.1\r\nHost: x\r\n" + auth + "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 104857600\r\n\r\n", "", false},
		{"upload, chunked", "POST " + fw + " HTTP/1.1\r\nHost: x\r\n" + auth + "Content-Type: multipart/form-data; boundary=b\r\nTransfer-Encoding: chunked\r\n\r\n",
			"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.bin\"\r\n\r\n", true},
		{"upload, huge field", "POST " + fw + " HTTP/1.1\r\nHost: x\r\n" + auth + "Content-Type: multipart/form-data; boundary=b\r\nTransfer-Encoding: chunked\r\n\r\n",
			"--b\r\nContent-Disposition: form-data; name=\"notes\"\r\n\r\n", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, sent := sendHuge(t, addr, tt.head, tt.first, tt.chunked)
			if !strings.Contains(status, " 413 ") {
				t.Errorf("got %q, want 413", status)
			}
			if sent > 32<<20 { // of 100 MiB; the rest sits in socket buffers
				t.Errorf("answered only after %d bytes, want it cut off early", sent)
			}
		})
	}
	wantDB(t, env.st, "0", `SELECT count(*) FROM firmwares`)
}

// TestMalformedMQTTBurst: 10,000 malformed, oversized or stray messages in a
// burst are dropped and counted; memory stays bounded, the API answers, and
// a real device report still goes through afterwards.
func TestMalformedMQTTBurst(t *testing.T) {
	// Not parallel: it measures the process's heap.
	env, link, b := brokerEnv(t)
	a := env.alice
	pub := testClient(t, b, "flood", "")
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	dropped := dropTotal(link)
	messages := [][2]string{
		{"devices/" + a.device + "/telemetry", strings.Repeat("x", wire.MaxPayload+1)},
		{"devices/" + a.device + "/telemetry", `{"rssi":`},
		{"devices/" + a.device + "/status", "maybe"},
		{"devices/esp32_ghost%d/status", "online"},
		{"devices//status", "online"}, // empty uid
	}
	const burst = 10_000
	var tokens []mqtt.Token
	for i := range burst {
		m := messages[i%len(messages)]
		tokens = append(tokens, pub.Publish(strings.ReplaceAll(m[0], "%d", fmt.Sprint(i)), 1, false, m[1]))
		if i%1000 == 0 {
			checkAnswer(t, env.request("GET", "/v1/user/devices/"+a.device, a.token, nil), 200, "")
		}
	}
	for _, tok := range tokens {
		if !tok.WaitTimeout(10*time.Second) || tok.Error() != nil {
			t.Fatalf("publish: %v", tok.Error())
		}
	}
	eventually(t, 20*time.Second, "every message counted as dropped", func() bool { return dropTotal(link)-dropped >= burst })
	if got := env.device(a).Status; got != "pending" {
		t.Errorf("status after the burst: %q, want pending", got)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 16<<20 {
		t.Errorf("heap grew by %d MiB after the burst", grew>>20)
	}
	publishWait(t, pub, "devices/"+a.device+"/status", true, "online")
	eventually(t, 3*time.Second, "a real report after the burst", func() bool { return env.device(a).Status == "online" })
}

// TestCORS: off by default; with an allowlist, listed origins get their
// preflight answered and their responses marked, others get nothing.
func TestCORS(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	const dash = "https://dash.example.com"
	preflight := func() *httptest.ResponseRecorder {
		req := newRequest("OPTIONS", "/v1/user/devices/"+env.alice.device, "", "", nil)
		req.Header.Set("Origin", dash)
		req.Header.Set("Access-Control-Request-Method", "PATCH")
		req.Header.Set("Access-Control-Request-Headers", "authorization, content-type")
		return env.serve(t, req)
	}
	get := func(origin string) *httptest.ResponseRecorder {
		req := newRequest("GET", "/v1/auth/me", "Bearer "+env.alice.token, "", nil)
		req.Header.Set("Origin", origin)
		return env.serve(t, req)
	}
	if w := preflight(); w.Header().Get("Access-Control-Allow-Origin") != "" || w.Code == http.StatusNoContent {
		t.Errorf("CORS off: preflight got %d with allow-origin %q", w.Code, w.Header().Get("Access-Control-Allow-Origin"))
	}
	if w := get(dash); w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Error("CORS off: GET carries Access-Control-Allow-Origin")
	}

	env = newTestEnv(t, nil, func(_ *testEnv, o *serverOptions) { o.corsOrigins = []string{dash} })
	w := preflight()
	if w.Code != http.StatusNoContent || w.Header().Get("Access-Control-Allow-Origin") != dash {
		t.Fatalf("preflight: got %d allow-origin %q, want 204 %s", w.Code, w.Header().Get("Access-Control-Allow-Origin"), dash)
	}
	if m := w.Header().Get("Access-Control-Allow-Methods"); !strings.Contains(m, "PATCH") {
		t.Errorf("allow-methods %q lacks PATCH", m)
	}
	if h := strings.ToLower(w.Header().Get("Access-Control-Allow-Headers")); !strings.Contains(h, "authorization") || !strings.Contains(h, "content-type") {
		t.Errorf("allow-headers %q", h)
	}
	if w := get(dash); w.Code != 200 || w.Header().Get("Access-Control-Allow-Origin") != dash || w.Header().Get("Vary") != "Origin" {
		t.Errorf("allowed GET: %d allow-origin %q vary %q", w.Code, w.Header().Get("Access-Control-Allow-Origin"), w.Header().Get("Vary"))
	}
	if w := get("https://evil.example.com"); w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Error("unlisted origin got Access-Control-Allow-Origin")
	}
}
