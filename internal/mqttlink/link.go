// Package mqttlink is devicehub's MQTT side: the link, the process's one
// MQTT client, which publishes commands and hands what devices say to the
// server in batches (Sink); and broker logins (Logins), which manage the
// devices' Mosquitto clients over the dynamic security plugin on a
// connection of their own. It knows nothing of HTTP nor of the server's
// database: the server implements Sink.
package mqttlink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/history"
	"devicehub/internal/wire"
)

const (
	// maxPendingDevices bounds the reports held between two flushes, the
	// largest batch: when it is full, the link stops reading from the
	// broker until the flusher takes it (queue), so neither a restart's
	// million retained statuses nor a flood for made-up uids grows memory
	// past it.
	maxPendingDevices = 50_000
	// maxPendingResults bounds the command results held between two
	// flushes, in the same way.
	maxPendingResults = 50_000
	// flushInterval is how often device reports are written, in one
	// transaction for all of them, at the most: after a flush the
	// flusher rests flushRest times as long as the flush took, so that
	// in a burst it writes fewer, larger batches (a device's messages
	// merged into one write) and leaves the rest of the time to reading
	// and parsing. A result, a status or a half-full batch is written at
	// once all the same (queue). The rest is at most maxFlushRest, so
	// that after a slow flush (a disk that stalls) telemetry, and
	// AwaitApplied's callers (a command's time-out), wait no longer.
	flushInterval = 100 * time.Millisecond
	flushRest     = 4
	maxFlushRest  = time.Second
	// publishTimeout bounds the wait for the broker's PUBACK of a command.
	publishTimeout = 1500 * time.Millisecond
	// dropLogInterval is how often a non-zero count of dropped messages is logged.
	dropLogInterval = time.Minute
	// nudgeInterval is how often the link writes to the broker while
	// messages arrive (nudge), well within the keepalive.
	nudgeInterval = 10 * time.Second
)

var (
	errPublishTimeout = errors.New("broker did not acknowledge in time")
	// ErrNotPublished: the client refused to send, so the message can
	// never arrive (any other publish error may still be followed by it).
	ErrNotPublished = errors.New("not connected: not sent")
	// ErrClosed: the link is closed, and applies nothing more.
	ErrClosed = errors.New("link closed")
)

// Sink is where the link hands what devices report; the server implements
// it over its database (the link's only way there) and tells its watchers
// what changed.
type Sink interface {
	// Apply writes the reports (one per device, by uid) and the results
	// (in the order they came) in one transaction, each alone: one that
	// fails to write is left out and named in Applied.Failed, and the
	// rest are written. An error drops them all.
	Apply(ctx context.Context, reports map[string]*Report, results []Result) (Applied, error)
}

// Applied is what Sink.Apply did.
type Applied struct {
	Unknown  int // reports that named no known device (dropped: unknown_device)
	Rejected int // results that matched no unfinished command of their device (dropped: unknown_or_finished_command)
	Devices  int // devices the reports changed
	Results  int // results written
	Unkept   int // samples left out: their device has as many series as it may (dropped: series_limit)
	// Boots and Crashes count the boots the reports told of that were
	// recorded (a boot told twice is recorded once), and of them crashes.
	Boots, Crashes int
	// Failed are the reports and results that failed to write, each
	// undone alone while the rest were written, each error naming its
	// device (dropped: write_failed). They are not tried again: the
	// device's next message is a report of its own.
	Failed []error
	// Resend are commands to publish again (same topic, same id): the
	// link publishes them once the batch is written, without waiting.
	Resend []Command
}

// Command is a command for a device to publish on P/{uid}/cmd/{id}.
type Command struct {
	UID, ID string
	Payload []byte
}

// Config is what New builds a link from.
type Config struct {
	Broker
	Sink Sink
	// Now is the clock reports are stamped with (the server's database's).
	Now func() time.Time
	Log *slog.Logger
}

// Stats are the link's counts since it started.
type Stats struct {
	Connected  bool             // as Connected says
	Applied    int64            // device reports and results written
	Reconnects int64            // connections to the broker after the first
	Drops      map[string]int64 // messages dropped, by reason; every reason, 0 included
	// Boots and Crashes are the boots devices told of that were recorded,
	// and of them crashes (Applied.Boots, Applied.Crashes).
	Boots, Crashes int64
}

