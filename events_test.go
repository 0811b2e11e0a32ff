package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
)

// serveEnv serves env's API on a loopback socket as serve does: its
// http.Server with readTimeout, the connection in each request's context,
// at most maxConns connections (0: no limit). It returns the base URL.
func serveEnv(t *testing.T, env *testEnv, readTimeout time.Duration, maxConns int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	srv := newHTTPServer(env.srv, env.log, readTimeout)
	limited := limitConns(srv, ln, newConnLimits(maxConns))
	go srv.Serve(limited)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// sse is an open event stream, read in the background.
type sse struct {
	events   chan sseEvent // closed when the stream ends
	comments atomic.Int32
}

type sseEvent struct {
	id, kind string
	data     map[string]any
}

// openStream opens GET /v1/user/events with token (and Last-Event-ID when
// lastID is not empty) and fails the test unless it answers 200.
func openStream(t *testing.T, base, token, lastID string) *sse {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", base+"/v1/user/events", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	res, err := http.DefaultTransport.RoundTrip(req)
	if err != nil || res.StatusCode != 200 || res.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("open stream: %v %v", res, err)
	}
	s := &sse{events: make(chan sseEvent, 20_000)}
	go func() {
		defer close(s.events)
		defer res.Body.Close()
		sc := bufio.NewScanner(res.Body)
		var ev sseEvent
		for sc.Scan() {
			name, value, _ := strings.Cut(sc.Text(), ": ")
			switch {
			case strings.HasPrefix(sc.Text(), ":"):
				s.comments.Add(1)
			case name == "":
				if ev.kind != "" {
					s.events <- ev
				}
				ev = sseEvent{}
			case name == "id":
				ev.id = value
			case name == "event":
				ev.kind = value
			case name == "data":
				json.Unmarshal([]byte(value), &ev.data)
			}
		}
	}()
	return s
}

// next returns the next event, failing the test when none comes in 5 s.
func (s *sse) next(t *testing.T) sseEvent {
	t.Helper()
	select {
	case ev, ok := <-s.events:
		if !ok {
			t.Fatal("the stream ended")
		}
		return ev
	case <-time.After(5 * time.Second):
		t.Fatal("no event in 5 s")
	}
	return sseEvent{}
}

// want returns the next event, and fails unless it is of that kind with
// those data fields.
func (s *sse) want(t *testing.T, kind string, fields map[string]any) sseEvent {
	t.Helper()
	ev := s.next(t)
	if ev.kind != kind {
		t.Fatalf("got event %s %v, want %s %v", ev.kind, ev.data, kind, fields)
	}
	if !matches(ev.data, fields) {
		t.Fatalf("event %s: %v, want %v", kind, ev.data, fields)
	}
	return ev
}

// matches reports whether got has want's values, in nested objects too.
func matches(got, want any) bool {
	w, ok := want.(map[string]any)
	if !ok {
		return fmt.Sprint(got) == fmt.Sprint(want)
	}
	g, _ := got.(map[string]any)
	for k, v := range w {
		if !matches(g[k], v) {
			return false
		}
	}
	return true
}

// none fails if an event arrives within d.
func (s *sse) none(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case ev, ok := <-s.events:
		if ok {
			t.Fatalf("got event %s %v, want none", ev.kind, ev.data)
		}
	case <-time.After(d):
	}
}

// ended waits up to within for the stream to end.
func (s *sse) ended(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case _, ok := <-s.events:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatalf("the stream is still open after %v", within)
		}
	}
}

