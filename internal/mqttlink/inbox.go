package mqttlink

import "time"

// The link reads the broker at the broker's pace. The client's reading
// goroutine only appends each device message to the inbox (take); the
// parser goroutine takes them from there in the order they came, parses
// them and queues them for the flusher (handle). A burst then waits in
// the link's memory instead of the broker's outgoing queue, which a
// Mosquitto with its default settings bounds at 1,000 messages per
// client and drops past. The inbox is bounded by bytes: when it is full
// the reading waits, and the broker queues (and at last drops) as before.

const (
	// maxInboxBytes bounds the messages taken but not yet parsed, by
	// their topics, payloads and inboxOverhead each: a minute of 10,000
	// devices' four-series reports, or about 150,000 statuses. A message
	// larger than that is taken when the inbox is empty.
	maxInboxBytes = 16 << 20
	// inboxOverhead is what a message costs in the inbox besides its
	// topic and payload.
	inboxOverhead = 64
)

// message is a device message as the link took it from the broker.
type message struct {
	topic    string
	payload  []byte
	retained bool
	at       time.Time // when it was taken, on Config.Now's clock
}

func (m *message) size() int { return len(m.topic) + len(m.payload) + inboxOverhead }

// take appends a message from the broker to the inbox, stamped with the
// time it is taken, and waits first while the inbox is full. Its caller
// is the client's reading goroutine (SetOrderMatters).
func (l *Link) take(topic string, payload []byte, retained bool) {
	l.received.Add(1)
	m := message{topic: topic, payload: payload, retained: retained}
	l.mu.Lock()
	for l.inboxBytes+m.size() > maxInboxBytes && len(l.inbox) > 0 && !l.stopped {
		l.room.Wait()
	}
	// Stamped under mu, as the flusher reads its clock when it takes the
	// batch (flush, unapplied).
	m.at = l.now()
	l.inbox = append(l.inbox, m)
	l.inboxBytes += m.size()
	l.arrived.Signal()
	l.mu.Unlock()
}

// parseLoop parses the inbox's messages in order, until the link stops
// and the inbox is empty; then it closes parsed.
func (l *Link) parseLoop() {
	defer close(l.parsed)
	for {
		m, ok := l.next()
		if !ok {
			return
		}
		l.parse(m)
	}
}

// parse parses a message next gave, queues it, and marks it done.
func (l *Link) parse(m message) {
	l.handle(m)
	l.mu.Lock()
	l.parsing = time.Time{}
	l.mu.Unlock()
}

// next takes the inbox's oldest message for parsing; it waits while the
// inbox is empty, and returns false when the link has stopped and
// nothing is left.
func (l *Link) next() (message, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.inbox) == 0 {
		if l.stopped {
			return message{}, false
		}
		l.arrived.Wait()
	}
	m := l.inbox[0]
	l.inbox[0] = message{}
	l.inbox = l.inbox[1:]
	l.inboxBytes -= m.size()
	l.parsing = m.at
	l.room.Broadcast()
	return m, true
}

// unapplied is the time before which every message taken has been queued
// for the flusher: when the oldest message still in the inbox or being
// parsed was taken, or now when there is none. The caller holds mu.
func (l *Link) unapplied(now time.Time) time.Time {
	oldest := l.parsing
	if oldest.IsZero() && len(l.inbox) > 0 {
		oldest = l.inbox[0].at
	}
	if oldest.IsZero() || now.Before(oldest) {
		return now
	}
	return oldest
}
