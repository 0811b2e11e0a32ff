package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Rollouts send one firmware to many devices in batches cut from
// device_uids in the order given. The rollout engine moves every running
// rollout on: it records how its devices' OTA commands ended, halts it past
// max_failures, and starts the current batch's devices that are online.
// All of a rollout's state is in the database, so it goes on after a
// restart where it stood.

const (
	maxRolloutDevices = 10_000
	// maxRolloutBody caps a rollout request: 10,000 uids do not fit in
	// maxJSONBody, and the list must be refused with a field error, not
	// cut off with a 413.
	maxRolloutBody = 1 << 20
	// rolloutTick is how often rollouts move on without a command result.
	rolloutTick = time.Second
	// rolloutSenders is how many OTA commands of a batch are sent at once.
	rolloutSenders = 16
)

// handleRolloutCreate serves POST /v1/user/rollouts.
func (s *server) handleRolloutCreate(w http.ResponseWriter, r *http.Request) error {
	owner := authFrom(r.Context()).user.teamID
	body, err := decodeJSONUpTo(w, r, maxRolloutBody)
	if err != nil {
		return err
	}
	nr, err := s.readRollout(r.Context(), owner, body)
	if err != nil {
		return err
	}
	nr.createdBy = authFrom(r.Context()).user.ID
	id, devices, err := s.store.createRollout(r.Context(), owner, nr)
	switch {
	case errors.Is(err, errMD5OfTwoFiles):
		err = fieldError("md5", "names two different files among your firmwares (an md5 collision); delete one of them first.")
	case errors.Is(err, errNoDeviceMatches):
		err = fieldError("select", "matches none of your devices.")
	}
	if err != nil {
		return err
	}
	noteAudit(r.Context(), "", map[string]any{"rollout_id": id, "md5": nr.md5, "devices": devices})
	// Start the first batch now, not at the next tick; a client that goes
	// away must not stop the engine half-way through a batch.
	s.rollouts.advance(context.WithoutCancel(r.Context()))
	return s.answerRollout(w, r, http.StatusCreated, id)
}

// readRollout validates a rollout request against the user's firmwares
// and devices.
func (s *server) readRollout(ctx context.Context, owner int64, body jsonBody) (newRollout, error) {
	var e fieldErrors
	nr := newRollout{
		name:        body.str(&e, "name", false, 255),
		batchSize:   body.integer(&e, "batch_size", 10, 1, 1000),
		maxFailures: body.integer(&e, "max_failures", 0, 0, math.MaxInt32), // a select may match a million
	}
	if sum := body.str(&e, "md5", true, 255); sum != nil {
		nr.md5 = strings.ToLower(strings.TrimSpace(*sum))
		if _, err := s.store.rolloutFirmware(ctx, owner, nr.md5); errors.Is(err, errFirmwareNotFound) {
			e.add("md5", "must be the md5 of one of your firmwares.")
		} else if err != nil {
			return nr, err
		}
	}
	if body.has("select") {
		if body.has("device_uids") {
			e.add("select", "must not be given with device_uids.")
		}
		nr.selection = body.selection(&e)
		return nr, e.err()
	}
	if err := s.readRolloutUIDs(ctx, owner, body, &nr, &e); err != nil {
		return nr, err
	}
	return nr, e.err()
}

// selection reads a rollout's "select": an object of filterFields, each
// a string as the device list's parameter of that name takes it.
func (b jsonBody) selection(e *fieldErrors) *deviceFilter {
	raw := b["select"]
	var fields map[string]json.RawMessage
	if isNull(raw) || raw[0] != '{' || json.Unmarshal(raw, &fields) != nil {
		e.add("select", "must be an object of %s.", strings.Join(filterFields, ", "))
		return nil
	}
	if hasDuplicateKey(raw, false) {
		e.add("select", "must not contain duplicate keys.")
		return nil
	}
	values := map[string]string{}
	for _, field := range slices.Sorted(maps.Keys(fields)) {
		var v string
		switch {
		case !slices.Contains(filterFields, field):
			e.add("select", "may only have the fields %s.", strings.Join(filterFields, ", "))
		case json.Unmarshal(fields[field], &v) != nil:
			e.add("select."+field, "must be a string.")
		case v == "":
			e.add("select."+field, "must not be empty.")
		default:
			values[field] = v
		}
	}
	f := readFilter(e, "select.", values)
	return &f
}

