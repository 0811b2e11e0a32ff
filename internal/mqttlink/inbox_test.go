package mqttlink

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// inboxLink is a link with no broker, no parser and no flusher running,
// on clock, writing into sink: the test takes, parses and flushes.
func inboxLink(clock *testClock, sink Sink) *Link {
	return newLink(Config{Broker: Broker{Prefix: "devices"}, Sink: sink, Now: clock.now, Log: slog.New(slog.DiscardHandler)})
}

// TestAwaitAppliedCountsTheInbox: a message taken before t but still in
// the inbox, unparsed, is not applied: a flush meanwhile does not let
// AwaitApplied(t) return, so that a result in the inbox still wins over a
// time-out decided at t. Once parsed and flushed, it does.
func TestAwaitAppliedCountsTheInbox(t *testing.T) {
	clock, sink := newTestClock(), newMemSink()
	l := inboxLink(clock, sink)
	l.take("devices/esp32_a/status", []byte("online"), false)
	clock.advance(time.Second)
	decided := clock.now()
	l.flush()

	ended, cancel := context.WithCancel(context.Background())
	cancel() // AwaitApplied answers at once: applied, or ctx's error
	if err := l.AwaitApplied(ended, decided); err == nil {
		t.Fatal("AwaitApplied returned while the status was in the inbox")
	}
	m, _ := l.next()
	l.parse(m)
	l.flush()
	if err := l.AwaitApplied(ended, decided); err != nil {
		t.Fatalf("AwaitApplied after the flush: %v", err)
	}
	if got := sink.statusOf("esp32_a"); got != "online" {
		t.Errorf("status %q, want online", got)
	}
}

// TestInboxBounded: the reading waits while the inbox holds
// maxInboxBytes, and goes on once the parser takes a message.
func TestInboxBounded(t *testing.T) {
	l := inboxLink(newTestClock(), newMemSink())
	topic := "devices/esp32_a/telemetry"
	payload := []byte(`{"rssi":-61,"note":"` + strings.Repeat("x", 4000) + `"}`)
	per := (&message{topic: topic, payload: payload}).size()
	fits := maxInboxBytes / per
	for range fits {
		l.take(topic, payload, false)
	}
	took := make(chan struct{})
	go func() {
		l.take(topic, payload, false)
		close(took)
	}()
	eventually(t, 10*time.Second, "the next message read", func() bool { return l.received.Load() == int64(fits+1) })
	l.mu.Lock()
	held, bytes := len(l.inbox), l.inboxBytes
	l.mu.Unlock()
	if held != fits || bytes > maxInboxBytes {
		t.Fatalf("inbox holds %d messages, %d bytes; want %d, at most %d", held, bytes, fits, maxInboxBytes)
	}
	l.next()
	<-took
}
