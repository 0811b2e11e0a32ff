package main

import (
	"context"
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/store"
)

// The event hub: each team's ring of recent events, the streams
// subscribed to it, and the telemetry coalescing. GET /v1/user/events
// (events.go) writes what it holds.

// eventHub keeps every team's recent events and open streams. Publishing
// never waits for a stream: it appends to the team's ring and wakes the
// streams without blocking. A team gets a ring when its members open their
// first stream (no client can resume from an event before that), and
// loses it ringIdle after their last stream closed. A nil hub hears nothing.
type eventHub struct {
	store eventStore
	now   func() time.Time
	// epoch starts every event id: an id from before a restart gets a reset.
	epoch string
	// writeWait and keepAlive are streamWriteWait and keepAliveEvery;
	// shorter in tests.
	writeWait, keepAlive time.Duration

	// webhooks hears every team's events whether or not a stream is
	// open; the webhook engine (webhook_engine.go) queues what it heard.
	webhooks *webhookTap

	mu    sync.Mutex
	teams map[int64]*teamEvents
	// freed is, for each team whose ring was freed, the id after its
	// newest event: a ring made again counts on past it, so that no id
	// names two events, and a client resuming from before it gets a reset
	// (what happened while the team had no ring was not kept).
	freed map[int64]uint64
}

// teamEvents is one team's ring of recent events, streams, and the
// devices whose telemetry events are held back. Each team counts its own
// events, so an id tells nothing of what other teams do.
type teamEvents struct {
	seq       uint64   // the team's newest event id
	ring      [][]byte // the frames of the newest events, oldest first: ids seq-len(ring)+1 to seq
	bytes     int      // the size of ring's frames, at most eventRingBytes
	streams   map[*stream]bool
	idleSince time.Time // when its last stream closed
	held      map[string]*heldStatus
}

// heldStatus is when a device's last device.status went out, and the
// newest one held back since.
type heldStatus struct {
	sent    time.Time
	pending *model.DeviceStatusEvent
}

// stream is one open stream: the last event id it was given, and a
// wake-up (woken).
type stream struct {
	teamID int64  // the team whose events it gets
	user   int64  // who opened it
	next   uint64 // the newest id written (or skipped by a reset)
	reset  bool   // the next write starts with event: reset
	wake   chan struct{}
}

// eventStore is what the event hub reads of the store: a device's detail
// and a command as its event shows them.
type eventStore interface {
	Device(ctx context.Context, teamID int64, uid string) (*model.Device, error)
	CommandEvent(ctx context.Context, id string) (teamID int64, uid string, c *model.Command, err error)
	Timestamp() string
}

func newEventHub(st eventStore) *eventHub {
	return &eventHub{store: st, now: time.Now, epoch: strconv.FormatInt(time.Now().UnixMilli(), 36), webhooks: newWebhookTap(st.Timestamp),
		writeWait: streamWriteWait, keepAlive: keepAliveEvery, teams: map[int64]*teamEvents{}, freed: map[int64]uint64{}}
}

// webhooksOf is the hub's webhook tap when the team has a webhook; nil otherwise.
func (h *eventHub) webhooksOf(teamID int64) *webhookTap {
	if !h.webhooks.hooked(teamID) {
		return nil
	}
	return h.webhooks
}

// webhookDrops is how many events the webhooks dropped from full queues.
func (h *eventHub) webhookDrops() int64 { return h.webhooks.dropped.Load() }

// woken receives when events for s have come.
func (s *stream) woken() <-chan struct{} { return s.wake }

// streamWaits are how long one write to a stream may take and how often
// an idle stream gets a keep-alive: streamWriteWait and keepAliveEvery,
// shorter in tests.
func (h *eventHub) streamWaits() (writeWait, keepAlive time.Duration) {
	return h.writeWait, h.keepAlive
}

// errTooManyStreams: the user, the team or the service has as many
// streams open as it may (maxStreams, maxTeamStreams, maxAllStreams).
var errTooManyStreams = tooManyAttempts(10 * time.Second)

// subscribe opens a stream of the team's events from now on for user, who
// may have maxStreams open, their team maxTeamStreams, and everyone
// together maxAllStreams.
func (h *eventHub) subscribe(teamID, user int64) (*stream, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	all := 0
	for _, t := range h.teams {
		all += len(t.streams)
	}
	t := h.teams[teamID]
	if t == nil {
		t = &teamEvents{seq: h.freed[teamID], streams: map[*stream]bool{}, held: map[string]*heldStatus{}}
		h.teams[teamID] = t
		delete(h.freed, teamID)
	}
	mine := 0
	for s := range t.streams {
		if s.user == user {
			mine++
		}
	}
	if mine >= maxStreams || len(t.streams) >= maxTeamStreams || all >= maxAllStreams {
		return nil, errTooManyStreams
	}
	s := &stream{teamID: teamID, user: user, next: t.seq, wake: make(chan struct{}, 1)}
	t.streams[s] = true
	return s, nil
}

