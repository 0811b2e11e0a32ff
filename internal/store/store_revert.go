package store

// The store's reverts (rollout_revert.go).

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"fmt"
	"slices"
)

// RevertRollout stores the rollout that reverts the team's rollout id
// and returns its id: named "Revert of <name>", with its batch size,
// failure limit and health gate, stopping on a halt. Its devices are
// those the rollout updated (that reported its md5 since it was created),
// in its order, each sent the md5 of its firmware run before that one;
// one that ran nothing reported before, or whose earlier file the team
// no longer holds, is skipped, saying so. Its md5 is theirs when they
// all go back to one file, else empty. CreatedBy is nil when devicehub
// reverts. audit is made of the revert as created (auditRollout).
// ErrRolloutNotFound, ErrRevertState, ErrAlreadyReverted.
func (s *Store) RevertRollout(ctx context.Context, teamID, id int64, createdBy *int64, audit Audit[*model.Rollout]) (revertID int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		ro, err := scanRollout(tx.QueryRowContext(ctx, `SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID))
		switch {
		case err != nil:
			return err
		case !slices.Contains(model.RolloutEnds, ro.State):
			return ErrRevertState
		case ro.RevertedBy != nil:
			return ErrAlreadyReverted
		}
		name := "Revert of rollout " + fmt.Sprint(id)
		if ro.Name != nil {
			name = "Revert of " + *ro.Name
		}
		now := s.Timestamp()
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (team_id, name, md5, sha256, state, batch_size, max_failures,
			created_at, updated_at, created_by, health, on_halt, reverts)
			SELECT team_id, ?, '', '', ?, batch_size, max_failures, ?, ?, ?, health, ?, id FROM rollouts WHERE id = ?
			RETURNING id`, name, model.RolloutRunning, now, now, createdBy, model.OnHaltStop, id).Scan(&revertID)
		if err != nil {
			return err
		}
		if err := addRevertDevices(ctx, tx, revertID, ro); err != nil {
			return err
		}
		if err := s.giveRevertFirmwares(ctx, tx, revertID, teamID, now); err != nil {
			return err
		}
		return auditRollout(ctx, tx, teamID, revertID, audit)
	})
	return revertID, err
}

// addRevertDevices adds to the revert the devices ro updated, in ro's
// order: each device's first run of ro's md5 since ro was created, and
// the run before it, whose md5 the device is sent; skipped when it has
// none (its md5 the empty string: it is sent nothing).
func addRevertDevices(ctx context.Context, tx *sql.Tx, revertID int64, ro *model.Rollout) error {
	_, err := tx.ExecContext(ctx, `WITH took AS (
			SELECT rd.device_id, rd.position, min(fr.id) AS run_id
			FROM rollout_devices rd JOIN firmware_runs fr ON fr.device_id = rd.device_id
			WHERE rd.rollout_id = ?1 AND fr.md5 = COALESCE(rd.md5, ?2) AND fr.from_at >= unixepoch(?3)
			GROUP BY rd.device_id),
		back AS (
			SELECT t.device_id, t.position, (SELECT p.md5 FROM firmware_runs p
				WHERE p.device_id = t.device_id AND p.id < t.run_id ORDER BY p.id DESC LIMIT 1) AS md5
			FROM took t)
		INSERT INTO rollout_devices (rollout_id, position, device_id, state, md5, error)
		SELECT ?4, row_number() OVER (ORDER BY position) - 1, device_id,
			CASE WHEN md5 IS NULL THEN ?5 ELSE ?6 END, COALESCE(md5, ''), CASE WHEN md5 IS NULL THEN ?7 END
		FROM back ORDER BY position`,
		ro.ID, ro.MD5, ro.CreatedAt, revertID, model.RdSkipped, model.RdPending, "It ran no firmware reported before that rollout.")
	return err
}

// giveRevertFirmwares finds, for each md5 the revert sends, the team's
// file: a device whose file the team no longer holds (or holds two of)
// is skipped, saying so; the others get a firmware row for it, counted
// against the quotas as a rollout's. The revert's md5 and sha256 are
// those of its one file, when it sends one.
func (s *Store) giveRevertFirmwares(ctx context.Context, tx *sql.Tx, revertID, teamID int64, now string) error {
	sums, err := queryAll(ctx, tx, func(row scanner) (string, error) {
		var sum string
		return sum, row.Scan(&sum)
	}, `SELECT DISTINCT md5 FROM rollout_devices WHERE rollout_id = ? AND state = ? ORDER BY md5`, revertID, model.RdPending)
	if err != nil {
		return err
	}
	var sent []rolloutSource
	for _, sum := range sums {
		src, err := rolloutSourceOf(ctx, tx, teamID, sum)
		why := ""
		switch {
		case errors.Is(err, ErrFirmwareNotFound):
			why = "Your team no longer holds its earlier firmware (md5 " + sum + ")."
		case errors.Is(err, ErrMD5OfTwoFiles):
			why = "Your team holds two files under its earlier firmware's md5 (" + sum + ")."
		case err != nil:
			return err
		}
		if why != "" {
			_, err = tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ?, error = ? WHERE rollout_id = ? AND md5 = ? AND state = ?`,
				model.RdSkipped, why, revertID, sum, model.RdPending)
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

var (
	// ErrRevertState: only a rollout that is over can be reverted.
	ErrRevertState = errors.New("the rollout is not over")
	// ErrAlreadyReverted: a rollout is reverted once.
	ErrAlreadyReverted = errors.New("the rollout is already reverted")
)
