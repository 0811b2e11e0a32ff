package main

// The store's rollouts (rollouts.go).

import (
	"context"
	"database/sql"
	"errors"
	"slices"
)

// errMD5OfTwoFiles: the user's firmwares hold two different files under
// the rollout's md5 (an md5 collision), so it could not say which to send.
var errMD5OfTwoFiles = errors.New("the md5 names two different files")

// rolloutDeviceState is a rollout device's state as shown: a device
// recorded as running whose command has ended shows that end, also in a
// rollout that the engine no longer moves (paused, halted, cancelled).
const rolloutDeviceState = `CASE WHEN rd.state = 'running' AND c.state IN ('succeeded', 'failed', 'timed_out')
	THEN c.state ELSE rd.state END`

// rolloutStates are the states a rollout's device can be in; the first
// three are not an end.
var rolloutStates = []string{"pending", "waiting", "running", "succeeded", "failed", "timed_out", "skipped"}

// newRollout is a validated rollout request.
type newRollout struct {
	name                   *string
	md5                    string
	deviceIDs              []int64
	batchSize, maxFailures int
	createdBy              int64 // the user; its OTA commands are sent by them
}

// rolloutFirmware returns the sha256 of the user's firmware with that md5,
// errFirmwareNotFound when none of the user's devices has one.
func (s *store) rolloutFirmware(ctx context.Context, ownerID int64, md5sum string) (string, error) {
	var sha string
	err := s.reader.QueryRowContext(ctx, `SELECT f.sha256 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.owner_id = ? AND f.md5 = ? ORDER BY f.id LIMIT 1`, ownerID, md5sum).Scan(&sha)
	return sha, notFound(err, errFirmwareNotFound)
}

// deviceIDsByUID maps those of the uids that name the user's devices to
// their ids.
func (s *store) deviceIDsByUID(ctx context.Context, ownerID int64, uids []string) (map[string]int64, error) {
	ids := map[string]int64{}
	for _, uid := range uids {
		var id int64
		err := s.reader.QueryRowContext(ctx, `SELECT id FROM devices WHERE uid = ? AND owner_id = ?`, uid, ownerID).Scan(&id)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			return nil, err
		}
		ids[uid] = id
	}
	return ids, nil
}

// createRollout stores a rollout: each device gets a firmware row for the
// file (copied from the user's firmware with that md5, sharing its bytes)
// as its target, and is pending, or skipped when it already reports the md5.
// Those rows count against the quotas as uploads do: over one, nothing is
// stored, and the quotaError names the first device over it.
func (s *store) createRollout(ctx context.Context, ownerID int64, nr newRollout) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		now := s.timestamp()
		var srcID, size int64
		var sha string
		var files int
		err := tx.QueryRowContext(ctx, `SELECT count(DISTINCT f.sha256), coalesce(min(f.id), 0), coalesce(min(f.sha256), ''),
			coalesce(min(f.size), 0) FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE d.owner_id = ? AND f.md5 = ?`, ownerID, nr.md5).Scan(&files, &srcID, &sha, &size)
		switch {
		case err != nil:
			return err
		case files == 0:
			return errFirmwareNotFound
		case files > 1:
			return errMD5OfTwoFiles
		}
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, created_by)
			VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?) RETURNING id`,
			ownerID, nr.name, nr.md5, sha, nr.batchSize, nr.maxFailures, now, now, nr.createdBy).Scan(&id)
		if err != nil {
			return err
		}
		used, err := s.firmwareBytesUsed(ctx, tx, ownerID)
		if err != nil {
			return err
		}
		for i, deviceID := range nr.deviceIDs {
			if err := s.checkRolloutQuotas(ctx, tx, deviceID, nr.md5, &used, size); err != nil {
				return err
			}
			if err := addRolloutDevice(ctx, tx, id, i, deviceID, srcID, nr.md5, now); err != nil {
				return err
			}
		}
		return nil
	})
	return id, err
}

// checkRolloutQuotas checks the firmware row of size bytes that a rollout
// gives the device, unless it has one with the md5 already, as an upload
// is checked; used is its owner's firmware bytes so far, and grows by
// size. A quotaError names the device.
func (s *store) checkRolloutQuotas(ctx context.Context, tx *sql.Tx, deviceID int64, md5sum string, used *int64, size int64) error {
	if s.limits.firmwares == 0 && s.limits.firmwareMiB == 0 {
		return nil
	}
	var has bool
	err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ? AND md5 = ?)`, deviceID, md5sum).Scan(&has)
	if err != nil || has {
		return err
	}
	var qe *quotaError
	if err := s.checkFirmwareQuotas(ctx, tx, deviceID, *used, size); !errors.As(err, &qe) {
		*used += size
		return err
	}
	if err := tx.QueryRowContext(ctx, `SELECT uid FROM devices WHERE id = ?`, deviceID).Scan(&qe.device); err != nil {
		return err
	}
	return qe
}

