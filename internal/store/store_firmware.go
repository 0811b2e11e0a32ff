package store

// The store's firmwares: rows, and the files under <data>/firmware named
// by their sha256.

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
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
func (s *Store) FirmwaresOf(ctx context.Context, deviceID int64) ([]*model.Firmware, error) {
	return queryAll(ctx, s.reader, scanFirmware, `SELECT `+firmwareColumns+`
		FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE f.device_id = ? ORDER BY f.id DESC`, deviceID)
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
func (s *Store) FirmwareOf(ctx context.Context, deviceID int64, ref string) (*model.Firmware, error) {
	return firmwareQuery(ctx, s.reader, deviceID, ref)
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

// UpdateFirmware applies u to the device's firmware named by ref and returns it.
func (s *Store) UpdateFirmware(ctx context.Context, deviceID int64, ref string, u FirmwareUpdate) (*model.Firmware, error) {
	var f *model.Firmware
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if f, err = firmwareQuery(ctx, tx, deviceID, ref); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `UPDATE firmwares SET name = COALESCE(?, name),
			version = NULLIF(COALESCE(?, version), ''), notes = NULLIF(COALESCE(?, notes), '')
			WHERE id = ?`, u.Name, u.Version, u.Notes, *f.ID)
		if err != nil {
			return err
		}
		f, err = firmwareQuery(ctx, tx, deviceID, fmt.Sprint(*f.ID))
		return err
	})
	return f, err
}

// DeleteFirmware removes the device's firmware named by ref, and its file
// when no other row uses it. ErrFirmwareAssigned when it is a target.
func (s *Store) DeleteFirmware(ctx context.Context, deviceID int64, ref string) error {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	_, err := s.deleteInTx(ctx, func(tx *sql.Tx) ([]string, error) {
		f, err := firmwareQuery(ctx, tx, deviceID, ref)
		if err != nil {
			return nil, err
		}
		var assigned bool
		err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM devices WHERE target_firmware_id = ?1)
			OR EXISTS (SELECT 1 FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
				WHERE rd.device_id = ?2 AND COALESCE(rd.md5, r.md5) = ?3 AND r.state IN `+SQLIn(model.RolloutRunning, model.RolloutPaused)+`)`,
			*f.ID, deviceID, f.MD5).Scan(&assigned)
		if err != nil {
			return nil, err
		}
		if assigned {
			return nil, ErrFirmwareAssigned
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM firmwares WHERE id = ?`, *f.ID)
		return []string{*f.SHA256}, err
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

// CreateFirmware moves the upload's file into place and adds the firmware
// row, in that order, so that a row never exists without its file.
// ErrFirmwareExists for a duplicate.
func (s *Store) CreateFirmware(ctx context.Context, deviceID int64, nf NewFirmware) (*model.Firmware, error) {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var f *model.Firmware
	placed := false
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var exists bool
		err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ? AND md5 = ?)`,
			deviceID, nf.MD5).Scan(&exists)
		if err != nil {
			return err
		}
		if exists {
			return ErrFirmwareExists
		}
		var teamID int64
		if err := tx.QueryRowContext(ctx, `SELECT team_id FROM devices WHERE id = ?`, deviceID).Scan(&teamID); err != nil {
			return notFound(err, ErrDeviceNotFound)
		}
		used, err := s.firmwareBytesUsed(ctx, tx, teamID)
		if err != nil {
			return err
		}
		if err := s.checkFirmwareQuotas(ctx, tx, deviceID, used, nf.Size); err != nil {
			return err
		}
		// Named by sha256: files with the same md5 never share a name.
		if err := os.Rename(nf.TmpPath, s.FirmwarePath(nf.SHA256)); err != nil {
			return fmt.Errorf("store firmware file: %w", err)
		}
		placed = true
		if err := SyncDir(s.FwDir); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)`, deviceID, *nf.Name, nf.Version, nf.Notes, nf.MD5, nf.SHA256, nf.Size, s.Timestamp())
		if err != nil {
			return err
		}
		id, err := res.LastInsertId()
		if err != nil {
			return err
		}
		f, err = firmwareQuery(ctx, tx, deviceID, fmt.Sprint(id))
		return err
	})
	if err != nil && placed {
		// The file is in place without a row; drop it unless another row
		// uses the same bytes.
		_, derr := s.deleteInTx(context.WithoutCancel(ctx), func(*sql.Tx) ([]string, error) { return []string{nf.SHA256}, nil })
		err = errors.Join(err, derr)
	}
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

