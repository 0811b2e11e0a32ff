package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// TestUnknownEmailCostsTheSame: an unknown email is checked against a hash
// of the same work factor as a real user's, so timing does not tell.
func TestUnknownEmailCostsTheSame(t *testing.T) {
	env := newTestEnv(t, nil)
	if got := strings.Split(env.srv.dummyHash(), "$")[1]; got != fmt.Sprint(testIterations) {
		t.Errorf("dummy hash work factor %s, want %d (the users')", got, testIterations)
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
	env, link, b := brokerEnv(t)
	a := env.alice
	pub := testClient(t, b, "flood", "")
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	dropped := dropTotal(link)
	messages := [][2]string{
		{"devices/" + a.device + "/telemetry", strings.Repeat("x", maxDevicePayload+1)},
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

	env.srv.corsOrigins[dash] = true
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