func addRolloutDevice(ctx context.Context, tx *sql.Tx, rolloutID int64, position int, deviceID, srcID int64, md5sum, now string) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
		SELECT ?1, name, version, notes, md5, sha256, size, ?2 FROM firmwares WHERE id = ?3
		AND NOT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ?1 AND md5 = ?4)`, deviceID, now, srcID, md5sum)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
		(SELECT id FROM firmwares WHERE device_id = ?1 AND md5 = ?2) WHERE id = ?1`, deviceID, md5sum)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO rollout_devices (rollout_id, position, device_id, state)
		SELECT ?, ?, id, CASE WHEN current_md5 IS ? THEN 'skipped' ELSE 'pending' END FROM devices WHERE id = ?`,
		rolloutID, position, md5sum, deviceID)
	return err
}

const rolloutColumns = `id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at, created_by`

func scanRollout(row scanner) (*rollout, error) {
	r := &rollout{Counts: map[string]int{}}
	err := row.Scan(&r.ID, &r.Name, &r.MD5, &r.SHA256, &r.State, &r.BatchSize, &r.MaxFailures,
		&r.CreatedAt, &r.UpdatedAt, &r.FinishedAt, &r.createdBy)
	if err != nil {
		return nil, notFound(err, errRolloutNotFound)
	}
	for _, st := range rolloutStates {
		r.Counts[st] = 0
	}
	return r, nil
}

// rolloutsOf lists the user's rollouts, newest first, with their counts.
func (s *store) rolloutsOf(ctx context.Context, ownerID int64) ([]*rollout, error) {
	list, err := queryAll(ctx, s.reader, scanRollout,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE owner_id = ? ORDER BY id DESC`, ownerID)
	if err != nil {
		return nil, err
	}
	byID := map[int64]*rollout{}
	for _, r := range list {
		byID[r.ID] = r
	}
	_, err = queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
		var id int64
		var state string
		var n int
		err := row.Scan(&id, &state, &n)
		if err == nil {
			byID[id].Counts[state] = n
		}
		return struct{}{}, err
	}, `SELECT rd.rollout_id, `+rolloutDeviceState+`, count(*)
		FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE r.owner_id = ? GROUP BY 1, 2`, ownerID)
	return list, err
}

// rolloutOf returns the user's rollout with its devices, in the order
// given, and what the engine needs to know of each; errRolloutNotFound
// when the user has none with that id.
func (s *store) rolloutOf(ctx context.Context, ownerID, id int64) (*rollout, error) {
	r, err := scanRollout(s.reader.QueryRowContext(ctx,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND owner_id = ?`, id, ownerID))
	if err != nil {
		return nil, err
	}
	r.Devices, err = queryAll(ctx, s.reader, func(row scanner) (rolloutDevice, error) {
		var d rolloutDevice
		err := row.Scan(&d.UID, &d.State, &d.CommandID, &d.Error, &d.position, &d.deviceID,
			&d.online, &d.runs, &d.cmdState, &d.cmdError)
		if d.State == "running" && d.cmdState != nil && slices.Contains([]string{"succeeded", "failed", "timed_out"}, *d.cmdState) {
			d.State, d.Error, d.ended = *d.cmdState, d.cmdError, true
		}
		r.Counts[d.State]++
		return d, err
	}, `SELECT d.uid, rd.state, rd.command_id, rd.error, rd.position, d.id,
		d.status = 'online', d.current_md5 IS ?, c.state, c.error
		FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE rd.rollout_id = ? ORDER BY rd.position`, r.MD5, id)
	return r, err
}

// activeRollouts returns the running rollouts, each with its owner only.
func (s *store) activeRollouts(ctx context.Context) ([]rolloutOwner, error) {
	return queryAll(ctx, s.reader, func(row scanner) (rolloutOwner, error) {
		var ro rolloutOwner
		return ro, row.Scan(&ro.id, &ro.owner)
	}, `SELECT id, owner_id FROM rollouts WHERE state = 'running'`)
}

// rolloutOwner is a rollout's id and its owner's.
type rolloutOwner struct{ id, owner int64 }

// setRolloutDevices records the states of devices of a rollout, in one
// transaction.
func (s *store) setRolloutDevices(ctx context.Context, rolloutID int64, devices []*rolloutDevice) error {
	if len(devices) == 0 {
		return nil
	}
	return s.inTx(ctx, func(tx *sql.Tx) error {
		for _, d := range devices {
			_, err := tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ?, command_id = ?, error = ?
				WHERE rollout_id = ? AND position = ?`, d.State, d.CommandID, d.Error, rolloutID, d.position)
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// moveRollout changes the user's rollout from one of the states in from to
// state to; it reports whether it did. errRolloutNotFound when the user
// has no such rollout.
func (s *store) moveRollout(ctx context.Context, ownerID, id int64, from []string, to string) (bool, error) {
	var moved bool
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var state string
		err := tx.QueryRowContext(ctx, `SELECT state FROM rollouts WHERE id = ? AND owner_id = ?`, id, ownerID).Scan(&state)
		if err != nil {
			return notFound(err, errRolloutNotFound)
		}
		if moved = slices.Contains(from, state); !moved {
			return nil
		}
		now := s.timestamp()
		_, err = tx.ExecContext(ctx, `UPDATE rollouts SET state = ?1, updated_at = ?2,
			finished_at = CASE WHEN ?1 IN ('halted', 'cancelled', 'completed') THEN ?2 END WHERE id = ?3`, to, now, id)
		return err
	})
	return moved, err
}
