package main

import (
	"bufio"
	"bytes"
	"cmp"
	"crypto/md5"
	"devicehub/internal/model"
	"devicehub/internal/store"
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
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// espUpdater simulates the stock HTTP updaters of the Arduino cores
// (HTTPUpdate on the ESP32, ESP8266httpUpdate on the ESP8266): the request
// they send, and the checks they make on the answer before they flash it.
type espUpdater struct {
	chip      string // "ESP32" or "ESP8266": names the x-<chip>-… headers
	sketchMD5 string // md5 of the running sketch; "" sends no sketch-md5 header
	freeSpace int    // free sketch space, bytes: a larger firmware is refused
	rcvBuf    int    // when set, the socket's receive buffer: an lwIP-sized window
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
	d := net.Dialer{Timeout: 5 * time.Second}
	if u.rcvBuf > 0 { // before connecting: the window is agreed in the handshake
		d.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, u.rcvBuf)
			})
			return cmp.Or(err, serr)
		}
	}
	conn, err := d.Dial("tcp", target.Host)
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
	if sum != "" && md5Hex(r.body[:r.contentLength]) != sum {
		return "failed: md5 mismatch"
	}
	return "updated"
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

// otaServe serves env's server on a real loopback TCP listener.
func otaServe(tb testing.TB, env *testEnv) *httptest.Server {
	tb.Helper()
	ts := httptest.NewServer(env.srv)
	tb.Cleanup(ts.Close)
	return ts
}

// otaLocal rewrites the scheme and host of a link (built on the public
// URL, http://devicehub.test) to those of ts.
func otaLocal(tb testing.TB, ts *httptest.Server, link string) string {
	tb.Helper()
	return strings.Replace(link, "http://devicehub.test", ts.URL, 1)
}

// otaAssign uploads content as a firmware of u's device and makes it the
// target; it returns its md5 and id.
func otaAssign(tb testing.TB, env *testEnv, u testUser, name, version string, content []byte) (string, int64) {
	tb.Helper()
	id, sum := env.uploadOK(u, map[string]string{"name": name, "version": version}, content)
	env.setTarget(u, sum)
	return sum, id
}

// otaEdit returns link changed by fn.
func otaEdit(tb testing.TB, link string, fn func(u *url.URL, q url.Values)) string {
	tb.Helper()
	u, err := url.Parse(link)
	must(tb, err)
	q := u.Query()
	fn(u, q)
	u.RawQuery = q.Encode()
	return u.String()
}

// checkOTAAnswer checks an answer's status and then either the download
// the way an updater needs it (the bytes wanted, their exact size in one
// Content-Length, one lowercase x-MD5, no chunking) or that a refusal is
// a JSON message without x-MD5.
func checkOTAAnswer(t *testing.T, r *otaResponse, wantStatus int, want []byte) {
	t.Helper()
	if r.status != wantStatus {
		t.Fatalf("status: got %d, want %d: %.200q", r.status, wantStatus, r.body)
	}
	if r.status >= 300 {
		var msg messageBody
		if ct := r.header.Get("Content-Type"); ct != "application/json" || json.Unmarshal(r.body, &msg) != nil || msg.Message == "" ||
			r.header.Get("x-MD5") != "" {
			t.Errorf("refusal: got Content-Type %q, x-MD5 %q, body %.200q; want a JSON message", ct, r.header.Get("x-MD5"), r.body)
		}
		return
	}
	if ct := r.header.Get("Content-Type"); ct != "application/octet-stream" {
		t.Errorf("Content-Type: got %q, want application/octet-stream", ct)
	}
	if cl := r.header.Values("Content-Length"); r.contentLength != int64(len(want)) || len(cl) != 1 {
		t.Errorf("Content-Length: got %q, want exactly [%d]", cl, len(want))
	}
	if got, sum := r.header.Values("x-MD5"), md5Hex(want); r.status == http.StatusOK && !slices.Equal(got, []string{sum}) {
		t.Errorf("x-MD5: got %q, want exactly [%q]", got, sum)
	}
	if len(r.transferEncoding) > 0 {
		t.Errorf("Transfer-Encoding: got %q, want none", r.transferEncoding)
	}
	if !bytes.Equal(r.body, want) {
		t.Errorf("body: got %d bytes (md5 %s), want %d (md5 %s)", len(r.body), md5Hex(r.body), len(want), md5Hex(want))
	}
}