// readRolloutUIDs reads a rollout's device_uids into nr: every one a
// device of the team, none twice.
func (s *server) readRolloutUIDs(ctx context.Context, owner int64, body jsonBody, nr *newRollout, e *fieldErrors) error {
	uids := body.stringList(e, "device_uids", maxRolloutDevices)
	ids, err := s.store.deviceIDsByUID(ctx, owner, uids)
	if err != nil {
		return err
	}
	seen := map[string]int{}
	var unknown, twice []string
	for _, uid := range uids {
		seen[uid]++
		_, known := ids[uid]
		switch {
		case seen[uid] == 2:
			twice = append(twice, uid)
		case seen[uid] == 1 && !known:
			unknown = append(unknown, uid)
		}
		nr.deviceIDs = append(nr.deviceIDs, ids[uid])
	}
	if len(unknown) > 0 {
		e.add("device_uids", "contains devices you do not have: %s.", quoteList(unknown))
	}
	if len(twice) > 0 {
		e.add("device_uids", "contains devices more than once: %s.", quoteList(twice))
	}
	return nil
}

// quoteList quotes up to five items, and says how many more there are.
func quoteList(items []string) string {
	var q []string
	for _, it := range items[:min(5, len(items))] {
		q = append(q, strconv.Quote(it))
	}
	if len(items) > 5 {
		q = append(q, fmt.Sprintf("and %d more", len(items)-5))
	}
	return strings.Join(q, ", ")
}

