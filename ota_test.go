package main

import (
	"bufio"
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"net/url"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// ---- a simulated ESP updater ----

// espUpdater simulates the stock HTTP updaters of the Arduino cores
// (HTTPUpdate on the ESP32, ESP8266httpUpdate on the ESP8266): the request
// they send, and the checks they make on the answer before they flash it.
type espUpdater struct {
	chip      string // "ESP32" or "ESP8266": names the x-<chip>-… headers
	sketchMD5 string // md5 of the running sketch; "" sends no sketch-md5 header
	freeSpace int    // free sketch space, bytes: a larger firmware is refused
}

// esp32Updater is an ESP32 with a 4 MB flash running the sketch with that md5.
func esp32Updater(sketchMD5 string) espUpdater {
	return espUpdater{chip: "ESP32", sketchMD5: sketchMD5, freeSpace: 0x1E0000}
}

// esp8266Updater is an ESP8266 with a 4 MB flash running the sketch with that md5.
func esp8266Updater(sketchMD5 string) espUpdater {
	return espUpdater{chip: "ESP8266", sketchMD5: sketchMD5, freeSpace: 0xFF000}
}

// headers are the updater's own request headers, in the order it adds them
// (HTTPUpdate::handleUpdate, ESP8266HTTPUpdate::handleUpdate).
func (u espUpdater) headers() [][2]string {
	x := "x-" + u.chip + "-"
	h := [][2]string{
		{"User-Agent", u.chip + "-http-Update"},
		{"Cache-Control", "no-cache"},
		{x + "STA-MAC", "24:0A:C4:12:34:56"},
		{x + "AP-MAC", "24:0A:C4:12:34:57"},
		{x + "free-space", strconv.Itoa(u.freeSpace)},
		{x + "sketch-size", "912336"},
	}
	if u.sketchMD5 != "" {
		h = append(h, [2]string{x + "sketch-md5", u.sketchMD5})
	}
	return append(h,
		[2]string{x + "chip-size", "4194304"},
		[2]string{x + "sdk-version", "v4.4.7-dirty"},
		[2]string{x + "mode", "sketch"},
	)
}

// otaResponse is an answer as the updater sees it.
type otaResponse struct {
	status           int
	header           http.Header
	contentLength    int64 // -1 when the answer has no Content-Length
	transferEncoding []string
	body             []byte // nil when the body was streamed elsewhere
	n                int64  // body bytes received
}

// get sends what the updater sends, over a new TCP connection and as
// HTTP/1.0 (the updaters call useHTTP10(true)), and reads the raw answer
// up to the server's close. Nothing decodes the body: chunk framing or a
// body longer than Content-Length would show in it. extra headers are
// added after the updater's own. The body is written to body, or kept in
// the response when body is nil. It sends no Authorization header.
func (u espUpdater) get(rawURL string, extra map[string]string, body io.Writer) (*otaResponse, error) {
	target, err := url.Parse(rawURL)
	if err != nil {
		return nil, err
	}
	conn, err := net.DialTimeout("tcp", target.Host, 5*time.Second)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(60 * time.Second))

	var req strings.Builder
	fmt.Fprintf(&req, "GET %s HTTP/1.0\r\nHost: %s\r\n", target.RequestURI(), target.Host)
	hs := u.headers()
	fmt.Fprintf(&req, "%s: %s\r\nConnection: close\r\n", hs[0][0], hs[0][1])
	for _, h := range hs[1:] {
		fmt.Fprintf(&req, "%s: %s\r\n", h[0], h[1])
	}
	for k, v := range extra {
		fmt.Fprintf(&req, "%s: %s\r\n", k, v)
	}
	req.WriteString("\r\n")
	if _, err := io.WriteString(conn, req.String()); err != nil {
		return nil, fmt.Errorf("send request: %w", err)
	}

	br := bufio.NewReader(conn)
	tp := textproto.NewReader(br)
	line, err := tp.ReadLine()
	if err != nil {
		return nil, fmt.Errorf("read status line: %w", err)
	}
	proto, rest, _ := strings.Cut(line, " ")
	code, _, _ := strings.Cut(rest, " ")
	status, err := strconv.Atoi(code)
	if !strings.HasPrefix(proto, "HTTP/1.") || err != nil {
		return nil, fmt.Errorf("bad status line %q", line)
	}
	mh, err := tp.ReadMIMEHeader()
	if err != nil {
		return nil, fmt.Errorf("read header: %w", err)
	}
	r := &otaResponse{status: status, header: http.Header(mh), contentLength: -1}
	r.transferEncoding = r.header.Values("Transfer-Encoding")
	if cl := r.header.Values("Content-Length"); len(cl) > 0 {
		if r.contentLength, err = strconv.ParseInt(cl[0], 10, 64); err != nil || len(cl) > 1 {
			return nil, fmt.Errorf("bad Content-Length %q", cl)
		}
	}
	var buf bytes.Buffer
	w := body
	if w == nil {
		w = &buf
	}
	// HTTP/1.0 without keep-alive: the body ends where the server closes.
	// A small buffer, as on a device, keeps the benchmark's clients from
	// weighing on the RSS it measures (io.Copy would take 32 KiB each).
	buf4k := make([]byte, 4<<10)
	if r.n, err = io.CopyBuffer(struct{ io.Writer }{w}, struct{ io.Reader }{br}, buf4k); err != nil {
		return nil, fmt.Errorf("read body up to the server's close: %w", err)
	}
	if body == nil {
		r.body = buf.Bytes()
	}
	return r, nil
}

