package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestUnknownEmailCostsTheSame: an unknown email is checked against a hash
// of the same work factor as a real user's, so timing does not tell.
func TestUnknownEmailCostsTheSame(t *testing.T) {
	env := newTestEnv(t, nil)
	iter := func(h string) string { return strings.Split(h, "$")[1] }
	if got := iter(env.srv.dummyHash()); got != fmt.Sprint(testIterations) {
		t.Errorf("dummy hash work factor %s, want %d (the users')", got, testIterations)
	}
}

// TestBadTokens: every malformed, stale or forged Authorization header is a
// plain 401, never a 500, never a success.
func TestBadTokens(t *testing.T) {
	env := newTestEnv(t, nil)
	ctx := context.Background()
	a := env.alice
	id, secret, _ := strings.Cut(a.token, "|")
	loggedOut, _ := issueToken(ctx, env.st, a.id, "gone", false)
	if w := env.request("POST", "/v1/auth/logout", loggedOut, nil); w.Code != 200 {
		t.Fatalf("logout: %d", w.Code)
	}
	victim := env.addUser("Carol", "carol@example.com", "carol-password")
	if _, err := env.st.wdb.Exec(`DELETE FROM users WHERE id = ?`, victim.id); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, header string
		want         int
	}{
		{"valid (control)", "Bearer " + a.token, 200},
		{"deleted user's token", "Bearer " + victim.token, 401},
		{"logged-out token", "Bearer " + loggedOut, 401},
		{"valid id, wrong secret", "Bearer " + id + "|" + strings.Repeat("A", 40), 401},
		{"valid id, secret one short", "Bearer " + id + "|" + secret[:39], 401},
		{"trailing garbage", "Bearer " + a.token + "x", 401},
		{"trailing space and garbage", "Bearer " + a.token + " x", 401},
		{"trailing NUL", "Bearer " + a.token + "\x00", 401},
		{"non-numeric id", "Bearer abc|" + secret, 401},
		{"negative id", "Bearer -" + id + "|" + secret, 401},
		{"huge id", "Bearer 99999999999999999999999|" + secret, 401},
		{"leading zero id", "Bearer 0" + id + "|" + secret, 401},
		{"empty secret", "Bearer " + id + "|", 401},
		{"empty id", "Bearer |" + secret, 401},
		{"two bars", "Bearer " + id + "|" + secret + "|" + secret, 401},
		{"no scheme", a.token, 401},
		{"lower-case scheme", "bearer " + a.token, 401},
		{"upper-case scheme", "BEARER " + a.token, 401},
		{"two spaces", "Bearer  " + a.token, 401},
		{"tab", "Bearer\t" + a.token, 401},
		{"scheme only", "Bearer", 401},
		{"scheme and space", "Bearer ", 401},
		{"basic auth", "Basic YWxpY2U6cGFzcw==", 401},
		{"empty", "", 401},
		{"unicode", "Bearer \u00e9|\u00e9", 401},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := httptest.NewRequest("GET", "/v1/auth/me", nil)
			if tt.header != "" {
				req.Header.Set("Authorization", tt.header)
			}
			w := httptest.NewRecorder()
			env.srv.ServeHTTP(w, req)
			if w.Code != tt.want {
				t.Fatalf("got %d %s, want %d", w.Code, w.Body, tt.want)
			}
			if tt.want == 401 && strings.TrimSpace(w.Body.String()) != `{"message":"Unauthenticated."}` {
				t.Errorf("body %s", w.Body)
			}
		})
	}
}

