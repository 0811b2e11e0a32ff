package main

import (
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// logLines returns the lines of log that match re.
func logLines(log *syncBuffer, re string) []string {
	return regexp.MustCompile(`(?m)^.*`+re+`.*$`).FindAllString(log.String(), -1)
}

// watchedLink is an MQTT link to url whose store runs on a fake clock and
// whose log the test reads.
func watchedLink(t *testing.T, url, user, password string) (*mqttLink, *fakeClock, *syncBuffer) {
	t.Helper()
	clock := newFakeClock()
	st := newTestStore(t, clock.now)
	logger, log := captureLogs(t)
	l := newMQTTLink(mqttConfig{url: url, user: user, password: password, prefix: "devices"}, st, logger)
	t.Cleanup(l.close) // captureLogs shows the log if the test fails
	return l, clock, log
}

// failures is how many connection attempts of l failed since its last connect.
func failures(l *mqttLink) int {
	l.watch.mu.Lock()
	defer l.watch.mu.Unlock()
	return l.watch.failures
}

// checkLoggedOncePerMinute: while the cause stays the same, the attempts
// go on and no second line comes until the fake clock passes a minute;
// then one comes, counting every failed attempt.
func checkLoggedOncePerMinute(t *testing.T, l *mqttLink, clock *fakeClock, log *syncBuffer, line string) {
	t.Helper()
	n := failures(l)
	eventually(t, 15*time.Second, "two more failed attempts", func() bool { return failures(l) >= n+2 })
	if got := logLines(log, line); len(got) != 1 {
		t.Fatalf("after %d failed attempts within the minute: %d lines %q, want 1", failures(l), len(got), got)
	}
	clock.advance(brokerLogInterval)
	eventually(t, 10*time.Second, "the line again a minute later", func() bool { return len(logLines(log, line)) == 2 })
	second := logLines(log, line)[1]
	m := regexp.MustCompile(`failed_attempts=(\d+)`).FindStringSubmatch(second)
	if m == nil || m[1] == "1" {
		t.Errorf("the line a minute later %q: want failed_attempts counting every attempt", second)
	}
}

// TestLogBrokerUnreachable: a broker that is not listening is named in a
// warn line at the first attempt, repeated once a minute; a connect
// is logged, and a broker gone again is logged at once.
func TestLogBrokerUnreachable(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.stop() // its port is free: nothing listens there
	start := time.Now()
	l, clock, log := watchedLink(t, b.url(), "", "")

	unreachable := `level=WARN msg="mqtt broker unreachable" broker=` + regexp.QuoteMeta(b.url()) + ` err=.*connection refused.* failed_attempts=\d+`
	eventually(t, 10*time.Second, "a warn line naming the broker", func() bool { return len(logLines(log, unreachable)) == 1 })
	t.Logf("logged %v after start: %s", time.Since(start).Round(time.Millisecond), logLines(log, unreachable)[0])
	checkLoggedOncePerMinute(t, l, clock, log, unreachable)

	b.start()
	eventually(t, 15*time.Second, "the connect line", func() bool {
		return len(logLines(log, `level=INFO msg="mqtt connected" broker=`+regexp.QuoteMeta(b.url())+` failed_attempts=[1-9]`)) == 1
	})
	b.stop()
	// The clock has not moved: the new outage is logged because the
	// connect ended the old one.
	eventually(t, 15*time.Second, "the lost line and a new unreachable line", func() bool {
		return len(logLines(log, `level=WARN msg="mqtt connection lost"`)) == 1 && len(logLines(log, unreachable)) == 3
	})
}

// startAuthBroker is a test broker that refuses anonymous clients and
// accepts only user with password.
func startAuthBroker(t *testing.T, user, password string) *testBroker {
	t.Helper()
	passwd, err := exec.LookPath("mosquitto_passwd")
	if err != nil {
		if os.Getenv("DEVICEHUB_REQUIRE_MOSQUITTO") != "" {
			t.Fatal("mosquitto_passwd not found (Debian package mosquitto)")
		}
		t.Skip("mosquitto_passwd not found (Debian package mosquitto)")
	}
	b := startBroker(t)
	b.stop()
	file := filepath.Join(filepath.Dir(b.conf), "passwd")
	if out, err := exec.Command(passwd, "-b", "-c", file, user, password).CombinedOutput(); err != nil {
		t.Fatalf("mosquitto_passwd: %v\n%s", err, out)
	}
	os.Chmod(file, 0o600)
	conf, err := os.ReadFile(b.conf)
	must(t, err)
	text := strings.Replace(string(conf), "allow_anonymous true", "allow_anonymous false\npassword_file "+file, 1)
	must(t, os.WriteFile(b.conf, []byte(text), 0o600))
	b.start()
	return b
}

// TestLogBrokerRefuses: wrong credentials are logged with the broker's
// answer (CONNACK code) and a hint, once a minute, never the password;
// a broker that was down and then refuses is logged at once (a new
// cause); the right credentials connect.
func TestLogBrokerRefuses(t *testing.T) {
	t.Parallel()
	b := startAuthBroker(t, "devicehub", "right-password")
	b.stop()
	l, clock, log := watchedLink(t, b.url(), "devicehub", "wrong-password")
	eventually(t, 10*time.Second, "the unreachable line", func() bool { return len(logLines(log, `msg="mqtt broker unreachable"`)) == 1 })

	b.start()
	refused := `level=WARN msg="mqtt broker refused the connection" broker=` + regexp.QuoteMeta(b.url()) +
		` code=(4|5) reason="(bad user name or password|not Authorized)" hint=".*DEVICEHUB_MQTT_PASSWORD.*" user=devicehub failed_attempts=\d+`
	eventually(t, 10*time.Second, "the refusal, at once after the broker came up", func() bool { return len(logLines(log, refused)) == 1 })
	t.Logf("refusal: %s", logLines(log, refused)[0])
	checkLoggedOncePerMinute(t, l, clock, log, refused)
	if l.connected() {
		t.Error("connected with a wrong password")
	}
	if strings.Contains(log.String(), "password=") || strings.Contains(log.String(), "wrong-password") {
		t.Errorf("the log shows the password:\n%s", log)
	}

	good, _, goodLog := watchedLink(t, b.url(), "devicehub", "right-password")
	eventually(t, 10*time.Second, "the right password to connect", good.connected)
	if lines := logLines(goodLog, `level=WARN`); len(lines) != 0 {
		t.Errorf("the right password logged warnings: %q", lines)
	}
}

// TestLogDrops: dropped device messages are logged by reason once the
// fake clock passes a minute, and only when there were new ones.
func TestLogDrops(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	l, clock, log := watchedLink(t, b.url(), "", "")
	quiet, quietClock, quietLog := watchedLink(t, b.url(), "", "")
	eventually(t, 10*time.Second, "the links to connect", func() bool { return l.connected() && quiet.connected() })
	dropped := `level=WARN msg="mqtt messages dropped since start"`

	dev := testClient(t, b, "dropper", "")
	publishWait(t, dev, "devices/nobody_1/status", false, "asleep")
	publishWait(t, dev, "devices/nobody_1/telemetry", false, "{not json")
	publishWait(t, dev, "devices/nobody_1/telemetry", false, `{"rssi":"strong"}`)
	eventually(t, 5*time.Second, "three drops counted", func() bool { return dropTotal(l) == 3 && dropTotal(quiet) == 3 })
	// Drain the quiet link's count into its log first, so that its next
	// minute has nothing new.
	quietClock.advance(dropLogInterval)
	eventually(t, 5*time.Second, "the quiet link's first drop line", func() bool { return len(logLines(quietLog, dropped)) == 1 })

	time.Sleep(5 * flushInterval)
	if lines := logLines(log, dropped); len(lines) != 0 {
		t.Fatalf("drops logged before a minute passed: %q", lines)
	}
	clock.advance(dropLogInterval)
	eventually(t, 5*time.Second, "the drop line", func() bool { return len(logLines(log, dropped)) == 1 })
	line := logLines(log, dropped)[0]
	for _, want := range []string{"bad_status=1", "bad_telemetry=2", "total=3"} {
		if !strings.Contains(line, want) {
			t.Errorf("drop line %q: want %s", line, want)
		}
	}

	// A minute with no new drops logs nothing, on either link.
	clock.advance(dropLogInterval)
	quietClock.advance(dropLogInterval)
	time.Sleep(5 * flushInterval)
	if n, q := len(logLines(log, dropped)), len(logLines(quietLog, dropped)); n != 1 || q != 1 {
		t.Errorf("after a minute without drops: %d and %d drop lines, want 1 and 1", n, q)
	}
}

// TestAccessLog: one info line per request with method, route pattern,
// status, duration and bytes; never the token, the query's signature,
// the password or the path's uid.
func TestAccessLog(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	logger, log := captureLogs(t)
	h := observe(env.srv, logRequest(logger))
	content := []byte("\xe9 firmware for the access log")
	env.uploadOK(env.alice, map[string]string{"name": "fw"}, content)
	signed := env.srv.ota.url(env.alice.device, md5Hex(content))
	sig := regexp.MustCompile(`sig=([0-9a-f]+)`).FindStringSubmatch(signed)[1]
	path := strings.TrimPrefix(signed, "http://devicehub.test")

	tests := []struct {
		method, path, token, body string // body: JSON
		wantRoute                 string
		wantStatus                int
	}{
		{"GET", "/v1/user/devices/" + env.alice.device, env.alice.token, "", `"GET /v1/user/devices/{uid}"`, 200},
		{"GET", path, "", "", `"GET /ota/{uid}/{file}"`, 200},
		{"GET", strings.Replace(path, "sig=", "sig=0", 1), "", "", `"GET /ota/{uid}/{file}"`, 403},
		{"POST", "/v1/auth/login", "", `{"email":"alice@example.com","password":"alice-password","token_name":"t"}`, `"POST /v1/auth/login"`, 200},
		{"GET", "/v1/user/devices", "1|not-a-real-secret", "", `"GET /v1/user/devices"`, 401},
		{"DELETE", "/v1/user/devices", env.alice.token, "", "/", 405},
		{"GET", "/nowhere?sig=abc", "", "", "/", 404},
		{"GET", "/v1//auth/me", "", "", `\(none\)`, 404},
	}
	for _, tt := range tests {
		req := newRequest(tt.method, tt.path, "Bearer "+tt.token, "application/json", strings.NewReader(tt.body))
		before := len(logLines(log, `msg=request`))
		w := &countingRecorder{header: http.Header{}}
		h.ServeHTTP(w, req)
		lines := logLines(log, `msg=request`)
		if w.status != tt.wantStatus || len(lines) != before+1 {
			t.Errorf("%s %s: status %d and %d new lines, want %d and 1", tt.method, tt.path, w.status, len(lines)-before, tt.wantStatus)
			continue
		}
		want := fmt.Sprintf(`^time=\S+ level=INFO msg=request method=%s route=%s status=%d duration=[0-9.]+[µnm]?s bytes=%d$`,
			tt.method, tt.wantRoute, tt.wantStatus, w.bytes)
		if line := lines[len(lines)-1]; !regexp.MustCompile(want).MatchString(line) {
			t.Errorf("%s %s: log line %q, want it to match %s", tt.method, tt.path, line, want)
		}
	}
	_, secret, _ := strings.Cut(env.alice.token, "|")
	for _, never := range []string{secret, "not-a-real-secret", sig, "sig=", "alice-password", env.alice.device, "exp="} {
		if strings.Contains(log.String(), never) {
			t.Errorf("the access log shows %q:\n%s", never, log)
		}
	}
}

// countingRecorder is a minimal ResponseWriter that counts what the
// client would receive (httptest's recorder hides io.ReaderFrom use).
type countingRecorder struct {
	header http.Header
	status int
	bytes  int
}

func (w *countingRecorder) Header() http.Header { return w.header }
func (w *countingRecorder) WriteHeader(s int) {
	if w.status == 0 {
		w.status = s
	}
}
func (w *countingRecorder) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = 200
	}
	w.bytes += len(p)
	return len(p), nil
}

