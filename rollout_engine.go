package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// The rollout engine: it moves rollouts on, batch by batch; the rollout
// handlers are in rollouts.go.

// rolloutEngine moves running rollouts on: it records how their devices'
// OTA commands ended, halts a rollout past max_failures, and starts the
// current batch's devices that are online. One pass at a time over a
// rollout: run, and the requests that create, move or resume it, take
// that rollout's lock, and only that one's.
type rolloutEngine struct {
	store    rolloutStore
	commands *commander
	log      *slog.Logger
	events   *eventHub // hears every change of a rollout's progress

	locks keyedLocks[int64] // the rollouts being moved on, by id
}

// rolloutStore is what the rollout engine uses of the store: the running
// rollouts, their batches and states, the devices and firmware it sends.
type rolloutStore interface {
	ActiveRollouts(ctx context.Context) ([]store.RolloutTeam, error)
	RolloutHead(ctx context.Context, teamID, id int64) (*model.Rollout, error)
	RolloutBatch(ctx context.Context, teamID int64, ro *model.Rollout) ([]store.RolloutDeviceRow, error)
	RolloutFailures(ctx context.Context, teamID, id int64) (int, error)
	RolloutCounts(ctx context.Context, teamID int64, ro *model.Rollout) error
	SetRolloutDevices(ctx context.Context, teamID, id int64, devices []*store.RolloutDeviceRow) error
	MoveRollout(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState, audit store.Audit[*model.Rollout]) (bool, error)
	EndRollout(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState, why []byte) (bool, error)
	DeviceRefOf(ctx context.Context, teamID int64, uid string) (*store.DeviceRef, error)
	FirmwareOf(ctx context.Context, d *store.DeviceRef, ref string) (*model.Firmware, error)
	RolloutHealthFigures(ctx context.Context, teamID int64, ro *model.Rollout) (crashes int, deviceDays float64, latest time.Time, err error)
	RevertRollout(ctx context.Context, teamID, id int64, createdBy *int64, audit store.Audit[*model.Rollout]) (int64, error)
	Now() time.Time
	CommandsChanged() <-chan struct{}
}

func newRolloutEngine(st rolloutStore, commands *commander, log *slog.Logger, events *eventHub) *rolloutEngine {
	return &rolloutEngine{store: st, commands: commands, log: log, events: events}
}

// move changes a rollout's state from one of from to to, under the
// rollout's lock: once a pause or cancel is answered, the engine starts
// no device for that rollout. audit (nil: none) is made of the rollout
// as moved.
func (e *rolloutEngine) move(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState,
	audit store.Audit[*model.Rollout]) (bool, error) {
	defer e.locks.lock(id)()
	return e.store.MoveRollout(ctx, teamID, id, from, to, audit)
}

// start moves one rollout on now, for the request that created or
// resumed it: its first batch goes out before the answer, and no other
// rollout is moved on, or waited for, by that request.
func (e *rolloutEngine) start(ctx context.Context, teamID, id int64) {
	if err := e.advanceLocked(ctx, teamID, id); err != nil {
		e.log.Error("advance rollout", "id", id, "err", err)
	}
}

// run moves rollouts on every rolloutTick and whenever a command changes,
// until ctx is done.
func (e *rolloutEngine) run(ctx context.Context) {
	t := time.NewTicker(rolloutTick)
	defer t.Stop()
	for {
		changed := e.store.CommandsChanged()
		e.advance(ctx)
		select {
		case <-t.C:
		case <-changed:
		case <-ctx.Done():
			return
		}
	}
}

// advance moves every running rollout on, one after the other.
func (e *rolloutEngine) advance(ctx context.Context) {
	active, err := e.store.ActiveRollouts(ctx)
	if err != nil {
		e.log.Error("list rollouts", "err", err)
		return
	}
	for _, ro := range active {
		e.start(ctx, ro.TeamID, ro.ID)
	}
}

// advanceLocked is advanceOne under the rollout's lock.
func (e *rolloutEngine) advanceLocked(ctx context.Context, teamID, id int64) error {
	defer e.locks.lock(id)()
	return e.advanceOne(ctx, teamID, id)
}