// TestOTADownload plays the ESP32 and ESP8266 updaters against a signed
// link: the firmware when they run something else, 304 when they run it
// already, and ranges for a resumed download. A current arduino-esp32 core
// sends only x-ESP32-sketch-sha256 (in upper case), no sketch md5: a match,
// in any case, is a 304; another sha256 gets the image.
func TestOTADownload(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	fw := otaFirmware(300_001, 1) // not a multiple of any buffer size
	_, sum := env.uploadOK(env.alice, map[string]string{"name": "blink"}, fw)
	link := otaLocal(t, otaServe(t, env), env.srv.ota.url(env.alice.device, sum))
	running := md5Hex(otaFirmware(1000, 2)) // what the device runs now
	sha := func(s string) map[string]string { return map[string]string{"x-ESP32-sketch-sha256": s} }
	tests := []struct {
		name        string
		dev         espUpdater
		extra       map[string]string // more request headers
		wantStatus  int
		wantBody    []byte
		wantRange   string // Content-Range of a 206
		wantVerdict string // "" for answers the updaters never ask for
	}{
		{"ESP32, other sketch", esp32Updater(running), nil, 200, fw, "", "updated"},
		{"ESP8266, other sketch", esp8266Updater(running), nil, 200, fw, "", "updated"},
		{"ESP32, no sketch md5", esp32Updater(""), nil, 200, fw, "", "updated"},
		{"ESP32 runs it", esp32Updater(sum), nil, 304, nil, "", "no update"},
		{"ESP32 runs it, uppercase md5", esp32Updater(strings.ToUpper(sum)), nil, 304, nil, "", "no update"},
		{"ESP8266 runs it", esp8266Updater(sum), nil, 304, nil, "", "no update"},
		{"ESP8266 runs it, uppercase md5", esp8266Updater(strings.ToUpper(sum)), nil, 304, nil, "", "no update"},
		{"sha256, upper case, as the core sends it", esp32Updater(""), sha(strings.ToUpper(sha256Hex(fw))), 304, nil, "", "no update"},
		{"sha256, lower case", esp32Updater(""), sha(sha256Hex(fw)), 304, nil, "", "no update"},
		{"sha256, header name in another case", esp32Updater(""), map[string]string{"X-ESP32-SKETCH-SHA256": strings.ToUpper(sha256Hex(fw))}, 304, nil, "", "no update"},
		{"sha256 of another image", esp32Updater(""), sha(sha256Hex(otaFirmware(50_000, 42))), 200, fw, "", "updated"},
		{"the md5 in the sha256 header", esp32Updater(""), sha(sum), 200, fw, "", "updated"},
		{"sha256 empty", esp32Updater(""), sha(""), 200, fw, "", "updated"},
		{"range", esp32Updater(running), map[string]string{"Range": "bytes=100-199"}, 206, fw[100:200], fmt.Sprintf("bytes 100-199/%d", len(fw)), ""},
		{"open range", esp32Updater(running), map[string]string{"Range": "bytes=300000-"}, 206, fw[300000:], "bytes 300000-300000/300001", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := tt.dev.get(link, tt.extra, nil)
			must(t, err)
			if tt.wantStatus == http.StatusNotModified {
				if r.status != tt.wantStatus || len(r.body) != 0 {
					t.Errorf("got %d with %d bytes, want 304 without a body", r.status, len(r.body))
				}
			} else {
				checkOTAAnswer(t, r, tt.wantStatus, tt.wantBody)
			}
			if got := r.header.Get("Content-Range"); got != tt.wantRange {
				t.Errorf("Content-Range: got %q, want %q", got, tt.wantRange)
			}
			if got := tt.dev.verdict(r); tt.wantVerdict != "" && got != tt.wantVerdict {
				t.Errorf("updater: got %q, want %q", got, tt.wantVerdict)
			}
		})
	}
}

