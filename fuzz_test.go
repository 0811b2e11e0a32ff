package main

// Fuzz targets: every JSON request body, the multipart firmware
// upload, the token header, the device status and telemetry messages and
// the signed OTA link. `go test` runs the seeds (f.Add and
// testdata/fuzz/<Name>/) as regular tests; .ci/fuzz fuzzes each target for
// a short fixed time.
//
// Each target builds one testEnv before f.Fuzz and reuses it for every
// input, so each property is stated against the state read just before the
// input, not against the initial state. Inside the fuzz function no method
// of the *testing.F may be called, which rules out the testEnv helpers (they
// call e.t); the fz* helpers here take the input's *testing.T instead.
//
// Seeds use placeholders ({A}: alice's device uid or token, {FA1}: the md5
// of one of her firmwares, …) that are replaced before each run, so that
// mutations of a valid input stay close to valid although uids and tokens
// are random.

import (
	"bytes"
	"context"
	"crypto/md5"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"
)

// ---- shared helpers ----

// fzLogBuf collects the server's log, so that a failing input can show it.
type fzLogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *fzLogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// take returns what was logged since the last call.
func (l *fzLogBuf) take() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.b.String()
	l.b.Reset()
	return s
}

// fzEnv is a testEnv whose server logs into a buffer instead of the
// *testing.F.
type fzEnv struct {
	*testEnv
	ctx  context.Context
	logs *fzLogBuf
	log  *slog.Logger
}

func newFzEnv(f *testing.F, link commandLink) *fzEnv {
	f.Helper()
	env := newTestEnv(f, link)
	logs := &fzLogBuf{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	env.srv.log = log
	return &fzEnv{testEnv: env, ctx: context.Background(), logs: logs, log: log}
}

func (e *fzEnv) serve(req *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	e.srv.ServeHTTP(w, req)
	return w
}

func fzJSONRequest(method, target, token string, body []byte) *http.Request {
	req := httptest.NewRequest(method, target, bytes.NewReader(body))
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	return req
}

// fail stops the input, showing the answer (when there is one) and what
// the server logged.
func (e *fzEnv) fail(t *testing.T, w *httptest.ResponseRecorder, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if w != nil {
		msg += fmt.Sprintf("\nanswer: %d %s", w.Code, strings.TrimSpace(w.Body.String()))
	}
	if l := e.logs.take(); l != "" {
		msg += "\nserver log:\n" + l
	}
	t.Fatal(msg)
}

// check asserts what every JSON answer of the API must satisfy and returns
// the decoded body: no 5xx; a JSON object with the JSON and nosniff
// headers; a non-empty string "message" on every non-2xx answer; "errors"
// only on 422, in Laravel's shape.
func (e *fzEnv) check(t *testing.T, w *httptest.ResponseRecorder) map[string]any {
	t.Helper()
	if w.Code >= 500 {
		e.fail(t, w, "server error")
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		e.fail(t, w, "Content-Type = %q, want application/json", ct)
	}
	if h := w.Header().Get("X-Content-Type-Options"); h != "nosniff" {
		e.fail(t, w, "X-Content-Type-Options = %q, want nosniff", h)
	}
	var v map[string]any
	if err := fzUnmarshal(w.Body.Bytes(), &v); err != nil || v == nil {
		e.fail(t, w, "answer is not a JSON object: %v", err)
	}
	msg, isString := v["message"].(string)
	if _, has := v["message"]; has && !isString {
		e.fail(t, w, "message is not a string")
	}
	if w.Code >= 300 && msg == "" {
		e.fail(t, w, "error answer without a message")
	}
	if errs, has := v["errors"]; has {
		if w.Code != http.StatusUnprocessableEntity {
			e.fail(t, w, "errors on a %d answer", w.Code)
		}
		if err := fzLaravelErrors(msg, errs); err != nil {
			e.fail(t, w, "errors not in Laravel's shape: %v", err)
		}
	}
	return v
}

// fzLaravelErrors checks a 422 body: errors is an object of field -> non-empty
// list of non-empty strings, and message is one field's first error, plus
// " (and N more error(s))" when there are N more.
func fzLaravelErrors(msg string, raw any) error {
	errs, ok := raw.(map[string]any)
	if !ok || len(errs) == 0 {
		return fmt.Errorf("errors is not a non-empty object: %#v", raw)
	}
	total := 0
	firsts := map[string]bool{}
	for field, list := range errs {
		if field == "" {
			return errors.New("empty field name")
		}
		items, ok := list.([]any)
		if !ok || len(items) == 0 {
			return fmt.Errorf("errors.%s is not a non-empty list: %#v", field, list)
		}
		for i, it := range items {
			s, ok := it.(string)
			if !ok || s == "" {
				return fmt.Errorf("errors.%s[%d] is not a non-empty string: %#v", field, i, it)
			}
			if i == 0 {
				firsts[s] = true
			}
		}
		total += len(items)
	}
	suffix := ""
	switch {
	case total == 2:
		suffix = " (and 1 more error)"
	case total > 2:
		suffix = fmt.Sprintf(" (and %d more errors)", total-1)
	}
	first, ok := strings.CutSuffix(msg, suffix)
	if !ok || !firsts[first] {
		return fmt.Errorf("message %q is not a field's first error followed by %q", msg, suffix)
	}
	return nil
}

// fzErrorFields lists the fields of a 422 answer's errors, sorted.
func fzErrorFields(v map[string]any) []string {
	errs, _ := v["errors"].(map[string]any)
	var fields []string
	for f := range errs {
		fields = append(fields, f)
	}
	slices.Sort(fields)
	return fields
}

// fzUnmarshal decodes JSON keeping numbers as written: JSON puts no limit
// on their range, so 1e999 is a valid payload value.
func fzUnmarshal(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(v); err != nil {
		return err
	}
	if _, err := d.Token(); err != io.EOF {
		return errors.New("data after the JSON value")
	}
	return nil
}

// fzSameJSON reports whether a and b have the same JSON form.
func fzSameJSON(a, b any) bool {
	norm := func(v any) string {
		j, err := json.Marshal(v)
		if err != nil {
			return "unmarshalable: " + err.Error()
		}
		var x any
		if err := fzUnmarshal(j, &x); err != nil {
			return "bad JSON: " + err.Error()
		}
		j, _ = json.Marshal(x)
		return string(j)
	}
	return norm(a) == norm(b)
}

func fzJSON(v any) string {
	j, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%#v", v)
	}
	return string(j)
}

func fzMD5(b []byte) string {
	h := md5.Sum(b)
	return hex.EncodeToString(h[:])
}