// Link is the process's one MQTT client: it publishes commands and
// applies what devices say on P/{uid}/status, P/{uid}/telemetry and
// P/{uid}/result/{id}, through its Sink.
type Link struct {
	client    mqtt.Client
	prefix    string
	sink      Sink
	now       func() time.Time
	log       *slog.Logger
	watch     *brokerWatch
	callbacks callbackGate // the client's calls that may log: close waits for them

	// connection counts connections and losses; subscribedOn is the
	// newest connection whose subscription is in place. The link is
	// usable while the two are equal.
	connection, subscribedOn atomic.Int64
	received                 atomic.Int64 // messages on the device topics, since start

	mu          sync.Mutex
	connectedAt time.Time // latest (re)connection, on the Now clock
	inbox       []message // taken from the broker, not yet parsed (inbox.go)
	inboxBytes  int       // their sizes
	parsing     time.Time // when the message being parsed was taken; zero when none is
	arrived     *sync.Cond
	pending     map[string]*Report
	results     []Result
	room        *sync.Cond       // on mu: signalled when the parser or the flusher makes room, or the link stops
	stopped     bool             // the flusher has stopped: nobody makes room any more
	drops       map[string]int64 // dropped messages by reason, since start
	dropsLogged time.Time        // when drops were last logged
	dropsSeen   int64            // their total then
	applied     int64            // device reports and results written, since start
	reconnects  int64            // connections to the broker after the first
	boots       int64            // boots recorded, since start
	crashes     int64            // of them crashes
	// appliedThrough: every message taken before it has been applied (or
	// dropped); advanced is closed, and replaced, when it moves on.
	appliedThrough time.Time
	advanced       chan struct{}

	kick   chan struct{}
	stop   chan struct{}
	parsed chan struct{} // closed when the parser has emptied the inbox after the stop
	done   chan struct{}
}

// newLink is a link with nothing connected yet: what New connects and
// Offline hands messages to.
func newLink(cfg Config) *Link {
	l := &Link{
		prefix:      cfg.prefix(),
		sink:        cfg.Sink,
		now:         cfg.Now,
		log:         cfg.Log,
		pending:     map[string]*Report{},
		drops:       map[string]int64{},
		dropsLogged: cfg.Now(),
		advanced:    make(chan struct{}),
		kick:        make(chan struct{}, 1),
		stop:        make(chan struct{}),
		parsed:      make(chan struct{}),
		done:        make(chan struct{}),
		watch:       newBrokerWatch(cfg.Log, cfg.URL, cfg.User, cfg.Now),
	}
	l.room = sync.NewCond(&l.mu)
	l.arrived = sync.NewCond(&l.mu)
	// Not usable until a first subscription: paho shows the connection
	// open before onConnect has counted it.
	l.connection.Store(1)
	return l
}

// New creates the link and starts connecting in the background; it keeps
// trying, and subscribes again after every reconnect.
func New(cfg Config) *Link {
	l := newLink(cfg)
	opts := clientOptions(cfg.Broker, "devicehub-").
		// Messages are handed over one at a time, in order, on the
		// client's one reading goroutine: when take waits for room, the
		// connection is not read, and the broker holds what follows.
		SetOrderMatters(true).
		// The broker answers a ping after everything it queued for us
		// before it; nudge keeps pings from being sent into a backlog,
		// and this is the margin for one sent just before it.
		SetPingTimeout(30 * time.Second).
		SetWriteTimeout(5 * time.Second).
		SetOnConnectHandler(func(c mqtt.Client) { l.callbacks.do(func() { l.onConnect(c) }) }).
		SetConnectionNotificationHandler(func(c mqtt.Client, n mqtt.ConnectionNotification) {
			l.callbacks.do(func() { l.watch.notify(c, n) })
		}).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) {
			l.callbacks.do(func() {
				l.connection.Add(1)
				l.log.Warn("mqtt connection lost", "broker", l.watch.broker, "err", err)
			})
		})
	l.client = mqtt.NewClient(opts)
	l.client.Connect() // with ConnectRetry it keeps trying in the background
	go l.parseLoop()
	go l.flushLoop()
	return l
}