// TestOTALinks checks that a link works only as signed: for one device,
// one md5 and for 24 hours, while the firmware exists. The device's
// sketch-md5 does not turn a bad link into a 304.
func TestOTALinks(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	a, b := env.alice, env.bob
	fw, bobFW, old, gone := otaFirmware(50_000, 3), otaFirmware(40_000, 4), otaFirmware(30_000, 5), otaFirmware(31_000, 6)
	_, sum := env.uploadOK(a, map[string]string{"name": "alice fw"}, fw)
	_, bobSum := env.uploadOK(b, map[string]string{"name": "bob fw"}, bobFW)
	env.uploadOK(b, map[string]string{"name": "bob's copy of alice's fw"}, fw) // same bytes, same md5, bob's row
	_, oldSum := env.uploadOK(a, map[string]string{"name": "old"}, old)
	goneID, goneSum := env.uploadOK(a, map[string]string{"name": "deleted"}, gone)
	env.uploadOK(b, map[string]string{"name": "bob's copy of the deleted fw"}, gone)
	ts := otaServe(t, env)
	issue := func(uid, sum string) string { return otaLocal(t, ts, env.srv.ota.url(uid, sum)) }
	link, bobLink, bobShared := issue(a.device, sum), issue(b.device, bobSum), issue(b.device, sum)
	oldLink, goneLink, bobGone := issue(a.device, oldSum), issue(a.device, goneSum), issue(b.device, goneSum)
	env.setTarget(a, oldSum)
	env.setTarget(a, sum) // old is no longer the target, but still uploaded
	checkAnswer(t, env.request("DELETE", fmt.Sprintf("/v1/user/devices/%s/firmwares/%d", a.device, goneID), a.token, nil), 200, "")
	t0 := env.clock.now()

	onPath := func(l, uid, md5sum string) string {
		return otaEdit(t, l, func(u *url.URL, _ url.Values) { u.Path = "/ota/" + uid + "/" + md5sum + ".bin" })
	}
	query := func(key string, fn func(string) string) string {
		return otaEdit(t, link, func(_ *url.URL, q url.Values) {
			if v := fn(q.Get(key)); v == "" {
				q.Del(key)
			} else {
				q.Set(key, v)
			}
		})
	}
	flip := func(s string) string {
		return s[:len(s)-1] + map[bool]string{true: "1", false: "0"}[s[len(s)-1] == '0']
	}
	later := func(exp string) string { n, _ := strconv.ParseInt(exp, 10, 64); return strconv.FormatInt(n+3600, 10) }
	none := func(string) string { return "" }
	const day = 24 * time.Hour
	tests := []struct {
		name       string
		link       func() string // made at t0, or at t0+age when it calls issue
		dev        espUpdater
		age        time.Duration // of the link at the request
		wantStatus int
		wantBody   []byte
	}{
		{"valid link", func() string { return link }, esp32Updater(""), 0, 200, fw},
		{"bob's valid link", func() string { return bobLink }, esp32Updater(""), 0, 200, bobFW},
		{"bob's valid link for his copy", func() string { return bobShared }, esp32Updater(""), 0, 200, fw},
		{"a firmware that is no longer the target", func() string { return oldLink }, esp32Updater(""), 0, 200, old},
		{"tampered signature", func() string { return query("sig", flip) }, esp32Updater(""), 0, 403, nil},
		{"uppercase signature", func() string { return query("sig", strings.ToUpper) }, esp32Updater(""), 0, 403, nil},
		{"no signature", func() string { return query("sig", none) }, esp32Updater(""), 0, 403, nil},
		{"tampered expiry", func() string { return query("exp", later) }, esp32Updater(""), 0, 403, nil},
		{"no expiry", func() string { return query("exp", none) }, esp32Updater(""), 0, 403, nil},
		{"bob's signature on alice's path", func() string { return onPath(bobLink, a.device, sum) }, esp32Updater(""), 0, 403, nil},
		{"bob's link for this md5 on alice's path", func() string { return onPath(bobShared, a.device, sum) }, esp32Updater(""), 0, 403, nil},
		{"alice's signature on bob's path", func() string { return onPath(link, b.device, bobSum) }, esp32Updater(""), 0, 403, nil},
		{"alice's signature on bob's copy", func() string { return onPath(link, b.device, sum) }, esp32Updater(""), 0, 403, nil},
		{"alice's signature on bob's md5", func() string { return onPath(link, a.device, bobSum) }, esp32Updater(""), 0, 403, nil},
		{"tampered signature, ESP32 runs the md5", func() string { return query("sig", flip) }, esp32Updater(sum), 0, 403, nil},
		{"tampered signature, ESP8266 runs the md5", func() string { return query("sig", flip) }, esp8266Updater(sum), 0, 403, nil},
		{"deleted firmware", func() string { return goneLink }, esp32Updater(""), 0, 404, nil},
		{"bob's copy of the deleted bytes", func() string { return bobGone }, esp32Updater(""), 0, 200, gone},
		{"one hour old", func() string { return link }, esp32Updater(""), time.Hour, 200, fw},
		{"one second before expiry", func() string { return link }, esp32Updater(""), day - time.Second, 200, fw},
		{"at expiry", func() string { return link }, esp32Updater(""), day, 403, nil},
		{"a week old", func() string { return link }, esp32Updater(""), 7 * day, 403, nil},
		{"a new link a week later", func() string { return issue(a.device, sum) }, esp32Updater(""), 7 * day, 200, fw},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env.clock.set(t0.Add(tt.age))
			r, err := tt.dev.get(tt.link(), nil, nil)
			must(t, err)
			checkOTAAnswer(t, r, tt.wantStatus, tt.wantBody)
			want := map[int]string{200: "updated", 403: "failed: forbidden", 404: "failed: not found"}[tt.wantStatus]
			if got := tt.dev.verdict(r); got != want {
				t.Errorf("updater: got %q, want %q", got, want)
			}
		})
	}
}

