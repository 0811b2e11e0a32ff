package main

// The store's rollouts (rollouts.go).

import (
	"context"
	"database/sql"
	"errors"
	"slices"
)

// rollout is the API's Rollout object (README: Rollouts); Devices only in the
// detail.
type rollout struct {
	ID          int64           `json:"id"`
	Name        *string         `json:"name"`
	MD5         string          `json:"md5"`
	SHA256      string          `json:"sha256"`
	State       string          `json:"state"`
	BatchSize   int             `json:"batch_size"`
	MaxFailures int             `json:"max_failures"`
	Counts      map[string]int  `json:"counts"`
	CreatedAt   string          `json:"created_at"`
	UpdatedAt   string          `json:"updated_at"`
	FinishedAt  *string         `json:"finished_at"`
	Devices     []rolloutDevice `json:"devices,omitempty"`
}

// rolloutDevice is one device of a rollout, and what the engine needs
// to know of it.
type rolloutDevice struct {
	UID       string  `json:"uid"`
	State     string  `json:"state"`
	CommandID *string `json:"command_id"`
	Error     *string `json:"error"`
	position  int
	deviceID  int64
	online    bool    // the device's status is online
	runs      bool    // it reports the rollout's md5
	cmdState  *string // its command's state; nil when the command does not exist
	cmdError  *string
	ended     bool // State was running and is now how its command ended, not yet recorded
}

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
}

// rolloutFirmware returns the sha256 of the user's firmware with that md5,
// errFirmwareNotFound when none of the user's devices has one.
func (s *store) rolloutFirmware(ctx context.Context, ownerID int64, md5sum string) (string, error) {
	var sha string
	err := s.read.QueryRowContext(ctx, `SELECT f.sha256 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.owner_id = ? AND f.md5 = ? ORDER BY f.id LIMIT 1`, ownerID, md5sum).Scan(&sha)
	return sha, notFound(err, errFirmwareNotFound)
}

// deviceIDsByUID maps those of the uids that name the user's devices to
// their ids.
func (s *store) deviceIDsByUID(ctx context.Context, ownerID int64, uids []string) (map[string]int64, error) {
	ids := map[string]int64{}
	for _, uid := range uids {
		var id int64
		err := s.read.QueryRowContext(ctx, `SELECT id FROM devices WHERE uid = ? AND owner_id = ?`, uid, ownerID).Scan(&id)
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
func (s *store) createRollout(ctx context.Context, ownerID int64, nr newRollout) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		now := s.timestamp()
		var srcID int64
		var sha string
		var files int
		err := tx.QueryRowContext(ctx, `SELECT count(DISTINCT f.sha256), coalesce(min(f.id), 0), coalesce(min(f.sha256), '')
			FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE d.owner_id = ? AND f.md5 = ?`, ownerID, nr.md5).Scan(&files, &srcID, &sha)
		switch {
		case err != nil:
			return err
		case files == 0:
			return errFirmwareNotFound
		case files > 1:
			return errMD5OfTwoFiles
		}
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at)
			VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?) RETURNING id`,
			ownerID, nr.name, nr.md5, sha, nr.batchSize, nr.maxFailures, now, now).Scan(&id)
		if err != nil {
			return err
		}
		for i, deviceID := range nr.deviceIDs {
			if err := addRolloutDevice(ctx, tx, id, i, deviceID, srcID, nr.md5, now); err != nil {
				return err
			}
		}
		return nil
	})
	return id, err
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

const rolloutColumns = `id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at`

func scanRollout(row interface{ Scan(...any) error }) (*rollout, error) {
	r := &rollout{Counts: map[string]int{}}
	err := row.Scan(&r.ID, &r.Name, &r.MD5, &r.SHA256, &r.State, &r.BatchSize, &r.MaxFailures,
		&r.CreatedAt, &r.UpdatedAt, &r.FinishedAt)
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
	rows, err := s.read.QueryContext(ctx, `SELECT `+rolloutColumns+` FROM rollouts WHERE owner_id = ? ORDER BY id DESC`, ownerID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []*rollout{}
	byID := map[int64]*rollout{}
	for rows.Next() {
		r, err := scanRollout(rows)
		if err != nil {
			return nil, err
		}
		list = append(list, r)
		byID[r.ID] = r
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	counts, err := s.read.QueryContext(ctx, `SELECT rd.rollout_id, `+rolloutDeviceState+`, count(*)
		FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE r.owner_id = ? GROUP BY 1, 2`, ownerID)
	if err != nil {
		return nil, err
	}
	defer counts.Close()
	for counts.Next() {
		var id int64
		var state string
		var n int
		if err := counts.Scan(&id, &state, &n); err != nil {
			return nil, err
		}
		byID[id].Counts[state] = n
	}
	return list, counts.Err()
}

// rolloutOf returns the user's rollout with its devices, in the order
// given, and what the engine needs to know of each; errRolloutNotFound
// when the user has none with that id.
func (s *store) rolloutOf(ctx context.Context, ownerID, id int64) (*rollout, error) {
	r, err := scanRollout(s.read.QueryRowContext(ctx,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND owner_id = ?`, id, ownerID))
	if err != nil {
		return nil, err
	}
	rows, err := s.read.QueryContext(ctx, `SELECT d.uid, rd.state, rd.command_id, rd.error, rd.position, d.id,
		d.status = 'online', d.current_md5 IS ?, c.state, c.error
		FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE rd.rollout_id = ? ORDER BY rd.position`, r.MD5, id)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var d rolloutDevice
		err := rows.Scan(&d.UID, &d.State, &d.CommandID, &d.Error, &d.position, &d.deviceID,
			&d.online, &d.runs, &d.cmdState, &d.cmdError)
		if err != nil {
			return nil, err
		}
		if d.State == "running" && d.cmdState != nil && slices.Contains([]string{"succeeded", "failed", "timed_out"}, *d.cmdState) {
			d.State, d.Error, d.ended = *d.cmdState, d.cmdError, true
		}
		r.Devices = append(r.Devices, d)
		r.Counts[d.State]++
	}
	return r, rows.Err()
}

// activeRollouts returns the ids and owners of the running rollouts.
func (s *store) activeRollouts(ctx context.Context) (map[int64]int64, error) {
	rows, err := s.read.QueryContext(ctx, `SELECT id, owner_id FROM rollouts WHERE state = 'running'`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	active := map[int64]int64{}
	for rows.Next() {
		var id, owner int64
		if err := rows.Scan(&id, &owner); err != nil {
			return nil, err
		}
		active[id] = owner
	}
	return active, rows.Err()
}

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