// onConnect runs on a goroutine of its own (the client starts one per
// connection), so it may wait for the subscription.
func (l *Link) onConnect(c mqtt.Client) {
	l.log.Info("mqtt connected", "broker", l.watch.broker, "failed_attempts", l.watch.connected())
	l.mu.Lock()
	if !l.connectedAt.IsZero() {
		l.reconnects++
	}
	l.connectedAt = l.now()
	l.mu.Unlock()
	l.subscribe(c, l.connection.Add(1))
}

// subscribe subscribes to the device topics, and tries again with a
// growing delay while the broker refuses or does not answer, for as long
// as the connection stays up.
func (l *Link) subscribe(c mqtt.Client, connection int64) {
	current := func() bool { return c.IsConnectionOpen() && l.connection.Load() == connection }
	l.watchBrokerDrops(c)
	for delay := time.Second; current(); delay = min(2*delay, 30*time.Second) {
		began, read := time.Now(), l.received.Load()
		err := l.trySubscribe(c)
		if err == nil {
			l.log.Info("mqtt subscribed", "messages_before_answer", l.received.Load()-read,
				"took", time.Since(began).Round(time.Millisecond))
			// Never lower it: a subscribe left over from a lost connection
			// must not undo a newer one.
			for old := l.subscribedOn.Load(); old < connection; old = l.subscribedOn.Load() {
				if l.subscribedOn.CompareAndSwap(old, connection) {
					break
				}
			}
			return
		}
		if l.callbacks.closing() {
			return // it failed because close disconnected
		}
		l.log.Error("mqtt subscribe failed", "err", err, "retry_in", delay)
		select {
		case <-time.After(delay):
		case <-l.stop:
			return
		}
	}
}

// watchBrokerDrops subscribes, best effort, to Mosquitto's count of the
// messages it dropped (brokerDropped), before the device topics, so that
// its retained copy is the count before their retained statuses. Another
// broker, or one whose ACL refuses $SYS, just goes without.
func (l *Link) watchBrokerDrops(c mqtt.Client) {
	c.Subscribe(brokerDropsTopic, 0, func(_ mqtt.Client, m mqtt.Message) {
		l.callbacks.do(func() { l.watch.brokerDropped(m.Payload(), m.Retained()) })
	}).WaitTimeout(10 * time.Second)
}

// trySubscribe subscribes once. Device topics are taken at QoS 0: with a
// clean session QoS 1 adds nothing, and it makes a Mosquitto with its
// default configuration drop everything past its 1,000-message queue.
func (l *Link) trySubscribe(c mqtt.Client) error {
	topics := map[string]byte{
		wire.Topic(l.prefix, "+", wire.StatusKind, ""): 0, wire.Topic(l.prefix, "+", wire.TelemetryKind, ""): 0,
		wire.Topic(l.prefix, "+", wire.ResultKind, "+"): 0,
	}
	t := c.SubscribeMultiple(topics, func(_ mqtt.Client, m mqtt.Message) {
		l.take(m.Topic(), m.Payload(), m.Retained())
	})
	// A broker may send the retained messages before its SUBACK: a
	// million statuses take longer than any fixed wait. While they keep
	// coming, the answer is on its way.
	for n := l.received.Load(); !t.WaitTimeout(10 * time.Second); n = l.received.Load() {
		if l.received.Load() == n {
			return errors.New("no answer from the broker in 10 s")
		}
	}
	if err := t.Error(); err != nil {
		return err
	}
	// A refused topic shows only in the granted QoS (0x80), not in Error().
	for topic, qos := range t.(*mqtt.SubscribeToken).Result() {
		if qos == 0x80 {
			return fmt.Errorf("broker refused the subscription to %s", topic)
		}
	}
	return nil
}

// Connected reports whether the broker connection is up and the device
// topics are subscribed on it.
func (l *Link) Connected() bool {
	return l.client != nil && l.client.IsConnectionOpen() && l.subscribedOn.Load() == l.connection.Load()
}

// ConnectedSince is when the connection that is up (Connected) was made,
// on the Now clock; zero while the link is not connected.
func (l *Link) ConnectedSince() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.Connected() {
		return time.Time{}
	}
	return l.connectedAt
}

