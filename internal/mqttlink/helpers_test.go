package mqttlink

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"devicehub/internal/brokertest"
)

// The broker, its clients and the log capture are brokertest's, which the
// server's tests share.
var (
	must        = brokertest.Must
	eventually  = brokertest.Eventually
	publishWait = brokertest.PublishWait
)

// testClock is a settable clock for a link (Config.Now).
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock {
	return &testClock{t: time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)}
}

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// memSink is a Sink that keeps each device's status and signal in memory;
// every uid is a known device, and no command is (its results are
// rejected). hold makes its Apply wait, as a store whose writer is busy.
type memSink struct {
	busy    sync.Mutex   // held while applying, and by hold
	entered atomic.Int64 // calls of Apply, counted before they wait for busy
	mu      sync.Mutex
	status  map[string]string
	rssi    map[string]float64
}

func newMemSink() *memSink {
	return &memSink{status: map[string]string{}, rssi: map[string]float64{}}
}

func (s *memSink) Apply(_ context.Context, reports map[string]*Report, results []Result) (Applied, error) {
	s.entered.Add(1)
	s.busy.Lock()
	defer s.busy.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid, r := range reports {
		if r.Status != nil {
			s.status[uid] = *r.Status
		}
		if r.RSSI != nil {
			s.rssi[uid] = *r.RSSI
		}
	}
	return Applied{Devices: len(reports), Rejected: len(results)}, nil
}

// hold makes Apply wait until release, which may be called again. Defer
// it too: the link's Close waits for its flusher, so a test that stopped
// before it released would hang in its clean-up.
func (s *memSink) hold() (release func()) {
	s.busy.Lock()
	return sync.OnceFunc(s.busy.Unlock)
}

// statusOf and rssiOf are what uid last reported.
func (s *memSink) statusOf(uid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status[uid]
}

func (s *memSink) rssiOf(uid string) float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rssi[uid]
}

// count is how many devices last reported status.
func (s *memSink) count(status string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, st := range s.status {
		if st == status {
			n++
		}
	}
	return n
}

// watchedLink is a link to url, as user with password, on a test clock,
// whose log the test reads; it writes into a memSink and is closed at
// cleanup.
func watchedLink(t *testing.T, url, user, password string) (*Link, *testClock, *brokertest.LogBuffer) {
	t.Helper()
	clock := newTestClock()
	logger, log := brokertest.CaptureLogs(t)
	l := New(Config{Broker: Broker{URL: url, User: user, Password: password, Prefix: "devices"},
		Sink: newMemSink(), Now: clock.now, Log: logger})
	t.Cleanup(l.Close) // CaptureLogs shows the log if the test fails
	return l, clock, log
}

// linkTo is a link to b that writes into sink, once it has connected.
func linkTo(t *testing.T, b *brokertest.Broker, sink Sink) *Link {
	t.Helper()
	logger, _ := brokertest.CaptureLogs(t)
	l := New(Config{Broker: Broker{URL: b.URL(), Prefix: "devices"}, Sink: sink, Now: newTestClock().now, Log: logger})
	t.Cleanup(l.Close)
	eventually(t, 5*time.Second, "the link to connect", l.Connected)
	return l
}

// pendingOf returns what the link holds for uid, unwritten, and the
// number of devices pending.
func pendingOf(l *Link, uid string) (Report, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if p := l.pending[uid]; p != nil {
		return *p, len(l.pending)
	}
	return Report{}, len(l.pending)
}

// dropTotal is how many device messages the link has dropped since start.
func dropTotal(l *Link) int64 {
	var n int64
	for _, c := range l.Stats().Drops {
		n += c
	}
	return n
}
