package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"mime/multipart"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// testIterations keeps password hashing fast in tests; production hashes
// use passwordIterations, and checkPassword reads the count from the hash.
const testIterations = 1000

// fakeClock is a settable clock for the store and server.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newTestStore opens a store on a fresh data directory under t.TempDir().
func newTestStore(tb testing.TB, now func() time.Time) *store {
	tb.Helper()
	if now == nil {
		now = time.Now
	}
	st, err := openStore(context.Background(), tb.TempDir(), now)
	if err != nil {
		tb.Fatalf("openStore: %v", err)
	}
	tb.Cleanup(func() { st.Close() })
	return st
}

func testLogger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tbWriter{tb}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// tbWriter sends log output to the test log.
type tbWriter struct{ tb testing.TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// testUser is a user provisioned for a test, with one device and a token.
type testUser struct {
	id       int64
	email    string
	password string
	token    string
	device   string // uid of the user's device
}

// testEnv is a server on a fresh store with two users, alice and bob,
// each owning one device.
type testEnv struct {
	t          testing.TB
	st         *store
	srv        *server
	clock      *fakeClock
	alice, bob testUser
}

// newTestEnv builds a testEnv; link may be nil (no broker).
func newTestEnv(tb testing.TB, link commandLink) *testEnv {
	tb.Helper()
	clock := newFakeClock()
	st := newTestStore(tb, clock.now)
	srv := newServer(st, link, testLogger(tb), bytes.Repeat([]byte{7}, 32), "http://devicehub.test")
	srv.iterations = testIterations
	e := &testEnv{t: tb, st: st, srv: srv, clock: clock}
	e.alice = e.addUser("Alice", "alice@example.com", "alice-password")
	e.bob = e.addUser("Bob", "bob@example.com", "bob-password")
	return e
}

// addUser creates a user with one esp32 device and a token.
func (e *testEnv) addUser(name, email, password string) testUser {
	e.t.Helper()
	ctx := context.Background()
	hash, err := hashPassword(password, testIterations)
	if err != nil {
		e.t.Fatal(err)
	}
	id, err := e.st.createUser(ctx, name, email, "user", hash)
	if err != nil {
		e.t.Fatalf("createUser: %v", err)
	}
	uid, err := e.st.createDevice(ctx, email, "esp32", "devkit", name+"'s device", 1883)
	if err != nil {
		e.t.Fatalf("createDevice: %v", err)
	}
	tok, err := issueToken(ctx, e.st, id, "test", false)
	if err != nil {
		e.t.Fatalf("issueToken: %v", err)
	}
	return testUser{id: id, email: email, password: password, token: tok, device: uid}
}

// request sends a request through the real router. body is sent as is
// when it is a string or []byte, and as JSON otherwise.
func (e *testEnv) request(method, path, token string, body any) *httptest.ResponseRecorder {
	e.t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	case []byte:
		r = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			e.t.Fatal(err)
		}
		r = bytes.NewReader(j)
	}
	req := httptest.NewRequest(method, path, r)
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	w := httptest.NewRecorder()
	e.srv.ServeHTTP(w, req)
	recordResponse(e.t, req, w)
	return w
}

// upload sends a multipart firmware upload with the given form fields
// and, unless content is nil, a file part.
func (e *testEnv) upload(uid, token string, fields map[string]string, content []byte) *httptest.ResponseRecorder {
	e.t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for k, v := range fields {
		mw.WriteField(k, v)
	}
	if content != nil {
		fw, err := mw.CreateFormFile("file", "firmware.bin")
		if err != nil {
			e.t.Fatal(err)
		}
		fw.Write(content)
	}
	mw.Close()
	req := httptest.NewRequest("POST", "/v1/user/devices/"+uid+"/firmwares", &buf)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	req.Header.Set("Authorization", "Bearer "+token)
	w := httptest.NewRecorder()
	e.srv.ServeHTTP(w, req)
	recordResponse(e.t, req, w)
	return w
}

// decode parses a JSON response body into a generic value.
func decode(tb testing.TB, w *httptest.ResponseRecorder) map[string]any {
	tb.Helper()
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		tb.Errorf("Content-Type = %q, want application/json", ct)
	}
	var v map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
		tb.Fatalf("response is not a JSON object: %v\n%s", err, w.Body.String())
	}
	return v
}

// jsonEqual reports whether two JSON texts are the same value.
func jsonEqual(tb testing.TB, a, b []byte) bool {
	tb.Helper()
	var va, vb any
	if err := json.Unmarshal(a, &va); err != nil {
		tb.Fatalf("bad JSON %s: %v", a, err)
	}
	if err := json.Unmarshal(b, &vb); err != nil {
		tb.Fatalf("bad JSON %s: %v", b, err)
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return bytes.Equal(ja, jb)
}

// device loads a device row directly from the store, by uid.
func (e *testEnv) device(u testUser) *device {
	e.t.Helper()
	d, err := deviceIn(context.Background(), e.st.read, u.id, u.device)
	if err != nil {
		e.t.Fatalf("deviceIn(%s): %v", u.device, err)
	}
	return d
}

// setStatus writes a device status directly, as a device report would.
func (e *testEnv) setStatus(uid, status string) {
	e.t.Helper()
	if _, err := e.st.wdb.Exec(`UPDATE devices SET status = ? WHERE uid = ?`, status, uid); err != nil {
		e.t.Fatal(err)
	}
}

// syncBuffer is a bytes.Buffer that a process's or run's output goroutines
// may write while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// dropTotal is how many device messages the link has dropped and not yet logged.
func dropTotal(l *mqttLink) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n int64
	for _, c := range l.drops {
		n += c
	}
	return n
}