// TestOTAOverBroker runs the whole flow with a real broker: assign,
// trigger, the device receives the ota command, downloads its url like
// the ESP32 updater, reports the new md5, and the API shows it.
func TestOTAOverBroker(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	local := strings.NewReplacer("http://devicehub.test", "") // the command's url, as a path on env's server
	ts := otaServe(t, env)
	issue := func(uid, sum string) string { return otaLocal(t, ts, env.srv.ota.url(uid, sum)) }
	base := "/v1/user/devices/" + a.device

	dev := deviceOnline(t, b, env, a) // a retained "offline" Last Will, then a retained "online"
	cmds := subscribe(t, testClient(t, b, "observer", ""), "devices/+/cmd/+")

	// The device runs v1, uploaded but never assigned.
	v1 := otaFirmware(70_000, 9)
	v1ID, v1Sum := env.uploadOK(a, map[string]string{"name": "blink", "version": "1.0.0"}, v1)
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q,"fw_version":"1.0.0"}`, v1Sum))
	eventually(t, 5*time.Second, "current firmware v1", func() bool {
		cf := env.device(a).CurrentFirmware
		return cf != nil && cf.MD5 != nil && *cf.MD5 == v1Sum
	})
	checkAnswer(t, env.request("POST", base+"/ota", a.token, nil), 422, `{"message":"Assign firmware first to trigger OTA."}`)
	// flags checks is_current and is_target in the firmware list, newest first.
	flags := func(want string) {
		t.Helper()
		var list struct{ Data []model.Firmware }
		json.Unmarshal(env.request("GET", base+"/firmwares", a.token, nil).Body.Bytes(), &list)
		var got []string
		for _, f := range list.Data {
			got = append(got, fmt.Sprintf("[%d %v %v]", *f.ID, *f.IsCurrent, *f.IsTarget))
		}
		if strings.Join(got, " ") != want {
			t.Errorf("firmwares [id is_current is_target]: got %s, want %s", got, want)
		}
	}

	// Assign v2 and trigger: exactly one command, not retained.
	v2 := otaFirmware(123_457, 11)
	v2ID, v2Sum := env.uploadOK(a, map[string]string{"name": "blink", "version": "1.1.0"}, v2)
	env.setTarget(a, v2Sum)
	flags(fmt.Sprintf("[%d false true] [%d true false]", v2ID, v1ID))
	w := env.request("POST", base+"/ota", a.token, nil)
	id, _ := decode(t, w)["command_id"].(string)
	checkAnswer(t, w, 200, fmt.Sprintf(`{"message":"OTA check triggered.","device_uid":%q,"command_id":%q}`, a.device, id))
	var cmd otaPayload
	m := receive(t, cmds, 5*time.Second, "ota command")
	if err := json.Unmarshal(m.Payload(), &cmd); err != nil || id == "" || m.Topic() != "devices/"+a.device+"/cmd/"+id || m.Qos() != 1 {
		t.Fatalf("command: got %s on %s at QoS %d (%v)", m.Payload(), m.Topic(), m.Qos(), err)
	}
	late := subscribe(t, testClient(t, b, "late-observer", ""), "devices/+/cmd/+")
	for _, ch := range []<-chan mqtt.Message{cmds, late} {
		select {
		case m := <-ch:
			t.Errorf("a second or retained command: %s on %s", m.Payload(), m.Topic())
		case <-time.After(300 * time.Millisecond):
		}
	}
	if want := issue(a.device, v2Sum); cmd.Cmd != "ota" || cmd.MD5 != v2Sum || cmd.SHA256 != sha256Hex(v2) || cmd.Size != int64(len(v2)) || *cmd.Version != "1.1.0" ||
		!strings.HasPrefix(cmd.URL, "http://devicehub.test/ota/") || local.Replace(cmd.URL) != want[strings.Index(want, "/ota/"):] {
		t.Fatalf("command: got %+v, want ota of %s (%d bytes, 1.1.0) at %s", cmd, v2Sum, len(v2), want)
	}

	// The device downloads the url with the ESP32 updater, running v1,
	// reboots into v2 and reports it, an hour later.
	updater := esp32Updater(v1Sum)
	r, err := updater.get(issue(a.device, v2Sum), nil, nil)
	if err != nil || updater.verdict(r) != "updated" {
		t.Fatalf("updater: got %v %q, want updated", err, updater.verdict(r))
	}
	checkOTAAnswer(t, r, 200, v2)
	env.clock.advance(time.Hour)
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q,"fw_version":"1.1.0"}`, v2Sum))
	eventually(t, 5*time.Second, "current firmware v2", func() bool {
		cf := env.device(a).CurrentFirmware
		return cf != nil && cf.MD5 != nil && *cf.MD5 == v2Sum
	})
	fw2 := fmt.Sprintf(`{"id":%d,"name":"blink","version":"1.1.0","notes":null,"md5":%q,"sha256":%q,"size":%d,"created_at":%q}`,
		v2ID, v2Sum, sha256Hex(v2), len(v2), apiNow)
	got := decode(t, env.request("GET", base, a.token, nil))["data"].(map[string]any)
	for k, want := range map[string]string{"current_firmware": fw2, "target_firmware": fw2, "last_ota_at": `"2026-11-21T13:00:00.000000Z"`, "status": `"online"`} {
		if g, _ := json.Marshal(got[k]); !jsonEqual(t, g, []byte(want)) {
			t.Errorf("%s: got %s, want %s", k, g, want)
		}
	}
	flags(fmt.Sprintf("[%d true true] [%d false false]", v2ID, v1ID))

	// Checking again, now running v2: nothing to do.
	updater = esp32Updater(v2Sum)
	if r, err := updater.get(issue(a.device, v2Sum), nil, nil); err != nil || r.status != http.StatusNotModified || updater.verdict(r) != "no update" {
		t.Errorf("check while running v2: got %v %v, want 304 no update", r, err)
	}
}