// TestLogStartupLine: serve logs one line with the effective
// configuration, with the MQTT password left out (also from the URL),
// then an access line per request unless -access-log is false.
func TestLogStartupLine(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"DEVICEHUB_MQTT_PASSWORD": "env-secret-pw",
		"DEVICEHUB_MQTT_USER":     "hub",
		"DEVICEHUB_TOPIC_PREFIX":  "fleet",
	}
	base, log, _ := serveInProcess(t, env, "-mqtt", "tcp://hub:url-secret-pw@127.0.0.1:1")
	lines := logLines(log, `msg=listening`)
	if len(lines) != 1 {
		t.Fatalf("listening lines: %q, want 1", lines)
	}
	for _, want := range []string{
		"addr=127.0.0.1:", "public_url=http://127.0.0.1:", "mqtt=tcp://hub:xxxxx@127.0.0.1:1", "mqtt_password_set=true",
		"access_log=true", "data=", "mqtt_user=hub", "topic_prefix=fleet", "debug=false",
	} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("start-up line %q: want %s", lines[0], want)
		}
	}
	(&liveClient{base: base, hc: http.DefaultClient}).want(t, 200, "GET", "/healthz", "", nil)
	eventually(t, 5*time.Second, "the access line", func() bool {
		return len(logLines(log, `msg=request method=GET route="GET /healthz" status=200`)) == 1
	})
	eventually(t, 10*time.Second, "the unreachable broker line", func() bool { return len(logLines(log, `msg="mqtt broker unreachable"`)) == 1 })
	for _, secret := range []string{"env-secret-pw", "url-secret-pw"} {
		if strings.Contains(log.String(), secret) {
			t.Errorf("serve's log shows the MQTT password %q:\n%s", secret, log)
		}
	}

	base, log, _ = serveInProcess(t, map[string]string{"DEVICEHUB_ACCESS_LOG": "false"}, "-mqtt", "tcp://127.0.0.1:1")
	(&liveClient{base: base, hc: http.DefaultClient}).want(t, 200, "GET", "/healthz", "", nil)
	time.Sleep(100 * time.Millisecond)
	if lines := logLines(log, `msg=request`); len(lines) != 0 || !strings.Contains(log.String(), "access_log=false") {
		t.Errorf("DEVICEHUB_ACCESS_LOG=false: access lines %q, want none, and access_log=false in the start-up line", lines)
	}
	_, _, err := cliRun(t, map[string]string{"DEVICEHUB_ACCESS_LOG": "maybe"}, "", "serve", "-data", t.TempDir())
	if err == nil || !strings.Contains(err.Error(), `$DEVICEHUB_ACCESS_LOG: "maybe" is not true or false`) {
		t.Errorf("DEVICEHUB_ACCESS_LOG=maybe: got %v, want a usage error", err)
	}
}