// SetTarget makes the device's firmware with that md5 its target.
// ErrTargetNotFound when the device has no such firmware.
func (s *Store) SetTarget(ctx context.Context, deviceID int64, md5sum string) error {
	res, err := s.writer.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
		(SELECT id FROM firmwares WHERE device_id = devices.id AND md5 = ?)
		WHERE id = ? AND EXISTS (SELECT 1 FROM firmwares WHERE device_id = devices.id AND md5 = ?)`,
		md5sum, deviceID, md5sum)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return ErrTargetNotFound
	}
	return nil
}

// FirmwarePath is where the bytes with that sha256 are kept.
func (s *Store) FirmwarePath(sha256sum string) string {
	return filepath.Join(s.FwDir, sha256sum+".bin")
}

// NewFirmwareTemp creates a temporary file for an upload in progress.
func (s *Store) NewFirmwareTemp() (*os.File, error) {
	return os.CreateTemp(filepath.Join(s.FwDir, "tmp"), "upload-*")
}

// migrateFirmwareFiles moves the files of a data directory from before
// version 3, named <md5>.bin, to <sha256>.bin. Each file is linked under
// its new name and fsynced before its rows record the sha256, and only
// then is the old name removed: a crash at any point loses no byte, and
// the next start finishes the job (cleanFirmwareFiles drops an old name
// whose rows were already moved).
func (s *Store) migrateFirmwareFiles(ctx context.Context) error {
	sums, err := queryAll(ctx, s.writer, scanString, `SELECT DISTINCT md5 FROM firmwares WHERE sha256 = ''`)
	if err != nil {
		return fmt.Errorf("find firmware files to migrate: %w", err)
	}
	for _, m := range sums {
		if err := s.migrateFirmwareFile(ctx, m); err != nil {
			return fmt.Errorf("migrate firmware file %s.bin: %w", m, err)
		}
	}
	return nil
}

// migrateFirmwareFile moves the file of the rows with that md5. An old
// name that is gone is fine if another process (the service, or an admin
// command started beside it) has just moved it.
func (s *Store) migrateFirmwareFile(ctx context.Context, md5sum string) error {
	old := filepath.Join(s.FwDir, md5sum+".bin")
	f, err := os.Open(old)
	if errors.Is(err, os.ErrNotExist) {
		var left bool
		if qerr := s.writer.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE md5 = ? AND sha256 = '')`,
			md5sum).Scan(&left); qerr != nil || left {
			return errors.Join(err, qerr)
		}
		return nil
	}
	if err != nil {
		return err
	}
	h := sha256.New()
	_, err = io.Copy(h, f)
	f.Close()
	if err != nil {
		return err
	}
	sha := hex.EncodeToString(h.Sum(nil))
	if err := os.Link(old, s.FirmwarePath(sha)); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := SyncDir(s.FwDir); err != nil {
		return err
	}
	_, err = s.writer.ExecContext(ctx, `UPDATE firmwares SET sha256 = ? WHERE md5 = ? AND sha256 = ''`, sha, md5sum)
	if err != nil {
		return err
	}
	if err := os.Remove(old); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// cleanFirmwareFiles removes unfinished uploads and files that no row
