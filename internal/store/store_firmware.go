package store

// The store's firmwares: a device's rows. Their files are firmwareFiles'
// (files.go).

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"

	"devicehub/internal/model"
	"devicehub/internal/wire"
)

const firmwareColumns = `f.id, f.name, f.version, f.notes, f.md5, f.sha256, f.size, f.created_at,
	f.md5 IS d.current_md5, f.id IS d.target_firmware_id`

func scanFirmware(row scanner) (*model.Firmware, error) {
	f := &model.Firmware{ID: new(int64), Name: new(string), SHA256: new(string), Size: new(int64), CreatedAt: new(string),
		IsCurrent: new(bool), IsTarget: new(bool)}
	if err := row.Scan(f.ID, f.Name, &f.Version, &f.Notes, &f.MD5, f.SHA256, f.Size, f.CreatedAt, f.IsCurrent, f.IsTarget); err != nil {
		return nil, notFound(err, ErrFirmwareNotFound)
	}
	return f, nil
}

// FirmwaresOf lists a device's firmwares, newest first.
func (s *Store) FirmwaresOf(ctx context.Context, d *DeviceRef) ([]*model.Firmware, error) {
	return queryAll(ctx, s.reader, scanFirmware, `SELECT `+firmwareColumns+`
		FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE f.device_id = ? ORDER BY f.id DESC`, d.id)
}

// firmwareRef finds the SQL condition for a {firmware_id} path segment: an
// integer id, or an md5 in either case.
func firmwareRef(ref string) (cond string, arg any, ok bool) {
	if IsMD5(ref) {
		return `f.md5 = ?`, strings.ToLower(ref), true
	}
	if id, err := strconv.ParseInt(ref, 10, 64); err == nil && id > 0 {
		return `f.id = ?`, id, true
	}
	return "", nil, false
}

// firmwareOf returns the device's firmware named by ref (an id or an md5),
// or ErrFirmwareNotFound.
func (s *Store) FirmwareOf(ctx context.Context, d *DeviceRef, ref string) (*model.Firmware, error) {
	return firmwareQuery(ctx, s.reader, d.id, ref)
}

func firmwareQuery(ctx context.Context, q queryer, deviceID int64, ref string) (*model.Firmware, error) {
	cond, arg, ok := firmwareRef(ref)
	if !ok {
		return nil, ErrFirmwareNotFound
	}
	return scanFirmware(q.QueryRowContext(ctx, `SELECT `+firmwareColumns+`
		FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE f.device_id = ? AND `+cond, deviceID, arg))
}

// FirmwareUpdate holds the fields a PATCH changes; nil leaves one as it is,
// and a pointer to "" clears version or notes.
type FirmwareUpdate struct {
	Name, Version, Notes *string
}

// UpdateFirmware applies u to the device's firmware named by ref and
// returns it; audit's entry, of the firmware as changed, commits with it.
func (s *Store) UpdateFirmware(ctx context.Context, d *DeviceRef, ref string, u FirmwareUpdate, audit Audit[*model.Firmware]) (*model.Firmware, error) {
	var f *model.Firmware
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if f, err = firmwareQuery(ctx, tx, d.id, ref); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `UPDATE firmwares SET name = COALESCE(?, name),
			version = NULLIF(COALESCE(?, version), ''), notes = NULLIF(COALESCE(?, notes), '')
			WHERE id = ?`, u.Name, u.Version, u.Notes, *f.ID)
		if err != nil {
			return err
		}
		if f, err = firmwareQuery(ctx, tx, d.id, fmt.Sprint(*f.ID)); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, f)
	})
	return f, err
}

