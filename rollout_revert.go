package main

// Revert: a rollout that is over can be undone by another, which sends
// each device it updated the firmware that device ran just before (its
// previous firmware run). A user asks for it (POST …/revert), or the
// rollout asked for it ahead ("on_halt": "revert") and the engine makes
// it the moment the rollout halts, as devicehub (an audit entry without
// an actor). Each side names the other: reverts, reverted_by.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
)

const (
	onHaltStop   = "stop"
	onHaltRevert = "revert"
)

var onHalts = []string{onHaltStop, onHaltRevert}

var (
	// errRevertState: only a rollout that is over can be reverted.
	errRevertState = errors.New("the rollout is not over")
	// errAlreadyReverted: a rollout is reverted once.
	errAlreadyReverted = errors.New("the rollout is already reverted")
)

// handleRolloutRevert serves POST /v1/user/rollouts/{id}/revert.
func (s *server) handleRolloutRevert(w http.ResponseWriter, r *http.Request) error {
	id, ok := rolloutID(r)
	if !ok {
		return errRolloutNotFound
	}
	u := authFrom(r.Context()).user
	revertID, err := s.store.revertRollout(r.Context(), u.teamID, id, &u.ID)
	switch {
	case errors.Is(err, errRevertState):
		return refusal("Only a halted, cancelled or completed rollout can be reverted.")
	case errors.Is(err, errAlreadyReverted):
		return refusal("This rollout is already reverted.")
	case err != nil:
		return err
	}
	s.rollouts.start(context.WithoutCancel(r.Context()), u.teamID, revertID)
	return s.answerRollout(w, r, http.StatusCreated, revertID)
}

// rolloutAuditDetail is the detail of a rollout's audit entry when it is
// created, moved or reverted.
func rolloutAuditDetail(ro *rollout) map[string]any {
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

// awaitsRevert reports whether the rollout has halted, asking to be
// reverted then, and is not reverted yet.
func (ro *rollout) awaitsRevert() bool {
	return ro.State == rolloutHalted && ro.OnHalt == onHaltRevert && ro.RevertedBy == nil
}

// revertOnHalt makes the revert of a rollout that has halted and asked
// for one (awaitsRevert), and starts it: as devicehub, its audit entry
// has no actor. It waits (the engine comes back to it) while a device
// of the rollout still runs its OTA command: that device too may take
// the firmware, and must go back with the others. Made here, after the
// halt is stored, the revert is made again after a restart in between.
// The caller holds ro's lock, not the revert's.
func (e *rolloutEngine) revertOnHalt(ctx context.Context, ro *rollout, teamID int64) error {
	batch, err := e.store.rolloutBatch(ctx, ro)
	if err != nil {
		return err
	}
	var settled []*rolloutDeviceRow
	for i := range batch {
		if settleRolloutDevice(&batch[i]) {
			settled = append(settled, &batch[i])
		}
	}
	if err := e.store.setRolloutDevices(ctx, ro.ID, settled); err != nil {
		return err
	}
	if slices.ContainsFunc(batch, func(d rolloutDeviceRow) bool { return d.State == rdRunning }) {
		return nil
	}
	id, err := e.store.revertRollout(ctx, teamID, ro.ID, nil)
	if errors.Is(err, errAlreadyReverted) { // by a user, meanwhile
		return nil
	}
	if err != nil {
		return err
	}
	e.start(ctx, teamID, id)
	revert, err := e.store.rolloutHead(ctx, teamID, id)
	if err == nil {
		err = e.store.rolloutCounts(ctx, revert)
	}
	if err != nil {
		return err
	}
	e.events.publish(teamID, "rollout.progress", progressOf(revert))
	entry := &auditEntry{Action: "rollout.revert", teamID: teamID, At: e.store.now().UTC().Format(timeFormat)}
	if entry.Detail, err = json.Marshal(rolloutAuditDetail(revert)); err != nil {
		return err
	}
	if err := e.store.addAudit(entry); err != nil {
		return err
	}
	e.events.audited(entry)
	return nil
}

// revertRollout stores the rollout that reverts the team's rollout id
// and returns its id: named "Revert of <name>", with its batch size,
// failure limit and health gate, stopping on a halt. Its devices are
// those the rollout updated (that reported its md5 since it was created),
// in its order, each sent the md5 of its firmware run before that one;
// one that ran nothing reported before, or whose earlier file the team
// no longer holds, is skipped, saying so. Its md5 is theirs when they
// all go back to one file, else empty. createdBy is nil when devicehub
// reverts. errRolloutNotFound, errRevertState, errAlreadyReverted.
func (s *store) revertRollout(ctx context.Context, teamID, id int64, createdBy *int64) (revertID int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		ro, err := scanRollout(tx.QueryRowContext(ctx, `SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID))
		switch {
		case err != nil:
			return err
		case !slices.Contains(rolloutEnds, ro.State):
			return errRevertState
		case ro.RevertedBy != nil:
			return errAlreadyReverted
		}
		name := "Revert of " + fmt.Sprint(id)
		if ro.Name != nil {
			name = "Revert of " + *ro.Name
		}
		now := s.timestamp()
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (team_id, name, md5, sha256, state, batch_size, max_failures,
			created_at, updated_at, created_by, health, on_halt, reverts)
			SELECT team_id, ?, '', '', ?, batch_size, max_failures, ?, ?, ?, health, ?, id FROM rollouts WHERE id = ?
			RETURNING id`, name, rolloutRunning, now, now, createdBy, onHaltStop, id).Scan(&revertID)
		if err != nil {
			return err
		}
		if err := addRevertDevices(ctx, tx, revertID, ro); err != nil {
			return err
		}
		return s.giveRevertFirmwares(ctx, tx, revertID, teamID, now)
	})
	return revertID, err
}

