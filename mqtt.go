package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/wire"
)

const (
	// maxDevicePayload is the largest message from a device that is applied.
	maxDevicePayload = 16 << 10
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
	// transaction for all of them.
	flushInterval = 100 * time.Millisecond
	// publishTimeout bounds the wait for the broker's PUBACK of a command.
	publishTimeout = 1500 * time.Millisecond
	// dropLogInterval is how often a non-zero count of dropped messages is logged.
	dropLogInterval = time.Minute
	// nudgeInterval is how often the link writes to the broker while
	// messages arrive (nudge), well within the keepalive.
	nudgeInterval = 10 * time.Second
	// sweepInterval is how often silent devices are checked, and the
	// sweep hooks run (command timeouts).
	sweepInterval = time.Second
)

var (
	errPublishTimeout = errors.New("broker did not acknowledge in time")
	// errNotPublished: the client refused to send, so the message can
	// never arrive (any other publish error may still be followed by it).
	errNotPublished = errors.New("not connected: not sent")
)

// mqttLink is the process's one MQTT client: it publishes commands and
// applies what devices say on P/{uid}/status, P/{uid}/telemetry and
// P/{uid}/result/{id}. It also sets silent devices offline.
type mqttLink struct {
	client       mqtt.Client
	prefix       string
	store        *store
	log          *slog.Logger
	offlineAfter time.Duration // 0: never set a silent device offline

	// connection counts connections and losses; subscribedOn is the
	// newest connection whose subscription is in place. The link is
	// usable while the two are equal.
	connection, subscribedOn atomic.Int64
	received                 atomic.Int64 // messages on the device topics, since start
	watch                    *brokerWatch
	callbacks                callbackGate // the client's calls that may log: close waits for them

	mu          sync.Mutex
	connectedAt time.Time // latest (re)connection, on the store's clock
	pending     map[string]*deviceReport
	results     []commandResult
	room        *sync.Cond       // on mu: signalled when the flusher takes the pending batch, or stops
	stopped     bool             // the flusher has stopped: nobody makes room any more
	drops       map[string]int64 // dropped messages by reason, since start
	dropsLogged time.Time        // when drops were last logged
	dropsSeen   int64            // their total then
	applied     int64            // device reports and results written, since start (metrics.go)
	reconnects  int64            // connections to the broker after the first
	boots       map[bool]int64   // boots recorded since start, by whether each was a crash
	events      eventSink        // nil until listen

	sweepHooks []func(context.Context) // under mu; onSweep

	kick chan struct{}
	stop chan struct{}
	done chan struct{}
}

// eventSink hears what the link applied: the event stream (events.go).
type eventSink interface {
	devicesChanged(ctx context.Context, changes []deviceChange)
	commandsChanged(ctx context.Context, ids []string)
}

// listen makes the link tell e what it applies from now on.
func (l *mqttLink) listen(e eventSink) {
	l.mu.Lock()
	l.events = e
	l.mu.Unlock()
}

// mqttConfig is what the link needs from the configuration.
type mqttConfig struct {
	url, user, password, prefix string
	offlineAfter                time.Duration
}

// newLinkState is a link with nothing connected yet: what newMQTTLink
// starts, and what the tests hand device messages to.
func newLinkState(cfg mqttConfig, st *store, log *slog.Logger) *mqttLink {
	l := &mqttLink{
		prefix:       strings.TrimRight(cfg.prefix, "/"),
		store:        st,
		log:          log,
		offlineAfter: cfg.offlineAfter,
		pending:      map[string]*deviceReport{},
		drops:        map[string]int64{},
		boots:        map[bool]int64{},
		dropsLogged:  st.now(),
		kick:         make(chan struct{}, 1),
		stop:         make(chan struct{}),
		done:         make(chan struct{}),
		watch:        newBrokerWatch(log, cfg.url, cfg.user, st.now),
	}
	l.room = sync.NewCond(&l.mu)
	return l
}