// advanceOne moves one rollout on, if it is still running: a request may
// have paused or ended it since it was listed. It reads the rollout's
// current batch, and the next when this one has just ended, never all of
// its devices: its memory does not grow with the rollout. The streams
// hear of it when a device shows another state, or the rollout does.
func (e *rolloutEngine) advanceOne(ctx context.Context, teamID, id int64) error {
	ro, err := e.store.RolloutHead(ctx, teamID, id)
	if err != nil {
		return err
	}
	if ro.AwaitsRevert() {
		return e.revertOnHalt(ctx, ro, teamID)
	}
	if ro.State != model.RolloutRunning {
		return nil
	}
	batch, err := e.store.RolloutBatch(ctx, teamID, ro)
	if err != nil {
		return err
	}
	changed := false
	defer func() {
		if changed {
			e.publishProgress(ctx, teamID, ro)
		}
	}()
	shown := deviceStates(batch)
	var settled []*store.RolloutDeviceRow
	for i := range batch {
		if settleRolloutDevice(&batch[i]) {
			settled = append(settled, &batch[i])
		}
	}
	if err := e.store.SetRolloutDevices(ctx, teamID, id, settled); err != nil {
		return err
	}
	// A device whose command ended already shows its end (shownState), but
	// the streams have not heard of it: while a health gate watches the
	// batch, no next batch starts to tell them.
	changed = len(settled) > 0 || !slices.Equal(shown, deviceStates(batch))
	failures, err := e.store.RolloutFailures(ctx, teamID, id)
	if err != nil {
		return err
	}
	if failures -= ro.FailuresBefore; failures > ro.MaxFailures { // since its latest resume from a halt
		changed = true
		return e.end(ctx, ro, teamID, model.RolloutHalted, &haltReason{Kind: haltFailures, Failed: &failures, Limit: float64(ro.MaxFailures)})
	}
	halted, watchUntil, err := e.checkHealth(ctx, ro, teamID)
	if halted || err != nil {
		changed = changed || halted
		return err
	}
	if !slices.ContainsFunc(batch, notEnded) { // it has just ended: on to the next
		if batch, err = e.store.RolloutBatch(ctx, teamID, ro); err != nil {
			return err
		}
		shown = deviceStates(batch)
	}
	// Under a health gate, neither the next batch nor the end comes
	// while the devices updated last are watched.
	watched := e.store.Now().Before(watchUntil)
	if watched && !slices.ContainsFunc(batch, started) {
		return nil
	}
	if batch == nil {
		changed = true
		return e.end(ctx, ro, teamID, model.RolloutCompleted, nil)
	}
	err = e.startBatch(ctx, ro, teamID, batch)
	changed = changed || !slices.Equal(shown, deviceStates(batch))
	return err
}

// deviceStates are the states of devices, in order.
func deviceStates(devices []store.RolloutDeviceRow) []model.RolloutDeviceState {
	states := make([]model.RolloutDeviceState, len(devices))
	for i, d := range devices {
		states[i] = d.State
	}
	return states
}

// notEnded reports whether a rollout's device is still to be sent, or
// still running.
func notEnded(d store.RolloutDeviceRow) bool {
	return slices.Contains(model.RdNotEnded, d.State)
}

// started reports whether a rollout's device has been taken up by the
// engine: anything but pending.
func started(d store.RolloutDeviceRow) bool { return d.State != model.RdPending }

// publishProgress tells the team's streams the rollout's state and counts.
func (e *rolloutEngine) publishProgress(ctx context.Context, teamID int64, ro *model.Rollout) {
	if err := e.store.RolloutCounts(ctx, teamID, ro); err != nil {
		e.log.Error("count rollout devices", "id", ro.ID, "err", err)
		return
	}
	e.events.publish(teamID, "rollout.progress", progressOf(ro))
}

// end moves a running rollout to state, halted (saying why) or completed;
// a halt starts its revert when it asked for one (once its devices'
// commands have ended).
func (e *rolloutEngine) end(ctx context.Context, ro *model.Rollout, teamID int64, state model.RolloutState, why *haltReason) error {
	var reason []byte
	if why != nil {
		reason, _ = json.Marshal(why)
	}
	moved, err := e.store.EndRollout(ctx, teamID, ro.ID, []model.RolloutState{model.RolloutRunning}, state, reason)
	if !moved || err != nil {
		return err
	}
	ro.State, ro.HaltReason = state, reason
	if !ro.AwaitsRevert() {
		return nil
	}
	return e.revertOnHalt(ctx, ro, teamID)
}