func (h *eventHub) unsubscribe(s *stream) {
	h.mu.Lock()
	defer h.mu.Unlock()
	t := h.teams[s.teamID]
	delete(t.streams, s)
	if len(t.streams) == 0 {
		t.idleSince = h.now()
	}
}

// resume starts s after the event lastID names, when the ring still
// holds every event since; otherwise s starts with a reset.
func (h *eventHub) resume(s *stream, lastID string) {
	if lastID == "" {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	epoch, n, _ := strings.Cut(lastID, "-")
	seq, err := strconv.ParseUint(n, 10, 64)
	if err != nil || epoch != h.epoch || seq > h.teams[s.teamID].seq {
		s.reset = true
		return
	}
	s.next = seq // since sends a reset instead when the ring no longer reaches back
}

// maxBatch bounds the events one write takes, and so the lock's hold.
const maxBatch = 1000

// since returns the frames s has not been sent yet, oldest first, at
// most maxBatch: a reset first when s asked to resume from too far back
// or fell behind the ring.
func (h *eventHub) since(s *stream) [][]byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	t := h.teams[s.teamID]
	var frames [][]byte
	gone := t.seq - uint64(len(t.ring)) // the newest id the ring does not hold
	if s.reset || s.next < gone {
		s.reset, s.next = false, t.seq
		frames = append(frames, h.frame(s.next, "reset", []byte("{}")))
	}
	for i := s.next - gone; i < uint64(len(t.ring)) && len(frames) < maxBatch; i++ {
		frames = append(frames, t.ring[i])
		s.next++
	}
	return frames
}

func (h *eventHub) frame(id uint64, kind string, data []byte) []byte {
	return []byte("id: " + h.epoch + "-" + strconv.FormatUint(id, 10) + "\nevent: " + kind + "\ndata: " + string(data) + "\n\n")
}

// listening reports whether the team has a ring, that is, had a stream
// lately, or a webhook.
func (h *eventHub) listening(teamID int64) bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	ring := h.teams[teamID] != nil
	h.mu.Unlock()
	return ring || h.webhooksOf(teamID) != nil
}