// TestAuditToldAtCommit: a command sent with ?wait= has its audit entry
// told once the command is committed, before the device answers, not
// once the request has answered (auditCommitted).
func TestAuditToldAtCommit(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	base := serveEnv(t, env, requestReadTimeout, 0)
	alice := openStream(t, base, env.alice.token, "")
	uid := env.alice.device
	dev := testClient(t, b, "alice-device", "")
	publishWait(t, dev, "devices/"+uid+"/status", true, "online")
	alice.want(t, "device.status", map[string]any{"uid": uid, "status": "online"})

	answered := make(chan *httptest.ResponseRecorder, 1)
	go func() {
		answered <- env.request("POST", "/v1/user/devices/"+uid+"/reboot?wait=30", env.alice.token, nil)
	}()
	sent := alice.want(t, "command.state", map[string]any{"device_uid": uid, "command": map[string]any{"kind": "reboot", "state": "sent"}})
	alice.want(t, "audit.entry", map[string]any{"action": "command.send", "device_uid": uid})
	id, _ := sent.data["command"].(map[string]any)["id"].(string)
	publishWait(t, dev, "devices/"+uid+"/result/"+id, false, `{"ok":true}`)
	alice.want(t, "command.state", map[string]any{"device_uid": uid, "command": map[string]any{"id": id, "state": "succeeded"}})
	if w := <-answered; w.Code != 200 {
		t.Fatalf("the command with ?wait=: %d %s", w.Code, w.Body)
	}
}

// TestEventStreamFromBroker: what a device says over a real Mosquitto, a
// command and a rename reach the owner's stream, and nobody else's; a
// client that reconnects with Last-Event-ID gets what it missed.
func TestEventStreamFromBroker(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	env.srv.events.now = env.clock.now // still: telemetry stays held back
	base := serveEnv(t, env, requestReadTimeout, 0)
	alice, bob := openStream(t, base, env.alice.token, ""), openStream(t, base, env.bob.token, "")
	uid := env.alice.device
	dev := testClient(t, b, "alice-device", "")

	publishWait(t, dev, "devices/"+uid+"/status", true, "online")
	first := alice.want(t, "device.status", map[string]any{"uid": uid, "status": "online", "last_rssi": nil})
	publishWait(t, dev, "devices/"+uid+"/telemetry", false, `{"rssi":-50}`)
	alice.none(t, 500*time.Millisecond) // within 5 s of the last: held back

	w := env.request("POST", "/v1/user/devices/"+uid+"/reboot", env.alice.token, nil)
	id, _ := decode(t, w)["command_id"].(string)
	alice.want(t, "command.state", map[string]any{"device_uid": uid, "command": map[string]any{"id": id, "kind": "reboot", "state": "sent"}})
	alice.want(t, "audit.entry", map[string]any{"action": "command.send", "device_uid": uid})
	publishWait(t, dev, "devices/"+uid+"/result/"+id, false, `{"ok":true}`)
	alice.want(t, "command.state", map[string]any{"device_uid": uid, "command": map[string]any{"id": id, "state": "succeeded"}})
	env.request("PATCH", "/v1/user/devices/"+uid, env.alice.token, map[string]any{"name": "Greenhouse"})
	alice.want(t, "device.updated", map[string]any{"uid": uid, "name": "Greenhouse", "description": nil})
	alice.want(t, "audit.entry", map[string]any{"action": "device.update", "device_uid": uid})
	bob.none(t, 200*time.Millisecond)

	again := openStream(t, base, env.alice.token, first.id)
	again.want(t, "command.state", map[string]any{"command": map[string]any{"state": "sent"}})
	again.want(t, "audit.entry", map[string]any{"action": "command.send"})
	again.want(t, "command.state", map[string]any{"command": map[string]any{"state": "succeeded"}})
	again.want(t, "device.updated", map[string]any{"name": "Greenhouse"})
	again.want(t, "audit.entry", map[string]any{"action": "device.update"})
	stale := openStream(t, base, env.alice.token, "0-1")
	stale.want(t, "reset", nil)
}