// handleRolloutList serves GET /v1/user/rollouts.
func (s *server) handleRolloutList(w http.ResponseWriter, r *http.Request) error {
	list, err := s.store.rolloutsOf(r.Context(), authFrom(r.Context()).user.teamID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleRolloutGet serves GET /v1/user/rollouts/{id}.
func (s *server) handleRolloutGet(w http.ResponseWriter, r *http.Request) error {
	id, ok := rolloutID(r)
	if !ok {
		return errRolloutNotFound
	}
	return s.answerRollout(w, r, http.StatusOK, id)
}

// answerRollout answers with the user's rollout in detail; its devices
// are encoded as they are read (dataWriter), so that the answer costs no
// more memory for a hundred thousand devices than for ten.
func (s *server) answerRollout(w http.ResponseWriter, r *http.Request, status int, id int64) error {
	owner := authFrom(r.Context()).user.teamID
	dw := &dataWriter{w: w, status: status, tail: "}"}
	err := s.store.rolloutDetail(r.Context(), owner, id, func(ro *rollout) error {
		if r.Method == http.MethodPost { // created or moved: tell the streams
			s.events.publish(owner, "rollout.progress", progressOf(ro))
		}
		head, err := json.Marshal(ro) // without devices: {…}
		dw.head = string(head[:len(head)-1]) + `,"devices":`
		return err
	}, func(d rolloutDevice) error { return dw.add(d) })
	var data []byte
	if err == nil {
		data, err = dw.end()
	}
	if written, err := s.finish(dw, err); written || err != nil {
		return err
	}
	writeData(w, status, data)
	return nil
}

func rolloutID(r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	return id, err == nil && id > 0
}

// rolloutMoves are the transitions a user may ask for: from which states,
// and what a refusal says.
var rolloutMoves = map[string]struct {
	from    []string
	to      string
	refusal string
}{
	"pause":  {[]string{"running"}, "paused", "Only a running rollout can be paused."},
	"resume": {[]string{"paused"}, "running", "Only a paused rollout can be resumed."},
	"cancel": {[]string{"running", "paused"}, "cancelled", "Only a running or paused rollout can be cancelled."},
}

// handleRolloutMove serves POST /v1/user/rollouts/{id}/pause, …/resume
// and …/cancel.
func (s *server) handleRolloutMove(move string) apiHandler {
	m := rolloutMoves[move]
	return func(w http.ResponseWriter, r *http.Request) error {
		id, ok := rolloutID(r)
		if !ok {
			return errRolloutNotFound
		}
		// Under the engine's lock: once a pause or cancel is answered, the
		// engine starts no device for that rollout.
		moved, err := s.rollouts.move(r.Context(), authFrom(r.Context()).user.teamID, id, m.from, m.to)
		if err != nil {
			return err
		}
		if !moved {
			return refusal(m.refusal)
		}
		noteAudit(r.Context(), "", map[string]any{"rollout_id": id})
		if m.to == "running" {
			s.rollouts.advance(context.WithoutCancel(r.Context()))
		}
		return s.answerRollout(w, r, http.StatusOK, id)
	}
}

// rolloutEngine moves running rollouts on: it records how their devices'
// OTA commands ended, halts a rollout past max_failures, and starts the
// current batch's devices that are online. One engine at a time: the
// HTTP handlers and run share mu.
type rolloutEngine struct {
	mu       sync.Mutex
	store    *store
	commands *commander
	log      *slog.Logger
	events   *eventHub // hears every change of a rollout's progress
}

// move changes a rollout's state from one of from to to, under the
// engine's lock: once a pause or cancel is answered, the engine starts no
// device for that rollout.
func (e *rolloutEngine) move(ctx context.Context, owner, id int64, from []string, to string) (bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.store.moveRollout(ctx, owner, id, from, to)
}

// run moves rollouts on every rolloutTick and whenever a command changes,
// until ctx is done.
func (e *rolloutEngine) run(ctx context.Context) {
	t := time.NewTicker(rolloutTick)
	defer t.Stop()
	for {
		changed := e.store.commandsChanged.wait()
		e.advance(ctx)
		select {
		case <-t.C:
		case <-changed:
		case <-ctx.Done():
			return
		}
	}
}

// advance moves every running rollout on.
func (e *rolloutEngine) advance(ctx context.Context) {
	e.mu.Lock()
	defer e.mu.Unlock()
	active, err := e.store.activeRollouts(ctx)
	if err != nil {
		e.log.Error("list rollouts", "err", err)
		return
	}
	for _, ro := range active {
		if err := e.advanceOne(ctx, ro.owner, ro.id); err != nil {
			e.log.Error("advance rollout", "id", ro.id, "err", err)
		}
	}
}

// advanceOne moves one running rollout on. It reads the rollout's
// current batch, and the next when this one has just ended, never all of
// its devices: its memory does not grow with the rollout. The streams
// hear of it when a device shows another state, or the rollout does.
func (e *rolloutEngine) advanceOne(ctx context.Context, owner, id int64) error {
	ro, err := e.store.rolloutHead(ctx, owner, id)
	if err != nil {
		return err
	}
	batch, err := e.store.rolloutBatch(ctx, ro)
	if err != nil {
		return err
	}
	changed := false
	defer func() {
		if changed {
			e.publishProgress(ctx, owner, ro)
		}
	}()
	shown := deviceStates(batch)
	var settled []*rolloutDevice
	for i := range batch {
		if settleRolloutDevice(&batch[i]) {
			settled = append(settled, &batch[i])
		}
	}
	if err := e.store.setRolloutDevices(ctx, id, settled); err != nil {
		return err
	}
	changed = !slices.Equal(shown, deviceStates(batch))
	failures, err := e.store.rolloutFailures(ctx, id)
	if err != nil {
		return err
	}
	if failures > ro.MaxFailures {
		changed = true
		return e.end(ctx, ro, owner, "halted")
	}
	if !slices.ContainsFunc(batch, notEnded) { // it has just ended: on to the next
		if batch, err = e.store.rolloutBatch(ctx, ro); err != nil {
			return err
		}
		shown = deviceStates(batch)
	}
	if batch == nil {
		changed = true
		return e.end(ctx, ro, owner, "completed")
	}
	err = e.startBatch(ctx, ro, owner, batch)
	changed = changed || !slices.Equal(shown, deviceStates(batch))
	return err
}

// deviceStates are the states of devices, in order.
func deviceStates(devices []rolloutDevice) []string {
	states := make([]string, len(devices))
	for i, d := range devices {
		states[i] = d.State
	}
	return states
}

// notEnded reports whether a rollout's device is still to be sent, or
// still running.
func notEnded(d rolloutDevice) bool {
	return d.State == "pending" || d.State == "waiting" || d.State == "running"
}

// publishProgress tells the owner's streams the rollout's state and counts.
func (e *rolloutEngine) publishProgress(ctx context.Context, owner int64, ro *rollout) {
	if err := e.store.rolloutCounts(ctx, ro); err != nil {
		e.log.Error("count rollout devices", "id", ro.ID, "err", err)
		return
	}
	e.events.publish(owner, "rollout.progress", progressOf(ro))
}

// end moves a running rollout to state, halted or completed.
func (e *rolloutEngine) end(ctx context.Context, ro *rollout, owner int64, state string) error {
	moved, err := e.store.moveRollout(ctx, owner, ro.ID, []string{"running"}, state)
	if moved {
		ro.State = state
	}
	return err
}

// settleRolloutDevice takes on how a running device's OTA command ended
// (rolloutOf has read it) and reports whether d changed. A command that
// does not exist was never published (the process stopped between
// recording the device as running and sending it), so the device may
// safely be sent it again.
func settleRolloutDevice(d *rolloutDevice) bool {
	switch {
	case d.ended:
		return true
	case d.State == "running" && d.cmdState == nil:
		d.State, d.CommandID = "pending", nil
		return true
	}
	return false
}

// rolloutSend is an OTA command for one device of a batch.
type rolloutSend struct {
	d   *rolloutDevice
	dev *deviceRef
	c   *command
}

// startBatch starts the batch's pending and waiting devices: one that
// already runs the image is skipped, one that is not online waits, and
// the others are recorded as running with their commands' ids, in one
// write, before any command is sent: after a crash none is sent twice.
// The commands then go out rolloutSenders at a time; a device whose
// command is refused waits again.
func (e *rolloutEngine) startBatch(ctx context.Context, ro *rollout, owner int64, batch []rolloutDevice) error {
	var changed []*rolloutDevice
	var sends []rolloutSend
	for i := range batch {
		d := &batch[i]
		if d.State != "pending" && d.State != "waiting" {
			continue
		}
		switch {
		case d.runs:
			d.State = "skipped"
		case !d.online || !e.commands.linkUp():
			if d.State == "waiting" {
				continue
			}
			d.State = "waiting"
		default:
			send, err := e.prepare(ctx, ro, owner, d)
			if err != nil {
				return err
			}
			d.State, d.CommandID = "running", &send.c.ID
			sends = append(sends, send)
		}
		changed = append(changed, d)
	}
	if err := e.store.setRolloutDevices(ctx, ro.ID, changed); err != nil {
		return err
	}
	return e.store.setRolloutDevices(ctx, ro.ID, e.send(ctx, ro.ID, sends))
}

// prepare makes the device's OTA command for the rollout's firmware, with
// its id drawn.
func (e *rolloutEngine) prepare(ctx context.Context, ro *rollout, owner int64, d *rolloutDevice) (rolloutSend, error) {
	dev, err := e.store.deviceRefOf(ctx, owner, d.UID)
	if err != nil {
		return rolloutSend{}, err
	}
	f, err := e.store.firmwareOf(ctx, dev.id, ro.MD5)
	if err != nil {
		return rolloutSend{}, err
	}
	c, err := e.commands.otaCommand(d.UID, f)
	if err != nil {
		return rolloutSend{}, err
	}
	c.ID = randomString(20, alnum)
	if ro.createdBy != nil {
		c.SentBy = &actorRef{ID: *ro.createdBy}
	}
	return rolloutSend{d: d, dev: dev, c: c}, nil
}

// send issues the commands, rolloutSenders at a time, so
// that their records share commits and their publishes overlap. It
// returns the devices whose command was refused, set waiting again.
func (e *rolloutEngine) send(ctx context.Context, rolloutID int64, sends []rolloutSend) []*rolloutDevice {
	var mu sync.Mutex
	var refused []*rolloutDevice
	var wg sync.WaitGroup
	slots := make(chan struct{}, rolloutSenders)
	for _, snd := range sends {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if err := e.commands.issue(ctx, snd.dev, snd.c); err != nil {
				e.log.Warn("rollout: send ota", "rollout", rolloutID, "uid", snd.d.UID, "err", err)
				mu.Lock()
				snd.d.State, snd.d.CommandID = "waiting", nil
				refused = append(refused, snd.d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return refused
}
