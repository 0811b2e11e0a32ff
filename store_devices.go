package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// The store's devices and their command buttons.

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
func scanTargets(d *deviceSummary) ([]any, func()) {
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
	dest, done := scanTargets(d)
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
	dest, done := scanTargets(&d.deviceSummary)
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
// this update left it, and the name it had before.
func (s *store) updateDevice(ctx context.Context, teamID int64, uid string, u deviceUpdate) (d *device, previousName string, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		err := tx.QueryRowContext(ctx, `SELECT name FROM devices WHERE uid = ? AND team_id = ?`, uid, teamID).Scan(&previousName)
		if err != nil {
			return notFound(err, errDeviceNotFound)
		}
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
	return d, previousName, err
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

// runningImage is a firmware image a device reports running.
type runningImage struct {
	md5, sha256, version string
	size                 int64
}

// runningImagesOf returns, by uid, the image each device of the team of
// the user with that email reports running, when the device holds a
// firmware row of it (its sha256 and size): what `simulate` restarts a
// device with.
func (s *store) runningImagesOf(ctx context.Context, email string) (map[string]runningImage, error) {
	images := map[string]runningImage{}
	err := queryEach(ctx, s.reader, func(row scanner) (struct{}, error) {
		var uid string
		var img runningImage
		err := row.Scan(&uid, &img.md5, &img.version, &img.sha256, &img.size)
		images[uid] = img
		return struct{}{}, err
	}, func(struct{}) error { return nil }, `SELECT d.uid, d.current_md5, COALESCE(d.current_version, f.version, ''), f.sha256, f.size
		FROM devices d JOIN users u ON u.team_id = d.team_id JOIN firmwares f ON f.device_id = d.id AND f.md5 = d.current_md5
		WHERE u.email = ? GROUP BY d.id`, normalizeEmail(email))
	return images, err
}