// procStatus is a size field of /proc/<pid>/status ("VmRSS", "VmHWM"), in
// bytes; pid may be "self".
func procStatus(pid, field string) (int64, error) {
	data, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(data)) {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			var kib int64
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kib)
			return kib << 10, err
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%s/status", field, pid)
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
	_, sum := env.uploadOK(env.alice, map[string]string{"name": "max"}, otaFirmware(store.MaxFirmwareSize, 12))
	link := otaLocal(b, otaServe(b, env), env.srv.ota.url(env.alice.device, sum))

	// A warm-up download, then the baseline with the upload's garbage gone.
	if r, err := esp32Updater("").get(link, nil, io.Discard); err != nil || r.status != http.StatusOK || r.n != store.MaxFirmwareSize {
		b.Fatalf("warm-up download: %v %+v", err, r)
	}
	runtime.GC()
	debug.FreeOSMemory()
	before, err := procStatus("self", "VmRSS")
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
				if rss, err := procStatus("self", "VmRSS"); err == nil && rss > peak.Load() {
					peak.Store(rss)
				}
			}
		}
	}()

	b.SetBytes(clients * store.MaxFirmwareSize)
	for b.Loop() {
		var wg sync.WaitGroup
		for i := range clients {
			wg.Go(func() {
				h := md5.New()
				r, err := esp32Updater("").get(link, nil, h)
				if err != nil || r.status != http.StatusOK || r.n != store.MaxFirmwareSize || hex.EncodeToString(h.Sum(nil)) != sum {
					b.Errorf("client %d: got %v %+v, body md5 %x; want 200 and the %d bytes of %s", i, err, r, h.Sum(nil), store.MaxFirmwareSize, sum)
				}
			})
		}
		wg.Wait()
	}
	close(stop)
	<-sampled
	b.ReportMetric(float64(peak.Load()-before)/(1<<20), "rss-growth-MiB")
}