// newMQTTLink creates the link and starts connecting in the background; it
// keeps trying, and subscribes again after every reconnect.
func newMQTTLink(cfg mqttConfig, st *store, log *slog.Logger) *mqttLink {
	l := newLinkState(cfg, st, log)
	opts := mqtt.NewClientOptions().
		AddBroker(cfg.url).
		// Unique per process, so two instances never kick each other off.
		SetClientID("devicehub-" + randomString(12, lowerAlnum)).
		SetUsername(cfg.user).
		SetPassword(cfg.password).
		// A clean session: the broker keeps nothing for us while we are
		// away. A command whose PUBACK is late stays recorded (commands.go):
		// the library may send it again after a reconnect.
		SetCleanSession(true).
		// MQTT 3.1.1 only: without an explicit version paho retries a
		// refused connection with 3.1, which hides the broker's answer.
		SetProtocolVersion(4).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second).
		SetMaxReconnectInterval(5 * time.Second).
		SetConnectTimeout(5 * time.Second).
		// Messages are handed over one at a time, in order, on the
		// client's one reading goroutine: when queue waits for room, the
		// connection is not read, and the broker holds what follows
		// (backpressure instead of dropping).
		SetOrderMatters(true).
		SetKeepAlive(30 * time.Second).
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
				log.Warn("mqtt connection lost", "broker", l.watch.broker, "err", err)
			})
		})
	if wire.IsTLSURL(cfg.url) {
		opts.SetTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12}) // system roots
	}
	l.client = mqtt.NewClient(opts)
	l.client.Connect() // with ConnectRetry it keeps trying in the background
	go l.flushLoop()
	return l
}

// onConnect runs on a goroutine of its own (the client starts one per
// connection), so it may wait for the subscription.
func (l *mqttLink) onConnect(c mqtt.Client) {
	l.log.Info("mqtt connected", "broker", l.watch.broker, "failed_attempts", l.watch.connected())
	l.mu.Lock()
	if !l.connectedAt.IsZero() {
		l.reconnects++
	}
	l.connectedAt = l.store.now()
	l.mu.Unlock()
	l.subscribe(c, l.connection.Add(1))
}