// TestEventCoalescing: telemetry-driven device.status events go out at
// most once per device per 5 s, the newest held back until then; a new
// status goes at once.
func TestEventCoalescing(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	h.now = env.clock.now
	s, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	steps := []struct {
		name    string
		advance time.Duration
		rssi    float64
		status  bool // a status change, not telemetry
		want    string
	}{
		{"the first report", 0, -50, false, "-50"},
		{"telemetry 1 s later is held", time.Second, -51, false, ""},
		{"and newer telemetry replaces it", time.Second, -52, false, ""},
		{"5 s after the first, tick sends the newest", 3 * time.Second, 0, false, "-52"},
		{"a status change goes at once", time.Second, -53, true, "-53"},
		{"telemetry right after it is held", time.Second, -54, false, ""},
		{"tick before 5 s sends nothing", 3 * time.Second, 0, false, ""},
		{"telemetry 6 s after the last event goes", 2 * time.Second, -55, false, "-55"},
	}
	for _, st := range steps {
		env.clock.advance(st.advance)
		if st.rssi == 0 {
			h.tick()
		} else {
			rssi := st.rssi
			h.devicesChanged(context.Background(), []store.DeviceChange{{TeamID: env.alice.id, StatusChanged: st.status,
				DeviceStatusEvent: model.DeviceStatusEvent{UID: env.alice.device, Status: "online", LastRSSI: &rssi}}})
		}
		var got []string
		for _, f := range h.since(s) {
			var ev struct {
				LastRSSI float64 `json:"last_rssi"`
			}
			_, data, _ := strings.Cut(string(f), "data: ")
			must(t, json.Unmarshal([]byte(data), &ev))
			got = append(got, fmt.Sprint(ev.LastRSSI))
		}
		if strings.Join(got, ",") != st.want {
			t.Errorf("%s: sent %q, want %q", st.name, got, st.want)
		}
	}
}

// TestEventResume: Last-Event-ID resumes after that event while the ring
// still holds everything since; otherwise the stream starts with a reset.
// Each team counts its own events: another team's take none of its ids.
func TestEventResume(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	first, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	bobs, err := h.subscribe(env.bob.id, env.bob.id)
	must(t, err)
	idOf := func(seq uint64) string { return fmt.Sprintf("%s-%d", h.epoch, seq) }
	for i := range eventRing + 5 {
		h.publish(env.alice.id, "test", i)
		if i%2 == 0 {
			h.publish(env.bob.id, "test", "bob's")
		}
	}
	tests := []struct {
		name, lastID string
		want         string // the first frame's id, event and data
	}{
		{"none: from now on", "", ""},
		{"within the ring", idOf(eventRing - 2), idOf(eventRing-1) + " test 9998"},
		{"the newest event", idOf(eventRing + 5), ""},
		{"overwritten", idOf(4), idOf(eventRing+5) + " reset {}"},
		{"the last overwritten", idOf(5), idOf(6) + " test 5"},
		{"before a restart", "abc-9000", idOf(eventRing+5) + " reset {}"},
		{"from the future", idOf(eventRing + 6), idOf(eventRing+5) + " reset {}"},
		{"not an id", "x", idOf(eventRing+5) + " reset {}"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := h.subscribe(env.alice.id, env.alice.id)
			must(t, err)
			defer h.unsubscribe(s)
			h.resume(s, tt.lastID)
			if got := firstFrame(h.since(s)); got != tt.want {
				t.Errorf("first frame %q, want %q", got, tt.want)
			}
		})
	}
	// A stream that fell behind the ring gets a reset and goes on from now.
	if frames := h.since(first); len(frames) != 1 || !strings.Contains(string(frames[0]), "event: reset") {
		t.Errorf("a stream behind the ring got %d frames, want one reset", len(frames))
	}
	// Bob's team counted its own events, every other of alice's.
	h.resume(bobs, idOf(eventRing/2+1))
	if got, want := firstFrame(h.since(bobs)), idOf(eventRing/2+2)+` test "bob's"`; got != want {
		t.Errorf("bob's first frame %q, want %q", got, want)
	}
}

// firstFrame is the first of frames as "<id> <event> <data>", or "".
func firstFrame(frames [][]byte) string {
	if len(frames) == 0 {
		return ""
	}
	id, rest, _ := strings.Cut(strings.TrimPrefix(string(frames[0]), "id: "), "\nevent: ")
	kind, data, _ := strings.Cut(rest, "\ndata: ")
	return id + " " + kind + " " + strings.TrimSpace(data)
}

