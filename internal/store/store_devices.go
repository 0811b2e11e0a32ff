package store

import (
	"cmp"
	"context"
	"database/sql"
	"devicehub/internal/model"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// The store's devices and their command buttons.

// NewDevice is what creating a device takes: keys are created on the
// fly; without a uid, one is drawn (NewDeviceUID).
type NewDevice struct {
	UID, Platform, Board, Name, Description string
	MQTTPort                                int
	// Capped counts the device against -max-devices: one added through
	// the API, not by the operator's CLI.
	Capped bool
}

// NewDeviceUID draws a uid for a new device of the platform.
func NewDeviceUID(platform string) string { return platform + "_" + RandomString(12, LowerAlnum) }

// ErrUIDTaken: a new device's uid is another device's.
var ErrUIDTaken = errors.New("uid taken")

// CreateDevice adds a pending device owned by the team (deviceInserter)
// and returns its uid. A QuotaError when nd is capped and the team has
// as many devices as -max-devices allows, or more (the CLI's). audit is
// made of the device as created.
func (s *Store) CreateDevice(ctx context.Context, teamID int64, nd NewDevice, audit Audit[*model.Device]) (string, error) {
	nd.UID = cmp.Or(nd.UID, NewDeviceUID(nd.Platform))
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.Devices; nd.Capped && max > 0 {
			// Counted no further than the limit: a team the CLI gave a
			// million devices costs no more than one at the limit.
			var n int
			err := tx.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM devices WHERE team_id = ? LIMIT ?)`, teamID, max).Scan(&n)
			if err != nil {
				return err
			}
			if n >= max {
				return &QuotaError{Quota: QuotaDevices, Limit: max}
			}
		}
		ins, err := newDeviceInserter(ctx, tx, teamID, s.Timestamp())
		if err != nil {
			return err
		}
		defer ins.close()
		if err := ins.add(nd); err != nil || audit == nil {
			return err
		}
		d, err := deviceIn(ctx, tx, teamID, nd.UID)
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, d)
	})
	return nd.UID, err
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
// ErrUIDTaken when its uid is in use.
func (ins *deviceInserter) add(nd NewDevice) error {
	platformID, err := ins.keyID("platforms", nd.Platform)
	if err != nil {
		return err
	}
	boardID, err := ins.keyID("boards", nd.Board)
	if err != nil {
		return err
	}
	meta := fmt.Sprintf(`{"mqtt_port":%d}`, nd.MQTTPort)
	_, err = ins.insert.ExecContext(ins.ctx, nd.UID, ins.teamID, cmp.Or(nd.Name, nd.UID), nd.Description, platformID, boardID, meta, ins.now)
	if isUniqueErr(err) {
		return ErrUIDTaken
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
func scanTargets(d *model.DeviceSummary) ([]any, func()) {
	var version *string
	cf := &model.Firmware{}
	return []any{&d.ID, &d.UID, &d.Name, &d.Status, &d.LastSeenAt,
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
func scanSummary(row scanner) (*model.DeviceSummary, error) {
	d := &model.DeviceSummary{}
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

// DeviceRef is a team's device as the store found it with a team-scoped
// read: what the handlers of a device's commands, buttons, firmwares and
// history need of it, much less than its Device detail, which costs a
// query of thirty-odd columns to load. Its fields are unexported and only
// the team-scoped reads DeviceRefOf (a device's routes, the rollout
// engine) and DeviceRefsOf (a rollout's list of devices) make one, so a
// method that takes a *DeviceRef reads or writes a device of the team that
// read it, and no other: the compiler, not the caller, holds that line.
// The device's own paths (the MQTT
// ingest, ApplyDeviceMessages, and its OTA download, OpenFirmwareFile)
// need none: they name the device by its uid, which the broker or the
// download URL authenticated, and have no team to scope to
// (docs/security.md, "Team scoping in the store").
type DeviceRef struct {
	id       int64
	uid      string
	teamID   int64 // its team: its events go to the team's streams
	status   model.DeviceStatus
	platform string // its key
	targetID *int64 // its target firmware, if any
}

// UID is the device's uid.
func (d *DeviceRef) UID() string { return d.uid }

// TeamID is the team whose read found the device.
func (d *DeviceRef) TeamID() int64 { return d.teamID }

// Status is the device's status when it was read.
func (d *DeviceRef) Status() model.DeviceStatus { return d.status }

// Platform is the key of the device's platform.
func (d *DeviceRef) Platform() string { return d.platform }

// DeviceRefOf returns the team's device with that uid, or ErrDeviceNotFound
// when it does not exist or belongs to another team. It and DeviceRefsOf
// are the only places a DeviceRef is made.
func (s *Store) DeviceRefOf(ctx context.Context, teamID int64, uid string) (*DeviceRef, error) {
	return deviceRefIn(pointRead(ctx), s.reader, teamID, uid)
}

// DeviceRefsOf returns those of the uids that name the team's devices,
// each with its DeviceRef: a uid of no device, or of another team's, is
// left out.
func (s *Store) DeviceRefsOf(ctx context.Context, teamID int64, uids []string) (map[string]*DeviceRef, error) {
	refs := map[string]*DeviceRef{}
	for _, uid := range uids {
		d, err := deviceRefIn(ctx, s.reader, teamID, uid)
		if errors.Is(err, ErrDeviceNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		refs[uid] = d
	}
	return refs, nil
}

// deviceRefIn reads the team's device with that uid as a DeviceRef.
func deviceRefIn(ctx context.Context, q queryer, teamID int64, uid string) (*DeviceRef, error) {
	d := &DeviceRef{teamID: teamID}
	err := q.QueryRowContext(ctx, `SELECT d.id, d.uid, d.status, p.key, d.target_firmware_id
		FROM devices d JOIN platforms p ON p.id = d.platform_id WHERE d.uid = ? AND d.team_id = ?`,
		uid, teamID).Scan(&d.id, &d.uid, &d.status, &d.platform, &d.targetID)
	if err != nil {
		return nil, notFound(err, ErrDeviceNotFound)
	}
	return d, nil
}

// TargetFirmware returns the device's target firmware, ErrNoTarget when
// it has none.
func (s *Store) TargetFirmware(ctx context.Context, d *DeviceRef) (*model.Firmware, error) {
	if d.targetID == nil {
		return nil, ErrNoTarget
	}
	return firmwareQuery(ctx, s.reader, d.id, strconv.FormatInt(*d.targetID, 10))
}

func deviceIn(ctx context.Context, q queryer, teamID int64, uid string) (*model.Device, error) {
	d := &model.Device{}
	var meta string
	var tf model.Firmware
	dest, done := scanTargets(&d.DeviceSummary)
	dest = append(dest, &d.Description, &d.PublicIP, &d.LocalIP,
		&d.Port, &d.LastRSSI, &d.FirstSeenAt, &d.LastOTAAt, &meta,
		&tf.ID, &tf.Name, &tf.Version, &tf.Notes, &tf.MD5, &tf.SHA256, &tf.Size, &tf.CreatedAt)
	if err := q.QueryRowContext(ctx, deviceQuery, uid, teamID).Scan(dest...); err != nil {
		return nil, notFound(err, ErrDeviceNotFound)
	}
	done()
	d.IsOnline = d.Status == model.StatusOnline
	d.Meta = json.RawMessage(meta)
	if tf.MD5 != nil {
		d.TargetFirmware = &tf
	}
	return d, nil
}

// Device returns the team's device as Device detail, with its newest
// OTA command; ErrDeviceNotFound when there is none.
func (s *Store) Device(ctx context.Context, teamID int64, uid string) (*model.Device, error) {
	d, err := deviceIn(ctx, s.reader, teamID, uid)
	if err != nil {
		return nil, err
	}
	d.OTA, err = newestOTA(ctx, s.reader, d.ID)
	return d, err
}

// DeviceUpdate holds the fields a device PATCH changes; nil leaves one as
// it is, and ClearDescription sets the description to null.
type DeviceUpdate struct {
	Name, Description *string
	ClearDescription  bool
}

// DeviceEdit is what an update did to a device: the device as the
// update left it, and the name it had before.
type DeviceEdit struct {
	Device       *model.Device
	PreviousName string
}

// UpdateDevice applies u to the team's device and returns the device as
// this update left it; audit is made of that and the name it had before.
func (s *Store) UpdateDevice(ctx context.Context, teamID int64, uid string, u DeviceUpdate, audit Audit[DeviceEdit]) (d *model.Device, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var previousName string
		err := tx.QueryRowContext(ctx, `SELECT name FROM devices WHERE uid = ? AND team_id = ?`, uid, teamID).Scan(&previousName)
		if err != nil {
			return notFound(err, ErrDeviceNotFound)
		}
		res, err := tx.ExecContext(ctx,
			`UPDATE devices SET name = COALESCE(?, name),
			 description = CASE WHEN ? THEN NULL ELSE COALESCE(?, description) END
			 WHERE uid = ? AND team_id = ?`, u.Name, u.ClearDescription, u.Description, uid, teamID)
		if err != nil {
			return fmt.Errorf("update device: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return ErrDeviceNotFound
		}
		// Read back in the same transaction: the answer is this update's result.
		if d, err = deviceIn(ctx, tx, teamID, uid); err != nil {
			return err
		}
		if d.OTA, err = newestOTA(ctx, tx, d.ID); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, DeviceEdit{d, previousName})
	})
	return d, err
}

// ButtonsOf lists a device's buttons in creation order.
func (s *Store) ButtonsOf(ctx context.Context, d *DeviceRef) ([]model.CommandButton, error) {
	return queryAll(ctx, s.reader, func(row scanner) (model.CommandButton, error) {
		var b model.CommandButton
		var payload string
		err := row.Scan(&b.ID, &b.Label, &payload, &b.Confirm)
		b.Payload = json.RawMessage(payload)
		return b, err
	}, `SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? ORDER BY seq`, d.id)
}

// Button returns one button of the device or ErrButtonNotFound.
func (s *Store) Button(ctx context.Context, d *DeviceRef, id string) (*model.CommandButton, error) {
	var b model.CommandButton
	var payload string
	err := s.reader.QueryRowContext(ctx,
		`SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? AND id = ?`,
		d.id, id).Scan(&b.ID, &b.Label, &payload, &b.Confirm)
	if err != nil {
		return nil, notFound(err, ErrButtonNotFound)
	}
	b.Payload = json.RawMessage(payload)
	return &b, nil
}

// CreateButton adds a button; ErrButtonExists when the device has one with
// that id, a QuotaError when it has as many as allowed, or when the team's
// buttons' payloads would pass -max-team-data-mib. Its commands are not
// counted there: the oldest finished ones make room (keepTeamData).
// audit is made of b.
func (s *Store) CreateButton(ctx context.Context, d *DeviceRef, b model.CommandButton, audit Audit[model.CommandButton]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.Buttons; max > 0 {
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM command_buttons WHERE device_id = ?`, d.id).Scan(&n); err != nil {
				return err
			}
			if n >= max {
				return &QuotaError{Quota: QuotaButtons, Limit: max}
			}
		}
		var teamID, buttonBytes int64
		err := tx.QueryRowContext(ctx, `SELECT t.id, t.button_bytes FROM devices d JOIN teams t ON t.id = d.team_id
			WHERE d.id = ?`, d.id).Scan(&teamID, &buttonBytes)
		if err != nil {
			return notFound(err, ErrDeviceNotFound)
		}
		if mib := s.limits.TeamDataMiB; mib > 0 && buttonBytes+int64(len(b.Payload)) > int64(mib)<<20 {
			return &QuotaError{Quota: QuotaTeamData, Limit: mib}
		}
		_, err = tx.ExecContext(ctx,
			`INSERT INTO command_buttons (device_id, id, label, payload, confirm) VALUES (?, ?, ?, ?, ?)`,
			d.id, b.ID, b.Label, string(b.Payload), b.Confirm)
		if isUniqueErr(err) {
			return ErrButtonExists
		}
		if err != nil {
			return err
		}
		if err := s.keepTeamData(ctx, tx, teamID); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, b)
	})
}