// get11 sends the updater's headers as HTTP/1.1 through net/http's client,
// following no redirect (the updaters follow none) and asking for no
// compression (they ask for none).
func (u espUpdater) get11(rawURL string, extra map[string]string) (*otaResponse, error) {
	req, err := http.NewRequest("GET", rawURL, nil)
	if err != nil {
		return nil, err
	}
	for _, h := range u.headers() {
		req.Header[h[0]] = append(req.Header[h[0]], h[1]) // as sent, not canonicalized
	}
	for k, v := range extra {
		req.Header.Set(k, v)
	}
	tr := &http.Transport{DisableCompression: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{
		Transport:     tr,
		Timeout:       60 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("read body: %w", err)
	}
	return &otaResponse{status: resp.StatusCode, header: resp.Header, contentLength: resp.ContentLength,
		transferEncoding: resp.TransferEncoding, body: b, n: int64(len(b))}, nil
}

// verdict applies the updater's checks to an answer, as handleUpdate and
// runUpdate do: "updated", "no update", or "failed: <why>".
func (u espUpdater) verdict(r *otaResponse) string {
	switch r.status {
	case http.StatusOK:
	case http.StatusNotModified:
		return "no update"
	case http.StatusForbidden:
		return "failed: forbidden"
	case http.StatusNotFound:
		return "failed: not found"
	default:
		return fmt.Sprintf("failed: HTTP %d", r.status)
	}
	// HTTPClient::getSize is the Content-Length; the updater needs it > 0.
	if r.contentLength <= 0 || len(r.transferEncoding) > 0 {
		return "failed: server did not report the size"
	}
	if r.contentLength > int64(u.freeSpace) {
		return "failed: too little free space"
	}
	if len(r.body) == 0 || r.body[0] != 0xE9 {
		return "failed: magic byte is not 0xE9"
	}
	// HTTPClient keeps one value per collected header; the ESP8266 core
	// joins repeated ones with a comma.
	sum := strings.Join(r.header.Values("x-MD5"), ",")
	if sum != "" && len(sum) != 32 {
		return "failed: faulty x-MD5 " + sum
	}
	if int64(len(r.body)) < r.contentLength {
		return fmt.Sprintf("failed: stream ended after %d of %d bytes", len(r.body), r.contentLength)
	}
	// Update.end compares its lowercase hex digest with x-MD5 as sent.
	if sum != "" && otaMD5(r.body[:r.contentLength]) != sum {
		return "failed: md5 mismatch"
	}
	return "updated"
}

// ---- helpers ----

// otaMD5 is the lowercase hex md5 of b, as the server names firmwares.
func otaMD5(b []byte) string {
	h := md5.Sum(b)
	return hex.EncodeToString(h[:])
}

// otaFirmware returns size bytes of deterministic pseudo-random firmware
// that starts with the 0xE9 magic byte the updaters check.
func otaFirmware(size int, seed byte) []byte {
	var key [32]byte
	key[0] = seed
	b := make([]byte, size)
	rand.NewChaCha8(key).Read(b)
	b[0] = 0xE9
	return b
}

// otaUpload uploads content as a firmware of u's device and returns its
// md5 and id.
func otaUpload(tb testing.TB, env *testEnv, u testUser, name, version string, content []byte) (string, int64) {
	tb.Helper()
	w := env.upload(u.device, u.token, map[string]string{"name": name, "version": version}, content)
	if w.Code != http.StatusCreated {
		tb.Fatalf("upload %s: got %d, want %d: %s", name, w.Code, http.StatusCreated, w.Body)
	}
	var resp struct {
		Data struct {
			ID  int64  `json:"id"`
			MD5 string `json:"md5"`
		} `json:"data"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil {
		tb.Fatalf("upload %s: %v: %s", name, err, w.Body)
	}
	if want := otaMD5(content); resp.Data.MD5 != want {
		tb.Fatalf("upload %s: got md5 %q, want %q", name, resp.Data.MD5, want)
	}
	return resp.Data.MD5, resp.Data.ID
}

// otaSetTarget makes the firmware with that md5 the target of u's device.
func otaSetTarget(tb testing.TB, env *testEnv, u testUser, sum string) {
	tb.Helper()
	w := env.request("POST", "/v1/user/devices/"+u.device+"/firmwares/set-target", u.token, map[string]string{"md5": sum})
	if w.Code != http.StatusOK {
		tb.Fatalf("set-target %s: got %d, want %d: %s", sum, w.Code, http.StatusOK, w.Body)
	}
}

// otaAssign uploads content and makes it the target of u's device.
func otaAssign(tb testing.TB, env *testEnv, u testUser, name, version string, content []byte) (string, int64) {
	tb.Helper()
	sum, id := otaUpload(tb, env, u, name, version, content)
	otaSetTarget(tb, env, u, sum)
	return sum, id
}

// otaServe serves env's server on a real loopback TCP listener.
func otaServe(tb testing.TB, env *testEnv) *httptest.Server {
	tb.Helper()
	ts := httptest.NewServer(env.srv)
	tb.Cleanup(ts.Close)
	return ts
}

// otaLocal rewrites the scheme and host of a link (built on the public URL,
// http://devicehub.test) to those of ts.
func otaLocal(tb testing.TB, ts *httptest.Server, link string) string {
	tb.Helper()
	u, err := url.Parse(link)
	if err != nil {
		tb.Fatalf("parse link %q: %v", link, err)
	}
	base, err := url.Parse(ts.URL)
	if err != nil {
		tb.Fatal(err)
	}
	u.Scheme, u.Host = base.Scheme, base.Host
	return u.String()
}

// otaEdit returns link changed by fn.
func otaEdit(tb testing.TB, link string, fn func(u *url.URL, q url.Values)) string {
	tb.Helper()
	u, err := url.Parse(link)
	if err != nil {
		tb.Fatalf("parse link %q: %v", link, err)
	}
	q := u.Query()
	fn(u, q)
	u.RawQuery = q.Encode()
	return u.String()
}

// otaPath is the download path of a device's firmware.
func otaPath(uid, sum string) string { return "/ota/" + uid + "/" + sum + ".bin" }

// checkOTAAnswer checks the status, and then either a whole download
// (checkOTADownload; it returns true) or that a refusal is JSON.
func checkOTAAnswer(t *testing.T, r *otaResponse, wantStatus int, wantBody []byte) (downloaded bool) {
	t.Helper()
	if r.status != wantStatus {
		t.Fatalf("status: got %d, want %d: %.200q", r.status, wantStatus, r.body)
	}
	if wantStatus == http.StatusOK {
		checkOTADownload(t, r, wantBody)
		return true
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type: got %q, want application/json", ct)
	}
	return false
}

// checkOTADownload checks a 200 answer the way an updater needs it: the whole
// file, its exact size in one Content-Length, one lowercase x-MD5, no
// chunking, no redirect.
func checkOTADownload(t *testing.T, r *otaResponse, want []byte) {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("status: got %d, want %d: %.200q", r.status, http.StatusOK, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/octet-stream" {
		t.Errorf("Content-Type: got %q, want %q", ct, "application/octet-stream")
	}
	if r.contentLength != int64(len(want)) {
		t.Errorf("Content-Length: got %d, want %d", r.contentLength, len(want))
	}
	if cl := r.header.Values("Content-Length"); len(cl) != 1 {
		t.Errorf("Content-Length header: got %q, want exactly one value", cl)
	}
	if got, sum := r.header.Values("x-MD5"), otaMD5(want); !slices.Equal(got, []string{sum}) {
		t.Errorf("x-MD5: got %q, want exactly [%q]", got, sum)
	}
	if len(r.transferEncoding) > 0 {
		t.Errorf("Transfer-Encoding: got %q, want none", r.transferEncoding)
	}
	if loc := r.header.Get("Location"); loc != "" {
		t.Errorf("Location: got %q, want none", loc)
	}
	if !bytes.Equal(r.body, want) {
		t.Errorf("body: got %d bytes (md5 %s), want the %d firmware bytes (md5 %s)",
			len(r.body), otaMD5(r.body), len(want), otaMD5(want))
	}
}

// ---- downloads ----

// TestOTADownload plays the ESP32 and ESP8266 updaters against a signed
// link: the firmware when they run something else, 304 when they run it
// already, and ranges for a resumed download.
func TestOTADownload(t *testing.T) {
	env := newTestEnv(t, nil)
	fw := otaFirmware(300_001, 1) // not a multiple of any buffer size
	sum, _ := otaAssign(t, env, env.alice, "blink", "1.1.0", fw)
	ts := otaServe(t, env)
	link := otaLocal(t, ts, env.srv.otaURL(env.alice.device, sum))
	running := otaMD5(otaFirmware(1000, 2)) // what the device runs now
	rangeHdr := map[string]string{"Range": "bytes=100-199"}

	tests := []struct {
		name        string
		dev         espUpdater
		http11      bool
		extra       map[string]string
		wantStatus  int
		wantBody    []byte
		wantRange   string // Content-Range of a 206
		wantVerdict string // "" for answers the updaters never ask for
	}{
		{"ESP32, HTTP/1.0, other sketch", esp32Updater(running), false, nil, 200, fw, "", "updated"},
		{"ESP8266, HTTP/1.0, other sketch", esp8266Updater(running), false, nil, 200, fw, "", "updated"},
		{"ESP32, HTTP/1.0, no sketch md5", esp32Updater(""), false, nil, 200, fw, "", "updated"},
		{"ESP32, HTTP/1.1, other sketch", esp32Updater(running), true, nil, 200, fw, "", "updated"},
		{"ESP8266, HTTP/1.1, other sketch", esp8266Updater(running), true, nil, 200, fw, "", "updated"},
		{"ESP32 runs it", esp32Updater(sum), false, nil, 304, nil, "", "no update"},
		{"ESP32 runs it, uppercase md5", esp32Updater(strings.ToUpper(sum)), false, nil, 304, nil, "", "no update"},
		{"ESP8266 runs it", esp8266Updater(sum), false, nil, 304, nil, "", "no update"},
		{"ESP8266 runs it, uppercase md5", esp8266Updater(strings.ToUpper(sum)), false, nil, 304, nil, "", "no update"},
		{"ESP32 runs it, HTTP/1.1", esp32Updater(sum), true, nil, 304, nil, "", "no update"},
		{"range, HTTP/1.1", esp32Updater(running), true, rangeHdr, 206, fw[100:200], fmt.Sprintf("bytes 100-199/%d", len(fw)), ""},
		{"range, HTTP/1.0", esp32Updater(running), false, rangeHdr, 206, fw[100:200], fmt.Sprintf("bytes 100-199/%d", len(fw)), ""},
		{"open range", esp32Updater(running), false, map[string]string{"Range": "bytes=300000-"}, 206, fw[300000:], "bytes 300000-300000/300001", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r *otaResponse
			var err error
			if tt.http11 {
				r, err = tt.dev.get11(link, tt.extra)
			} else {
				r, err = tt.dev.get(link, tt.extra, nil)
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.status != tt.wantStatus {
				t.Fatalf("status: got %d, want %d: %.200q", r.status, tt.wantStatus, r.body)
			}
			switch tt.wantStatus {
			case http.StatusOK:
				checkOTADownload(t, r, tt.wantBody)
			case http.StatusPartialContent:
				if got := r.header.Get("Content-Range"); got != tt.wantRange {
					t.Errorf("Content-Range: got %q, want %q", got, tt.wantRange)
				}
				if r.contentLength != int64(len(tt.wantBody)) {
					t.Errorf("Content-Length: got %d, want %d", r.contentLength, len(tt.wantBody))
				}
				if len(r.transferEncoding) > 0 {
					t.Errorf("Transfer-Encoding: got %q, want none", r.transferEncoding)
				}
				if !bytes.Equal(r.body, tt.wantBody) {
					t.Errorf("body: got %d bytes, want the %d bytes of %s", len(r.body), len(tt.wantBody), tt.wantRange)
				}
			case http.StatusNotModified:
				if len(r.body) != 0 {
					t.Errorf("body: got %d bytes, want none", len(r.body))
				}
			}
			if tt.wantVerdict != "" {
				if got := tt.dev.verdict(r); got != tt.wantVerdict {
					t.Errorf("updater: got %q, want %q", got, tt.wantVerdict)
				}
			}
		})
	}
}

// TestOTADownloadRejected checks that a link works only as signed: for
// one device, one md5 and until its expiry. The device's sketch-md5 does
// not turn a bad link into a 304.
func TestOTADownloadRejected(t *testing.T) {
	env := newTestEnv(t, nil)
	a, b := env.alice, env.bob
	fw := otaFirmware(50_000, 3)
	bobFW := otaFirmware(40_000, 4)
	sum, _ := otaAssign(t, env, a, "alice fw", "1.0.0", fw)
	bobSum, _ := otaAssign(t, env, b, "bob fw", "2.0.0", bobFW)
	otaUpload(t, env, b, "bob copy of alice fw", "1.0.0", fw) // same bytes, same md5, bob's row
	ts := otaServe(t, env)

	link := otaLocal(t, ts, env.srv.otaURL(a.device, sum))
	bobLink := otaLocal(t, ts, env.srv.otaURL(b.device, bobSum))
	bobSharedLink := otaLocal(t, ts, env.srv.otaURL(b.device, sum)) // valid for bob's copy
	onPath := func(l, uid, md5sum string) string {
		return otaEdit(t, l, func(u *url.URL, _ url.Values) { u.Path = otaPath(uid, md5sum) })
	}
	flip := func(s string) string {
		c := byte('0')
		if s[len(s)-1] == '0' {
			c = '1'
		}
		return s[:len(s)-1] + string(c)
	}

	tests := []struct {
		name       string
		link       string
		dev        espUpdater
		wantStatus int
		wantBody   []byte
	}{
		{"valid link", link, esp32Updater(""), 200, fw},
		{"bob's valid link", bobLink, esp32Updater(""), 200, bobFW},
		{"bob's valid link for his copy", bobSharedLink, esp32Updater(""), 200, fw},
		{"tampered signature", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Set("sig", flip(q.Get("sig"))) }), esp32Updater(""), 403, nil},
		{"uppercase signature", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Set("sig", strings.ToUpper(q.Get("sig"))) }), esp32Updater(""), 403, nil},
		{"no signature", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Del("sig") }), esp32Updater(""), 403, nil},
		{"tampered expiry", otaEdit(t, link, func(_ *url.URL, q url.Values) {
			exp, _ := strconv.ParseInt(q.Get("exp"), 10, 64)
			q.Set("exp", strconv.FormatInt(exp+3600, 10))
		}), esp32Updater(""), 403, nil},
		{"no expiry", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Del("exp") }), esp32Updater(""), 403, nil},
		{"bob's signature on alice's firmware path", onPath(bobLink, a.device, sum), esp32Updater(""), 403, nil},
		{"link for bob's device and this md5, on alice's path", onPath(bobSharedLink, a.device, sum), esp32Updater(""), 403, nil},
		{"alice's signature on bob's firmware path", onPath(link, b.device, bobSum), esp32Updater(""), 403, nil},
		{"alice's signature on bob's copy of the same bytes", onPath(link, b.device, sum), esp32Updater(""), 403, nil},
		{"alice's signature on bob's md5 under alice's uid", onPath(link, a.device, bobSum), esp32Updater(""), 403, nil},
		{"tampered signature, device runs the md5", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Set("sig", flip(q.Get("sig"))) }), esp32Updater(sum), 403, nil},
		{"tampered signature, ESP8266 runs the md5", otaEdit(t, link, func(_ *url.URL, q url.Values) { q.Set("sig", flip(q.Get("sig"))) }), esp8266Updater(sum), 403, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := tt.dev.get(tt.link, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if checkOTAAnswer(t, r, tt.wantStatus, tt.wantBody) {
				return
			}
			if v := r.header.Get("x-MD5"); v != "" {
				t.Errorf("x-MD5: got %q on a %d, want none", v, r.status)
			}
			var msg messageBody
			if err := json.Unmarshal(r.body, &msg); err != nil || msg.Message == "" {
				t.Errorf("body: got %.200q, want a JSON message", r.body)
			}
			if got := tt.dev.verdict(r); got != "failed: forbidden" {
				t.Errorf("updater: got %q, want %q", got, "failed: forbidden")
			}
		})
	}
}

// TestOTADownloadExpiry checks that a link works for 24 hours and no
// longer, on the injected clock, and that a new link works after that.
func TestOTADownloadExpiry(t *testing.T) {
	env := newTestEnv(t, nil)
	fw := otaFirmware(20_000, 5)
	sum, _ := otaAssign(t, env, env.alice, "blink", "1.0.0", fw)
	ts := otaServe(t, env)
	link := otaLocal(t, ts, env.srv.otaURL(env.alice.device, sum))

	tests := []struct {
		name       string
		age        time.Duration // since the link was made; cumulative, increasing
		wantStatus int
	}{
		{"new", 0, 200},
		{"one hour old", time.Hour, 200},
		{"one second before expiry", 24*time.Hour - time.Second, 200},
		{"one second after expiry", 24*time.Hour + time.Second, 403},
		{"a week old", 7 * 24 * time.Hour, 403},
	}
	var age time.Duration
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env.clock.advance(tt.age - age)
			age = tt.age
			r, err := esp32Updater("").get(link, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if r.status != tt.wantStatus {
				t.Fatalf("status: got %d, want %d: %.200q", r.status, tt.wantStatus, r.body)
			}
			if tt.wantStatus == http.StatusOK {
				checkOTADownload(t, r, fw)
			}
		})
	}

	t.Run("new link after expiry", func(t *testing.T) {
		r, err := esp32Updater("").get(otaLocal(t, ts, env.srv.otaURL(env.alice.device, sum)), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		checkOTADownload(t, r, fw)
	})
}

// TestOTADownloadDeletedFirmware checks that a link for a deleted firmware
// answers 404, even while another device keeps the same bytes.
func TestOTADownloadDeletedFirmware(t *testing.T) {
	env := newTestEnv(t, nil)
	a := env.alice
	fw1, fw2 := otaFirmware(30_000, 6), otaFirmware(31_000, 7)
	sum1, id1 := otaAssign(t, env, a, "v1", "1.0.0", fw1)
	bobSum, _ := otaAssign(t, env, env.bob, "bob's copy of v1", "1.0.0", fw1)
	ts := otaServe(t, env)
	link1 := otaLocal(t, ts, env.srv.otaURL(a.device, sum1))
	bobLink := otaLocal(t, ts, env.srv.otaURL(env.bob.device, bobSum))

	get := func(t *testing.T, link string) *otaResponse {
		t.Helper()
		r, err := esp32Updater("").get(link, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	// A firmware that is no longer the target but still uploaded is served.
	sum2, _ := otaAssign(t, env, a, "v2", "2.0.0", fw2)
	checkOTADownload(t, get(t, link1), fw1)

	w := env.request("DELETE", fmt.Sprintf("/v1/user/devices/%s/firmwares/%d", a.device, id1), a.token, nil)
	if w.Code != http.StatusOK {
		t.Fatalf("delete v1: got %d, want %d: %s", w.Code, http.StatusOK, w.Body)
	}

	tests := []struct {
		name       string
		link       string
		wantStatus int
		wantBody   []byte
	}{
		{"deleted firmware", link1, 404, nil},
		{"bob's copy of the same bytes", bobLink, 200, fw1},
		{"the new target", otaLocal(t, ts, env.srv.otaURL(a.device, sum2)), 200, fw2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := get(t, tt.link)
			if checkOTAAnswer(t, r, tt.wantStatus, tt.wantBody) {
				return
			}
			if got := esp32Updater("").verdict(r); got != "failed: not found" {
				t.Errorf("updater: got %q, want %q", got, "failed: not found")
			}
		})
	}
}

// TestOTADownloadConcurrent checks that 100 updaters downloading at once
// each get the exact bytes.
func TestOTADownloadConcurrent(t *testing.T) {
	const clients = 100
	env := newTestEnv(t, nil)
	fw := otaFirmware(512<<10, 8)
	sum, _ := otaAssign(t, env, env.alice, "big", "3.0.0", fw)
	ts := otaServe(t, env)
	link := otaLocal(t, ts, env.srv.otaURL(env.alice.device, sum))

	var wg sync.WaitGroup
	var ok atomic.Int64
	for i := range clients {
		wg.Go(func() {
			dev := esp32Updater(otaMD5([]byte{byte(i)}))
			r, err := dev.get(link, nil, nil)
			if err != nil {
				t.Errorf("client %d: %v", i, err)
				return
			}
			if got := dev.verdict(r); got != "updated" {
				t.Errorf("client %d: got %q (status %d), want %q", i, got, r.status, "updated")
				return
			}
			if !bytes.Equal(r.body, fw) {
				t.Errorf("client %d: got %d bytes (md5 %s), want the %d firmware bytes", i, len(r.body), otaMD5(r.body), len(fw))
				return
			}
			ok.Add(1)
		})
	}
	wg.Wait()
	if got := ok.Load(); got != clients {
		t.Errorf("exact downloads: got %d, want %d", got, clients)
	}
}

// ---- end to end over a broker ----

// TestOTAOverBroker runs the whole flow with a real broker: assign,
// trigger, the device receives the ota command, downloads its url like
// the ESP32 updater, reports the new md5, and the API shows it.
func TestOTAOverBroker(t *testing.T) {
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	a := env.alice
	ts := otaServe(t, env)
	base := "/v1/user/devices/" + a.device

	// The device: a retained "offline" Last Will, then a retained "online".
	dev := testClient(t, b, "esp32-"+a.device, "devices/"+a.device+"/status")
	publishWait(t, dev, "devices/"+a.device+"/status", true, "online")
	eventually(t, 5*time.Second, "the device online", func() bool { return env.device(a).Status == "online" })
	obs := testClient(t, b, "observer", "")
	cmds := subscribe(t, obs, "devices/+/cmd/+")

	// The device runs v1, uploaded but never assigned.
	v1 := otaFirmware(70_000, 9)
	v1Sum, v1ID := otaUpload(t, env, a, "blink", "1.0.0", v1)
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q,"fw_version":"1.0.0"}`, v1Sum))
	eventually(t, 5*time.Second, "current firmware v1", func() bool {
		d := env.device(a)
		return d.CurrentFirmware != nil && d.CurrentFirmware.MD5 == v1Sum
	})
	if d := env.device(a); d.LastOTAAt != nil {
		t.Errorf("last_ota_at after reporting a firmware that is not the target: got %q, want null", *d.LastOTAAt)
	}

	// Bob's device has a target: a 404 for alice is not about the target.
	otaAssign(t, env, env.bob, "bob fw", "9.9.9", otaFirmware(10_000, 10))
	tests := []struct {
		name       string
		uid        string
		wantStatus int
		wantBody   string
	}{
		{"no target", a.device, 422, `{"message":"Assign firmware first to trigger OTA."}`},
		{"another user's device", env.bob.device, 404, `{"message":"Device not found."}`},
		{"unknown device", "esp32_doesnotexist", 404, `{"message":"Device not found."}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := env.request("POST", "/v1/user/devices/"+tt.uid+"/ota", a.token, nil)
			if w.Code != tt.wantStatus {
				t.Fatalf("got %d, want %d: %s", w.Code, tt.wantStatus, w.Body)
			}
			decode(t, w)
			if !jsonEqual(t, w.Body.Bytes(), []byte(tt.wantBody)) {
				t.Errorf("body: got %s, want %s", w.Body, tt.wantBody)
			}
		})
	}

	// Assign v2 and trigger.
	v2 := otaFirmware(123_457, 11)
	v2Sum, v2ID := otaAssign(t, env, a, "blink", "1.1.0", v2)
	w := env.request("POST", base+"/ota", a.token, nil)
	if w.Code != http.StatusOK {
		t.Fatalf("trigger: got %d, want %d: %s", w.Code, http.StatusOK, w.Body)
	}
	cmdID, _ := decode(t, w)["command_id"].(string)
	if want := fmt.Sprintf(`{"message":"OTA check triggered.","device_uid":%q,"command_id":%q}`, a.device, cmdID); cmdID == "" || !jsonEqual(t, w.Body.Bytes(), []byte(want)) {
		t.Errorf("trigger body: got %s, want %s", w.Body, want)
	}

	// Exactly one command, for alice's device: none for the refused triggers.
	var payload []byte
	select {
	case m := <-cmds:
		if want := "devices/" + a.device + "/cmd/" + cmdID; m.Topic() != want {
			t.Fatalf("command topic: got %q, want %q (payload %s)", m.Topic(), want, m.Payload())
		}
		if m.Qos() != 1 {
			t.Errorf("command QoS: got %d, want 1", m.Qos())
		}
		payload = m.Payload()
	case <-time.After(5 * time.Second):
		t.Fatal("no ota command within 5s")
	}
	select {
	case m := <-cmds:
		t.Errorf("second command: got %s on %s, want exactly one", m.Payload(), m.Topic())
	case <-time.After(300 * time.Millisecond):
	}
	// Not retained: a device that subscribes later is not sent it. (A live
	// subscriber always sees the retain flag cleared.)
	late := subscribe(t, testClient(t, b, "late-observer", ""), "devices/+/cmd")
	select {
	case m := <-late:
		t.Errorf("late subscriber: got %s on %s (retained %v), want no retained command", m.Payload(), m.Topic(), m.Retained())
	case <-time.After(300 * time.Millisecond):
	}
	// Before the update: v1 runs, v2 is the target.
	checkOTAFirmwareFlags(t, env, a, map[int64][2]bool{v1ID: {true, false}, v2ID: {false, true}})

	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil {
		t.Fatalf("command is not a JSON object: %v: %s", err, payload)
	}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range fields {
			if !yield(k) {
				return
			}
		}
	})
	if want := []string{"cmd", "md5", "sha256", "size", "url", "version"}; !slices.Equal(keys, want) {
		t.Errorf("command keys: got %q, want %q", keys, want)
	}
	var cmd struct {
		Cmd     string `json:"cmd"`
		URL     string `json:"url"`
		MD5     string `json:"md5"`
		SHA256  string `json:"sha256"`
		Size    int64  `json:"size"`
		Version string `json:"version"`
	}
	if err := json.Unmarshal(payload, &cmd); err != nil {
		t.Fatalf("command fields: %v: %s", err, payload)
	}
	if cmd.Cmd != "ota" || cmd.MD5 != v2Sum || cmd.SHA256 != sha256Hex(v2) || cmd.Size != int64(len(v2)) || cmd.Version != "1.1.0" {
		t.Errorf("command: got cmd=%q md5=%q sha256=%q size=%d version=%q, want ota %q %q %d %q",
			cmd.Cmd, cmd.MD5, cmd.SHA256, cmd.Size, cmd.Version, v2Sum, sha256Hex(v2), len(v2), "1.1.0")
	}
	if !strings.HasPrefix(cmd.URL, "http://devicehub.test/") {
		t.Fatalf("command url: got %q, want an absolute url on http://devicehub.test/", cmd.URL)
	}

	// The device downloads the url with the ESP32 updater, running v1.
	updater := esp32Updater(v1Sum)
	r, err := updater.get(otaLocal(t, ts, cmd.URL), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	checkOTADownload(t, r, v2)
	if got := updater.verdict(r); got != "updated" {
		t.Fatalf("updater: got %q, want %q", got, "updated")
	}

	// It reboots into v2 and reports it, an hour later.
	env.clock.advance(time.Hour)
	otaAt := env.clock.now()
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q,"fw_version":"1.1.0"}`, v2Sum))
	var detail struct {
		Data struct {
			Status          string                     `json:"status"`
			LastOTAAt       *string                    `json:"last_ota_at"`
			CurrentFirmware map[string]json.RawMessage `json:"current_firmware"`
			TargetFirmware  map[string]json.RawMessage `json:"target_firmware"`
		} `json:"data"`
	}
	eventually(t, 5*time.Second, "current firmware v2 in the API", func() bool {
		w := env.request("GET", base, a.token, nil)
		if w.Code != http.StatusOK {
			t.Fatalf("device detail: got %d, want %d: %s", w.Code, http.StatusOK, w.Body)
		}
		if err := json.Unmarshal(w.Body.Bytes(), &detail); err != nil {
			t.Fatalf("device detail: %v: %s", err, w.Body)
		}
		return string(detail.Data.CurrentFirmware["md5"]) == strconv.Quote(v2Sum)
	})
	d := detail.Data
	cur := d.CurrentFirmware
	for _, c := range []struct{ field, want string }{
		{"id", strconv.FormatInt(v2ID, 10)},
		{"name", `"blink"`},
		{"version", `"1.1.0"`},
		{"md5", strconv.Quote(v2Sum)},
		{"size", strconv.Itoa(len(v2))},
	} {
		if got := string(cur[c.field]); got != c.want {
			t.Errorf("current_firmware.%s: got %s, want %s", c.field, got, c.want)
		}
	}
	for _, k := range []string{"is_current", "is_target"} {
		if _, ok := cur[k]; ok {
			t.Errorf("current_firmware has %q, want no such field", k)
		}
	}
	if got := string(d.TargetFirmware["md5"]); got != strconv.Quote(v2Sum) {
		t.Errorf("target_firmware.md5: got %s, want %q", got, v2Sum)
	}
	if d.LastOTAAt == nil {
		t.Errorf("last_ota_at: got null, want %s", otaAt.Format(time.RFC3339))
	} else if at, err := time.Parse(time.RFC3339, *d.LastOTAAt); err != nil || !at.Equal(otaAt) {
		t.Errorf("last_ota_at: got %q, want %s", *d.LastOTAAt, otaAt.Format(time.RFC3339))
	}
	if d.Status != "online" {
		t.Errorf("status: got %q, want online", d.Status)
	}

	checkOTAFirmwareFlags(t, env, a, map[int64][2]bool{v1ID: {false, false}, v2ID: {true, true}})

	// Checking again, now running v2: nothing to do.
	updater = esp32Updater(v2Sum)
	r, err = updater.get(otaLocal(t, ts, cmd.URL), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := updater.verdict(r); r.status != http.StatusNotModified || got != "no update" {
		t.Errorf("check while running v2: got %d %q, want %d %q", r.status, got, http.StatusNotModified, "no update")
	}
}

// checkOTAFirmwareFlags checks is_current and is_target ([2]bool, in that
// order) of every firmware in the list of u's device, by id.
func checkOTAFirmwareFlags(t *testing.T, env *testEnv, u testUser, want map[int64][2]bool) {
	t.Helper()
	w := env.request("GET", "/v1/user/devices/"+u.device+"/firmwares", u.token, nil)
	if w.Code != http.StatusOK {
		t.Fatalf("firmware list: got %d, want %d: %s", w.Code, http.StatusOK, w.Body)
	}
	var list struct {
		Data []struct {
			ID        int64  `json:"id"`
			MD5       string `json:"md5"`
			IsCurrent *bool  `json:"is_current"`
			IsTarget  *bool  `json:"is_target"`
		} `json:"data"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &list); err != nil {
		t.Fatalf("firmware list: %v: %s", err, w.Body)
	}
	if len(list.Data) != len(want) {
		t.Errorf("firmware list: got %d firmwares, want %d: %s", len(list.Data), len(want), w.Body)
	}
	for _, f := range list.Data {
		flags, ok := want[f.ID]
		if !ok {
			t.Errorf("firmware list: unexpected id %d", f.ID)
			continue
		}
		if f.IsCurrent == nil || *f.IsCurrent != flags[0] {
			t.Errorf("firmware %d (%s) is_current: got %s, want %v", f.ID, f.MD5, otaBool(f.IsCurrent), flags[0])
		}
		if f.IsTarget == nil || *f.IsTarget != flags[1] {
			t.Errorf("firmware %d (%s) is_target: got %s, want %v", f.ID, f.MD5, otaBool(f.IsTarget), flags[1])
		}
	}
}

// otaBool renders an optional JSON boolean for a failure message.
func otaBool(b *bool) string {
	if b == nil {
		return "null"
	}
	return strconv.FormatBool(*b)
}

// ---- benchmark ----

// otaRSS returns the process's resident set size in bytes (VmRSS).
func otaRSS() (int64, error) {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) != 2 || f[1] != "kB" {
				return 0, fmt.Errorf("unexpected VmRSS line %q", line)
			}
			kb, err := strconv.ParseInt(f[0], 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/self/status")
}

// BenchmarkOTADownload runs rounds of 100 concurrent updater downloads of
// a 4 MiB firmware through a real TCP server. It reports throughput (one
// op is a round) and rss-growth-MiB: the peak resident set size during the
// run minus the size before it. The clients run in the same process (each
// streams the body into a hash through a 4 KiB buffer), so the figure
// includes their goroutines and buffers too: it overstates the server's
// own growth by a few MiB.
func BenchmarkOTADownload(b *testing.B) {
	const clients = 100
	env := newTestEnv(b, nil)
	sum, _ := otaAssign(b, env, env.alice, "max", "4.0.0", otaFirmware(maxFirmwareSize, 12))
	ts := otaServe(b, env)
	link := otaLocal(b, ts, env.srv.otaURL(env.alice.device, sum))

	// A warm-up download, then the baseline with the upload's garbage gone.
	if r, err := esp32Updater("").get(link, nil, io.Discard); err != nil || r.status != http.StatusOK || r.n != maxFirmwareSize {
		b.Fatalf("warm-up download: %v %+v", err, r)
	}
	runtime.GC()
	debug.FreeOSMemory()
	before, err := otaRSS()
	if err != nil {
		b.Skipf("cannot read RSS: %v", err)
	}
	var peak atomic.Int64
	peak.Store(before)
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if rss, err := otaRSS(); err == nil && rss > peak.Load() {
					peak.Store(rss)
				}
			}
		}
	}()

	b.SetBytes(clients * maxFirmwareSize)
	for b.Loop() {
		var wg sync.WaitGroup
		for i := range clients {
			wg.Go(func() {
				h := md5.New()
				r, err := esp32Updater("").get(link, nil, h)
				switch {
				case err != nil:
					b.Errorf("client %d: %v", i, err)
				case r.status != http.StatusOK || r.contentLength != maxFirmwareSize || r.n != maxFirmwareSize:
					b.Errorf("client %d: got status %d, Content-Length %d, %d bytes; want 200 and %d bytes",
						i, r.status, r.contentLength, r.n, maxFirmwareSize)
				case hex.EncodeToString(h.Sum(nil)) != sum:
					b.Errorf("client %d: body md5 %x, want %s", i, h.Sum(nil), sum)
				}
			})
		}
		wg.Wait()
	}
	close(stop)
	<-sampled
	b.ReportMetric(float64(peak.Load()-before)/(1<<20), "rss-growth-MiB")
}