// TestEventIDsAfterIdle: a team's ring freed while it has no stream, then
// made again, counts on past where it was: an id from before is never
// taken for a newer event, and resuming from it gets a reset (what
// happened meanwhile was not kept).
func TestEventIDsAfterIdle(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	h.now = env.clock.now
	s, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	for i := range 3 {
		h.publish(env.alice.id, "test", i)
	}
	lastID := fmt.Sprintf("%s-%d", h.epoch, 3)
	h.unsubscribe(s)
	env.clock.advance(ringIdle)
	h.tick()
	if h.listening(env.alice.id) {
		t.Fatal("the idle ring was not freed")
	}
	s, err = h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	for i := range 5 {
		h.publish(env.alice.id, "test", 10+i)
	}
	again, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	h.resume(again, lastID)
	if got, want := firstFrame(h.since(again)), fmt.Sprintf("%s-%d reset {}", h.epoch, 9); got != want {
		t.Errorf("resumed from before the ring was freed: first frame %q, want %q", got, want)
	}
	if got, want := firstFrame(h.since(s)), fmt.Sprintf("%s-%d test 10", h.epoch, 5); got != want {
		t.Errorf("the new ring's first frame %q, want %q", got, want)
	}
}

// TestEventRingBytes: a team's ring keeps at most eventRingBytes of
// frames, however big its events (issue 28: 2,000 commands of 62 KiB
// after one stream had opened and closed kept 124 MiB); a stream that
// asks for what was dropped gets a reset, one that asks for what is kept
// gets it.
func TestEventRingBytes(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	s, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	h.unsubscribe(s)
	big := strings.Repeat("x", 62<<10)
	for range 2000 {
		h.publish(env.alice.id, "test", big)
	}
	h.mu.Lock()
	t2 := h.teams[env.alice.id]
	held, n := 0, len(t2.ring)
	for _, f := range t2.ring {
		held += len(f)
	}
	h.mu.Unlock()
	if held > eventRingBytes || n == 0 {
		t.Errorf("the ring holds %d events, %d bytes; want at most %d bytes", n, held, eventRingBytes)
	}
	idOf := func(seq int) string { return fmt.Sprintf("%s-%d", h.epoch, seq) }
	for _, tt := range []struct{ lastID, want string }{
		{idOf(2000 - n), idOf(2001-n) + " test"},
		{idOf(1999 - n), idOf(2000) + " reset"},
	} {
		s, err := h.subscribe(env.alice.id, env.alice.id)
		must(t, err)
		h.resume(s, tt.lastID)
		if got := strings.Join(strings.Fields(firstFrame(h.since(s)))[:2], " "); got != tt.want {
			t.Errorf("from %s: first frame %q, want %q", tt.lastID, got, tt.want)
		}
		h.unsubscribe(s)
	}
}