// DeleteButton removes a button or returns ErrButtonNotFound. audit is
// made of the button's id.
func (s *Store) DeleteButton(ctx context.Context, d *DeviceRef, id string, audit Audit[string]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM command_buttons WHERE device_id = ? AND id = ?`, d.id, id)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return ErrButtonNotFound
		}
		return insertAudit(ctx, tx, audit, id)
	})
}

// DeviceUIDsOwnedBy returns the uids of the devices of the team of the
// user with that email, oldest first (`devicehub simulate` runs them); ErrUserNotFound when no
// user has that email, an empty list when the user has no devices.
func (s *Store) DeviceUIDsOwnedBy(ctx context.Context, email string) ([]string, error) {
	if _, err := s.UserByEmail(ctx, email); err != nil {
		return nil, err
	}
	return queryAll(ctx, s.reader, scanString, `SELECT d.uid FROM devices d JOIN users u ON u.team_id = d.team_id
		WHERE u.email = ? ORDER BY d.id`, NormalizeEmail(email))
}

// runningImage is a firmware image a device reports running.
type runningImage struct {
	MD5, SHA256, Version string
	Size                 int64
}

// RunningImagesOf returns, by uid, the image each device of the team of
// the user with that email reports running, when the device holds a
// firmware row of it (its sha256 and size): what `simulate` restarts a
// device with.
func (s *Store) RunningImagesOf(ctx context.Context, email string) (map[string]runningImage, error) {
	images := map[string]runningImage{}
	err := queryEach(ctx, s.reader, func(row scanner) (struct{}, error) {
		var uid string
		var img runningImage
		err := row.Scan(&uid, &img.MD5, &img.Version, &img.SHA256, &img.Size)
		images[uid] = img
		return struct{}{}, err
	}, func(struct{}) error { return nil }, `SELECT d.uid, d.current_md5, COALESCE(d.current_version, f.version, ''), f.sha256, f.size
		FROM devices d JOIN users u ON u.team_id = d.team_id JOIN firmwares f ON f.device_id = d.id AND f.md5 = d.current_md5
		WHERE u.email = ? GROUP BY d.id`, NormalizeEmail(email))
	return images, err
}