// fzSetClock sets the test clock to t (it may go backwards).
func fzSetClock(c *fakeClock, t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// Firmware images used by the targets; they start with the ESP image magic.
var (
	fzFirmwareA1 = []byte("\xe9\x04\x02\x20alice firmware 1.0\n")
	fzFirmwareA2 = []byte("\xe9\x04\x02\x20alice firmware 2.0\n")
	fzFirmwareB  = []byte("\xe9\x04\x02\x20bob firmware 1.0\n")
)

type fzFirmware struct {
	id  int64
	md5 string
}

// mustUpload uploads a firmware for u (set-up only: it uses the *testing.F).
func (e *fzEnv) mustUpload(f *testing.F, u testUser, name string, content []byte) fzFirmware {
	f.Helper()
	w := e.upload(u.device, u.token, map[string]string{"name": name, "version": "1.0"}, content)
	if w.Code != http.StatusCreated {
		f.Fatalf("upload %s: %d %s", name, w.Code, w.Body)
	}
	var b struct {
		Data struct {
			ID  int64  `json:"id"`
			MD5 string `json:"md5"`
		} `json:"data"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &b); err != nil || b.Data.MD5 != fzMD5(content) {
		f.Fatalf("upload %s: %v %s", name, err, w.Body)
	}
	return fzFirmware{b.Data.ID, b.Data.MD5}
}

// mustRequest sends a request (set-up only: it uses the *testing.F).
func (e *fzEnv) mustRequest(f *testing.F, method, target, token, body string, want int) {
	f.Helper()
	var b any
	if body != "" {
		b = body
	}
	if w := e.request(method, target, token, b); w.Code != want {
		f.Fatalf("%s %s: %d %s, want %d", method, target, w.Code, w.Body, want)
	}
}

// deviceID is the internal id of u's device.
func (e *fzEnv) deviceID(f *testing.F, u testUser) int64 {
	f.Helper()
	d, err := deviceIn(e.ctx, e.st.read, u.id, u.device)
	if err != nil {
		f.Fatal(err)
	}
	return d.id
}

// snapshot is everything the API shows about u's device: the device, its
// buttons and its firmwares.
func (e *fzEnv) snapshot(u testUser) (string, error) {
	d, err := deviceIn(e.ctx, e.st.read, u.id, u.device)
	if err != nil {
		return "", err
	}
	buttons, err := e.st.buttonsOf(e.ctx, d.id)
	if err != nil {
		return "", err
	}
	fws, err := e.st.firmwaresOf(e.ctx, d.id)
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(map[string]any{"device": d, "buttons": buttons, "firmwares": fws})
	return string(b), err
}

// ---- JSON body rules, as the README states them ----

// fzParseBody applies the rules for a JSON request body: at most 64 KiB
// (413), empty is {}, otherwise a JSON object (422 on "body"). It returns
// the fields and 0, or the status the body must get.
func fzParseBody(body []byte) (map[string]json.RawMessage, int) {
	if len(body) > maxJSONBody {
		return nil, http.StatusRequestEntityTooLarge
	}
	m := map[string]json.RawMessage{}
	if len(bytes.Trim(body, " \t\r\n")) == 0 {
		return m, 0
	}
	if err := json.Unmarshal(body, &m); err != nil || m == nil {
		return nil, http.StatusUnprocessableEntity
	}
	if fzColons(body, 1) != len(m) { // a key twice
		return nil, http.StatusUnprocessableEntity
	}
	return m, 0
}

// fzColons counts the colons outside strings, at most maxDepth objects or
// arrays deep, in the JSON text b: one per object member as written.
func fzColons(b []byte, maxDepth int) int {
	n, depth, inString := 0, 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case inString && c == '\\':
			i++
		case c == '"':
			inString = !inString
		case inString:
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			depth--
		case c == ':' && depth <= maxDepth:
			n++
		}
	}
	return n
}

// fzKeys counts the keys of every object in a decoded JSON value.
func fzKeys(v any) int {
	n := 0
	switch v := v.(type) {
	case map[string]any:
		n = len(v)
		for _, x := range v {
			n += fzKeys(x)
		}
	case []any:
		for _, x := range v {
			n += fzKeys(x)
		}
	}
	return n
}

var (
	fzEscapedBackslash = regexp.MustCompile(`\\\\`)
	fzSurrogatePair    = regexp.MustCompile(`\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}`)
	fzSurrogate        = regexp.MustCompile(`\\u[dD][89a-fA-F][0-9a-fA-F]{2}`)
)

// fzValidText reports whether the JSON text raw is UTF-8 without an
// escaped surrogate that lacks its pair.
func fzValidText(raw []byte) bool {
	if !utf8.Valid(raw) {
		return false
	}
	s := fzEscapedBackslash.ReplaceAll(raw, nil)
	return !fzSurrogate.Match(fzSurrogatePair.ReplaceAll(s, nil))
}

func fzIsNull(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

// fzString reads an optional string field of at most max characters
// (absent or null: nil); required also rejects absent, null and blank.
func fzString(m map[string]json.RawMessage, field string, required bool, max int) (val *string, bad bool) {
	raw := m[field]
	if fzIsNull(raw) {
		return nil, required
	}
	var s string
	if json.Unmarshal(raw, &s) != nil || !fzValidText(raw) {
		return nil, true
	}
	if required && strings.TrimSpace(s) == "" || utf8.RuneCountInString(s) > max {
		return nil, true
	}
	return &s, false
}

// fzObject reads a required JSON object field and returns it compacted.
func fzObject(m map[string]json.RawMessage, field string) (json.RawMessage, bool) {
	raw := m[field]
	var obj map[string]any
	if fzIsNull(raw) || fzUnmarshal(raw, &obj) != nil || obj == nil {
		return nil, true
	}
	if !fzValidText(raw) || fzColons(raw, len(raw)) != fzKeys(obj) { // a key twice, at any depth
		return nil, true
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return nil, true
	}
	return buf.Bytes(), false
}

// fzBool reads an optional boolean field (absent or null: false).
func fzBool(m map[string]json.RawMessage, field string) (bool, bool) {
	raw := m[field]
	if fzIsNull(raw) {
		return false, false
	}
	var v bool
	if json.Unmarshal(raw, &v) != nil {
		return false, true
	}
	return v, false
}

// expectInvalid checks the answer to a body that is unusable (parseStatus
// != 0) or has bad fields, and reports whether the body was valid.
func (e *fzEnv) expectInvalid(t *testing.T, w *httptest.ResponseRecorder, v map[string]any, parseStatus int, bad []string) bool {
	t.Helper()
	switch {
	case parseStatus == http.StatusRequestEntityTooLarge:
		if w.Code != parseStatus {
			e.fail(t, w, "oversized body: want 413")
		}
	case parseStatus != 0:
		if w.Code != parseStatus || !slices.Equal(fzErrorFields(v), []string{"body"}) {
			e.fail(t, w, "body that is not a JSON object: want 422 with errors.body")
		}
	case len(bad) > 0:
		slices.Sort(bad)
		if w.Code != http.StatusUnprocessableEntity || !slices.Equal(fzErrorFields(v), bad) {
			e.fail(t, w, "want 422 with errors on %v", bad)
		}
	default:
		return true
	}
	return false
}

// ---- FuzzJSONBodies ----

// fzLink is a connected device link that records what it publishes.
type fzLink struct {
	mu   sync.Mutex
	sent []fzSent
}

type fzSent struct {
	uid     string
	payload []byte
}

func (l *fzLink) connected() bool { return true }

func (l *fzLink) publish(uid, _ string, payload []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sent = append(l.sent, fzSent{uid, bytes.Clone(payload)})
	return nil
}

func (l *fzLink) take() []fzSent {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.sent
	l.sent = nil
	return s
}

// fzJSONRoutes are the routes FuzzJSONBodies sends bodies to; the input's
// route byte picks one (modulo the length).
var fzJSONRoutes = []string{"login", "device-patch", "button-create", "command", "firmware-patch", "set-target", "firmware-patch-by-md5"}

// FuzzJSONBodies sends fuzzed bodies to every route that takes a JSON body,
// through the real router with alice's token (foreign: at bob's device).
// Properties: never 5xx; JSON answers with a message on errors and 422s in
// Laravel's shape; the status is the one the README's validation rules
// give; a 200/201 answer's data is what the database then holds, and
// nothing else changed; a refused body changes nothing; bob's device,
// buttons and firmwares never change.
func FuzzJSONBodies(f *testing.F) {
	link := &fzLink{}
	e := newFzEnv(f, link)
	alice, bob := e.alice, e.bob
	// Online, so that a valid command is published (200) rather than refused.
	e.setStatus(alice.device, "online")
	e.setStatus(bob.device, "online")
	fa1 := e.mustUpload(f, alice, "alice-1", fzFirmwareA1)
	fa2 := e.mustUpload(f, alice, "alice-2", fzFirmwareA2)
	fb := e.mustUpload(f, bob, "bob-1", fzFirmwareB)
	for _, u := range []testUser{alice, bob} {
		e.mustRequest(f, "POST", "/v1/user/devices/"+u.device+"/command-buttons", u.token,
			`{"id":"reboot","label":"Reboot","payload":{"cmd":"reboot"},"confirm":true}`, http.StatusCreated)
	}
	aliceDev := e.deviceID(f, alice)
	bobBefore, err := e.snapshot(bob)
	if err != nil {
		f.Fatal(err)
	}
	repl := strings.NewReplacer("{FA1}", fa1.md5, "{FA1U}", strings.ToUpper(fa1.md5), "{FA2}", fa2.md5, "{FB}", fb.md5)

	route := func(name string) uint8 { return uint8(slices.Index(fzJSONRoutes, name)) }
	add := func(name string, foreign bool, body string) { f.Add(route(name), foreign, []byte(body)) }
	for _, b := range []string{
		`{"email":"alice@example.com","password":"alice-password","token_name":"laptop"}`,
		`{"email":"  BOB@Example.COM ","password":"bob-password","token_name":"ci"}`,
		`{"email":"alice@example.com","password":"wrong","token_name":"laptop"}`,
		`{"email":"nobody@example.com","password":"x","token_name":"x"}`,
		`{"email":null,"password":null,"token_name":null}`,
		`{"email":1,"password":true,"token_name":[]}`,
		`{"email":"alice@example.com","password":"alice-password","token_name":"   "}`,
		`{"email":"alice@example.com","email":"bob@example.com","password":"bob-password","token_name":"dup"}`,
		``, `null`, `[]`, `"x"`, `{`,
	} {
		add("login", false, b)
	}
	for _, b := range []string{
		`{"name":"Kitchen sensor","description":"on the shelf"}`,
		`{"description":null}`,
		`{"name":""}`, `{"name":null}`, `{"name":"   "}`, `{"name":123}`,
		`{"name":"` + strings.Repeat("é", 255) + `"}`,
		`{"name":"` + strings.Repeat("é", 256) + `"}`,
		`{"description":"` + strings.Repeat("x", 2001) + `"}`,
		`{"name":"a","name":"b"}`,
		`{"name":"\u0000\ud800 日本語 🚀"}`,
		`{}`, ``, `   `, `null`, `[1,2]`, `{"name":"x"} trailing`, `{"name":1e999}`,
		strings.Repeat(`{"a":`, 100) + `1` + strings.Repeat(`}`, 100),
		strings.Repeat(`[`, 20000),
	} {
		add("device-patch", false, b)
	}
	add("device-patch", true, `{"name":"stolen"}`)
	for _, b := range []string{
		`{"id":"led-on","label":"LED on","payload":{"cmd":"led","on":true},"confirm":false}`,
		`{"id":"reboot","label":"Reboot again","payload":{"cmd":"reboot"}}`,
		`{"id":"a.b_c-d","label":"x","payload":{}}`,
		`{"id":"..","label":"dots","payload":{}}`,
		`{"id":"has space","label":"x","payload":{}}`,
		`{"id":"` + strings.Repeat("a", 65) + `","label":"x","payload":{}}`,
		`{"id":"x","label":"x","payload":[]}`,
		`{"id":"x","label":"x","payload":"{}"}`,
		`{"id":"x","label":"x","payload":null}`,
		`{"id":"x","label":"x","payload":{"n":123456789012345678901234567890e300}}`,
		`{"id":"x","label":"x","payload":{"a":1,"a":2},"confirm":"yes"}`,
		`{"id":"x","label":"<b>&amp;</b>","payload":{"html":"<script>"},"confirm":null}`,
		`{"id":"x","label":"x","payload":` + strings.Repeat(`{"a":`, 500) + `1` + strings.Repeat(`}`, 500) + `}`,
		`{}`, ``,
	} {
		add("button-create", false, b)
	}
	add("button-create", true, `{"id":"evil","label":"x","payload":{}}`)
	for _, b := range []string{
		`{"payload":{"cmd":"blink","times":3}}`,
		`{"payload":{ "a" : [ 1, 2, {"b": null} ] }}`,
		`{"payload":{}}`, `{"payload":[]}`, `{"payload":1}`, `{"payload":null}`, `{}`, ``,
		`{"payload":{"big":1e308,"small":-1e-308,"u":"\u2028"}}`,
	} {
		add("command", false, b)
	}
	add("command", true, `{"payload":{"cmd":"reboot"}}`)
	for _, r := range []string{"firmware-patch", "firmware-patch-by-md5"} {
		for _, b := range []string{
			`{"name":"stable","version":"1.2.3","notes":"fixes"}`,
			`{"version":null,"notes":""}`,
			`{"name":""}`, `{"name":null}`, `{"version":7}`,
			`{"notes":"` + strings.Repeat("n", 2001) + `"}`,
			`{}`, ``, `[]`,
		} {
			add(r, false, b)
		}
		add(r, true, `{"name":"stolen"}`)
	}
	for _, b := range []string{
		`{"md5":"{FA1}"}`, `{"md5":"{FA2}"}`, `{"md5":" {FA1U} "}`,
		`{"md5":"{FB}"}`, // bob's firmware: not alice's to assign
		`{"md5":"00000000000000000000000000000000"}`,
		`{"md5":"not-an-md5"}`, `{"md5":""}`, `{"md5":null}`, `{"md5":5}`, `{}`, ``,
	} {
		add("set-target", false, b)
	}
	add("set-target", true, `{"md5":"{FB}"}`)

	f.Fuzz(func(t *testing.T, r uint8, foreign bool, body []byte) {
		e.logs.take()
		link.take()
		body = []byte(repl.Replace(string(body)))
		switch fzJSONRoutes[int(r)%len(fzJSONRoutes)] {
		case "login":
			e.fuzzLogin(t, body)
		case "device-patch":
			e.fuzzDevicePatch(t, foreign, body)
		case "button-create":
			e.fuzzButtonCreate(t, aliceDev, foreign, body)
		case "command":
			e.fuzzCommand(t, link, foreign, body)
		case "firmware-patch":
			e.fuzzFirmwarePatch(t, aliceDev, strconv.FormatInt(fa1.id, 10), foreign, body)
		case "firmware-patch-by-md5":
			e.fuzzFirmwarePatch(t, aliceDev, strings.ToUpper(fa2.md5), foreign, body)
		case "set-target":
			e.fuzzSetTarget(t, []string{fa1.md5, fa2.md5}, foreign, body)
		}
		if got, err := e.snapshot(bob); err != nil || got != bobBefore {
			e.fail(t, nil, "bob's device changed (err %v):\nbefore %s\nafter  %s", err, bobBefore, got)
		}
	})
}

// targetUID is the device a request goes to: alice's, or bob's (foreign).
func (e *fzEnv) targetUID(foreign bool) string {
	if foreign {
		return e.bob.device
	}
	return e.alice.device
}

// expectForeign checks the answer to alice's request at bob's device.
func (e *fzEnv) expectForeign(t *testing.T, w *httptest.ResponseRecorder, v map[string]any) {
	t.Helper()
	if w.Code != http.StatusNotFound || v["message"] != "Device not found." {
		e.fail(t, w, "request at another user's device: want 404 Device not found.")
	}
}

func (e *fzEnv) fuzzLogin(t *testing.T, body []byte) {
	w := e.serve(fzJSONRequest("POST", "/v1/auth/login", "", body))
	v := e.check(t, w)
	m, st := fzParseBody(body)
	var bad []string
	var email, password *string
	if st == 0 {
		var isBad bool
		if email, isBad = fzString(m, "email", true, 255); isBad {
			bad = append(bad, "email")
		}
		if password, isBad = fzString(m, "password", true, 1024); isBad {
			bad = append(bad, "password")
		}
		if _, isBad = fzString(m, "token_name", true, 255); isBad {
			bad = append(bad, "token_name")
		}
	}
	if !e.expectInvalid(t, w, v, st, bad) {
		return
	}
	var who *testUser
	for _, u := range []testUser{e.alice, e.bob} {
		if strings.ToLower(strings.TrimSpace(*email)) == u.email && *password == u.password {
			who = &u
		}
	}
	switch w.Code {
	case http.StatusTooManyRequests:
		secs, err := strconv.Atoi(w.Header().Get("Retry-After"))
		if v["message"] != "Too Many Attempts." || err != nil || secs < 1 || secs > 60 {
			e.fail(t, w, "429 without its message or a Retry-After of 1..60 s")
		}
		// Let the window pass, so that later inputs are not all 429.
		e.clock.advance(time.Minute + time.Second)
	case http.StatusOK:
		if who == nil {
			e.fail(t, w, "login succeeded with wrong credentials")
		}
		var ok struct {
			TokenType string      `json:"token_type"`
			Token     string      `json:"token"`
			User      userSummary `json:"user"`
		}
		json.Unmarshal(w.Body.Bytes(), &ok)
		if ok.TokenType != "Bearer" || ok.User.ID != who.id || ok.User.Email != who.email {
			e.fail(t, w, "login answer does not name %s", who.email)
		}
		rec, err := authenticate(e.ctx, e.st, ok.Token)
		if err != nil || rec.user.ID != who.id {
			e.fail(t, w, "the token given does not authenticate %s: %v", who.email, err)
		}
		if err := e.st.deleteToken(e.ctx, rec.id); err != nil {
			e.fail(t, w, "delete token: %v", err)
		}
	case http.StatusUnprocessableEntity:
		const msg = "The provided credentials are incorrect."
		if who != nil {
			e.fail(t, w, "login with the right credentials refused")
		}
		if v["message"] != msg || !slices.Equal(fzErrorFields(v), []string{"email"}) {
			e.fail(t, w, "wrong credentials: want 422 %q on email", msg)
		}
	default:
		e.fail(t, w, "unexpected status")
	}
}

func (e *fzEnv) fuzzDevicePatch(t *testing.T, foreign bool, body []byte) {
	u := e.alice
	before, err := deviceIn(e.ctx, e.st.read, u.id, u.device)
	if err != nil {
		e.fail(t, nil, "deviceOf: %v", err)
	}
	w := e.serve(fzJSONRequest("PATCH", "/v1/user/devices/"+e.targetUID(foreign), u.token, body))
	v := e.check(t, w)
	after, err := deviceIn(e.ctx, e.st.read, u.id, u.device)
	if err != nil {
		e.fail(t, w, "deviceOf: %v", err)
	}
	unchanged := func() {
		if !fzSameJSON(after, before) {
			e.fail(t, w, "refused PATCH changed the device:\nbefore %s\nafter  %s", fzJSON(before), fzJSON(after))
		}
	}
	if foreign {
		e.expectForeign(t, w, v)
		unchanged()
		return
	}
	m, st := fzParseBody(body)
	want := *before
	var bad []string
	if st == 0 {
		if _, present := m["name"]; present {
			if name, isBad := fzString(m, "name", true, 255); isBad {
				bad = append(bad, "name")
			} else {
				want.Name = *name
			}
		}
		if desc, isBad := fzString(m, "description", false, 2000); isBad {
			bad = append(bad, "description")
		} else if _, present := m["description"]; present {
			want.Description = desc // nil for null: cleared
		}
	}
	if !e.expectInvalid(t, w, v, st, bad) {
		unchanged()
		return
	}
	if w.Code != http.StatusOK {
		e.fail(t, w, "valid PATCH: want 200")
	}
	if !fzSameJSON(v["data"], after) {
		e.fail(t, w, "answer's data is not what the database holds: %s", fzJSON(after))
	}
	if !fzSameJSON(after, &want) {
		e.fail(t, w, "device after PATCH:\n got  %s\n want %s", fzJSON(after), fzJSON(&want))
	}
}

// fzPathSegment escapes a path segment so that the router does not take
// "." or ".." for a dot-segment and redirect.
func fzPathSegment(s string) string {
	if s == "." || s == ".." {
		return strings.ReplaceAll(s, ".", "%2E")
	}
	return url.PathEscape(s)
}

var fzButtonIDPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

func (e *fzEnv) fuzzButtonCreate(t *testing.T, devID int64, foreign bool, body []byte) {
	u := e.alice
	before, err := e.st.buttonsOf(e.ctx, devID)
	if err != nil {
		e.fail(t, nil, "buttonsOf: %v", err)
	}
	w := e.serve(fzJSONRequest("POST", "/v1/user/devices/"+e.targetUID(foreign)+"/command-buttons", u.token, body))
	v := e.check(t, w)
	after, err := e.st.buttonsOf(e.ctx, devID)
	if err != nil {
		e.fail(t, w, "buttonsOf: %v", err)
	}
	unchanged := func() {
		if !fzSameJSON(after, before) {
			e.fail(t, w, "refused button changed the buttons:\nbefore %s\nafter  %s", fzJSON(before), fzJSON(after))
		}
	}
	if foreign {
		e.expectForeign(t, w, v)
		unchanged()
		return
	}
	m, st := fzParseBody(body)
	var bad []string
	var b commandButton
	if st == 0 {
		id, isBad := fzString(m, "id", true, 64)
		if isBad || !fzButtonIDPattern.MatchString(*id) || *id == "." || *id == ".." {
			bad = append(bad, "id")
		} else {
			b.ID = *id
		}
		if label, isBad := fzString(m, "label", true, 255); isBad {
			bad = append(bad, "label")
		} else {
			b.Label = *label
		}
		if payload, isBad := fzObject(m, "payload"); isBad {
			bad = append(bad, "payload")
		} else {
			b.Payload = payload
		}
		if confirm, isBad := fzBool(m, "confirm"); isBad {
			bad = append(bad, "confirm")
		} else {
			b.Confirm = confirm
		}
	}
	if !e.expectInvalid(t, w, v, st, bad) {
		unchanged()
		return
	}
	if slices.ContainsFunc(before, func(x commandButton) bool { return x.ID == b.ID }) {
		if w.Code != http.StatusUnprocessableEntity || v["message"] != "A command button with this id already exists." || v["errors"] != nil {
			e.fail(t, w, "button id %q exists: want 422 already exists", b.ID)
		}
		unchanged()
		return
	}
	if w.Code != http.StatusCreated || v["message"] != "Command button created." || v["device_uid"] != u.device {
		e.fail(t, w, "valid new button: want 201 Command button created.")
	}
	if !fzSameJSON(v["data"], b) {
		e.fail(t, w, "answer's data is not the button sent: %s", fzJSON(b))
	}
	if !fzSameJSON(after, append(slices.Clone(before), b)) {
		e.fail(t, w, "buttons after create:\n got  %s\n want %s + %s", fzJSON(after), fzJSON(before), fzJSON(b))
	}
	stored, err := e.st.button(e.ctx, devID, b.ID)
	if err != nil || !bytes.Equal(stored.Payload, b.Payload) || !json.Valid(stored.Payload) {
		e.fail(t, w, "stored payload is not the compacted payload sent: %v %q want %q", err, stored.Payload, b.Payload)
	}
	// Delete it again, so that every input starts from the same buttons.
	wd := e.serve(fzJSONRequest("DELETE", "/v1/user/devices/"+u.device+"/command-buttons/"+fzPathSegment(b.ID), u.token, nil))
	if wd.Code != http.StatusOK {
		e.fail(t, wd, "delete button %q", b.ID)
	}
	if now, err := e.st.buttonsOf(e.ctx, devID); err != nil || !fzSameJSON(now, before) {
		e.fail(t, wd, "buttons after delete: %s, want %s (%v)", fzJSON(now), fzJSON(before), err)
	}
}

func (e *fzEnv) fuzzCommand(t *testing.T, link *fzLink, foreign bool, body []byte) {
	u := e.alice
	w := e.serve(fzJSONRequest("POST", "/v1/user/devices/"+e.targetUID(foreign)+"/commands", u.token, body))
	v := e.check(t, w)
	sent := link.take()
	if foreign {
		e.expectForeign(t, w, v)
	}
	var payload json.RawMessage
	m, st := fzParseBody(body)
	var bad []string
	if st == 0 {
		var isBad bool
		if payload, isBad = fzObject(m, "payload"); isBad {
			bad = append(bad, "payload")
		}
	}
	if foreign || !e.expectInvalid(t, w, v, st, bad) {
		if len(sent) != 0 {
			e.fail(t, w, "refused command was published: %q", sent)
		}
		return
	}
	if w.Code != http.StatusOK || v["message"] != "Command sent." || v["device_uid"] != u.device {
		e.fail(t, w, "valid command: want 200 Command sent.")
	}
	if len(sent) != 1 || sent[0].uid != u.device || !bytes.Equal(sent[0].payload, payload) {
		e.fail(t, w, "published %q, want exactly %q to %s", sent, payload, u.device)
	}
}

func (e *fzEnv) fuzzFirmwarePatch(t *testing.T, devID int64, ref string, foreign bool, body []byte) {
	u := e.alice
	before, err := firmwareQuery(e.ctx, e.st.db, devID, ref)
	if err != nil {
		e.fail(t, nil, "firmwareOf(%s): %v", ref, err)
	}
	w := e.serve(fzJSONRequest("PATCH", "/v1/user/devices/"+e.targetUID(foreign)+"/firmwares/"+ref, u.token, body))
	v := e.check(t, w)
	after, err := firmwareQuery(e.ctx, e.st.db, devID, ref)
	if err != nil {
		e.fail(t, w, "firmwareOf(%s): %v", ref, err)
	}
	unchanged := func() {
		if !fzSameJSON(after, before) {
			e.fail(t, w, "refused PATCH changed the firmware:\nbefore %s\nafter  %s", fzJSON(before), fzJSON(after))
		}
	}
	if foreign {
		e.expectForeign(t, w, v)
		unchanged()
		return
	}
	m, st := fzParseBody(body)
	want := *before
	var bad []string
	if st == 0 {
		if _, present := m["name"]; present {
			if name, isBad := fzString(m, "name", true, 255); isBad {
				bad = append(bad, "name")
			} else {
				want.Name = name
			}
		}
		// version and notes: null or "" clears.
		for _, fld := range []struct {
			name string
			max  int
			dst  **string
		}{{"version", 255, &want.Version}, {"notes", 2000, &want.Notes}} {
			if _, present := m[fld.name]; !present {
				continue
			}
			if s, isBad := fzString(m, fld.name, false, fld.max); isBad {
				bad = append(bad, fld.name)
			} else if s == nil || *s == "" {
				*fld.dst = nil
			} else {
				*fld.dst = s
			}
		}
	}
	if !e.expectInvalid(t, w, v, st, bad) {
		unchanged()
		return
	}
	if w.Code != http.StatusOK {
		e.fail(t, w, "valid firmware PATCH: want 200")
	}
	if !fzSameJSON(v["data"], after) {
		e.fail(t, w, "answer's data is not what the database holds: %s", fzJSON(after))
	}
	if !fzSameJSON(after, &want) {
		e.fail(t, w, "firmware after PATCH:\n got  %s\n want %s", fzJSON(after), fzJSON(&want))
	}
}

func (e *fzEnv) fuzzSetTarget(t *testing.T, own []string, foreign bool, body []byte) {
	u := e.alice
	target := func() string {
		d, err := deviceIn(e.ctx, e.st.read, u.id, u.device)
		if err != nil {
			e.fail(t, nil, "deviceOf: %v", err)
		}
		if d.TargetFirmware == nil {
			return ""
		}
		return d.TargetFirmware.MD5
	}
	before := target()
	w := e.serve(fzJSONRequest("POST", "/v1/user/devices/"+e.targetUID(foreign)+"/firmwares/set-target", u.token, body))
	v := e.check(t, w)
	after := target()
	if foreign {
		e.expectForeign(t, w, v)
	}
	m, st := fzParseBody(body)
	var bad []string
	var sum *string
	if st == 0 {
		var isBad bool
		if sum, isBad = fzString(m, "md5", true, 255); isBad {
			bad = append(bad, "md5")
		}
	}
	if foreign || !e.expectInvalid(t, w, v, st, bad) {
		if after != before {
			e.fail(t, w, "refused set-target changed the target from %q to %q", before, after)
		}
		return
	}
	norm := strings.ToLower(strings.TrimSpace(*sum))
	if !slices.Contains(own, norm) {
		if w.Code != http.StatusUnprocessableEntity || v["message"] != "Firmware with the provided md5 was not found for this device." {
			e.fail(t, w, "md5 %q is none of the device's firmwares: want 422 not found", norm)
		}
		if after != before {
			e.fail(t, w, "refused set-target changed the target from %q to %q", before, after)
		}
		return
	}
	if w.Code != http.StatusOK || v["md5"] != norm || v["device_uid"] != u.device || v["message"] != "Firmware assigned to device." {
		e.fail(t, w, "set-target to the device's firmware %s: want 200", norm)
	}
	if after != norm {
		e.fail(t, w, "target after set-target is %q, want %q", after, norm)
	}
}

// ---- FuzzUpload ----

// fzForm builds a multipart/form-data body with the boundary b.
func fzForm(b string, fields [][2]string, file []byte) []byte {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	if err := mw.SetBoundary(b); err != nil {
		panic(err)
	}
	for _, kv := range fields {
		mw.WriteField(kv[0], kv[1])
	}
	if file != nil {
		fw, _ := mw.CreateFormFile("file", "firmware.bin")
		fw.Write(file)
	}
	mw.Close()
	return buf.Bytes()
}

// fzUploadForm is what a multipart body holds, read the way the README
// describes the upload: name, version and notes fields (the last of each
// counts) and the first file part.
type fzUploadForm struct {
	readable bool // a multipart/form-data body that can be read to its end
	hasFile  bool
	file     []byte
	fields   map[string]string
}

func fzReadForm(contentType string, body []byte) fzUploadForm {
	form := fzUploadForm{fields: map[string]string{}}
	mt, params, err := mime.ParseMediaType(contentType)
	boundary, ok := params["boundary"]
	// Request.MultipartReader also takes multipart/mixed.
	if err != nil || mt != "multipart/form-data" && mt != "multipart/mixed" || !ok {
		return form
	}
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return form
		}
		data, err := io.ReadAll(p)
		if err != nil {
			return form
		}
		switch name := p.FormName(); {
		case name == "file" && !form.hasFile:
			form.hasFile, form.file = true, data
		case name == "name" || name == "version" || name == "notes":
			form.fields[name] = string(data[:min(len(data), maxJSONBody)])
		}
	}
	form.readable = true
	return form
}

// fzJSONString is s as it comes out of a JSON round trip (invalid UTF-8
// replaced), the way form fields are validated.
func fzJSONString(s string) string {
	j, _ := json.Marshal(s)
	var out string
	json.Unmarshal(j, &out)
	return out
}

func fzListDir(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names, err
}

// FuzzUpload sends fuzzed multipart bodies and Content-Types to the
// firmware upload. Properties: never 5xx; JSON answers; a well-formed
// upload of a new non-empty file with a name is 201; a 201 answer
// describes the file part sent (md5, sha256, size, fields), the file
// stored at firmwarePath(sha256) has that md5, sha256 and size, and its
// row exists; a file that is not an ESP image (first byte 0xE9) is
// refused; any other answer leaves no row and no file behind;
// firmware/tmp is always empty after the request.
func FuzzUpload(f *testing.F) {
	e := newFzEnv(f, nil)
	alice, bob := e.alice, e.bob
	e.mustUpload(f, alice, "existing", fzFirmwareA1)
	e.mustUpload(f, bob, "bob's", fzFirmwareB)
	aliceDev := e.deviceID(f, alice)
	fwDir := e.st.fwDir
	tmpDir := filepath.Join(fwDir, "tmp")

	const ct = "multipart/form-data; boundary=fzB"
	fw := []byte("\xe9\x04\x02\x20new firmware\x00\xff\n")
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "ok"}, {"version", "2.0"}, {"notes", "notes"}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "only name"}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "dup of alice's"}}, fzFirmwareA1))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "same bytes as bob's"}}, fzFirmwareB))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "empty"}}, []byte{}))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "no file"}}, nil))
	f.Add(ct, fzForm("fzB", nil, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "  "}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", strings.Repeat("ü", 256)}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "a"}, {"version", strings.Repeat("v", 256)}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "bad utf8 \xff\xfe"}, {"name", "last wins"}}, fw))
	f.Add(ct, fzForm("fzB", [][2]string{{"name", "x"}}, []byte("\xe9 truncated"))[:60])
	f.Add(`multipart/form-data; boundary="a:b c"`, fzForm("a:b c", [][2]string{{"name", "quoted"}}, fw))
	f.Add("multipart/form-data", fzForm("fzB", [][2]string{{"name", "no boundary"}}, fw))
	f.Add("multipart/form-data; boundary=", fzForm("fzB", [][2]string{{"name", "empty boundary"}}, fw))
	f.Add("multipart/mixed; boundary=fzB", fzForm("fzB", [][2]string{{"name", "mixed"}}, fw))
	f.Add("application/json", []byte(`{"name":"json"}`))
	f.Add("", []byte{})
	f.Add(ct, []byte("--fzB\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nqp\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.bin\"\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n=E9=04 q=\r\np\r\n--fzB--\r\n"))
	f.Add(ct, []byte("--fzB\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n\xe9first\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nsecond\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\ntwo files\r\n--fzB--\r\n"))
	f.Add(ct, []byte("--fzB\r\nContent-Type: text/plain\r\n\r\nno disposition\r\n--fzB--\r\n"))
	f.Add(ct, []byte("--fzB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"../../etc/passwd\"\r\n\r\n\xe9x\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\ntraversal\r\n--fzB--\r\n"))

	f.Fuzz(func(t *testing.T, contentType string, body []byte) {
		e.logs.take()
		rowsBefore, err := e.st.firmwaresOf(e.ctx, aliceDev)
		if err != nil {
			e.fail(t, nil, "firmwaresOf: %v", err)
		}
		filesBefore, err := fzListDir(fwDir)
		if err != nil {
			e.fail(t, nil, "list firmware dir: %v", err)
		}
		req := httptest.NewRequest("POST", "/v1/user/devices/"+alice.device+"/firmwares", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+alice.token)
		req.Header.Set("Accept", "application/json")
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		w := e.serve(req)
		v := e.check(t, w)
		if tmp, err := fzListDir(tmpDir); err != nil || len(tmp) != 0 {
			e.fail(t, w, "firmware/tmp not empty after the request: %q %v", tmp, err)
		}
		rowsAfter, err := e.st.firmwaresOf(e.ctx, aliceDev)
		if err != nil {
			e.fail(t, w, "firmwaresOf: %v", err)
		}
		filesAfter, err := fzListDir(fwDir)
		if err != nil {
			e.fail(t, w, "list firmware dir: %v", err)
		}

		form := fzReadForm(contentType, body)
		name := fzJSONString(form.fields["name"])
		version, notes := fzJSONString(form.fields["version"]), fzJSONString(form.fields["notes"])
		sum := fzMD5(form.file)
		valid := form.readable && form.hasFile && len(form.file) > 0 && len(form.file) <= maxFirmwareSize &&
			form.file[0] == 0xE9 && // alice's device is an esp32: an ESP application image
			utf8.ValidString(form.fields["name"]) && utf8.ValidString(form.fields["version"]) && utf8.ValidString(form.fields["notes"]) &&
			strings.TrimSpace(name) != "" && utf8.RuneCountInString(name) <= 255 &&
			utf8.RuneCountInString(version) <= 255 && utf8.RuneCountInString(notes) <= 2000
		dup := slices.ContainsFunc(rowsBefore, func(f *firmware) bool { return f.MD5 == sum })

		if w.Code != http.StatusCreated {
			if valid && !dup && len(body) <= maxUploadBody {
				e.fail(t, w, "well-formed upload of a new file (md5 %s, name %q) refused", sum, name)
			}
			if dup && valid && (w.Code != http.StatusUnprocessableEntity || v["message"] != "This firmware file is already uploaded.") {
				e.fail(t, w, "upload of a file the device has: want 422 already uploaded")
			}
			if !fzSameJSON(rowsAfter, rowsBefore) {
				e.fail(t, w, "refused upload changed the firmware rows:\nbefore %s\nafter  %s", fzJSON(rowsBefore), fzJSON(rowsAfter))
			}
			if !slices.Equal(filesAfter, filesBefore) {
				e.fail(t, w, "refused upload changed the firmware files: %q -> %q", filesBefore, filesAfter)
			}
			return
		}

		var got struct {
			Data firmware `json:"data"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil || got.Data.ID == nil || got.Data.Size == nil || got.Data.Name == nil {
			e.fail(t, w, "201 without a firmware: %v", err)
		}
		d := got.Data
		if !valid || dup {
			e.fail(t, w, "upload accepted (readable %v, file %v, %d bytes, name %q, duplicate %v)",
				form.readable, form.hasFile, len(form.file), name, dup)
		}
		wantOpt := func(s string) *string {
			if s == "" {
				return nil
			}
			return &s
		}
		if d.MD5 != sum || *d.Size != int64(len(form.file)) || *d.Name != name ||
			!fzSameJSON(d.Version, wantOpt(version)) || !fzSameJSON(d.Notes, wantOpt(notes)) {
			e.fail(t, w, "answer does not describe the part sent: md5 %s, %d bytes, name %q, version %q, notes %q",
				sum, len(form.file), name, version, notes)
		}
		sha := sha256Hex(form.file)
		stored, err := os.ReadFile(e.st.firmwarePath(sha))
		if err != nil || d.SHA256 == nil || *d.SHA256 != sha || fzMD5(stored) != d.MD5 || sha256Hex(stored) != sha || int64(len(stored)) != *d.Size {
			e.fail(t, w, "stored file for %s: %d bytes, md5 %s, sha256 %s, err %v", d.MD5, len(stored), fzMD5(stored), sha256Hex(stored), err)
		}
		row, err := firmwareQuery(e.ctx, e.st.db, aliceDev, d.MD5)
		if err != nil || *row.ID != *d.ID || len(rowsAfter) != len(rowsBefore)+1 {
			e.fail(t, w, "row for %s: %v (rows %d -> %d)", d.MD5, err, len(rowsBefore), len(rowsAfter))
		}
		// Delete it again, so that every input starts from the same rows;
		// the file goes unless another device's row has the same bytes.
		wd := e.serve(fzJSONRequest("DELETE", "/v1/user/devices/"+alice.device+"/firmwares/"+strconv.FormatInt(*d.ID, 10), alice.token, nil))
		if wd.Code != http.StatusOK {
			e.fail(t, wd, "delete the uploaded firmware")
		}
		if files, err := fzListDir(fwDir); err != nil || !slices.Equal(files, filesBefore) {
			e.fail(t, wd, "firmware files after delete: %q, want %q (%v)", files, filesBefore, err)
		}
	})
}

// ---- FuzzBearerToken ----

// fzAcceptBareSecret: store.authenticate also accepts a token's secret
// without its "<id>|" (looked up by hash), as Laravel Sanctum does; its
// comment says so. That form is as secret as the whole token, so it counts
// as valid here. The README only documents the whole "<id>|<secret>" form.
const fzAcceptBareSecret = true

// FuzzBearerToken fuzzes the Authorization header of GET /v1/auth/me, and
// gives the same string (whole, and after "Bearer ") to store.authenticate.
// Properties: never 5xx; exactly "Bearer <a live token>" answers 200 with
// that token's user; everything else is 401 {"message":"Unauthenticated."}
// (logged-out tokens, deleted users' tokens, mutations); authenticate
// returns that token's record for a live token and errNotFound for
// anything else, never another error.
func FuzzBearerToken(f *testing.F) {
	e := newFzEnv(f, nil)
	alice, bob := e.alice, e.bob
	loggedOut, err := issueToken(e.ctx, e.st, alice.id, "logged-out", false)
	if err != nil {
		f.Fatal(err)
	}
	e.mustRequest(f, "POST", "/v1/auth/logout", loggedOut, "", http.StatusOK)
	carol := e.addUser("Carol", "carol@example.com", "carol-password")
	if _, err := e.st.wdb.Exec(`DELETE FROM users WHERE id = ?`, carol.id); err != nil {
		f.Fatal(err)
	}
	type live struct {
		user    testUser
		tokenID int64
	}
	valid := map[string]live{}
	for _, u := range []testUser{alice, bob} {
		idPart, secret, _ := strings.Cut(u.token, "|")
		id, _ := strconv.ParseInt(idPart, 10, 64)
		valid[u.token] = live{u, id}
		if fzAcceptBareSecret {
			valid[secret] = live{u, id}
		}
	}
	aliceID, aliceSecret, _ := strings.Cut(alice.token, "|")
	repl := strings.NewReplacer("{A}", alice.token, "{B}", bob.token, "{L}", loggedOut, "{C}", carol.token,
		"{Aid}", aliceID, "{As}", aliceSecret)

	for _, h := range []string{
		"Bearer {A}", "Bearer {B}", "Bearer {L}", "Bearer {C}",
		"bearer {A}", "BEARER {A}", "Bearer  {A}", "Bearer\t{A}", " Bearer {A}", "Bearer {A} ", "Bearer {A}\t",
		"Bearer {A}x", "Bearer {A}|", "Bearer {Aid}|", "Bearer {Aid}|{As}{As}", "Bearer {Aid}|wrong",
		"Bearer 0{Aid}|{As}", "Bearer +{Aid}|{As}", "Bearer -1|{As}", "Bearer 99999999999999999999|{As}",
		"Bearer x|{As}", "Bearer |{As}", "Bearer {As}", "Bearer {As}|{Aid}", "Bearer {Aid}", "Bearer {Aid}|{As}\x00",
		"Bearer ", "Bearer", "", "Basic YWxpY2U6YWxpY2UtcGFzc3dvcmQ=", "Token {A}", "Bearer {A},Bearer {B}",
		"Bearer 2|{As}", "Bearer 1|ä", "Bearer \xff\xfe",
	} {
		f.Add(h)
	}

	f.Fuzz(func(t *testing.T, header string) {
		e.logs.take()
		header = repl.Replace(header)
		req := httptest.NewRequest("GET", "/v1/auth/me", nil)
		req.Header["Authorization"] = []string{header}
		req.Header.Set("Accept", "application/json")
		w := e.serve(req)
		v := e.check(t, w)
		tok, bearer := strings.CutPrefix(header, "Bearer ")
		who, ok := valid[tok]
		if ok && bearer {
			data, _ := v["data"].(map[string]any)
			if w.Code != http.StatusOK || fmt.Sprint(data["id"]) != strconv.FormatInt(who.user.id, 10) || data["email"] != who.user.email {
				e.fail(t, w, "token of %s: want 200 with that user", who.user.email)
			}
		} else if w.Code != http.StatusUnauthorized || v["message"] != "Unauthenticated." || len(v) != 1 {
			e.fail(t, w, "not a live token: want 401 {\"message\":\"Unauthenticated.\"}")
		}
		for _, s := range []string{header, tok} {
			rec, err := authenticate(e.ctx, e.st, s)
			if who, ok := valid[s]; ok {
				if err != nil || rec.user.ID != who.user.id || rec.id != who.tokenID {
					e.fail(t, nil, "authenticate(%q) = %+v, %v; want token %d of %s", s, rec, err, who.tokenID, who.user.email)
				}
			} else if !errors.Is(err, errTokenNotFound) || rec != nil {
				e.fail(t, nil, "authenticate(%q) = %+v, %v; want errTokenNotFound", s, rec, err)
			}
		}
	})
}

// ---- FuzzDeviceMessage ----

// fzTelemetry is the telemetry message as the README describes it.
type fzTelemetry struct {
	LocalIP   *string  `json:"local_ip"`
	PublicIP  *string  `json:"public_ip"`
	RSSI      *float64 `json:"rssi"`
	FWMD5     *string  `json:"fw_md5"`
	FWVersion *string  `json:"fw_version"`
}

// fzDeviceRow is the part of a device row that device messages write, and
// some that they must not.
type fzDeviceRow struct {
	Status                                        string
	CurrentMD5, CurrentVersion, LocalIP, PublicIP sql.NullString
	FirstSeen, LastSeen, LastOTA                  sql.NullString
	Name, Description                             sql.NullString
	RSSI                                          sql.NullFloat64
	Target                                        sql.NullInt64
}

func (e *fzEnv) deviceRow(uid string) (fzDeviceRow, error) {
	var r fzDeviceRow
	err := e.st.db.QueryRowContext(e.ctx, `SELECT status, current_md5, current_version, local_ip, public_ip,
		first_seen_at, last_seen_at, last_ota_at, name, description, last_rssi, target_firmware_id
		FROM devices WHERE uid = ?`, uid).Scan(&r.Status, &r.CurrentMD5, &r.CurrentVersion, &r.LocalIP, &r.PublicIP,
		&r.FirstSeen, &r.LastSeen, &r.LastOTA, &r.Name, &r.Description, &r.RSSI, &r.Target)
	return r, err
}

var fzLowerMD5 = regexp.MustCompile(`^[0-9a-f]{32}$`)

func fzNull(s *string) sql.NullString {
	if s == nil {
		return sql.NullString{}
	}
	return sql.NullString{String: *s, Valid: true}
}

// FuzzDeviceMessage feeds fuzzed topics, payloads and retained flags to
// mqttLink.handle on a link without a broker, then flushes. Properties:
// nothing panics or fails to apply; each message is counted exactly once,
// as dropped or applied, and applied only when its topic is
// devices/<known uid>/status or /telemetry and its payload is valid; an
// applied message writes exactly what it says (status, telemetry fields,
// seen times, last_ota_at on reaching the target) to the device it names
// and nothing else; a dropped one changes nothing; every status is
// pending, online, offline or reconnecting; current_md5 is NULL or 32
// lowercase hex digits.
func FuzzDeviceMessage(f *testing.F) {
	e := newFzEnv(f, nil)
	alice, bob := e.alice, e.bob
	fa := e.mustUpload(f, alice, "alice", fzFirmwareA1)
	fb := e.mustUpload(f, bob, "bob", fzFirmwareB)
	e.mustRequest(f, "POST", "/v1/user/devices/"+alice.device+"/firmwares/set-target", alice.token, `{"md5":"`+fa.md5+`"}`, http.StatusOK)
	l := &mqttLink{prefix: "devices", store: e.st, log: e.log, pending: map[string]*deviceReport{}, drops: map[string]int64{}, kick: make(chan struct{}, 1)}
	targets := map[string]string{alice.device: fa.md5}
	repl := strings.NewReplacer("{A}", alice.device, "{B}", bob.device, "{FA}", fa.md5, "{FAU}", strings.ToUpper(fa.md5), "{FB}", fb.md5)

	for _, s := range []struct {
		topic, payload string
		retained       bool
	}{
		{"devices/{A}/status", "online", false},
		{"devices/{A}/status", "offline", true},
		{"devices/{B}/status", "reconnecting", false},
		{"devices/{A}/status", "pending", false},
		{"devices/{A}/status", "Online", false},
		{"devices/{A}/status", "online\n", false},
		{"devices/{A}/status", "", false},
		{"devices/{A}/telemetry", `{"local_ip":"192.168.1.20","public_ip":"203.0.113.9","rssi":-61,"fw_md5":"{FAU}","fw_version":"1.0"}`, false},
		{"devices/{A}/telemetry", `{"fw_md5":"{FB}"}`, true},
		{"devices/{B}/telemetry", `{"rssi":-1e308,"fw_version":"only version"}`, false},
		{"devices/{A}/telemetry", `{"fw_md5":"not-hex-not-hex-not-hex-not-hex!"}`, false},
		{"devices/{A}/telemetry", `{"fw_md5":"{FA}0"}`, false},
		{"devices/{A}/telemetry", `{"rssi":"strong"}`, false},
		{"devices/{A}/telemetry", `{"rssi":1e999}`, false},
		{"devices/{A}/telemetry", `{"local_ip":"` + strings.Repeat("1", 256) + `"}`, false},
		{"devices/{A}/telemetry", `{"LOCAL_IP":"case","fw_md5":"{FA}","fw_md5":null}`, false},
		{"devices/{A}/telemetry", `{"local_ip":"\u0000 \ud800 日本"}`, false},
		{"devices/{A}/telemetry", `null`, false},
		{"devices/{A}/telemetry", `[]`, false},
		{"devices/{A}/telemetry", `{}`, true},
		{"devices/{A}/telemetry", strings.Repeat(`{"a":`, 5000), false},
		{"devices/{A}/telemetry", `{"pad":"` + strings.Repeat("x", 17000) + `"}`, false},
		{"devices/{A}/cmd", `{"cmd":"reboot"}`, false},
		{"devices/{A}/status/extra", "online", false},
		{"devices//status", "online", false},
		{"devices/unknown_device/status", "online", false},
		{"devices/{A}x/status", "online", false},
		{"other/{A}/status", "online", false},
		{"devices/" + strings.Repeat("u", 129) + "/status", "online", false},
		{"{A}/status", "online", false},
		{"", "", false},
	} {
		f.Add(s.topic, []byte(s.payload), s.retained)
	}

	kinds := []string{"status", "telemetry"}
	f.Fuzz(func(t *testing.T, topic string, payload []byte, retained bool) {
		e.logs.take()
		topic = repl.Replace(topic)
		payload = []byte(repl.Replace(string(payload)))
		e.clock.advance(time.Second)
		now := e.st.timestamp()
		devices := []string{alice.device, bob.device}
		before := map[string]fzDeviceRow{}
		for _, uid := range devices {
			r, err := e.deviceRow(uid)
			if err != nil {
				e.fail(t, nil, "device row: %v", err)
			}
			before[uid] = r
		}
		d0 := dropTotal(l)

		l.handle(topic, payload, retained)
		l.flush()

		dropped := dropTotal(l) - d0
		if logs := e.logs.take(); logs != "" {
			e.fail(t, nil, "the link logged a problem:\n%s", logs)
		}
		if dropped < 0 || dropped > 1 {
			e.fail(t, nil, "one message counted %d times as dropped", dropped)
		}
		// The device and kind the topic names, if it is one of the two
		// topics a known device publishes on.
		var named, kind string
		for _, uid := range devices {
			for _, k := range kinds {
				if topic == "devices/"+uid+"/"+k {
					named, kind = uid, k
				}
			}
		}
		after := map[string]fzDeviceRow{}
		for _, uid := range devices {
			r, err := e.deviceRow(uid)
			if err != nil {
				e.fail(t, nil, "device row: %v", err)
			}
			after[uid] = r
			switch r.Status {
			case "pending", "online", "offline", "reconnecting":
			default:
				e.fail(t, nil, "device %s has status %q", uid, r.Status)
			}
			if r.CurrentMD5.Valid && !fzLowerMD5.MatchString(r.CurrentMD5.String) {
				e.fail(t, nil, "device %s has current_md5 %q", uid, r.CurrentMD5.String)
			}
			if uid != named && r != before[uid] {
				e.fail(t, nil, "device %s changed by a message on %q:\nbefore %+v\nafter  %+v", uid, topic, before[uid], r)
			}
		}

		// What the message must do, by the device contract.
		var want *fzDeviceRow
		if named != "" && len(payload) <= maxDevicePayload {
			w := before[named]
			switch kind {
			case "status":
				switch s := strings.TrimSpace(string(payload)); s {
				case "online", "offline", "reconnecting":
					w.Status = s
					want = &w
				}
			case "telemetry":
				var tm fzTelemetry
				ok := json.Unmarshal(payload, &tm) == nil
				for _, s := range []*string{tm.LocalIP, tm.PublicIP, tm.FWVersion} {
					ok = ok && (s == nil || len(*s) <= 255)
				}
				ok = ok && (tm.FWMD5 == nil || isMD5(*tm.FWMD5))
				if !ok {
					break
				}
				if tm.LocalIP != nil {
					w.LocalIP = fzNull(tm.LocalIP)
				}
				if tm.PublicIP != nil {
					w.PublicIP = fzNull(tm.PublicIP)
				}
				if tm.RSSI != nil {
					w.RSSI = sql.NullFloat64{Float64: *tm.RSSI, Valid: true}
				}
				if tm.FWMD5 != nil {
					sum := strings.ToLower(*tm.FWMD5)
					if sum != w.CurrentMD5.String && sum == targets[named] {
						w.LastOTA = fzNull(&now)
					}
					w.CurrentMD5 = fzNull(&sum)
					w.CurrentVersion = fzNull(tm.FWVersion)
				} else if tm.FWVersion != nil {
					w.CurrentVersion = fzNull(tm.FWVersion)
				}
				want = &w
			}
			if want != nil {
				if !want.FirstSeen.Valid {
					want.FirstSeen = fzNull(&now)
				}
				if !retained || !want.LastSeen.Valid {
					want.LastSeen = fzNull(&now)
				}
			}
		}
		if want == nil {
			if dropped != 1 {
				e.fail(t, nil, "a message on %q (%q) that names no device or is malformed was not counted as dropped", topic, payload)
			}
			if named != "" && after[named] != before[named] {
				e.fail(t, nil, "dropped message changed %s:\nbefore %+v\nafter  %+v", named, before[named], after[named])
			}
			return
		}
		if dropped != 0 {
			e.fail(t, nil, "valid %s message for %s (%q, retained %v) was dropped", kind, named, payload, retained)
		}
		if after[named] != *want {
			e.fail(t, nil, "after %s message %q (retained %v):\n got  %+v\n want %+v", kind, payload, retained, after[named], *want)
		}
	})
}

// ---- FuzzOTALink ----

// fzCleanPath is the router's path canonicalisation (net/http cleanPath):
// a request for any other spelling is redirected to this one.
func fzCleanPath(p string) string {
	if p == "" {
		return "/"
	}
	if p[0] != '/' {
		p = "/" + p
	}
	np := path.Clean(p)
	if p[len(p)-1] == '/' && np != "/" {
		if len(p) == len(np)+1 && strings.HasPrefix(p, np) {
			np = p
		} else {
			np += "/"
		}
	}
	return np
}

// FuzzOTALink fuzzes the uid and file path segments (escaped, or raw),
// the exp and sig query values, the device's sketch-md5 header and the
// clock. Properties: never 5xx, and never 200, 206 or 304 unless the
// request names a link that env.srv.otaURL issued (same uid, md5, expiry
// and signature) and that has not expired; such a link answers 200 with
// the file's bytes (304 when the sketch md5 is the file's) if the firmware
// exists, 404 if not (another device's md5, or deleted); any other link
// answers 403 {"message":"Invalid or expired link."}; a path the router
// does not route is 404, and one it must canonicalise a redirect.
func FuzzOTALink(f *testing.F) {
	e := newFzEnv(f, nil)
	alice, bob := e.alice, e.bob
	fa := e.mustUpload(f, alice, "alice", fzFirmwareA1)
	fb := e.mustUpload(f, bob, "bob", fzFirmwareB)
	fd := e.mustUpload(f, alice, "deleted", fzFirmwareA2)
	t0 := e.clock.now()

	type pair struct{ uid, md5 string }
	type signed struct {
		exp int64
		sig string
	}
	issued := map[pair]signed{}
	for _, p := range []pair{{alice.device, fa.md5}, {bob.device, fb.md5}, {alice.device, fb.md5}, {bob.device, fa.md5}, {alice.device, fd.md5}} {
		link := e.srv.otaURL(p.uid, p.md5)
		u, err := url.Parse(link)
		if err != nil || u.Path != "/ota/"+p.uid+"/"+p.md5+".bin" {
			f.Fatalf("otaURL(%s, %s) = %s (%v)", p.uid, p.md5, link, err)
		}
		exp, err := strconv.ParseInt(u.Query().Get("exp"), 10, 64)
		if err != nil {
			f.Fatalf("otaURL(%s, %s) = %s: %v", p.uid, p.md5, link, err)
		}
		issued[p] = signed{exp, u.Query().Get("sig")}
	}
	e.mustRequest(f, "DELETE", "/v1/user/devices/"+alice.device+"/firmwares/"+strconv.FormatInt(fd.id, 10), alice.token, "", http.StatusOK)
	files := map[pair][]byte{{alice.device, fa.md5}: fzFirmwareA1, {bob.device, fb.md5}: fzFirmwareB}
	expStr := strconv.FormatInt(issued[pair{alice.device, fa.md5}].exp, 10)
	repl := strings.NewReplacer("{A}", alice.device, "{B}", bob.device, "{FA}", fa.md5, "{FAU}", strings.ToUpper(fa.md5),
		"{FB}", fb.md5, "{FD}", fd.md5, "{exp}", expStr)

	day := int64(otaLinkLifetime / time.Second)
	for _, s := range []struct {
		uid, file, exp, sig, sketch string
		delta                       int64
		raw                         bool
	}{
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", day - 1, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", day, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", -day, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "{FAU}", 0, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "{FB}", 0, false},
		{"{B}", "{FB}.bin", "{exp}", "{sig}", "", 3600, true},
		{"{A}", "{FB}.bin", "{exp}", "{sig}", "", 0, false}, // signed, but bob's firmware
		{"{B}", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FD}.bin", "{exp}", "{sig}", "", 0, false}, // signed, then deleted
		{"{B}", "{FA}.bin", "{exp}", "", "", 0, false},
		{"{A}", "{FAU}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.BIN", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}0", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "+{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "9223372036854775807", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "99999999999999999999", "0", "", 0, false},
		{"{A}", "{FA}.bin", "-1", "", "", 0, false},
		{"{A}", "{FA}.bin", "", "", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}", "00", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}&sig={sig}", "x", "", 0, true},
		{"{A}", "{FA}.bin", "{exp}", "{sig}&sig=x", "", 0, true},
		{"{A}", "{FA}.bin", "{exp}", "x&sig={sig}", "", 0, true},
		{"..", "{FA}.bin", "{exp}", "{sig}", "", 0, true},
		{".", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}/..", "{FA}.bin", "{exp}", "{sig}", "", 0, true},
		{"{A}/x", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}", "", "{exp}", "{sig}", "", 0, false},
		{"%41", "{FA}.bin", "{exp}", "{sig}", "", 0, true},
		{"日本", "ü.bin", "{exp}", "{sig}", "", 0, false},
	} {
		f.Add(s.uid, s.file, s.exp, s.sig, s.sketch, s.delta, s.raw)
	}

	f.Fuzz(func(t *testing.T, uid, file, exp, sig, sketch string, delta int64, raw bool) {
		e.logs.take()
		uid, file, exp, sketch = repl.Replace(uid), repl.Replace(file), repl.Replace(exp), repl.Replace(sketch)
		if s, ok := issued[pair{uid, strings.TrimSuffix(file, ".bin")}]; ok {
			exp, sig = strings.ReplaceAll(exp, "{sig}", s.sig), strings.ReplaceAll(sig, "{sig}", s.sig)
		}
		now := t0.Add(time.Duration(delta%(20*365*day)) * time.Second)
		fzSetClock(e.clock, now)
		var target string
		if raw {
			target = "/ota/" + uid + "/" + file + "?exp=" + exp + "&sig=" + sig
		} else {
			target = "/ota/" + url.PathEscape(uid) + "/" + url.PathEscape(file) + "?" + url.Values{"exp": {exp}, "sig": {sig}}.Encode()
		}
		u, err := url.ParseRequestURI(target)
		if err != nil || strings.ContainsAny(target, " \x7f") || strings.ContainsFunc(target, func(r rune) bool { return r < 0x20 }) {
			return // not a request line a client can send
		}
		req := httptest.NewRequest("GET", "/", nil)
		req.URL, req.RequestURI = u, target
		if sketch != "" {
			req.Header.Set("x-ESP32-sketch-md5", sketch)
		}
		w := e.serve(req)
		if w.Code >= 500 {
			e.fail(t, w, "server error for %s", target)
		}

		// What the request names, split the way the router splits it.
		esc := u.EscapedPath()
		clean := fzCleanPath(esc) == esc
		routed := false
		var p pair
		if rest, ok := strings.CutPrefix(esc, "/ota/"); ok && clean {
			segs := strings.Split(rest, "/")
			if len(segs) == 2 && segs[0] != "" && segs[1] != "" {
				uidU, err1 := url.PathUnescape(segs[0])
				fileU, err2 := url.PathUnescape(segs[1])
				routed = err1 == nil && err2 == nil
				p = pair{uidU, strings.TrimSuffix(fileU, ".bin")}
			}
		}
		q := u.Query()
		s, isIssued := issued[p]
		gotExp, expErr := strconv.ParseInt(q.Get("exp"), 10, 64)
		valid := routed && isIssued && expErr == nil && gotExp == s.exp && q.Get("sig") == s.sig && now.Unix() < s.exp
		content, exists := files[p]

		switch {
		case !clean:
			if w.Code != http.StatusTemporaryRedirect && w.Code != http.StatusMovedPermanently && w.Code != http.StatusNotFound {
				e.fail(t, w, "non-canonical path %s: want a redirect or 404", target)
			}
		case !routed:
			if w.Code != http.StatusNotFound {
				e.fail(t, w, "unrouted path %s: want 404", target)
			}
		case !valid:
			// 403 from the handler; 404 from the router, which does not
			// route some escaped segments (a segment "%2F" matches no
			// wildcard).
			if body := w.Body.String(); !(w.Code == http.StatusForbidden && body == "{\"message\":\"Invalid or expired link.\"}\n" ||
				w.Code == http.StatusNotFound && body == "{\"message\":\"Not found.\"}\n") {
				e.fail(t, w, "link not issued or expired (%s, now %d, issued %v): want 403 Invalid or expired link.", target, now.Unix(), isIssued)
			}
		case !exists:
			if w.Code != http.StatusNotFound || w.Body.String() != "{\"message\":\"Firmware not found.\"}\n" {
				e.fail(t, w, "signed link to a firmware that does not exist (%s): want 404", target)
			}
		case sketch != "" && strings.EqualFold(sketch, p.md5):
			if w.Code != http.StatusNotModified || w.Body.Len() != 0 {
				e.fail(t, w, "the device runs %s already: want 304", p.md5)
			}
		default:
			if w.Code != http.StatusOK || !bytes.Equal(w.Body.Bytes(), content) || w.Header().Get("x-MD5") != p.md5 ||
				w.Header().Get("Content-Length") != strconv.Itoa(len(content)) || w.Header().Get("Content-Type") != "application/octet-stream" {
				e.fail(t, w, "issued link %s: want 200 with the file", target)
			}
		}
	})
}