// needs. Only the service runs it, at start; a CLI command beside it
// leaves the files alone.
func (s *Store) cleanFirmwareFiles(ctx context.Context) error {
	tmp, err := os.ReadDir(filepath.Join(s.FwDir, "tmp"))
	if err != nil {
		return fmt.Errorf("read firmware tmp dir: %w", err)
	}
	for _, e := range tmp {
		p := filepath.Join(s.FwDir, "tmp", e.Name())
		// A file that a removal moved aside (deleteInTx) goes back to its
		// place, unless that is taken: the removal may have crashed before
		// it committed. Below it goes for good if no row needs it.
		if sum, _, aside := strings.Cut(e.Name(), ".bin."); aside {
			if err := os.Link(p, s.FirmwarePath(sum)); err != nil && !errors.Is(err, os.ErrExist) {
				return fmt.Errorf("put back firmware file: %w", err) // keep the only copy
			}
		}
		os.Remove(p)
	}
	files, err := os.ReadDir(s.FwDir)
	if err != nil {
		return fmt.Errorf("read firmware dir: %w", err)
	}
	var sums []string
	for _, e := range files {
		if sum, ok := strings.CutSuffix(e.Name(), ".bin"); ok && !e.IsDir() {
			sums = append(sums, sum)
		}
	}
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	_, err = s.deleteInTx(ctx, func(*sql.Tx) ([]string, error) { return sums, nil })
	return err
}

// unusedFiles returns those of the firmware files with these names (the
// sha256 of their bytes) that no firmware row needs.
func unusedFiles(ctx context.Context, q queryer, sums []string) ([]string, error) {
	var unused []string
	for _, sum := range sums {
		var used bool
		if err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE sha256 = ?1)
			OR EXISTS (SELECT 1 FROM library_firmwares WHERE sha256 = ?1)`, sum).Scan(&used); err != nil {
			return nil, err
		}
		if !used {
			unused = append(unused, sum)
		}
	}
	return unused, nil
}

// deleteInTx runs del in a write transaction, as inTx does; del deletes
// firmware rows and returns the sha256s of their files. Those files that
// no row needs then are removed, and deleteInTx returns how many there
// were. Each leaves its place before the commit, under SQLite's write
// lock, which an upload holds too from before it moves its file into place
// until its row is committed (CreateFirmware), in this process or another
// (the CLI): so an upload of the same bytes either committed first, and
// its row keeps the file, or comes after and brings its own. The files go
// into tmp/ and are deleted after the commit (removeAsideFiles: once no
// backup runs); back to their place if it fails. A crash in between leaves them to the next start
// (cleanFirmwareFiles). The caller holds fwMu.
func (s *Store) deleteInTx(ctx context.Context, del func(tx *sql.Tx) ([]string, error)) (int, error) {
	var unneeded []string
	aside := map[string]string{} // where a file went -> its place
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		sums, err := del(tx)
		if err != nil {
			return err
		}
		if unneeded, err = unusedFiles(ctx, tx, sums); err != nil {
			return err
		}
		for _, sum := range unneeded {
			tmp := filepath.Join(s.FwDir, "tmp", sum+".bin."+RandomString(8, LowerAlnum))
			err := os.Rename(s.FirmwarePath(sum), tmp)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				return fmt.Errorf("remove firmware file: %w", err)
			}
			aside[tmp] = s.FirmwarePath(sum)
		}
		return nil
	})
	if err != nil {
		for tmp, place := range aside {
			err = errors.Join(err, os.Rename(tmp, place)) // its rows are back
		}
		return 0, err
	}
	return len(unneeded), s.removeAsideFiles(slices.Collect(maps.Keys(aside)))
}

func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

func IsMD5(s string) bool { return wire.IsHex(s, 32) }

// IsSHA256 reports whether s is a sha256 in lower-case hex.
func IsSHA256(s string) bool { return wire.IsHex(s, 64) }

// OpenFirmwareFile opens the file of the firmware with that md5 of the
// device with that uid, and returns its sha256 too; ErrFirmwareNotFound
// when either is gone.
func (s *Store) OpenFirmwareFile(ctx context.Context, uid, md5sum string) (*os.File, string, error) {
	var sha string
	err := s.reader.QueryRowContext(ctx, `SELECT f.sha256 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.uid = ? AND f.md5 = ?`, uid, md5sum).Scan(&sha)
	if err != nil {
		return nil, "", notFound(err, ErrFirmwareNotFound)
	}
	f, err := os.Open(s.FirmwarePath(sha))
	if errors.Is(err, os.ErrNotExist) {
		return nil, "", ErrFirmwareNotFound
	}
	return f, sha, err
}
