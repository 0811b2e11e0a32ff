package store

// The store's rollouts (rollouts.go).

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"devicehub/internal/model"
)

// ErrMD5OfTwoFiles: the user's firmwares hold two different files under
// the rollout's md5 (an md5 collision), so it could not say which to send.
var ErrMD5OfTwoFiles = errors.New("the md5 names two different files")

// shownState is a rollout device's state as shown, and the rule of the
// device recorded as running whose command has ended: it shows that end,
// also in a rollout that the engine no longer moves (paused, halted,
// cancelled), and the engine records it (scanRolloutDevice).
var shownState = `CASE WHEN rd.state = ` + sqlString(model.RdRunning) + ` AND c.state IN ` + SQLIn(model.CommandEnds...) + `
	THEN c.state ELSE rd.state END`

// ErrNoDeviceMatches: a rollout's select matches none of the team's devices.
var ErrNoDeviceMatches = errors.New("no device matches the selection")

// NewRollout is a validated rollout request: its devices are Devices,
// in that order, or those that selection matches, in uid order.
type NewRollout struct {
	Name                   *string
	MD5                    string
	Devices                []*DeviceRef
	Selection              *DeviceFilter
	BatchSize, MaxFailures int
	CreatedBy              int64                // the user; its OTA commands are sent by them
	Health                 *model.RolloutHealth // its health gate; nil: none
	OnHalt                 string               // model.OnHaltStop or model.OnHaltRevert
}

// RolloutFirmware returns the sha256 of the team's file with that md5,
// from its library or a device; ErrFirmwareNotFound when it has none.
func (s *Store) RolloutFirmware(ctx context.Context, teamID int64, md5sum string) (string, error) {
	src, err := rolloutSourceOf(ctx, s.reader, teamID, md5sum)
	return src.sha256, err
}

// CreateRollout stores a rollout and returns its id. Each device is
// pending, or skipped when it already reports the md5, and gets a
// firmware row for the file (copied from the team's file with that md5,
// in its library or on a device, sharing its bytes); the row becomes its
// target only when the engine sends it the OTA (startBatch). A selection
// is resolved here, inside the database: however many devices match, none
// is loaded. The rows count against the quotas as uploads do: over one,
// nothing is stored, and the QuotaError names the first device over it.
// ErrNoDeviceMatches when a selection matches no device. audit is made
// of the rollout as created (auditRollout).
func (s *Store) CreateRollout(ctx context.Context, teamID int64, nr NewRollout, audit Audit[*model.Rollout]) (id int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		now := s.Timestamp()
		src, err := rolloutSourceOf(ctx, tx, teamID, nr.MD5)
		if err != nil {
			return err
		}
		var health *string
		if nr.Health != nil {
			b, _ := json.Marshal(nr.Health)
			text := string(b)
			health = &text
		}
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (team_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at,
			created_by, health, on_halt) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id`,
			teamID, nr.Name, nr.MD5, src.sha256, model.RolloutRunning, nr.BatchSize, nr.MaxFailures, now, now, nr.CreatedBy, health, nr.OnHalt).Scan(&id)
		if err != nil {
			return err
		}
		devices, err := addRolloutDevices(ctx, tx, id, teamID, nr)
		if err != nil {
			return err
		}
		if devices == 0 {
			return ErrNoDeviceMatches
		}
		if err := checkRolloutPlatform(ctx, tx, id, src.platform); err != nil {
			return err
		}
		if err := s.checkRolloutQuotas(ctx, tx, id, teamID, nr.MD5, src.size); err != nil {
			return err
		}
		if err := giveFirmwareRows(ctx, tx, id, nr.MD5, src, now); err != nil {
			return err
		}
		return auditRollout(ctx, tx, teamID, id, audit)
	})
	return id, err
}

// auditRollout inserts, in tx, the entry audit makes of the team's
// rollout id as the write left it. Nothing when audit is nil.
func auditRollout(ctx context.Context, tx *sql.Tx, teamID, id int64, audit Audit[*model.Rollout]) error {
	if audit == nil {
		return nil
	}
	ro, err := readRollout(ctx, tx, teamID, id)
	if err != nil {
		return err
	}
	return insertAudit(ctx, tx, audit, ro)
}

// readRollout reads the team's rollout id with its device counts and its
// firmware, as RolloutDetail and the audit entries show it.
func readRollout(ctx context.Context, q queryer, teamID, id int64) (*model.Rollout, error) {
	ro, err := scanRollout(q.QueryRowContext(ctx, `SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID))
	if err != nil {
		return nil, err
	}
	if err := countRolloutDevices(ctx, q, ro); err != nil {
		return nil, err
	}
	ro.Firmware, err = firmwareLabelOf(ctx, q, teamID, ro.SHA256)
	return ro, err
}