// addRevertDevices adds to the revert the devices ro updated, in ro's
// order: each device's first run of ro's md5 since ro was created, and
// the run before it, whose md5 the device is sent; skipped when it has
// none (its md5 the empty string: it is sent nothing).
func addRevertDevices(ctx context.Context, tx *sql.Tx, revertID int64, ro *rollout) error {
	_, err := tx.ExecContext(ctx, `WITH took AS (
			SELECT rd.device_id, rd.position, min(fr.id) AS run_id
			FROM rollout_devices rd JOIN firmware_runs fr ON fr.device_id = rd.device_id
			WHERE rd.rollout_id = ?1 AND fr.md5 = COALESCE(rd.md5, ?2) AND fr.from_at >= ?3
			GROUP BY rd.device_id),
		back AS (
			SELECT t.device_id, t.position, (SELECT p.md5 FROM firmware_runs p
				WHERE p.device_id = t.device_id AND p.id < t.run_id ORDER BY p.id DESC LIMIT 1) AS md5
			FROM took t)
		INSERT INTO rollout_devices (rollout_id, position, device_id, state, md5, error)
		SELECT ?4, row_number() OVER (ORDER BY position) - 1, device_id,
			CASE WHEN md5 IS NULL THEN ?5 ELSE ?6 END, COALESCE(md5, ''), CASE WHEN md5 IS NULL THEN ?7 END
		FROM back ORDER BY position`,
		ro.ID, ro.MD5, ro.CreatedAt, revertID, rdSkipped, rdPending, "It ran no firmware reported before that rollout.")
	return err
}

// giveRevertFirmwares finds, for each md5 the revert sends, the team's
// file: a device whose file the team no longer holds (or holds two of)
// is skipped, saying so; the others get a firmware row for it, counted
// against the quotas as a rollout's. The revert's md5 and sha256 are
// those of its one file, when it sends one.
func (s *store) giveRevertFirmwares(ctx context.Context, tx *sql.Tx, revertID, teamID int64, now string) error {
	sums, err := queryAll(ctx, tx, func(row scanner) (string, error) {
		var sum string
		return sum, row.Scan(&sum)
	}, `SELECT DISTINCT md5 FROM rollout_devices WHERE rollout_id = ? AND state = ? ORDER BY md5`, revertID, rdPending)
	if err != nil {
		return err
	}
	var sent []rolloutSource
	for _, sum := range sums {
		src, err := rolloutSourceOf(ctx, tx, teamID, sum)
		why := ""
		switch {
		case errors.Is(err, errFirmwareNotFound):
			why = "Your team no longer holds its earlier firmware (md5 " + sum + ")."
		case errors.Is(err, errMD5OfTwoFiles):
			why = "Your team holds two files under its earlier firmware's md5 (" + sum + ")."
		case err != nil:
			return err
		}
		if why != "" {
			_, err = tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ?, error = ? WHERE rollout_id = ? AND md5 = ? AND state = ?`,
				rdSkipped, why, revertID, sum, rdPending)
			if err != nil {
				return err
			}
			continue
		}
		if err := s.checkRolloutQuotas(ctx, tx, revertID, teamID, sum, src.size); err != nil {
			return err
		}
		if err := giveFirmwareRows(ctx, tx, revertID, sum, src, now); err != nil {
			return err
		}
		sent = append(sent, src)
		if len(sent) == 1 {
			_, err = tx.ExecContext(ctx, `UPDATE rollouts SET md5 = ?, sha256 = ? WHERE id = ?`, sum, src.sha256, revertID)
		} else {
			_, err = tx.ExecContext(ctx, `UPDATE rollouts SET md5 = '', sha256 = '' WHERE id = ?`, revertID)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
