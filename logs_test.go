package main

import (
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"
)

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
