package main

// Revert: a rollout that is over can be undone by another, which sends
// each device it updated the firmware that device ran just before (its
// previous firmware run). A user asks for it (POST …/revert), or the
// rollout asked for it ahead ("on_halt": "revert") and the engine makes
// it the moment the rollout halts, as devicehub (an audit entry without
// an actor). Each side names the other: reverts, reverted_by.

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
)

var onHalts = []string{model.OnHaltStop, model.OnHaltRevert}

// handleRolloutRevert serves POST /v1/user/rollouts/{id}/revert.
func (s *server) handleRolloutRevert(w http.ResponseWriter, r *http.Request) error {
	id, ok := rolloutID(r)
	if !ok {
		return store.ErrRolloutNotFound
	}
	u := authFrom(r.Context()).user
	revertID, err := s.store.RevertRollout(r.Context(), u.TeamID, id, &u.ID, auditOf(r.Context(), rolloutAuditDetail))
	switch {
	case errors.Is(err, store.ErrRevertState):
		return refusal("Only a halted, cancelled or completed rollout can be reverted.")
	case errors.Is(err, store.ErrAlreadyReverted):
		return refusal("This rollout is already reverted.")
	case err != nil:
		return err
	}
	s.rollouts.start(context.WithoutCancel(r.Context()), u.TeamID, revertID)
	return s.answerRollout(w, r, http.StatusCreated, revertID)
}

// rolloutAuditDetail is the detail of a rollout's audit entry when it is
// created, moved or reverted.
func rolloutAuditDetail(ro *model.Rollout) map[string]any {
	devices := 0
	for _, n := range ro.Counts {
		devices += n
	}
	detail := map[string]any{"rollout_id": ro.ID, "name": ro.Name, "md5": ro.MD5, "firmware": ro.Firmware, "devices": devices}
	if ro.Reverts != nil {
		detail["reverts"] = *ro.Reverts
	}
	return detail
}

// revertOnHalt makes the revert of a rollout that has halted and asked
// for one (AwaitsRevert), and starts it: as devicehub, its audit entry
// has no actor. It waits (the engine comes back to it) while a device
// of the rollout still runs its OTA command: that device too may take
// the firmware, and must go back with the others. Made here, after the
// halt is stored, the revert is made again after a restart in between.
// The caller holds ro's lock, not the revert's.
func (e *rolloutEngine) revertOnHalt(ctx context.Context, ro *model.Rollout, teamID int64) error {
	batch, err := e.store.RolloutBatch(ctx, teamID, ro)
	if err != nil {
		return err
	}
	var settled []*store.RolloutDeviceRow
	for i := range batch {
		if settleRolloutDevice(&batch[i]) {
			settled = append(settled, &batch[i])
		}
	}
	if err := e.store.SetRolloutDevices(ctx, teamID, ro.ID, settled); err != nil {
		return err
	}
	if slices.ContainsFunc(batch, func(d store.RolloutDeviceRow) bool { return d.State == model.RdRunning }) {
		return nil
	}
	entry := &model.AuditEntry{Action: "rollout.revert", TeamID: teamID, At: e.store.Now().UTC().Format(store.TimeFormat)}
	id, err := e.store.RevertRollout(ctx, teamID, ro.ID, nil, func(revert *model.Rollout) *model.AuditEntry {
		entry.Detail, _ = json.Marshal(rolloutAuditDetail(revert)) // a map of numbers and strings
		return entry
	})
	if errors.Is(err, store.ErrAlreadyReverted) { // by a user, meanwhile
		return nil
	}
	if err != nil {
		return err
	}
	e.events.audited(entry) // committed: told even if a read below fails
	e.start(ctx, teamID, id)
	revert, err := e.store.RolloutHead(ctx, teamID, id)
	if err == nil {
		err = e.store.RolloutCounts(ctx, teamID, revert)
	}
	if err != nil {
		return err
	}
	e.events.publish(teamID, "rollout.progress", progressOf(revert))
	return nil
}