// DeleteFirmware removes the device's firmware named by ref, and its file
// when no other row uses it; the audit entry commits with it.
// ErrFirmwareAssigned when it is a target.
func (s *Store) DeleteFirmware(ctx context.Context, d *DeviceRef, ref string, audit Audit[string]) error {
	_, err := s.deleteWithFiles(ctx, func(tx *sql.Tx) ([]string, error) {
		f, err := firmwareQuery(ctx, tx, d.id, ref)
		if err != nil {
			return nil, err
		}
		var assigned bool
		err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM devices WHERE target_firmware_id = ?1)
			OR EXISTS (SELECT 1 FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
				WHERE rd.device_id = ?2 AND COALESCE(rd.md5, r.md5) = ?3 AND r.state IN `+SQLIn(model.RolloutRunning, model.RolloutPaused)+`)`,
			*f.ID, d.id, f.MD5).Scan(&assigned)
		if err != nil {
			return nil, err
		}
		if assigned {
			return nil, ErrFirmwareAssigned
		}
		if _, err = tx.ExecContext(ctx, `DELETE FROM firmwares WHERE id = ?`, *f.ID); err != nil {
			return nil, err
		}
		return []string{*f.SHA256}, insertAudit(ctx, tx, audit, ref)
	})
	return err
}

// NewFirmware is an upload to be stored: its fields, and its bytes in the
// fsynced temporary file TmpPath.
type NewFirmware struct {
	Name, Version, Notes *string
	MD5, SHA256          string
	Size                 int64
	TmpPath              string
}

// CreateFirmware stores the upload's file and adds the firmware row
// (addWithFile); audit's entry, of the new firmware, commits with it.
// ErrFirmwareExists for a duplicate.
func (s *Store) CreateFirmware(ctx context.Context, d *DeviceRef, nf NewFirmware, audit Audit[*model.Firmware]) (*model.Firmware, error) {
	var f *model.Firmware
	check := func(tx *sql.Tx) error {
		var exists bool
		err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ? AND md5 = ?)`,
			d.id, nf.MD5).Scan(&exists)
		if err != nil {
			return err
		}
		if exists {
			return ErrFirmwareExists
		}
		var teamID int64
		if err := tx.QueryRowContext(ctx, `SELECT team_id FROM devices WHERE id = ?`, d.id).Scan(&teamID); err != nil {
			return notFound(err, ErrDeviceNotFound)
		}
		used, err := s.firmwareBytesUsed(ctx, tx, teamID)
		if err != nil {
			return err
		}
		return s.checkFirmwareQuotas(ctx, tx, d.id, used, nf.Size)
	}
	add := func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)`, d.id, *nf.Name, nf.Version, nf.Notes, nf.MD5, nf.SHA256, nf.Size, s.Timestamp())
		if err != nil {
			return err
		}
		id, err := res.LastInsertId()
		if err != nil {
			return err
		}
		if f, err = firmwareQuery(ctx, tx, d.id, fmt.Sprint(id)); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, f)
	}
	err := s.addWithFile(ctx, nf, check, add)
	return f, err
}

// diskBlock is the size of the disk blocks a file is counted by against
// -max-firmware-mib: a file of a few bytes takes a block on disk.
const diskBlock = 4096

// diskBytes is what a file of size bytes takes on disk, in whole blocks.
func diskBytes(size int64) int64 { return (size + diskBlock - 1) / diskBlock * diskBlock }

// sqlDiskBytes is diskBytes of the column size, in SQL.
const sqlDiskBytes = `((size + 4095) / 4096 * 4096)`

// firmwareBytesUsed returns what the storage quota counts for a team:
// the disk bytes (diskBytes) of every firmware row of its devices, a file
// shared by rows once per row, and of its library's files, once each. 0
// when there is no such limit.
func (s *Store) firmwareBytesUsed(ctx context.Context, tx *sql.Tx, teamID int64) (int64, error) {
	var used int64
	if s.limits.FirmwareMiB == 0 {
		return 0, nil
	}
	err := tx.QueryRowContext(ctx, `SELECT (SELECT COALESCE(sum(`+sqlDiskBytes+`), 0) FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.team_id = ?1) + (SELECT COALESCE(sum(`+sqlDiskBytes+`), 0) FROM library_firmwares WHERE team_id = ?1)`, teamID).Scan(&used)
	return used, err
}

// checkFirmwareQuotas refuses with a QuotaError one more firmware of size
// bytes for the device when the device has as many as allowed, or when
// used, its owner's firmware bytes (firmwareBytesUsed), and size together
// pass the byte limit.
func (s *Store) checkFirmwareQuotas(ctx context.Context, tx *sql.Tx, deviceID, used, size int64) error {
	if max := s.limits.Firmwares; max > 0 {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE device_id = ?`, deviceID).Scan(&n); err != nil {
			return err
		}
		if n >= max {
			return &QuotaError{Quota: QuotaFirmwares, Limit: max}
		}
	}
	if mib := s.limits.FirmwareMiB; mib > 0 && used+diskBytes(size) > int64(mib)<<20 {
		return &QuotaError{Quota: QuotaFirmwareMiB, Limit: mib}
	}
	return nil
}

// SetTarget makes the device's firmware with that md5 its target; the
// audit entry commits with it. ErrTargetNotFound when the device has no
// such firmware.
func (s *Store) SetTarget(ctx context.Context, d *DeviceRef, md5sum string, audit Audit[string]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
			(SELECT id FROM firmwares WHERE device_id = devices.id AND md5 = ?)
			WHERE id = ? AND EXISTS (SELECT 1 FROM firmwares WHERE device_id = devices.id AND md5 = ?)`,
			md5sum, d.id, md5sum)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return ErrTargetNotFound
		}
		return insertAudit(ctx, tx, audit, md5sum)
	})
}

func IsMD5(s string) bool { return wire.IsHex(s, 32) }

// IsSHA256 reports whether s is a sha256 in lower-case hex.
func IsSHA256(s string) bool { return wire.IsHex(s, 64) }