// giveFirmwareRows gives each device of the rollout sent md5 that has
// no firmware row for it one, copied from src.
func giveFirmwareRows(ctx context.Context, tx *sql.Tx, rolloutID int64, md5sum string, src rolloutSource, now string) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
		SELECT rd.device_id, ?1, ?2, ?3, ?4, ?5, ?6, ?7
		FROM rollout_devices rd
		WHERE rd.rollout_id = ?8 AND COALESCE(rd.md5, ?4) = ?4
			AND NOT EXISTS (SELECT 1 FROM firmwares x WHERE x.device_id = rd.device_id AND x.md5 = ?4)
		ORDER BY rd.position`, src.name, src.version, src.notes, md5sum, src.sha256, src.size, now, rolloutID)
	return err
}

// addRolloutDevices adds the rollout's devices, pending or skipped, at
// their positions from 0: nr.Devices in order (ErrDeviceNotFound if one
// is not of the team), or the team's devices
// that nr.selection matches in uid order, by one INSERT … SELECT. It
// returns how many it added.
func addRolloutDevices(ctx context.Context, tx *sql.Tx, rolloutID, teamID int64, nr NewRollout) (int64, error) {
	state := `CASE WHEN d.current_md5 IS ? THEN ` + sqlString(model.RdSkipped) + ` ELSE ` + sqlString(model.RdPending) + ` END`
	if nr.Selection != nil {
		where, args := matchingDevices(teamID, *nr.Selection)
		res, err := tx.ExecContext(ctx, `INSERT INTO rollout_devices (rollout_id, position, device_id, state)
			SELECT ?, row_number() OVER (ORDER BY d.uid) - 1, d.id, `+state+` FROM devices d`+where+` ORDER BY d.uid`,
			append([]any{rolloutID, nr.MD5}, args...)...)
		if err != nil {
			return 0, err
		}
		return res.RowsAffected()
	}
	insert, err := tx.PrepareContext(ctx, `INSERT INTO rollout_devices (rollout_id, position, device_id, state)
		SELECT ?, ?, d.id, `+state+` FROM devices d WHERE d.id = ? AND d.team_id = ?`)
	if err != nil {
		return 0, err
	}
	defer insert.Close()
	for i, d := range nr.Devices {
		res, err := insert.ExecContext(ctx, rolloutID, i, nr.MD5, d.id, teamID)
		if err != nil {
			return 0, err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return 0, ErrDeviceNotFound
		}
	}
	return int64(len(nr.Devices)), nil
}

// ErrPlatformMismatch: a rollout sends a library file checked for one
// platform to a device of another.
var ErrPlatformMismatch = errors.New("the firmware is for another platform")

// checkRolloutPlatform refuses a file checked as an image of one ESP
// platform for a rollout that has a device of another.
func checkRolloutPlatform(ctx context.Context, tx *sql.Tx, rolloutID int64, platform *string) error {
	if platform == nil || !strings.HasPrefix(*platform, "esp") {
		return nil
	}
	var other bool
	err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
		JOIN platforms p ON p.id = d.platform_id WHERE rd.rollout_id = ? AND p.key != ?)`, rolloutID, *platform).Scan(&other)
	if err == nil && other {
		err = ErrPlatformMismatch
	}
	return err
}

