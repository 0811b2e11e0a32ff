package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestMetrics scrapes /metrics after some traffic and checks the figures,
// then has Prometheus's own parser check the text: `promtool check
// metrics` (Debian's prometheus package). Without promtool the parse is
// skipped, or fails when DEVICEHUB_REQUIRE_PROMTOOL is set (as .ci/run does).
func TestMetrics(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	env, link := newLinkedEnv(t, b)
	m := newMetrics(env.st, link, env.srv.events)
	api := observe(env.srv, m.record)
	send := func(method, path, token, body string) {
		req := newRequest(method, path, "Bearer "+token, "application/json", strings.NewReader(body))
		api.ServeHTTP(httptest.NewRecorder(), req)
	}
	send("GET", "/v1/user/devices", env.alice.token, "")
	send("GET", "/v1/user/devices", env.bob.token, "")
	send("GET", "/v1/user/devices", "bad", "")
	send("POST", "/v1/auth/login", "", `{"email":"alice@example.com","password":"wrong","token_name":"x"}`)
	send("GET", "/no/such/route", "", "")
	dev := testClient(t, b, "dev", "")
	publishWait(t, dev, "devices/"+env.alice.device+"/status", false, "online")
	publishWait(t, dev, "devices/"+env.alice.device+"/status", false, "sleeping")
	// The link counts a write after it commits, so wait for the count, not
	// only for the row.
	eventually(t, 5*time.Second, "the status applied", func() bool { return dropTotal(link) == 1 && link.Stats().Applied == 1 })
	if st := env.device(env.alice).Status; st != "online" {
		t.Fatalf("status %q after the applied write, want online", st)
	}
	s, err := env.srv.events.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	defer env.srv.events.unsubscribe(s)

	w := httptest.NewRecorder()
	m.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	if ct := w.Header().Get("Content-Type"); w.Code != 200 || ct != "text/plain; version=0.0.4; charset=utf-8" {
		t.Fatalf("GET /metrics: %d %q", w.Code, ct)
	}
	text := w.Body.String()
	for _, want := range []string{
		`devicehub_http_requests_total{route="GET /v1/user/devices",status="200"} 2`,
		`devicehub_http_requests_total{route="GET /v1/user/devices",status="401"} 1`,
		`devicehub_http_requests_total{route="/",status="404"} 1`,
		`devicehub_http_request_duration_seconds_count{route="GET /v1/user/devices"} 3`,
		`devicehub_http_request_duration_seconds_bucket{route="POST /v1/auth/login",le="+Inf"} 1`,
		`devicehub_login_failures_total 1`,
		`devicehub_throttled_total 0`,
		`devicehub_devices{status="online"} 1`,
		`devicehub_devices{status="pending"} 1`,
		`devicehub_rollouts{state="running"} 0`,
		`devicehub_mqtt_messages_applied_total 1`,
		`devicehub_mqtt_messages_dropped_total{reason="bad_status"} 1`,
		`devicehub_mqtt_messages_dropped_total{reason="unknown_device"} 0`,
		`devicehub_mqtt_connected 1`,
		`devicehub_mqtt_reconnects_total 0`,
		`devicehub_event_streams 1`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("no line %s in\n%s", want, text)
		}
	}
	for _, re := range []string{`(?m)^go_goroutines [1-9]`, `(?m)^go_memstats_heap_alloc_bytes [1-9]`, `(?m)^process_resident_memory_bytes [1-9]`} {
		if !regexp.MustCompile(re).MatchString(text) {
			t.Errorf("no line matching %s", re)
		}
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		msg := "promtool not found: install Debian's prometheus package ('apt-get install -y prometheus') to check the format"
		if os.Getenv("DEVICEHUB_REQUIRE_PROMTOOL") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(text)
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// TestMetricsListener: -metrics-addr serves /metrics on its own listener
// and nothing else there; the API's port does not serve it; it is off by
// default.
func TestMetricsListener(t *testing.T) {
	t.Parallel()
	base, log, _ := serveInProcess(t, map[string]string{"DEVICEHUB_METRICS_ADDR": "127.0.0.1:0"})
	addr := regexp.MustCompile(`msg="metrics listening" addr=(\S+)`).FindStringSubmatch(log.String())
	if addr == nil {
		t.Fatalf("no metrics listening line in\n%s", log)
	}
	for _, tt := range []struct {
		url  string
		want int
	}{
		{"http://" + addr[1] + "/metrics", 200},
		{"http://" + addr[1] + "/v1/user/devices", 404},
		{base + "/metrics", 404},
	} {
		res, err := http.Get(tt.url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != tt.want {
			t.Errorf("GET %s: %d, want %d", tt.url, res.StatusCode, tt.want)
		}
		if tt.want == 200 && !bytes.Contains(body, []byte("\ndevicehub_mqtt_connected 0\n")) {
			t.Errorf("GET %s: no devicehub_mqtt_connected 0 in\n%s", tt.url, body)
		}
	}
	_, quiet, _ := serveInProcess(t, nil)
	if strings.Contains(quiet.String(), "metrics listening") {
		t.Error("metrics listen without -metrics-addr")
	}
}