// Publish sends payload to P/{uid}/cmd/{id} at QoS 1, not retained, and
// waits a bounded time for the broker's acknowledgement. ErrNotPublished
// means it was not sent; after any other error it may still arrive.
func (l *Link) Publish(uid, id string, payload []byte) error {
	t := l.client.Publish(wire.Topic(l.prefix, uid, wire.CommandKind, id), 1, false, payload)
	if !t.WaitTimeout(publishTimeout) {
		return errPublishTimeout
	}
	if errors.Is(t.Error(), mqtt.ErrNotConnected) {
		return ErrNotPublished
	}
	return t.Error()
}

// AwaitApplied returns once every message the link took before t (on the
// Now clock) has been applied through the Sink or dropped; a result that
// came before t then always wins over a time-out decided at t. It returns
// ctx's error when ctx ends first, ErrClosed when the link does.
func (l *Link) AwaitApplied(ctx context.Context, t time.Time) error {
	for {
		l.mu.Lock()
		through, advanced := l.appliedThrough, l.advanced
		l.mu.Unlock()
		if !through.Before(t) {
			return nil
		}
		select {
		case <-advanced:
		case <-ctx.Done():
			return ctx.Err()
		case <-l.done:
			return ErrClosed
		}
	}
}

// Stats returns the link's counts.
func (l *Link) Stats() Stats {
	l.mu.Lock()
	s := Stats{Applied: l.applied, Reconnects: l.reconnects, Drops: maps.Clone(l.drops), Boots: l.boots, Crashes: l.crashes}
	l.mu.Unlock()
	for _, r := range dropReasons {
		s.Drops[r] += 0
	}
	s.Connected = l.Connected()
	return s
}

// Close stops the link: it disconnects and writes what is pending. When
// it returns, nothing of the link runs or logs any more.
func (l *Link) Close() {
	l.callbacks.close()
	l.client.Disconnect(250)
	close(l.stop) // ends subscribe's wait between attempts, and the flusher
	l.callbacks.wait()
	<-l.done
}

// handle parses one message from a device topic and queues it. Anything
// malformed is dropped and counted; nothing here can fail the process.
func (l *Link) handle(m message) {
	uid, kind, id, ok := wire.ParseTopic(l.prefix, m.topic)
	payload := m.payload
	if !ok || len(uid) > maxUIDLength || len(payload) > wire.MaxPayload {
		l.drop(dropBadTopic)
		return
	}
	var rep Report // a result is a sign of life too: an empty report
	var res *Result
	switch {
	case kind == wire.ResultKind && id != "":
		r, ok := wire.ParseResult(payload)
		if !ok {
			l.drop(dropBadResult)
			return
		}
		res = &Result{UID: uid, ID: id, Result: r}
	case kind == wire.StatusKind && id == "":
		s, ok := wire.ParseStatus(payload)
		if !ok {
			l.drop(dropBadStatus)
			return
		}
		rep.Status = &s
	case kind == wire.TelemetryKind && id == "":
		t, bad, ok := wire.ParseTelemetry(payload)
		l.dropMany(dropBadTelemetry, bad)
		if !ok {
			return
		}
		rep.History, rep.Boots = history.Fold(nil, nil, &t, m.at)
		rep.Telemetry = t
	default:
		l.drop(dropBadTopic)
		return
	}
	rep.Live, rep.Seen = !m.retained, m.at
	l.queue(uid, &rep, res)
}

// queue merges rep into the device's pending report and adds res (when not nil) to the pending results,
// together, so that one flush writes a result and the sign of life it
// is. It wakes the flusher at once for a result or a status, which
// someone may be waiting for or watching, and early when many devices are
// waiting; telemetry waits for the next tick.
//
// It never drops a message for want of room: while the batch is full it
// waits until the flusher has taken it, and the inbox fills meanwhile.
func (l *Link) queue(uid string, rep *Report, res *Result) {
	l.mu.Lock()
	for l.full(uid, res != nil) && !l.stopped {
		l.wakeFlusher()
		l.room.Wait()
	}
	if res != nil {
		l.results = append(l.results, *res)
	}
	p := l.pending[uid]
	if p == nil {
		p = &Report{}
		l.pending[uid] = p
	}
	p.merge(rep)
	n := len(l.pending)
	l.mu.Unlock()
	if res != nil || rep.Status != nil || n >= maxPendingDevices/2 {
		l.wakeFlusher()
	}
}