// lackingFirmware is the rollout's devices that have no firmware row with
// the md5 yet, in the rollout's order: those it gives one.
const lackingFirmware = ` FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
	WHERE rd.rollout_id = ?1 AND COALESCE(rd.md5, ?2) = ?2
		AND NOT EXISTS (SELECT 1 FROM firmwares f WHERE f.device_id = rd.device_id AND f.md5 = ?2)`

// checkRolloutQuotas checks the firmware rows of size bytes that the
// rollout gives its devices that lack one, as one upload each, in the
// rollout's order: the first device that would pass a limit (the count
// per device before the bytes, as for an upload) is named in the
// QuotaError.
func (s *Store) checkRolloutQuotas(ctx context.Context, tx *sql.Tx, rolloutID, teamID int64, md5sum string, size int64) error {
	var over []*QuotaError
	var positions []int64
	find := func(qe *QuotaError, query string, args ...any) error {
		var pos int64
		err := tx.QueryRowContext(ctx, `SELECT rd.position, d.uid`+lackingFirmware+query,
			append([]any{rolloutID, md5sum}, args...)...).Scan(&pos, &qe.Device)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		over, positions = append(over, qe), append(positions, pos)
		return err
	}
	if limit := s.limits.Firmwares; limit > 0 {
		err := find(&QuotaError{Quota: QuotaFirmwares, Limit: limit},
			` AND (SELECT count(*) FROM firmwares f WHERE f.device_id = rd.device_id) >= ?3 ORDER BY rd.position LIMIT 1`, limit)
		if err != nil {
			return err
		}
	}
	if mib := s.limits.FirmwareMiB; mib > 0 {
		used, err := s.firmwareBytesUsed(ctx, tx, teamID)
		if err != nil {
			return err
		}
		fit := max(0, (int64(mib)<<20-used)/diskBytes(size)) // how many rows fit: the next one is over
		err = find(&QuotaError{Quota: QuotaFirmwareMiB, Limit: mib}, ` ORDER BY rd.position LIMIT 1 OFFSET ?3`, fit)
		if err != nil {
			return err
		}
	}
	if len(over) == 0 {
		return nil
	}
	first := 0
	if len(over) == 2 && positions[1] < positions[0] {
		first = 1
	}
	return over[first]
}

const rolloutColumns = `id, name, NULLIF(md5, ''), NULLIF(sha256, ''), state, batch_size, max_failures, created_at, updated_at, finished_at, created_by,
	health, halt_reason, COALESCE(gate_from, created_at), COALESCE(failures_before, 0),
	on_halt, reverts, (SELECT x.id FROM rollouts x WHERE x.reverts = rollouts.id)`

func scanRollout(row scanner) (*model.Rollout, error) {
	r := &model.Rollout{Counts: map[model.RolloutDeviceState]int{}}
	var health, why *string
	err := row.Scan(&r.ID, &r.Name, &r.MD5, &r.SHA256, &r.State, &r.BatchSize, &r.MaxFailures,
		&r.CreatedAt, &r.UpdatedAt, &r.FinishedAt, &r.CreatedBy, &health, &why, &r.GateFrom, &r.FailuresBefore,
		&r.OnHalt, &r.Reverts, &r.RevertedBy)
	if err != nil {
		return nil, notFound(err, ErrRolloutNotFound)
	}
	if health != nil {
		r.Health = &model.RolloutHealth{}
		if err := json.Unmarshal([]byte(*health), r.Health); err != nil {
			return nil, fmt.Errorf("rollout %d: health: %w", r.ID, err)
		}
	}
	if why != nil {
		r.HaltReason = json.RawMessage(*why)
	}
	for _, st := range model.RolloutDeviceStates {
		r.Counts[st] = 0
	}
	return r, nil
}