// TestCommandEvents: command.state says which command of which device and
// its state, never the payload or the result (64 KiB each at most, which
// the ring would keep): the client fetches the command.
func TestCommandEvents(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	h := env.srv.events
	s, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	uid := env.alice.device
	env.setStatus(uid, "online")
	w := env.want(t, 200, "POST", "/v1/user/devices/"+uid+"/commands", env.alice.token,
		`{"payload":{"cmd":"`+strings.Repeat("p", 60<<10)+`"}}`)
	id, _ := decode(t, w)["command_id"].(string)
	ok := true
	_, err = env.st.ApplyDeviceMessages(context.Background(), nil,
		[]mqttlink.Result{{UID: uid, ID: id, Result: wire.Result{OK: &ok, Value: json.RawMessage(`{"r":"` + strings.Repeat("r", 15<<10) + `"}`)}}})
	must(t, err)
	h.CommandsChanged(context.Background(), []string{id})
	var got []string
	for _, f := range h.since(s) {
		if _, data, ok := strings.Cut(firstFrame([][]byte{f}), "command.state "); ok {
			got = append(got, data)
		}
	}
	want := []string{
		`{"device_uid":"` + uid + `","command":{"id":"` + id + `","kind":"custom","state":"sent"}}`,
		`{"device_uid":"` + uid + `","command":{"id":"` + id + `","kind":"custom","state":"succeeded"}}`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestEventStreamLimits: 10 streams per user, the 11th is refused with a
// 429 until one closes, other users (of the team too) unaffected; a revoked token's stream
// ends; a stream that a client stops reading is dropped, without holding
// up the publisher or the other streams.
func TestEventStreamLimits(t *testing.T) {
	// Not parallel: it times 1,000 publishes beside a stalled stream (at most 1 s).
	env := newTestEnv(t, nil)
	env.srv.events.writeWait = 500 * time.Millisecond
	base := serveEnv(t, env, requestReadTimeout, 0)
	_, second, err := issueToken(context.Background(), env.st, env.alice.id, "second", nil, nil)
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	w := env.serve(t, newRequest("GET", "/v1/user/events", "Bearer "+env.alice.token, "", nil).WithContext(ctx))
	if w.Code != 200 || w.Header().Get("Content-Type") != "text/event-stream" {
		t.Fatalf("a stream: got %d %q, want 200 text/event-stream", w.Code, w.Header().Get("Content-Type"))
	}
	for range maxStreams - 1 {
		openStream(t, base, env.alice.token, "")
	}
	revoked := openStream(t, base, second, "")
	ctx, cancel = context.WithTimeout(context.Background(), 2*time.Second) // ends a stream opened by mistake
	defer cancel()
	refused := env.serve(t, newRequest("GET", "/v1/user/events", "Bearer "+env.alice.token, "", nil).WithContext(ctx))
	if refused.Code != 429 || refused.Header().Get("Retry-After") == "" {
		t.Fatalf("the 11th stream: got %d %s, want 429 with Retry-After", refused.Code, refused.Body)
	}
	openStream(t, base, env.bob.token, "")
	// The limit is alice's, not her team's: a teammate opens one.
	mate, err := env.st.CreateUser(context.Background(), "Mate", "mate@example.com", "viewer", "", env.alice.email)
	must(t, err)
	_, mateToken, err := issueToken(context.Background(), env.st, mate, "mate", nil, nil)
	must(t, err)
	openStream(t, base, mateToken, "")

	env.request("DELETE", "/v1/user/tokens/"+strings.Split(second, "|")[0], env.alice.token, nil)
	revoked.ended(t, 3*time.Second)
	openStream(t, base, env.alice.token, "") // its place is free again

	// A client that reads nothing, with a small receive window.
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	conn, err := d.Dial("tcp", strings.TrimPrefix(base, "http://"))
	must(t, err)
	defer conn.Close()
	fmt.Fprintf(conn, "GET /v1/user/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", env.bob.token)
	eventually(t, 5*time.Second, "bob's second stream", func() bool { return env.srv.events.streams() == maxStreams+3 })
	start, big := time.Now(), strings.Repeat("x", 8<<10)
	for range 1000 { // 8 MiB: more than the sockets hold
		env.srv.events.publish(env.bob.id, "test", big)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("publishing 1,000 events took %v: a stream held it up", took)
	}
	// The ring keeps 1 MiB, less than the sockets may hold: publishing goes
	// on until the stalled stream's socket is full and it is dropped.
	eventually(t, 10*time.Second, "the stalled stream to be dropped", func() bool {
		for range 50 {
			env.srv.events.publish(env.bob.id, "test", big)
		}
		return env.srv.events.streams() == maxStreams+2
	})
}

// TestEventStreamBounds: besides maxStreams a user, a team has at most
// maxTeamStreams open and the service maxAllStreams; past either, a new
// stream is a 429 with Retry-After, other teams are unaffected by a team's
// bound, and a stream that closes makes room.
func TestEventStreamBounds(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	// fill opens n streams of the team, for members who each stay under maxStreams.
	opened := 0
	fill := func(teamID int64, n int) {
		for range n {
			_, err := h.subscribe(teamID, 1_000_000+int64(opened/maxStreams))
			must(t, err)
			opened++
		}
	}
	status := func(u testUser) string {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond) // ends a stream that opens
		defer cancel()
		w := env.serve(t, newRequest("GET", "/v1/user/events", "Bearer "+u.token, "", nil).WithContext(ctx))
		return fmt.Sprint(w.Code, " ", w.Header().Get("Retry-After") != "")
	}
	steps := []struct {
		name string
		do   func()
		who  testUser
		want string
	}{
		{"a team's streams under its bound", func() { fill(env.alice.id, maxTeamStreams-1) }, env.alice, "200 false"},
		{"a team at its bound", func() { fill(env.alice.id, 1) }, env.alice, "429 true"},
		{"another team meanwhile", func() {}, env.bob, "200 false"},
		{"every team's together at the service's bound", func() {
			for team := int64(1_000); h.streams() < maxAllStreams; team++ {
				fill(team, min(maxTeamStreams, maxAllStreams-h.streams()))
			}
		}, env.bob, "429 true"},
		{"one closed makes room", func() {
			s, _ := h.subscribe(1_000, 0) // refused: it is the stream below that closes
			if s != nil {
				t.Fatal("a stream past the service's bound")
			}
			h.mu.Lock()
			var one *stream
			for s := range h.teams[1_000].streams {
				one = s
			}
			h.mu.Unlock()
			h.unsubscribe(one)
		}, env.bob, "200 false"},
	}
	for _, st := range steps {
		st.do()
		if got := status(st.who); got != st.want {
			t.Errorf("%s: got %s, want %s (status, Retry-After)", st.name, got, st.want)
		}
	}
}

// TestEventStreamConnection: a stream outlives the server's read timeout,
// sends keep-alive comments, and gives back its -max-conns slot.
func TestEventStreamConnection(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	env.srv.events.keepAlive = 100 * time.Millisecond
	base := serveEnv(t, env, 300*time.Millisecond, 1)
	s := openStream(t, base, env.alice.token, "")
	hc := http.Client{Timeout: 3 * time.Second}
	res, err := hc.Get(base + "/healthz") // a second connection, past -max-conns 1 but for the stream
	if err != nil || res.StatusCode != 200 {
		t.Fatalf("GET /healthz beside a stream: %v %v", res, err)
	}
	res.Body.Close()
	time.Sleep(time.Second)
	env.srv.events.publish(env.alice.id, "test", "after the read timeout")
	s.want(t, "test", nil)
	if n := s.comments.Load(); n < 3 {
		t.Errorf("%d keep-alive comments in a second, want one every 100 ms", n)
	}
}

// TestEventRollout: a rollout's creation and its engine's steps reach the
// stream as rollout.progress, its commands as command.state.
func TestEventRollout(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	base := serveEnv(t, env, requestReadTimeout, 0)
	s := openStream(t, base, env.alice.token, "")
	env.setStatus(env.alice.device, "online")
	_, sum := env.uploadOK(env.alice, map[string]string{"name": "fw"}, []byte("\xe9 image"))
	w := env.request("POST", "/v1/user/rollouts", env.alice.token, map[string]any{"md5": sum, "device_uids": []string{env.alice.device}})
	if w.Code != 201 {
		t.Fatalf("create rollout: %d %s", w.Code, w.Body)
	}
	var got []string
	for len(got) < 3 {
		ev := s.next(t)
		if ev.kind == "audit.entry" { // TestAuditEvents has these
			continue
		}
		state := ev.data["state"]
		if c, ok := ev.data["command"].(map[string]any); ok {
			state = c["state"]
		}
		got = append(got, fmt.Sprint(ev.kind, " ", state, " ", ev.data["counts"]))
	}
	want := []string{
		"command.state sent <nil>",
		"rollout.progress running map[failed:0 pending:0 running:1 skipped:0 succeeded:0 timed_out:0 waiting:0]",
		"rollout.progress running map[failed:0 pending:0 running:1 skipped:0 succeeded:0 timed_out:0 waiting:0]",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// BenchmarkEventLatency: the time from a device's status message to its
// event on a stream, with 1,000 devices of the stream's owner reporting
// telemetry once a second each through a real Mosquitto. It reports the
// median and the 99th percentile; BENCHMARKS.md has the figures.
func BenchmarkEventLatency(b *testing.B) {
	broker := startBroker(b)
	env, _ := newLinkedEnv(b, broker)
	uids := []string{env.alice.device}
	for len(uids) < 1000 {
		uid, err := createDeviceOf(context.Background(), env.st, env.alice.email, "esp32", "devkit", "")
		must(b, err)
		uids = append(uids, uid)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(b, err)
	srv := newHTTPServer(env.srv, env.log, requestReadTimeout)
	go srv.Serve(ln)
	defer srv.Close()
	req, _ := http.NewRequest("GET", "http://"+ln.Addr().String()+"/v1/user/events", nil)
	req.Header.Set("Authorization", "Bearer "+env.alice.token)
	res, err := http.DefaultClient.Do(req)
	if err != nil || res.StatusCode != 200 {
		b.Fatalf("open stream: %v %v", res, err)
	}
	defer res.Body.Close()
	statuses := make(chan model.DeviceStatusEvent, 10_000)
	go func() {
		sc := bufio.NewScanner(res.Body)
		for sc.Scan() {
			var st model.DeviceStatusEvent
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok && json.Unmarshal([]byte(data), &st) == nil {
				statuses <- st
			}
		}
	}()

	reporter := testClient(b, broker, "reporter", "")
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		tick := time.NewTicker(time.Second / time.Duration(len(uids)))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-tick.C:
				reporter.Publish("devices/"+uids[i%len(uids)]+"/telemetry", 0, false, fmt.Sprintf(`{"rssi":%d}`, -40-i%50))
			case <-ctx.Done():
				return
			}
		}
	}()
	time.Sleep(2 * time.Second) // every device has reported once

	sender := testClient(b, broker, "sender", "")
	took := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		uid, status := uids[i%len(uids)], []string{"online", "offline"}[i/len(uids)%2]
		start := time.Now()
		sender.Publish("devices/"+uid+"/status", 0, false, status)
		for st := range statuses {
			if st.UID == uid && string(st.Status) == status {
				break
			}
		}
		took = append(took, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(took[len(took)*99/100].Microseconds())/1000, "p99-ms")
}

// TestMemberUpdatedEvent: a role change goes to the team's streams as
// member.updated, so that the member's open pages redraw their controls;
// so does an invite or a reset link used, so that open Team pages stop
// showing the member, or their reset, as pending.
func TestMemberUpdatedEvent(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	v := newAPIVars(env)
	teamVars(t, env, v)
	base := serveEnv(t, env, requestReadTimeout, 0)
	vic := openStream(t, base, v["vic_token"], "")
	env.want(t, 200, "PATCH", "/v1/user/team/members/"+v["vic"], v["ada_token"], `{"role":"user"}`)
	id, _ := strconv.ParseFloat(v["vic"], 64)
	vic.want(t, "member.updated", map[string]any{"id": id, "name": "Vic", "role": "user"})

	vic.want(t, "audit.entry", map[string]any{"action": "member.update"})
	carol, secret := inviteAs(t, env, v["ada_token"], "carol@example.com", "viewer")
	vic.want(t, "audit.entry", map[string]any{"action": "member.invite"})
	checkAnswer(t, redeem(env, "192.0.2.1:1234", secret, "carol-password"), 200, "")
	id, _ = strconv.ParseFloat(carol, 64)
	vic.want(t, "member.updated", map[string]any{"id": id, "role": "viewer"})

	// A reset link used: open Team pages stop showing it as pending.
	w := env.want(t, 200, "POST", "/v1/user/team/members/"+carol+"/reset", v["ada_token"], nil)
	link := resetURL.FindStringSubmatch(decode(t, w)["reset_url"].(string))
	if link == nil {
		t.Fatalf("reset: %s", w.Body)
	}
	vic.want(t, "audit.entry", map[string]any{"action": "member.reset"})
	code, body := postLink(env, "/v1/auth/reset", map[string]string{"reset": link[1], "password": "carol-new-password", "token_name": "x"})
	checkBody(t, "the reset", code, body, 200, "")
	vic.want(t, "member.updated", map[string]any{"id": id, "name": "New", "role": "viewer"})
}

// TestAuditEvents: each committed audit entry goes to its team's streams
// as audit.entry, a command's with its record; none to another team.
func TestAuditEvents(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	h := env.srv.events
	alice, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	bob, err := h.subscribe(env.bob.id, env.bob.id)
	must(t, err)
	uid := env.alice.device
	env.setStatus(uid, "online")
	env.want(t, 200, "PATCH", "/v1/user/devices/"+uid, env.alice.token, `{"name":"Greenhouse"}`)
	id, _ := decode(t, env.want(t, 200, "POST", "/v1/user/devices/"+uid+"/reboot", env.alice.token, nil))["command_id"].(string)
	var got []string
	for _, f := range h.since(alice) {
		if _, data, ok := strings.Cut(firstFrame([][]byte{f}), "audit.entry "); ok {
			var e model.AuditEntry
			must(t, json.Unmarshal([]byte(data), &e))
			got = append(got, fmt.Sprintf("%d %s %s %s %s", e.ID, e.Actor.Name, e.Action, *e.DeviceUID, e.Detail))
		}
	}
	want := []string{
		`1 Alice device.update ` + uid + ` {"description":null,"name":"Greenhouse","previous_name":"Alice's device"}`,
		`2 Alice command.send ` + uid + ` {"command_id":"` + id + `","kind":"reboot"}`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("audit events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if frames := h.since(bob); len(frames) != 0 {
		t.Errorf("bob's stream got %d events of alice's team: %s", len(frames), firstFrame(frames))
	}
}

// TestFirmwareAuditEvents: the entry of each firmware and library write,
// committed in the write's transaction, goes to the team's streams as
// audit.entry with its id once the write has committed.
func TestFirmwareAuditEvents(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	h := env.srv.events
	alice, err := h.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	uid, image, lib := env.alice.device, []byte("\xe9 an image"), []byte("\xe9 a library image")
	fw := apiUpload(env, env.alice, "fw", image)
	env.want(t, 200, "PATCH", "/v1/user/devices/"+uid+"/firmwares/"+fw, env.alice.token, `{"name":"renamed"}`)
	env.want(t, 200, "POST", "/v1/user/devices/"+uid+"/firmwares/set-target", env.alice.token, map[string]string{"md5": md5Hex(image)})
	if w := env.uploadToLibrary(env.alice, map[string]string{"name": "lib"}, lib); w.Code != 201 {
		t.Fatalf("library upload: %d %s", w.Code, w.Body)
	}
	env.want(t, 200, "DELETE", "/v1/user/firmwares/"+sha256Hex(lib), env.alice.token, nil)
	mustExec(t, env.st, `UPDATE devices SET target_firmware_id = NULL WHERE uid = ?`, uid) // a target cannot be deleted
	env.want(t, 200, "DELETE", "/v1/user/devices/"+uid+"/firmwares/"+fw, env.alice.token, nil)
	var got []string
	for _, f := range h.since(alice) {
		if _, data, ok := strings.Cut(firstFrame([][]byte{f}), "audit.entry "); ok {
			var e model.AuditEntry
			must(t, json.Unmarshal([]byte(data), &e))
			got = append(got, fmt.Sprintf("%d %s %s", e.ID, e.Action, e.Detail))
		}
	}
	libEntry := fmt.Sprintf(`{"md5":"%s","name":"lib","sha256":"%s","version":null}`, md5Hex(lib), sha256Hex(lib))
	want := []string{
		`1 firmware.upload {"firmware_id":` + fw + `,"md5":"` + md5Hex(image) + `","name":"fw"}`,
		`2 firmware.update {"firmware_id":` + fw + `,"name":"renamed"}`,
		`3 firmware.set_target {"md5":"` + md5Hex(image) + `"}`,
		`4 firmware.upload ` + libEntry,
		`5 firmware.delete ` + libEntry,
		`6 firmware.delete {"firmware_id":"` + fw + `"}`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("audit events:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