// startTestServer serves env's API on a loopback port with the production
// http.Server settings.
func startTestServer(t *testing.T, env *testEnv) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := newHTTPServer(env.srv, testLogger(t), requestReadTimeout)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// TestSlowClients: 500 connections that never finish their headers do not
// stop anyone else from being served, and over-long headers are refused.
func TestSlowClients(t *testing.T) {
	env := newTestEnv(t, nil)
	addr := startTestServer(t, env)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < 500; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		fmt.Fprintf(c, "GET /v1/auth/me HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
		conns = append(conns, c)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	for i := 0; i < 20; i++ {
		req, _ := http.NewRequest("GET", "http://"+addr+"/v1/auth/me", nil)
		req.Header.Set("Authorization", "Bearer "+env.alice.token)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d beside 500 slow clients: %v", i, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: got %d, want 200", i, resp.StatusCode)
		}
	}

	req, _ := http.NewRequest("GET", "http://"+addr+"/healthz", nil)
	req.Header.Set("X-Padding", strings.Repeat("a", 64<<10))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("64 KiB header: got %d, want 431", resp.StatusCode)
	}
}

// sendHuge writes a request with a 100 MiB body to addr, in 64 KiB pieces,
// and reads the answer at the same time. It returns the status line and
// how many body bytes had been written when the answer arrived.
func sendHuge(t *testing.T, addr, head, first string, chunked bool) (string, int64) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
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
	addr := startTestServer(t, env)
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
	var n int
	env.st.db.QueryRow(`SELECT count(*) FROM firmwares`).Scan(&n)
	if n != 0 {
		t.Errorf("%d firmware rows after refused uploads", n)
	}
}

// TestMalformedMQTTBurst: 10,000 malformed, oversized or stray messages in a
// burst are dropped and counted; memory stays bounded, the API answers, and
// a real device report still goes through afterwards.
func TestMalformedMQTTBurst(t *testing.T) {
	b := startBroker(t)
	env, link := newLinkedEnv(t, b)
	a := env.alice
	pub := testClient(t, b, "flood", "")
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	dropped0 := dropTotal(link)

	big := strings.Repeat("x", maxDevicePayload+1)
	var tokens []interface {
		WaitTimeout(time.Duration) bool
		Error() error
	}
	const burst = 10_000
	for i := 0; i < burst; i++ {
		var topic, payload string
		switch i % 5 {
		case 0:
			topic, payload = "devices/"+a.device+"/telemetry", big
		case 1:
			topic, payload = "devices/"+a.device+"/telemetry", `{"rssi":`
		case 2:
			topic, payload = "devices/"+a.device+"/status", "maybe"
		case 3:
			topic, payload = fmt.Sprintf("devices/esp32_ghost%d/status", i), "online"
		case 4:
			topic, payload = "devices//status", "online" // empty uid
		}
		tokens = append(tokens, pub.Publish(topic, 1, false, payload))
		if i%1000 == 0 {
			if w := env.request("GET", "/v1/user/devices/"+a.device, a.token, nil); w.Code != 200 {
				t.Fatalf("API during the burst: got %d", w.Code)
			}
		}
	}
	for _, tok := range tokens {
		if !tok.WaitTimeout(10*time.Second) || tok.Error() != nil {
			t.Fatalf("publish: %v", tok.Error())
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for dropTotal(link)-dropped0 < burst {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages counted as dropped", dropTotal(link)-dropped0, burst)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := env.device(a).Status; got != "pending" {
		t.Errorf("status after the burst: %q, want pending", got)
	}
	runtime.GC()
	var after runtime.MemStats
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
		req := httptest.NewRequest("OPTIONS", "/v1/user/devices/"+env.alice.device, nil)
		req.Header.Set("Origin", dash)
		req.Header.Set("Access-Control-Request-Method", "PATCH")
		req.Header.Set("Access-Control-Request-Headers", "authorization, content-type")
		w := httptest.NewRecorder()
		env.srv.ServeHTTP(w, req)
		return w
	}
	get := func(origin string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", "/v1/auth/me", nil)
		req.Header.Set("Origin", origin)
		req.Header.Set("Authorization", "Bearer "+env.alice.token)
		w := httptest.NewRecorder()
		env.srv.ServeHTTP(w, req)
		return w
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