// settleRolloutDevice takes on how a running device's OTA command ended
// (rolloutOf has read it) and reports whether d changed. A command that
// does not exist was never published (the process stopped between
// recording the device as running and sending it), so the device may
// safely be sent it again.
func settleRolloutDevice(d *store.RolloutDeviceRow) bool {
	switch {
	case d.Ended:
		return true
	case d.State == model.RdRunning && d.CmdState == nil:
		d.State, d.CommandID = model.RdPending, nil
		return true
	}
	return false
}

// rolloutSend is an OTA command for one device of a batch.
type rolloutSend struct {
	d   *store.RolloutDeviceRow
	dev *store.DeviceRef
	c   *model.Command
}

// startBatch starts the batch's pending and waiting devices: one that
// already runs the image is skipped, one that is not online waits, and
// the others are recorded as running with their commands' ids, and get
// the firmware as their target, in one write, before any command is
// sent: after a crash none is sent twice.
// The commands then go out rolloutSenders at a time; a device whose
// command is refused waits again.
func (e *rolloutEngine) startBatch(ctx context.Context, ro *model.Rollout, teamID int64, batch []store.RolloutDeviceRow) error {
	var changed []*store.RolloutDeviceRow
	var sends []rolloutSend
	for i := range batch {
		d := &batch[i]
		if d.State != model.RdPending && d.State != model.RdWaiting {
			continue
		}
		switch {
		case d.Runs:
			d.State = model.RdSkipped
		case !d.Online || !e.commands.linkUp():
			if d.State == model.RdWaiting {
				continue
			}
			d.State = model.RdWaiting
		default:
			send, err := e.prepare(ctx, ro, teamID, d)
			if err != nil {
				return err
			}
			d.State, d.CommandID = model.RdRunning, &send.c.ID
			sends = append(sends, send)
		}
		changed = append(changed, d)
	}
	if err := e.store.SetRolloutDevices(ctx, teamID, ro.ID, changed); err != nil {
		return err
	}
	return e.store.SetRolloutDevices(ctx, teamID, ro.ID, e.send(ctx, ro.ID, sends))
}

// prepare makes the device's OTA command for the rollout's firmware, with
// its id drawn, and makes that firmware the device's target when the
// device is recorded running: a rollout changes the target only of the
// devices it sends the OTA.
func (e *rolloutEngine) prepare(ctx context.Context, ro *model.Rollout, teamID int64, d *store.RolloutDeviceRow) (rolloutSend, error) {
	dev, err := e.store.DeviceRefOf(ctx, teamID, d.UID)
	if err != nil {
		return rolloutSend{}, err
	}
	f, err := e.store.FirmwareOf(ctx, dev, *d.MD5)
	if err != nil {
		return rolloutSend{}, err
	}
	c, err := e.commands.otaCommand(d.UID, f)
	if err != nil {
		return rolloutSend{}, err
	}
	c.ID = newCommandID()
	if ro.CreatedBy != nil {
		c.SentBy = &model.ActorRef{ID: *ro.CreatedBy}
	}
	d.Target = &store.NewTarget{Device: dev, FirmwareID: *f.ID}
	return rolloutSend{d: d, dev: dev, c: c}, nil
}

// send issues the commands, rolloutSenders at a time, so
// that their records share commits and their publishes overlap. It
// returns the devices whose command was refused, set waiting again.
func (e *rolloutEngine) send(ctx context.Context, rolloutID int64, sends []rolloutSend) []*store.RolloutDeviceRow {
	var mu sync.Mutex
	var refused []*store.RolloutDeviceRow
	var wg sync.WaitGroup
	slots := make(chan struct{}, rolloutSenders)
	for _, snd := range sends {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if err := e.commands.issue(ctx, snd.dev, snd.c, nil); err != nil {
				e.log.Warn("rollout: send ota", "rollout", rolloutID, "uid", snd.d.UID, "err", err)
				mu.Lock()
				snd.d.State, snd.d.CommandID = model.RdWaiting, nil
				refused = append(refused, snd.d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return refused
}