// subscribe subscribes to the device topics, and tries again with a
// growing delay while the broker refuses or does not answer, for as long
// as the connection stays up.
func (l *mqttLink) subscribe(c mqtt.Client, connection int64) {
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
func (l *mqttLink) watchBrokerDrops(c mqtt.Client) {
	c.Subscribe(brokerDropsTopic, 0, func(_ mqtt.Client, m mqtt.Message) {
		l.callbacks.do(func() { l.watch.brokerDropped(m.Payload(), m.Retained()) })
	}).WaitTimeout(10 * time.Second)
}

// trySubscribe subscribes once. Device topics are taken at QoS 0: with a
// clean session QoS 1 adds nothing, and it makes a Mosquitto with its
// default configuration drop everything past its 1,000-message queue.
func (l *mqttLink) trySubscribe(c mqtt.Client) error {
	topics := map[string]byte{
		wire.Topic(l.prefix, "+", wire.StatusKind, ""): 0, wire.Topic(l.prefix, "+", wire.TelemetryKind, ""): 0,
		wire.Topic(l.prefix, "+", wire.ResultKind, "+"): 0,
	}
	t := c.SubscribeMultiple(topics, func(_ mqtt.Client, m mqtt.Message) {
		l.handle(m.Topic(), m.Payload(), m.Retained())
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

// connected reports whether the broker connection is up and the device
// topics are subscribed on it.
func (l *mqttLink) connected() bool {
	return l.client.IsConnectionOpen() && l.subscribedOn.Load() == l.connection.Load()
}

// publish sends payload to P/{uid}/cmd/{id} at QoS 1, not retained, and
// waits a bounded time for the broker's acknowledgement.
func (l *mqttLink) publish(uid, id string, payload []byte) error {
	t := l.client.Publish(wire.Topic(l.prefix, uid, wire.CommandKind, id), 1, false, payload)
	if !t.WaitTimeout(publishTimeout) {
		return errPublishTimeout
	}
	if errors.Is(t.Error(), mqtt.ErrNotConnected) {
		return errNotPublished
	}
	return t.Error()
}

// close stops the link: it disconnects and writes what is pending. When
// it returns, nothing of the link runs or logs any more.
func (l *mqttLink) close() {
	l.callbacks.close()
	l.client.Disconnect(250)
	close(l.stop) // ends subscribe's wait between attempts, and the flusher
	l.callbacks.wait()
	<-l.done
}

// callbackGate holds the MQTT client's calls into us that may log or
// start work (connected, connection lost, its notifications), so that
// closing can wait for them: the client runs each on a goroutine of its
// own and may still call after Disconnect has returned. Once close has
// returned, nothing is logged any more, which a caller that reads the
// log next (a CLI command's stderr) relies on.
type callbackGate struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// do runs f unless close has begun; wait waits for it.
func (g *callbackGate) do(f func()) {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return
	}
	g.wg.Add(1)
	g.mu.Unlock()
	defer g.wg.Done()
	f()
}

// close lets no more calls in.
func (g *callbackGate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// closing reports whether close has begun: a call that fails then
// failed because the connection is being closed, and says nothing.
func (g *callbackGate) closing() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.closed
}

// wait waits for the calls let in before close to end.
func (g *callbackGate) wait() { g.wg.Wait() }

// handle applies one message from a device topic. Anything malformed is
// dropped and counted; nothing here can fail the process.
func (l *mqttLink) handle(topic string, payload []byte, retained bool) {
	l.received.Add(1)
	uid, kind, id, ok := wire.ParseTopic(l.prefix, topic)
	if !ok || len(uid) > 128 || len(payload) > maxDevicePayload {
		l.drop("bad_topic_or_size")
		return
	}
	var rep deviceReport // a result is a sign of life too: an empty report
	var res *commandResult
	switch {
	case kind == wire.ResultKind && id != "":
		r, ok := wire.ParseResult(payload)
		if !ok {
			l.drop("bad_result")
			return
		}
		res = &commandResult{uid: uid, id: id, Result: r}
	case kind == wire.StatusKind && id == "":
		s, ok := wire.ParseStatus(payload)
		if !ok {
			l.drop("bad_status")
			return
		}
		rep.status = &s
	case kind == wire.TelemetryKind && id == "":
		t, bad, ok := wire.ParseTelemetry(payload)
		l.dropMany("bad_telemetry", bad)
		if !ok {
			return
		}
		rep.addHealth(&t, l.store.now())
		rep.Telemetry = t
	default:
		l.drop("bad_topic_or_size")
		return
	}
	rep.seen = l.store.timestamp()
	rep.live = !retained
	l.queue(uid, &rep, res)
}

// queue merges rep into the device's pending report and adds res (when
// not nil) to the pending results, together, so that one flush writes a
// result and the sign of life it is. It wakes the flusher at once for a
// result or a status, which someone may be waiting for or watching
// (events.go), and early when many devices are waiting; telemetry waits
// for the next tick.
//
// It never drops a message for want of room: while the batch is full it
// waits until the flusher has taken it. Its caller is the MQTT client's
// reading goroutine (SetOrderMatters), so the wait stops the reading of
// the broker connection, and TCP's flow control holds the broker back.
func (l *mqttLink) queue(uid string, rep *deviceReport, res *commandResult) {
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
		p = &deviceReport{}
		l.pending[uid] = p
	}
	p.merge(rep)
	n := len(l.pending)
	l.mu.Unlock()
	if res != nil || rep.status != nil || n >= maxPendingDevices/2 {
		l.wakeFlusher()
	}
}

// full reports whether the pending batch has no room for a report of uid
// (with a result: withResult). The caller holds mu.
func (l *mqttLink) full(uid string, withResult bool) bool {
	return (withResult && len(l.results) >= maxPendingResults) ||
		(l.pending[uid] == nil && len(l.pending) >= maxPendingDevices)
}

// wakeFlusher makes the flusher run now instead of at its next tick.
func (l *mqttLink) wakeFlusher() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// drop counts a message that was not applied, by reason.
func (l *mqttLink) drop(reason string) { l.dropMany(reason, 1) }

func (l *mqttLink) dropMany(reason string, n int) {
	if n == 0 {
		return
	}
	l.mu.Lock()
	l.drops[reason] += int64(n)
	l.mu.Unlock()
}

// logDrops logs the dropped-message counts since start, by reason, at
// most once per dropLogInterval of the store's clock and only when more
// were dropped since the last such line.
func (l *mqttLink) logDrops() {
	now := l.store.now()
	l.mu.Lock()
	var total int64
	args := []any{}
	for reason, n := range l.drops {
		total += n
		args = append(args, reason, n)
	}
	due := now.Sub(l.dropsLogged) >= dropLogInterval && total > l.dropsSeen
	if due {
		l.dropsLogged, l.dropsSeen = now, total
	}
	l.mu.Unlock()
	if due {
		l.log.Warn("mqtt messages dropped since start", append(args, "total", total)...)
	}
}

func (l *mqttLink) flushLoop() {
	defer close(l.done)
	t := time.NewTicker(flushInterval)
	defer t.Stop()
	var swept, nudged time.Time
	var received int64
	for {
		select {
		case <-t.C:
		case <-l.kick:
		case <-l.stop:
			l.mu.Lock()
			l.stopped = true
			l.room.Broadcast()
			l.mu.Unlock()
			l.flush()
			return
		}
		l.flush()
		l.logDrops()
		if time.Since(swept) >= sweepInterval {
			l.sweep()
			swept = time.Now()
		}
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
func (l *mqttLink) nudge(before int64) int64 {
	now := l.received.Load()
	if now != before {
		l.client.Unsubscribe(l.prefix + "/nudge") // its answer may come after the backlog: not awaited
	}
	return now
}

// flush writes every pending report and result in one transaction.
func (l *mqttLink) flush() {
	l.mu.Lock()
	reports, results := l.pending, l.results
	if len(reports) == 0 && len(results) == 0 {
		l.mu.Unlock()
		return
	}
	l.pending, l.results = make(map[string]*deviceReport, len(reports)), nil
	events := l.events
	l.room.Broadcast()
	l.mu.Unlock()

	ctx := context.Background()
	a, err := l.store.applyDeviceMessages(ctx, reports, results)
	if err != nil {
		l.log.Error("apply device messages", "devices", len(reports), "results", len(results), "err", err)
		l.dropMany("write_failed", len(reports)+len(results))
		return
	}
	l.dropMany("unknown_device", a.unknown)
	l.dropMany("unknown_or_finished_command", a.rejected)
	l.dropMany("series_limit", a.unkept)
	l.mu.Lock()
	l.applied += int64(len(a.devices) + len(results) - a.rejected)
	for _, c := range a.devices {
		for _, b := range c.boots {
			l.boots[b.Crash]++
		}
	}
	l.mu.Unlock()
	if events != nil {
		events.devicesChanged(ctx, a.devices)
		events.commandsChanged(ctx, a.commands)
	}
}

// onSweep runs f in every sweep, right after a flush: whatever devices
// said before the sweep is written before f runs.
func (l *mqttLink) onSweep(f func(context.Context)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sweepHooks = append(l.sweepHooks, f)
}

// sweep runs the sweep hooks, then sets devices offline that have said
// nothing for offlineAfter, counted from no earlier than the latest
// connection to the broker: while the link is down, or just back, silence
// proves nothing.
func (l *mqttLink) sweep() {
	ctx := context.Background()
	l.mu.Lock()
	hooks := l.sweepHooks
	l.mu.Unlock()
	for _, f := range hooks {
		f(ctx)
	}
	if l.offlineAfter <= 0 || !l.connected() {
		return
	}
	cutoff := l.store.now().Add(-l.offlineAfter)
	l.mu.Lock()
	recent, events := l.connectedAt.After(cutoff), l.events
	l.mu.Unlock()
	if recent {
		return
	}
	if changed, err := l.store.markSilentOffline(ctx, cutoff); err != nil {
		l.log.Error("mark silent devices offline", "err", err)
	} else if len(changed) > 0 {
		l.log.Info("devices silent for too long set offline", "devices", len(changed), "after", l.offlineAfter)
		if events != nil {
			events.devicesChanged(ctx, changed)
		}
	}
}
