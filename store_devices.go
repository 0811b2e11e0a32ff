package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"devicehub/internal/mqttlink"
)

// The store's devices, their command buttons, and what devices report.

// newDevice is what creating a device takes: keys are created on the
// fly; without a uid, one is drawn (newDeviceUID).
type newDevice struct {
	uid, platform, board, name, description string
	mqttPort                                int
	// capped counts the device against -max-devices: one added through
	// the API, not by the operator's CLI.
	capped bool
}

// newDeviceUID draws a uid for a new device of the platform.
func newDeviceUID(platform string) string { return platform + "_" + randomString(12, lowerAlnum) }

// errUIDTaken: a new device's uid is another device's.
var errUIDTaken = errors.New("uid taken")

// createDevice adds a pending device owned by the team (deviceInserter)
// and returns its uid. A quotaError when nd is capped and the team has
// as many devices as -max-devices allows, or more (the CLI's).
func (s *store) createDevice(ctx context.Context, teamID int64, nd newDevice) (string, error) {
	nd.uid = cmp.Or(nd.uid, newDeviceUID(nd.platform))
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.devices; nd.capped && max > 0 {
			// Counted no further than the limit: a team the CLI gave a
			// million devices costs no more than one at the limit.
			var n int
			err := tx.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM devices WHERE team_id = ? LIMIT ?)`, teamID, max).Scan(&n)
			if err != nil {
				return err
			}
			if n >= max {
				return &quotaError{quota: quotaDevices, limit: max}
			}
		}
		ins, err := newDeviceInserter(ctx, tx, teamID, s.timestamp())
		if err != nil {
			return err
		}
		defer ins.close()
		return ins.add(nd)
	})
	return nd.uid, err
}

// deviceInserter adds devices in a transaction, each a pending device of
// the team: its platform and board keys are created on the fly, its name is
// its uid unless given, its meta holds its MQTT port. The INSERT is
// prepared once, and the keys' ids are remembered: for each of a million
// imported devices, parsing the statement or looking the keys up again
// would cost more than the insert.
type deviceInserter struct {
	ctx    context.Context
	tx     *sql.Tx
	teamID int64
	insert *sql.Stmt
	keys   map[[2]string]int64 // {table, key} → id
	now    string
}

func newDeviceInserter(ctx context.Context, tx *sql.Tx, teamID int64, now string) (*deviceInserter, error) {
	insert, err := tx.PrepareContext(ctx, `INSERT INTO devices (uid, team_id, name, description, platform_id, board_id, meta, created_at)
		VALUES (?, ?, ?, NULLIF(?, ''), ?, ?, ?, ?)`)
	return &deviceInserter{ctx: ctx, tx: tx, teamID: teamID, insert: insert, keys: map[[2]string]int64{}, now: now}, err
}

func (ins *deviceInserter) close() {
	if ins.insert != nil {
		ins.insert.Close()
	}
}

// add inserts nd, whose uid is set, as a device of the team;
// errUIDTaken when its uid is in use.
func (ins *deviceInserter) add(nd newDevice) error {
	platformID, err := ins.keyID("platforms", nd.platform)
	if err != nil {
		return err
	}
	boardID, err := ins.keyID("boards", nd.board)
	if err != nil {
		return err
	}
	meta := fmt.Sprintf(`{"mqtt_port":%d}`, nd.mqttPort)
	_, err = ins.insert.ExecContext(ins.ctx, nd.uid, ins.teamID, cmp.Or(nd.name, nd.uid), nd.description, platformID, boardID, meta, ins.now)
	if isUniqueErr(err) {
		return errUIDTaken
	}
	return err
}

// keyID returns the id of the team's row with that key in table
// (platforms or boards), creating it when missing (upsertKey).
func (ins *deviceInserter) keyID(table, key string) (int64, error) {
	if id, ok := ins.keys[[2]string{table, key}]; ok {
		return id, nil
	}
	id, err := upsertKey(ins.ctx, ins.tx, table, ins.teamID, key)
	if err == nil {
		ins.keys[[2]string{table, key}] = id
	}
	return id, err
}

// upsertKey returns the id of the team's row with that key in table
// (platforms or boards), creating it with name = key when missing,
// numbered after the team's own (schema.sql, version 11).
func upsertKey(ctx context.Context, tx *sql.Tx, table string, teamID int64, key string) (int64, error) {
	var id int64
	err := tx.QueryRowContext(ctx,
		`INSERT INTO `+table+` (team_id, number, key, name)
		 VALUES (?1, (SELECT coalesce(max(number), 0) + 1 FROM `+table+` WHERE team_id = ?1), ?2, ?2)
		 ON CONFLICT (team_id, key) DO UPDATE SET key = excluded.key RETURNING id`, teamID, key).Scan(&id)
	return id, err
}

// summaryColumns are a Device summary's columns, its current firmware's
// (cf) included, as summaryFrom joins them.
const summaryColumns = `d.id, d.uid, d.name, d.status, d.last_seen_at, p.number, p.name, p.key, b.number, b.name, b.key,
	d.current_md5, d.current_version, cf.id, cf.name, cf.version, cf.notes, cf.sha256, cf.size, cf.created_at`

const summaryFrom = ` FROM devices d
	JOIN platforms p ON p.id = d.platform_id
	JOIN boards b ON b.id = d.board_id
	LEFT JOIN firmwares cf ON cf.device_id = d.id AND cf.md5 = d.current_md5`

// scanTargets returns where summaryColumns scan into, and what makes the
// current firmware of them once scanned: a reported md5 that matches no
// uploaded firmware of the device has only md5 and version; a device
// that reported only a version, only that.
func (d *deviceSummary) scanTargets() ([]any, func()) {
	var version *string
	cf := &firmware{}
	return []any{&d.id, &d.UID, &d.Name, &d.Status, &d.LastSeenAt,
			&d.Platform.ID, &d.Platform.Name, &d.Platform.Key, &d.Board.ID, &d.Board.Name, &d.Board.Key,
			&cf.MD5, &version, &cf.ID, &cf.Name, &cf.Version, &cf.Notes, &cf.SHA256, &cf.Size, &cf.CreatedAt},
		func() {
			if cf.MD5 == nil && version == nil {
				return
			}
			if cf.ID == nil { // reported by the device, not uploaded here
				cf.Version = version
			}
			d.CurrentFirmware = cf
		}
}

// scanSummary reads a row of summaryColumns.
func scanSummary(row scanner) (*deviceSummary, error) {
	d := &deviceSummary{}
	dest, done := d.scanTargets()
	err := row.Scan(dest...)
	done()
	return d, err
}

const deviceQuery = `SELECT ` + summaryColumns + `, d.description, d.public_ip, d.local_ip,
	COALESCE(json_extract(d.meta, '$.mqtt_port'), 0), d.last_rssi, d.first_seen_at, d.last_ota_at, d.meta,
	tf.id, tf.name, tf.version, tf.notes, tf.md5, tf.sha256, tf.size, tf.created_at` + summaryFrom + `
	LEFT JOIN firmwares tf ON tf.id = d.target_firmware_id
	WHERE d.uid = ? AND d.team_id = ?`

// deviceRef is what the handlers of a device's commands, buttons and
// firmwares need of it: much less than its Device detail, which costs a
// query of thirty-odd columns to load.
type deviceRef struct {
	id       int64
	uid      string
	teamID   int64 // its team: its events go to the team's streams
	status   deviceStatus
	platform string // its key
	targetID *int64 // its target firmware, if any
}

// deviceRefOf returns the team's device with that uid, or errDeviceNotFound
// when it does not exist or belongs to another team.
func (s *store) deviceRefOf(ctx context.Context, teamID int64, uid string) (*deviceRef, error) {
	d := &deviceRef{teamID: teamID}
	err := s.reader.QueryRowContext(pointRead(ctx), `SELECT d.id, d.uid, d.status, p.key, d.target_firmware_id
		FROM devices d JOIN platforms p ON p.id = d.platform_id WHERE d.uid = ? AND d.team_id = ?`,
		uid, teamID).Scan(&d.id, &d.uid, &d.status, &d.platform, &d.targetID)
	if err != nil {
		return nil, notFound(err, errDeviceNotFound)
	}
	return d, nil
}

// targetFirmware returns the device's target firmware, errNoTarget when
// it has none.
func (s *store) targetFirmware(ctx context.Context, d *deviceRef) (*firmware, error) {
	if d.targetID == nil {
		return nil, errNoTarget
	}
	return firmwareQuery(ctx, s.reader, d.id, strconv.FormatInt(*d.targetID, 10))
}

func deviceIn(ctx context.Context, q queryer, teamID int64, uid string) (*device, error) {
	d := &device{}
	var meta string
	var tf firmware
	dest, done := d.scanTargets()
	dest = append(dest, &d.Description, &d.PublicIP, &d.LocalIP,
		&d.Port, &d.LastRSSI, &d.FirstSeenAt, &d.LastOTAAt, &meta,
		&tf.ID, &tf.Name, &tf.Version, &tf.Notes, &tf.MD5, &tf.SHA256, &tf.Size, &tf.CreatedAt)
	if err := q.QueryRowContext(ctx, deviceQuery, uid, teamID).Scan(dest...); err != nil {
		return nil, notFound(err, errDeviceNotFound)
	}
	done()
	d.IsOnline = d.Status == statusOnline
	d.Meta = json.RawMessage(meta)
	if tf.MD5 != nil {
		d.TargetFirmware = &tf
	}
	return d, nil
}

// device returns the team's device as Device detail, with its newest
// OTA command; errDeviceNotFound when there is none.
func (s *store) device(ctx context.Context, teamID int64, uid string) (*device, error) {
	d, err := deviceIn(ctx, s.reader, teamID, uid)
	if err != nil {
		return nil, err
	}
	d.OTA, err = newestOTA(ctx, s.reader, d.id)
	return d, err
}

// deviceUpdate holds the fields a device PATCH changes; nil leaves one as
// it is, and clearDescription sets the description to null.
type deviceUpdate struct {
	name, description *string
	clearDescription  bool
}

// updateDevice applies u to the team's device and returns the device as
// this update left it.
func (s *store) updateDevice(ctx context.Context, teamID int64, uid string, u deviceUpdate) (*device, error) {
	var d *device
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx,
			`UPDATE devices SET name = COALESCE(?, name),
			 description = CASE WHEN ? THEN NULL ELSE COALESCE(?, description) END
			 WHERE uid = ? AND team_id = ?`, u.name, u.clearDescription, u.description, uid, teamID)
		if err != nil {
			return fmt.Errorf("update device: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return errDeviceNotFound
		}
		// Read back in the same transaction: the answer is this update's result.
		if d, err = deviceIn(ctx, tx, teamID, uid); err != nil {
			return err
		}
		d.OTA, err = newestOTA(ctx, tx, d.id)
		return err
	})
	return d, err
}

// applied is what applyDeviceMessages did.
type applied struct {
	unknown  int            // reports that named no known device
	rejected int            // results that matched no unfinished command of their device
	devices  []deviceChange // the devices the reports changed, as they left them
	commands []string       // the commands a result or a reported md5 changed
	unkept   int            // samples left out: their device has maxSeries series
}

// deviceChange is a device as a report left it, for the event stream.
type deviceChange struct {
	teamID int64
	deviceStatusEvent
	statusChanged, firmwareChanged bool
	boots                          []bootEvent // the boots the report told of, recorded
}

// applyDeviceMessages writes what devices said since the last call in one
// transaction: the command results in the order they came, then the
// merged reports (an updater's progress comes before the md5 it reports
// once it has rebooted). Waiters are woken after a result, and after a
// reported md5, which may end an OTA.
func (s *store) applyDeviceMessages(ctx context.Context, reports map[string]*mqttlink.Report, results []mqttlink.Result) (applied, error) {
	now := s.timestamp()
	var a applied
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var teams []int64 // whose JSON the results grew
		for _, r := range results {
			teamID, err := applyCommandResult(ctx, tx, r, now)
			if err != nil {
				return err
			}
			if teamID == 0 {
				a.rejected++
			} else {
				a.commands = append(a.commands, r.ID)
				teams = append(teams, teamID)
			}
		}
		if err := s.keepTeamData(ctx, tx, teams...); err != nil {
			return err
		}
		if len(reports) == 0 {
			return nil
		}
		stmts, err := prepareReportStmts(ctx, tx, s.limits.historyDays > 0)
		if err != nil {
			return err
		}
		defer stmts.close()
		var statuses []statusReport
		for uid, r := range reports {
			if r.LocalIP == nil && r.PublicIP == nil && r.RSSI == nil && r.FWMD5 == nil && r.FWVersion == nil &&
				len(r.History) == 0 && len(r.Boots) == 0 {
				statuses = append(statuses, statusReport{uid, r.Status, r.Seen.UTC().Format(timeFormat), r.Live})
				continue
			}
			c, ended, unkept, err := stmts.apply(ctx, uid, r)
			if err != nil {
				return err
			}
			a.unkept += unkept
			if c == nil {
				a.unknown++
				continue
			}
			a.devices = append(a.devices, *c)
			a.commands = append(a.commands, ended...)
		}
		if err := applyStatuses(ctx, tx, statuses, &a); err != nil {
			return err
		}
		if s.limits.historyDays == 0 {
			return nil
		}
		return recordPresence(ctx, tx, now, a.devices)
	})
	if err == nil && len(results)+len(a.commands) > 0 {
		s.commandEnds.broadcast()
	}
	return a, err
}

// statusReport is a report with no telemetry: a status, or only a sign
// of life (a result). A restart's retained replay is a million of them.
type statusReport struct {
	uid    string
	status *string
	seen   string
	live   bool
}

// statusChunk is how many status reports one pair of statements writes.
const statusChunk = 1000

// applyStatuses applies status reports as reportStmts.apply would, a
// chunk at a time: two statements for a thousand devices instead of two
// for each, which is what lets a restart apply a million statuses in
// seconds. The reports are bound as parameters of a VALUES list: read
// from a JSON array, each field cost a parse of its element. A retained
// status that changes nothing (a restart's usual case) writes nothing.
// It adds the devices it changed to a, and counts unknown uids.
func applyStatuses(ctx context.Context, tx *sql.Tx, reports []statusReport, a *applied) error {
	for len(reports) > 0 {
		chunk := reports[:min(len(reports), statusChunk)]
		reports = reports[len(chunk):]
		uids := make([]any, len(chunk))
		rows := make([]any, 0, 4*len(chunk))
		for i, r := range chunk {
			uids[i] = r.uid
			rows = append(rows, r.uid, r.status, r.seen, r.live)
		}
		before := map[string]deviceChange{} // owner and status before, by uid
		_, err := queryAll(ctx, tx, func(row scanner) (struct{}, error) {
			var c deviceChange
			err := row.Scan(&c.UID, &c.teamID, &c.Status)
			before[c.UID] = c
			return struct{}{}, err
		}, `SELECT uid, team_id, status FROM devices WHERE uid IN (?`+strings.Repeat(`, ?`, len(chunk)-1)+`)`, uids...)
		if err != nil {
			return err
		}
		a.unknown += len(chunk) - len(before)
		_, err = queryAll(ctx, tx, func(row scanner) (struct{}, error) {
			var n deviceChange
			err := row.Scan(&n.UID, &n.Status, &n.LastSeenAt, &n.LastRSSI)
			c := before[n.UID]
			c.statusChanged = n.Status != c.Status
			c.deviceStatusEvent = n.deviceStatusEvent
			a.devices = append(a.devices, c)
			return struct{}{}, err
		}, `WITH r(u, s, t, l) AS (VALUES (?, ?, ?, ?)`+strings.Repeat(`, (?, ?, ?, ?)`, len(chunk)-1)+`)
			UPDATE devices SET status = COALESCE(r.s, status), first_seen_at = COALESCE(first_seen_at, r.t),
			last_seen_at = CASE WHEN r.l THEN r.t ELSE COALESCE(last_seen_at, r.t) END
			FROM r WHERE devices.uid = r.u
			AND (r.l OR status IS NOT COALESCE(r.s, status) OR first_seen_at IS NULL OR last_seen_at IS NULL)
			RETURNING uid, status, last_seen_at, last_rssi`, rows...)
		if err != nil {
			return err
		}
	}
	return nil
}

// reportStmts are the statements that apply a report, prepared once per
// batch: parsing them for each report cost more than running them.
type reportStmts struct {
	before, update, otaEnd *sql.Stmt
	health                 []*sql.Stmt // healthStmts, in order
	keepHistory            bool        // write samples (-history-days is not 0)
}

func prepareReportStmts(ctx context.Context, tx *sql.Tx, keepHistory bool) (*reportStmts, error) {
	st := &reportStmts{keepHistory: keepHistory, health: make([]*sql.Stmt, len(healthStmts))}
	var err error
	for _, p := range []struct {
		stmt  **sql.Stmt
		query string
	}{
		{&st.before, `SELECT id, team_id, status, COALESCE(current_md5, '') FROM devices WHERE uid = ?`},
		{&st.update, `UPDATE devices SET
		status = COALESCE(?1, status),
		first_seen_at = COALESCE(first_seen_at, ?2),
		last_seen_at = CASE WHEN ?3 THEN ?2 ELSE COALESCE(last_seen_at, ?2) END,
		local_ip = COALESCE(?4, local_ip),
		public_ip = COALESCE(?5, public_ip),
		last_rssi = COALESCE(?6, last_rssi),
		last_ota_at = CASE WHEN ?7 IS NOT NULL AND (
			(?7 IS NOT current_md5 AND ?7 = (SELECT md5 FROM firmwares WHERE id = target_firmware_id))
			OR EXISTS (SELECT 1 FROM commands c WHERE c.device_id = devices.id AND c.kind = 'ota'
				AND c.finished_at IS NULL AND json_extract(c.payload, '$.md5') = ?7
				AND (c.state = ` + sqlString(commandRunning) + ` OR ?7 IS NOT current_md5)))
			THEN ?2 ELSE last_ota_at END,
		current_md5 = COALESCE(?7, current_md5),
		current_version = CASE WHEN ?7 IS NOT NULL THEN ?8 ELSE COALESCE(?8, current_version) END
		WHERE uid = ?9 RETURNING status, last_seen_at, last_rssi, COALESCE(current_md5, '')`},
		{&st.otaEnd, `UPDATE commands SET state = ` + sqlString(commandSucceeded) + `, updated_at = ?1, finished_at = ?1
		WHERE finished_at IS NULL AND kind = 'ota' AND json_extract(payload, '$.md5') = ?2
		AND device_id = (SELECT id FROM devices WHERE uid = ?3) RETURNING id`},
	} {
		if *p.stmt, err = tx.PrepareContext(ctx, p.query); err != nil {
			st.close()
			return nil, err
		}
	}
	for i, q := range healthStmts {
		if st.health[i], err = tx.PrepareContext(ctx, q); err != nil {
			st.close()
			return nil, err
		}
	}
	return st, nil
}

func (st *reportStmts) close() {
	for _, s := range append([]*sql.Stmt{st.before, st.update, st.otaEnd}, st.health...) {
		if s != nil {
			s.Close()
		}
	}
}

// apply applies one merged report and returns the device as it left it
// (nil when no device has that uid) and the ota commands it ended. A
// retained replay (not live) fills the seen times only where they are
// empty. A reported md5 ends the device's unfinished ota commands for that
// md5 as succeeded. last_ota_at is set when the report ends
// such a command after a flash: its image was downloaded (running), or the
// md5 differs from the one the device ran; so also when the target was
// changed since the command was sent. It is set too, as before commands
// existed, when the reported md5 changes to the target's. The report's
// health is written too (applyHealth), which returns the samples left out.
func (st *reportStmts) apply(ctx context.Context, uid string, r *mqttlink.Report) (*deviceChange, []string, int, error) {
	c := &deviceChange{}
	var deviceID int64
	var oldStatus deviceStatus
	var oldMD5, newMD5 string
	err := st.before.QueryRowContext(ctx, uid).Scan(&deviceID, &c.teamID, &oldStatus, &oldMD5)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil, 0, nil
	}
	if err != nil {
		return nil, nil, 0, err
	}
	seen := r.Seen.UTC().Format(timeFormat)
	err = st.update.QueryRowContext(ctx, r.Status, seen, r.Live, r.LocalIP, r.PublicIP, r.RSSI, r.FWMD5, r.FWVersion, uid).
		Scan(&c.Status, &c.LastSeenAt, &c.LastRSSI, &newMD5)
	if err != nil {
		return nil, nil, 0, err
	}
	c.UID, c.statusChanged, c.firmwareChanged = uid, c.Status != oldStatus, newMD5 != oldMD5
	unkept, err := st.applyHealth(ctx, deviceID, r, c)
	if err != nil || r.FWMD5 == nil {
		return c, nil, unkept, err
	}
	rows, err := st.otaEnd.QueryContext(ctx, seen, *r.FWMD5, uid)
	if err != nil {
		return nil, nil, 0, err
	}
	defer rows.Close()
	var ended []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, nil, 0, err
		}
		ended = append(ended, id)
	}
	return c, ended, unkept, rows.Err()
}

// applyCommandResult applies one result to its command if the command is
// unfinished and belongs to the device that sent it; it returns the
// device's team, or 0 when no command changed.
func applyCommandResult(ctx context.Context, tx *sql.Tx, r mqttlink.Result, now string) (int64, error) {
	var result *string
	if r.Value != nil {
		v := string(r.Value)
		result = &v
	}
	var teamID int64
	err := tx.QueryRowContext(ctx, `UPDATE commands SET
		state = CASE WHEN ?1 IS NULL THEN `+sqlString(commandRunning)+` WHEN ?1 THEN `+sqlString(commandSucceeded)+` ELSE `+sqlString(commandFailed)+` END,
		progress = COALESCE(?2, progress), result = ?3, error = ?4, updated_at = ?5,
		finished_at = CASE WHEN ?1 IS NULL THEN NULL ELSE ?5 END
		WHERE id = ?6 AND finished_at IS NULL AND device_id = (SELECT id FROM devices WHERE uid = ?7)
		RETURNING (SELECT team_id FROM devices WHERE id = device_id)`,
		r.OK, r.Progress, result, r.Error, now, r.ID, r.UID).Scan(&teamID)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return teamID, err
}

// buttonsOf lists a device's buttons in creation order.
func (s *store) buttonsOf(ctx context.Context, deviceID int64) ([]commandButton, error) {
	return queryAll(ctx, s.reader, func(row scanner) (commandButton, error) {
		var b commandButton
		var payload string
		err := row.Scan(&b.ID, &b.Label, &payload, &b.Confirm)
		b.Payload = json.RawMessage(payload)
		return b, err
	}, `SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? ORDER BY seq`, deviceID)
}

// button returns one button of the device or errButtonNotFound.
func (s *store) button(ctx context.Context, deviceID int64, id string) (*commandButton, error) {
	var b commandButton
	var payload string
	err := s.reader.QueryRowContext(ctx,
		`SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? AND id = ?`,
		deviceID, id).Scan(&b.ID, &b.Label, &payload, &b.Confirm)
	if err != nil {
		return nil, notFound(err, errButtonNotFound)
	}
	b.Payload = json.RawMessage(payload)
	return &b, nil
}

// createButton adds a button; errButtonExists when the device has one with
// that id, a quotaError when it has as many as allowed, or when the team's
// buttons' payloads would pass -max-team-data-mib. Its commands are not
// counted there: the oldest finished ones make room (keepTeamData).
func (s *store) createButton(ctx context.Context, deviceID int64, b commandButton) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.buttons; max > 0 {
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM command_buttons WHERE device_id = ?`, deviceID).Scan(&n); err != nil {
				return err
			}
			if n >= max {
				return &quotaError{quota: quotaButtons, limit: max}
			}
		}
		var teamID, buttonBytes int64
		err := tx.QueryRowContext(ctx, `SELECT t.id, t.button_bytes FROM devices d JOIN teams t ON t.id = d.team_id
			WHERE d.id = ?`, deviceID).Scan(&teamID, &buttonBytes)
		if err != nil {
			return notFound(err, errDeviceNotFound)
		}
		if mib := s.limits.teamDataMiB; mib > 0 && buttonBytes+int64(len(b.Payload)) > int64(mib)<<20 {
			return &quotaError{quota: quotaTeamData, limit: mib}
		}
		_, err = tx.ExecContext(ctx,
			`INSERT INTO command_buttons (device_id, id, label, payload, confirm) VALUES (?, ?, ?, ?, ?)`,
			deviceID, b.ID, b.Label, string(b.Payload), b.Confirm)
		if isUniqueErr(err) {
			return errButtonExists
		}
		if err != nil {
			return err
		}
		return s.keepTeamData(ctx, tx, teamID)
	})
}

// deleteButton removes a button or returns errButtonNotFound.
func (s *store) deleteButton(ctx context.Context, deviceID int64, id string) error {
	res, err := s.writer.ExecContext(ctx, `DELETE FROM command_buttons WHERE device_id = ? AND id = ?`, deviceID, id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errButtonNotFound
	}
	return nil
}

// deviceUIDsOwnedBy returns the uids of the devices of the team of the
// user with that email, oldest first (`devicehub simulate` runs them); errUserNotFound when no
// user has that email, an empty list when the user has no devices.
func (s *store) deviceUIDsOwnedBy(ctx context.Context, email string) ([]string, error) {
	if _, err := s.userByEmail(ctx, email); err != nil {
		return nil, err
	}
	return queryAll(ctx, s.reader, scanString, `SELECT d.uid FROM devices d JOIN users u ON u.team_id = d.team_id
		WHERE u.email = ? ORDER BY d.id`, normalizeEmail(email))
}