// RolloutsOf lists the user's rollouts, newest first, with their counts.
func (s *Store) RolloutsOf(ctx context.Context, teamID int64) ([]*model.Rollout, error) {
	list, err := queryAll(ctx, s.reader, scanRollout,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE team_id = ? ORDER BY id DESC`, teamID)
	if err != nil {
		return nil, err
	}
	byID := map[int64]*model.Rollout{}
	for _, r := range list {
		byID[r.ID] = r
		if r.Firmware, err = firmwareLabelOf(ctx, s.reader, teamID, r.SHA256); err != nil {
			return nil, err
		}
	}
	_, err = queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
		var id int64
		var state model.RolloutDeviceState
		var n int
		err := row.Scan(&id, &state, &n)
		if err == nil {
			byID[id].Counts[state] = n
		}
		return struct{}{}, err
	}, `SELECT rd.rollout_id, `+shownState+`, count(*)
		FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE r.team_id = ? GROUP BY 1, 2`, teamID)
	return list, err
}

// rolloutHead returns the user's rollout without its devices;
// ErrRolloutNotFound when the user has none with that id.
func (s *Store) RolloutHead(ctx context.Context, teamID, id int64) (*model.Rollout, error) {
	return scanRollout(s.reader.QueryRowContext(ctx,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID))
}

// RolloutDeviceRow is a rollout's device as the store reads it: as
// shown, and what the engine needs to know of it.
type RolloutDeviceRow struct {
	model.RolloutDevice
	position int
	Online   bool                // the device's status is online
	Runs     bool                // it reports the rollout's md5
	CmdState *model.CommandState // its command's state; nil when the command does not exist
	Ended    bool                // State was running and is now how its command ended, not yet recorded
	Target   *NewTarget          // set by the engine when it sends the device the OTA
}

// NewTarget is the firmware row a rollout makes a device's target.
type NewTarget struct {
	Device     *DeviceRef
	FirmwareID int64
}

// rolloutDeviceQuery reads a rollout's devices in order (scanRolloutDevice);
// its first argument is the rollout's md5, its second the rollout's id.
// A device is sent its own md5 if it has one (a revert's; empty: nothing),
// else the rollout's.
var rolloutDeviceQuery = `SELECT d.uid, d.name, c.progress, ` + shownState + `, NULLIF(COALESCE(rd.md5, ?1), ''), rd.state, rd.command_id, rd.error,
	rd.position, d.status = ` + sqlString(model.StatusOnline) + `, d.current_md5 IS COALESCE(rd.md5, ?1), c.state, c.error
	FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
	LEFT JOIN commands c ON c.id = rd.command_id
	WHERE rd.rollout_id = ?2`

// scanRolloutDevice reads a row of rolloutDeviceQuery. A device whose
// shown state is not the recorded one has ended (shownState), with its
// command's error.
func scanRolloutDevice(row scanner) (RolloutDeviceRow, error) {
	var d RolloutDeviceRow
	var recorded model.RolloutDeviceState
	var cmdError *string
	err := row.Scan(&d.UID, &d.Name, &d.Progress, &d.State, &d.MD5, &recorded, &d.CommandID, &d.Error, &d.position,
		&d.Online, &d.Runs, &d.CmdState, &cmdError)
	if d.Ended = d.State != recorded; d.Ended {
		d.Error = cmdError
	}
	return d, err
}

// RolloutDetail reads the user's rollout with its counts and its health
// gate's status and hands it to
// start, then each of its devices, in order, to each, as they are read:
// nothing but the device at hand is held, however many the rollout has.
// It reads in one transaction, so that the counts are those of the
// devices. ErrRolloutNotFound when the user has no rollout with that id.
func (s *Store) RolloutDetail(ctx context.Context, teamID, id int64, start func(*model.Rollout) error, each func(model.RolloutDevice) error) error {
	conn, err := s.reader.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	// A deferred transaction, not the DSN's immediate one: it only reads.
	if _, err := conn.ExecContext(ctx, `BEGIN DEFERRED`); err != nil {
		return err
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), `ROLLBACK`)
	ro, err := readRollout(ctx, conn, teamID, id)
	if err != nil {
		return err
	}
	if ro.HealthStatus, err = healthStatusOf(ctx, conn, ro, s.Now()); err != nil {
		return err
	}
	if err := start(ro); err != nil {
		return err
	}
	return queryEach(ctx, conn, scanRolloutDevice, func(d RolloutDeviceRow) error { return each(d.RolloutDevice) },
		rolloutDeviceQuery+` ORDER BY rd.position`, ro.MD5, id)
}

// rolloutBatchStart is the position of a rollout's first device not yet
// ended: a seek of rollout_devices_state for each state not an end.
var rolloutBatchStart = func() string {
	seeks := make([]string, len(model.RdNotEnded))
	for i, st := range model.RdNotEnded {
		seeks[i] = `SELECT min(position) AS p FROM rollout_devices WHERE rollout_id = ?1 AND state = ` + sqlString(st)
	}
	return `SELECT min(p) FROM (` + strings.Join(seeks, ` UNION ALL `) + `)`
}()

// teamRollout returns ErrRolloutNotFound unless the team has the rollout:
// the first read of each method that takes a rollout the caller found
// before (RolloutHead), so that none reads or writes another team's.
func teamRollout(ctx context.Context, q queryer, teamID, id int64) error {
	var one int
	err := q.QueryRowContext(ctx, `SELECT 1 FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID).Scan(&one)
	return notFound(err, ErrRolloutNotFound)
}