// TestAccessLogKeepsConnectionControls: behind the access log a handler
// still reaches the connection: an upload extends its read deadline
// (http.ResponseController), a stream flushes.
func TestAccessLogKeepsConnectionControls(t *testing.T) {
	t.Parallel()
	logger, log := captureLogs(t)
	errs := make(chan error, 2)
	srv := httptest.NewServer(observe(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		errs <- rc.SetReadDeadline(time.Now().Add(time.Minute))
		w.Write([]byte("part"))
		errs <- rc.Flush()
	}), logRequest(logger)))
	defer srv.Close()
	(&liveClient{base: srv.URL, hc: http.DefaultClient}).want(t, 200, "GET", "/", "", nil)
	for _, what := range []string{"SetReadDeadline", "Flush"} {
		if err := <-errs; err != nil {
			t.Errorf("%s behind the access log: %v", what, err)
		}
	}
	eventually(t, 5*time.Second, "the access line", func() bool { return len(logLines(log, `status=200 duration=\S+ bytes=4$`)) == 1 })
}

// TestStartupSettingsLeaveOutSecrets: a flag named like a secret never
// reaches the start-up line; a limit named after tokens does.
func TestStartupSettingsLeaveOutSecrets(t *testing.T) {
	t.Parallel()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	for _, name := range []string{"addr", "mqtt-password", "webhook-secret", "api-token", "max-tokens", "topic-prefix"} {
		fs.String(name, "value-of-"+name, "")
	}
	got := fmt.Sprint(startupSettings(fs, "addr"))
	if want := "[max_tokens value-of-max-tokens topic_prefix value-of-topic-prefix]"; got != want {
		t.Errorf("startupSettings: got %s, want %s", got, want)
	}
}
