package main

// 'devicehub backup -to DIR': a consistent copy of a data directory,
// taken while the service runs. DIR is a data directory itself: restoring
// is copying it back in place of the old one, with the service stopped.

import (
	"context"
	"devicehub/internal/store"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
)

// backupAttempts bounds how often a backup starts over because a firmware
// file its database copy needs could not be found. With the backup lock
// held that takes a file on the move at the very moment of the copy: put
// back by a removal that rolled back, or by the service's start
// (internal/store/files.go). Without file locks (not on Unix), a removal.
const backupAttempts = 10

func cmdBackup(ctx context.Context, c *cli, args []string) error {
	to := c.fs.String("to", "", "directory to write the backup into: a new or empty one (required)")
	if err := c.parse(args, "to"); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	files, err := backup(ctx, st, filepath.Join(c.cfg.data, "ota.key"), *to)
	if err != nil {
		return fmt.Errorf("backup to %q: %w", *to, err)
	}
	fmt.Fprintf(c.stdout, "backed up the database and %d firmware files to %q\n", files, *to)
	return nil
}

// backup writes into dir (mode 0700, files 0600) a copy of the database
// taken with VACUUM INTO, the firmware files that copy's rows need, each
// checked against its sha256, and the OTA link key from keyPath if there is
// one. It returns how many firmware files it copied.
//
// The service may write meanwhile. A file added after the database copy
// is not needed by it; a file deleted after it stays in tmp/ while the
// backup holds the backup lock (internal/store/files.go), and is
// copied from there.
func backup(ctx context.Context, st *store.Store, keyPath, dir string) (int, error) {
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		return 0, errors.New("the directory is not empty")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, err
	}
	// Owner-only, also when dir existed (empty) with a wider mode.
	if err := os.Chmod(dir, 0o700); err != nil {
		return 0, err
	}
	dbPath := filepath.Join(dir, "devicehub.db")
	fwDir := filepath.Join(dir, "firmware")
	if err := os.Mkdir(fwDir, 0o700); err != nil {
		return 0, err
	}
	unlock, _, err := st.LockFirmwareFiles(true, true)
	if err != nil {
		return 0, err
	}
	defer unlock()
	tmpDB := dbPath + ".tmp"
	var sums []string
	for attempt := 1; ; attempt++ {
		var err error
		sums, err = backupOnce(ctx, st, tmpDB, fwDir)
		if err == nil {
			break
		}
		os.Remove(tmpDB)
		if !errors.Is(err, os.ErrNotExist) || attempt == backupAttempts {
			return 0, err
		}
	}
	if err := removeUnlisted(fwDir, sums); err != nil {
		return 0, err
	}
	if err := copyKey(keyPath, filepath.Join(dir, "ota.key")); err != nil {
		return 0, err
	}
	if err := os.Chmod(tmpDB, 0o600); err != nil {
		return 0, err
	}
	if err := syncFile(tmpDB); err != nil {
		return 0, err
	}
	// Last: a directory with devicehub.db in it is a finished backup.
	if err := os.Rename(tmpDB, dbPath); err != nil {
		return 0, err
	}
	return len(sums), store.SyncDir(dir)
}

// backupOnce copies the database to tmpDB, then the firmware files the
// copy needs into fwDir, and returns their sha256s. An error that wraps
// os.ErrNotExist means a needed file was deleted meanwhile.
func backupOnce(ctx context.Context, st *store.Store, tmpDB, fwDir string) ([]string, error) {
	os.Remove(tmpDB) // VACUUM INTO refuses to overwrite
	if err := st.VacuumInto(ctx, tmpDB); err != nil {
		return nil, err
	}
	sums, err := store.SnapshotFirmwareSHA256s(ctx, tmpDB)
	if err != nil {
		return nil, err
	}
	for _, sum := range sums {
		if err := copyFirmware(st, sum, filepath.Join(fwDir, sum+".bin")); err != nil {
			return nil, err
		}
	}
	return sums, store.SyncDir(fwDir)
}

// copyFirmware copies the firmware file with that sha256 unless dst has it
// already (from an earlier attempt), and checks that its bytes have the
// sha256 it is kept under.
func copyFirmware(st *store.Store, sha256sum, dst string) error {
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	in, err := st.OpenKeptFirmware(sha256sum)
	if err != nil {
		return fmt.Errorf("copy firmware file: %w", err)
	}
	defer in.Close()
	tmp := dst + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	sums, _, err := hashToTemp(out, in, math.MaxInt64-1) // hashed and fsynced
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil && sums.sha256 != sha256sum {
		err = fmt.Errorf("firmware file %s does not have sha256 %s: the data directory is damaged", in.Name(), sha256sum)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, dst)
}

// removeUnlisted removes files in fwDir copied by an attempt whose
// database copy was replaced, and whose rows the final copy lacks.
func removeUnlisted(fwDir string, sums []string) error {
	keep := map[string]bool{}
	for _, sum := range sums {
		keep[sum+".bin"] = true
	}
	entries, err := os.ReadDir(fwDir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !keep[e.Name()] {
			if err := os.RemoveAll(filepath.Join(fwDir, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// copyKey copies the OTA link key, if the service has made one: with it,
// links sent before the backup still work after a restore.
func copyKey(src, dst string) error {
	key, err := os.ReadFile(src)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read ota key: %w", err)
	}
	if err := os.WriteFile(dst, key, 0o600); err != nil {
		return err
	}
	return syncFile(dst)
}

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