// RolloutBatch returns the devices of the team's rollout's current batch, in
// order: the batch (of batch_size positions) of its first device not yet
// ended. nil when every device has ended. Through the index
// rollout_devices_state, whose states it reads, this costs what it costs
// whatever the rollout's size: the engine never reads all its devices.
func (s *Store) RolloutBatch(ctx context.Context, teamID int64, ro *model.Rollout) ([]RolloutDeviceRow, error) {
	if err := teamRollout(ctx, s.reader, teamID, ro.ID); err != nil {
		return nil, err
	}
	var first sql.NullInt64
	err := s.reader.QueryRowContext(ctx, rolloutBatchStart, ro.ID).Scan(&first)
	if err != nil || !first.Valid {
		return nil, err
	}
	start := first.Int64 / int64(ro.BatchSize) * int64(ro.BatchSize)
	return queryAll(ctx, s.reader, scanRolloutDevice, rolloutDeviceQuery+` AND rd.position >= ?3 AND rd.position < ?4 ORDER BY rd.position`,
		ro.MD5, ro.ID, start, start+int64(ro.BatchSize))
}

// RolloutFailures returns how many devices of the team's rollout are
// recorded as failed or timed out.
func (s *Store) RolloutFailures(ctx context.Context, teamID, id int64) (int, error) {
	if err := teamRollout(ctx, s.reader, teamID, id); err != nil {
		return 0, err
	}
	var n int
	err := s.reader.QueryRowContext(ctx, `SELECT count(*) FROM rollout_devices
		WHERE rollout_id = ? AND state IN `+SQLIn(model.RdFailures...), id).Scan(&n)
	return n, err
}

// RolloutCounts fills ro.Counts, ro a rollout of the team: how many of its
// devices show each state.
func (s *Store) RolloutCounts(ctx context.Context, teamID int64, ro *model.Rollout) error {
	if err := teamRollout(ctx, s.reader, teamID, ro.ID); err != nil {
		return err
	}
	return countRolloutDevices(ctx, s.reader, ro)
}

func countRolloutDevices(ctx context.Context, q queryer, ro *model.Rollout) error {
	return queryEach(ctx, q, func(row scanner) (struct{}, error) {
		var state model.RolloutDeviceState
		var n int
		err := row.Scan(&state, &n)
		ro.Counts[state] = n
		return struct{}{}, err
	}, func(struct{}) error { return nil }, `SELECT `+shownState+`, count(*) FROM rollout_devices rd
		LEFT JOIN commands c ON c.id = rd.command_id WHERE rd.rollout_id = ? GROUP BY 1`, ro.ID)
}