// publish adds an event for the team's streams, when it has a ring, and
// its webhooks.
func (h *eventHub) publish(teamID int64, kind string, data any) {
	if h == nil {
		return
	}
	b, err := json.Marshal(data)
	if err != nil {
		return // the event types always encode; nothing half-made goes out
	}
	if w := h.webhooksOf(teamID); w != nil {
		w.heard(teamID, kind, b)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if t := h.teams[teamID]; t != nil {
		h.add(t, kind, b)
	}
}

// audited tells the team's streams of an audit entry just committed, so
// that an open audit log shows it at once.
func (h *eventHub) audited(e *model.AuditEntry) { h.publish(e.TeamID, "audit.entry", e) }

// add appends an event to t's ring, drops its oldest events while it
// holds more than eventRing of them or eventRingBytes (always keeping the
// newest), and wakes t's streams; h.mu is held.
func (h *eventHub) add(t *teamEvents, kind string, data []byte) {
	t.seq++
	f := h.frame(t.seq, kind, data)
	t.ring = append(t.ring, f)
	t.bytes += len(f)
	for len(t.ring) > eventRing || t.bytes > eventRingBytes && len(t.ring) > 1 {
		t.bytes -= len(t.ring[0])
		t.ring[0] = nil // the array no longer holds the frame either
		t.ring = t.ring[1:]
	}
	for s := range t.streams {
		select {
		case s.wake <- struct{}{}:
		default: // already woken
		}
	}
}

// devicesChanged publishes device.status for each change, at once for a
// new status and otherwise at most once per coalesceWindow per device
// (tick sends what was held back), and device.updated for a device that
// reported new firmware. A team's webhooks hear each boot and each new
// status, not the telemetry between.
func (h *eventHub) devicesChanged(ctx context.Context, changes []store.DeviceChange) {
	now := h.now()
	var flashed []store.DeviceChange
	hooked := map[int64]bool{}
	for _, c := range changes {
		if w := h.webhooksOf(c.TeamID); w != nil {
			tellWebhooks(w, c)
			hooked[c.TeamID] = true
		}
	}
	h.mu.Lock()
	for _, c := range changes {
		t := h.teams[c.TeamID]
		if c.FirmwareChanged && (t != nil || hooked[c.TeamID]) {
			flashed = append(flashed, c)
		}
		if t == nil {
			continue
		}
		for _, b := range c.Boots {
			data, _ := json.Marshal(b)
			h.add(t, "device.boot", data)
		}
		held := t.held[c.UID]
		if c.StatusChanged || held == nil || now.Sub(held.sent) >= coalesceWindow {
			b, _ := json.Marshal(c.DeviceStatusEvent)
			h.add(t, "device.status", b)
			t.held[c.UID] = &heldStatus{sent: now}
		} else {
			held.pending = &c.DeviceStatusEvent
		}
	}
	h.mu.Unlock()
	for _, c := range flashed {
		h.deviceUpdated(ctx, c.TeamID, c.UID, "current_firmware")
	}
}

// tellWebhooks gives w a device change's boots, and its status when it
// is new.
func tellWebhooks(w *webhookTap, c store.DeviceChange) {
	for _, b := range c.Boots {
		data, _ := json.Marshal(b)
		w.heard(c.TeamID, "device.boot", data)
	}
	if c.StatusChanged {
		data, _ := json.Marshal(c.DeviceStatusEvent)
		w.heard(c.TeamID, "device.status", data)
	}
}

// deviceUpdated publishes device.updated: the device's uid and fields, as
// its Device detail renders them.
func (h *eventHub) deviceUpdated(ctx context.Context, teamID int64, uid string, fields ...string) {
	if !h.listening(teamID) {
		return
	}
	d, err := h.store.Device(ctx, teamID, uid)
	if err != nil {
		return // deleted meanwhile: nothing to tell
	}
	var all map[string]json.RawMessage
	b, _ := json.Marshal(d)
	json.Unmarshal(b, &all)
	data := map[string]json.RawMessage{"uid": all["uid"]}
	for _, f := range fields {
		data[f] = all[f]
	}
	h.publish(teamID, "device.updated", data)
}

// command publishes command.state for a command as recorded: its id,
// kind and state, which the client fetches the command by when it wants
// more. A payload or result may be 64 KiB, and the ring would keep it.
func (h *eventHub) command(teamID int64, uid string, c *model.Command) {
	h.publish(teamID, "command.state", commandStateEvent{uid, commandRef{c.ID, c.Kind, c.State}})
}

// CommandsChanged publishes command.state for each command, read as it
// stands now.
func (h *eventHub) CommandsChanged(ctx context.Context, ids []string) {
	if h == nil || len(ids) == 0 {
		return
	}
	h.mu.Lock()
	anyone := len(h.teams) > 0
	h.mu.Unlock()
	anyone = anyone || h.webhooks.hookedAny()
	if !anyone {
		return
	}
	slices.Sort(ids)
	for _, id := range slices.Compact(ids) {
		if teamID, uid, c, err := h.store.CommandEvent(ctx, id); err == nil && h.listening(teamID) {
			h.command(teamID, uid, c)
		}
	}
}

// progressOf is a rollout's progress, counted from its devices when it
// has them (the engine changes their states in place).
func progressOf(ro *model.Rollout) rolloutProgress {
	p := rolloutProgress{ro.ID, ro.State, map[model.RolloutDeviceState]int{}}
	for _, st := range model.RolloutDeviceStates {
		p.Counts[st] = ro.Counts[st]
		if ro.Devices != nil {
			p.Counts[st] = 0
		}
	}
	for _, d := range ro.Devices {
		p.Counts[d.State]++
	}
	return p
}

// run sends held-back device.status events and frees idle rings, every
// second until ctx is done.
func (h *eventHub) run(ctx context.Context) {
	every(ctx, time.Second, func(context.Context) { h.tick() })
}

func (h *eventHub) tick() {
	now := h.now()
	h.mu.Lock()
	defer h.mu.Unlock()
	for teamID, t := range h.teams {
		if len(t.streams) == 0 && now.Sub(t.idleSince) >= ringIdle {
			h.freed[teamID] = t.seq + 1
			delete(h.teams, teamID)
			continue
		}
		for uid, held := range t.held {
			switch {
			case now.Sub(held.sent) < coalesceWindow:
			case held.pending != nil:
				b, _ := json.Marshal(held.pending)
				h.add(t, "device.status", b)
				held.sent, held.pending = now, nil
			default:
				delete(t.held, uid)
			}
		}
	}
}

// streams is how many streams are open.
func (h *eventHub) streams() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, t := range h.teams {
		n += len(t.streams)
	}
	return n
}