// full reports whether the pending batch has no room for a report of uid
// (with a result: withResult). The caller holds mu.
func (l *Link) full(uid string, withResult bool) bool {
	return (withResult && len(l.results) >= maxPendingResults) ||
		(l.pending[uid] == nil && len(l.pending) >= maxPendingDevices)
}

// wakeFlusher makes the flusher run now instead of at its next tick.
func (l *Link) wakeFlusher() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

func (l *Link) flushLoop() {
	defer close(l.done)
	t := time.NewTimer(flushInterval)
	defer t.Stop()
	var nudged time.Time
	var received int64
	for {
		select {
		case <-t.C:
		case <-l.kick:
		case <-l.stop:
			l.mu.Lock()
			l.stopped = true
			l.room.Broadcast()
			l.arrived.Broadcast()
			l.mu.Unlock()
			<-l.parsed
			l.flush()
			return
		}
		began := time.Now()
		l.flush()
		t.Reset(min(max(flushInterval, flushRest*time.Since(began)), maxFlushRest))
		l.logDrops()
		if time.Since(nudged) >= nudgeInterval {
			received = l.nudge(received)
			nudged = time.Now()
		}
	}
}

// nudge keeps the client from pinging into a backlog. The broker answers
// a ping after everything it queued for us before it: after a subscribe,
// every device's retained status. A ping sent into a million of them
// times out (seen: 70 s into a restart), the client drops the connection,
// and the next subscribe brings the million again, forever. The client
// pings only after a keepalive without writing, so while messages arrive
// (received moved on from before) the link writes: an UNSUBSCRIBE from a
// topic it never subscribed to, which changes nothing. When messages
// stop, so do the nudges, and the client's pings find a dead connection
// as before. It returns the received count now.
func (l *Link) nudge(before int64) int64 {
	now := l.received.Load()
	if now != before {
		l.client.Unsubscribe(l.prefix + "/nudge") // its answer may come after the backlog: not awaited
	}
	return now
}

// flush writes every pending report and result in one transaction, and
// then moves appliedThrough on to when it took them, or to when the
// oldest message not yet queued was taken.
func (l *Link) flush() {
	l.mu.Lock()
	reports, results, took := l.pending, l.results, l.unapplied(l.now())
	if len(reports) == 0 && len(results) == 0 {
		l.advance(took)
		l.mu.Unlock()
		return
	}
	l.pending, l.results = make(map[string]*Report, len(reports)), nil
	l.room.Broadcast()
	l.mu.Unlock()

	a, err := l.sink.Apply(context.Background(), reports, results)
	if err != nil {
		l.log.Error("apply device messages", "devices", len(reports), "results", len(results), "err", err)
		l.dropMany(dropWriteFailed, len(reports)+len(results))
	} else {
		l.dropMany(dropUnknownDevice, a.Unknown)
		l.dropMany(dropRejectedResult, a.Rejected)
		l.dropMany(dropSeriesLimit, a.Unkept)
		l.dropMany(dropWriteFailed, len(a.Failed))
	}
	l.resend(a.Resend)
	if len(a.Failed) > 0 {
		l.log.Error("device messages not written, the rest of their batch was", "failed", len(a.Failed),
			"devices", len(reports), "results", len(results), "first", a.Failed[0])
	}
	l.mu.Lock()
	if err == nil {
		l.applied += int64(a.Devices + a.Results)
		l.boots += int64(a.Boots)
		l.crashes += int64(a.Crashes)
	}
	l.advance(took)
	l.mu.Unlock()
}

// resend publishes the commands again at QoS 1, without waiting for the
// broker (the flush must not stall); an Offline link has no client.
func (l *Link) resend(commands []Command) {
	for _, c := range commands {
		if l.client != nil {
			l.client.Publish(wire.Topic(l.prefix, c.UID, wire.CommandKind, c.ID), 1, false, c.Payload)
			l.log.Info("command sent again to a device that rebooted without answering it", "uid", c.UID, "command", c.ID)
		}
	}
}

// advance moves appliedThrough on to t and wakes AwaitApplied. The caller
// holds mu.
func (l *Link) advance(t time.Time) {
	if t.After(l.appliedThrough) {
		l.appliedThrough = t
		close(l.advanced)
		l.advanced = make(chan struct{})
	}
}