// activeRollouts returns the rollouts the engine moves on, each with its
// team only: the running ones, and the halted ones that await their
// revert (rollout.awaitsRevert).
func (s *Store) ActiveRollouts(ctx context.Context) ([]RolloutTeam, error) {
	return queryAll(ctx, s.reader, func(row scanner) (RolloutTeam, error) {
		var ro RolloutTeam
		return ro, row.Scan(&ro.ID, &ro.TeamID)
	}, `SELECT id, team_id FROM rollouts r WHERE state = ?1
		OR (state = ?2 AND on_halt = ?3 AND NOT EXISTS (SELECT 1 FROM rollouts x WHERE x.reverts = r.id))`,
		model.RolloutRunning, model.RolloutHalted, model.OnHaltRevert)
}

// RolloutTeam is a rollout's id and its team's.
type RolloutTeam struct{ ID, TeamID int64 }

// SetRolloutDevices records the states of devices of the team's rollout,
// and the targets of those it sends the OTA (the team's devices), in one
// transaction.
func (s *Store) SetRolloutDevices(ctx context.Context, teamID, id int64, devices []*RolloutDeviceRow) error {
	if len(devices) == 0 {
		return nil
	}
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if err := teamRollout(ctx, tx, teamID, id); err != nil {
			return err
		}
		for _, d := range devices {
			_, err := tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ?, command_id = ?, error = ?
				WHERE rollout_id = ? AND position = ?`, d.State, d.CommandID, d.Error, id, d.position)
			if err == nil && d.Target != nil {
				_, err = tx.ExecContext(ctx, `UPDATE devices SET target_firmware_id = ? WHERE id = ? AND team_id = ?`,
					d.Target.FirmwareID, d.Target.Device.id, teamID)
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// MoveRollout changes the user's rollout from one of the states in from to
// state to; it reports whether it did, and audit is made of the rollout
// as moved when it did (auditRollout). ErrRolloutNotFound when the user
// has no such rollout.
func (s *Store) MoveRollout(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState, audit Audit[*model.Rollout]) (bool, error) {
	return s.endRollout(ctx, teamID, id, from, to, nil, audit)
}

// EndRollout is MoveRollout that also records why (JSON), the reason
// of a halt, which the engine makes: no one audits it.
func (s *Store) EndRollout(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState, why []byte) (bool, error) {
	return s.endRollout(ctx, teamID, id, from, to, why, nil)
}

// endRollout is MoveRollout and EndRollout. A halted rollout resumed
// counts its gates from now on: its crashes from now, its failures past
// those it shows now. A cancelled one skips the devices it has sent
// nothing.
func (s *Store) endRollout(ctx context.Context, teamID, id int64, from []model.RolloutState, to model.RolloutState, why []byte,
	audit Audit[*model.Rollout]) (bool, error) {
	var moved bool
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var state model.RolloutState
		err := tx.QueryRowContext(ctx, `SELECT state FROM rollouts WHERE id = ? AND team_id = ?`, id, teamID).Scan(&state)
		if err != nil {
			return notFound(err, ErrRolloutNotFound)
		}
		if moved = slices.Contains(from, state); !moved {
			return nil
		}
		now := s.Timestamp()
		var reason *string
		if why != nil {
			text := string(why)
			reason = &text
		}
		_, err = tx.ExecContext(ctx, `UPDATE rollouts SET state = ?1, updated_at = ?2, halt_reason = ?4,
			finished_at = CASE WHEN ?1 IN `+SQLIn(model.RolloutEnds...)+` THEN ?2 END WHERE id = ?3`, to, now, id, reason)
		switch {
		case err != nil:
		case state == model.RolloutHalted && to == model.RolloutRunning:
			_, err = tx.ExecContext(ctx, `UPDATE rollouts SET gate_from = ?2, failures_before =
				(SELECT count(*) FROM rollout_devices rd LEFT JOIN commands c ON c.id = rd.command_id
					WHERE rd.rollout_id = ?1 AND `+shownState+` IN `+SQLIn(model.RdFailures...)+`)
				WHERE id = ?1`, id, now)
		case to == model.RolloutCancelled:
			_, err = tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ? WHERE rollout_id = ? AND state IN `+
				SQLIn(model.RdPending, model.RdWaiting), model.RdSkipped, id)
		}
		if err != nil {
			return err
		}
		return auditRollout(ctx, tx, teamID, id, audit)
	})
	return moved, err
}
