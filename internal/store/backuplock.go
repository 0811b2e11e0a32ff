package store

// The backup lock: a backup (another process, usually) copies the
// firmware files that its copy of the database needs, while the service
// may delete firmwares. A file deleted after the copy of the database is
// kept until the backups that run then have ended.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
)

// backupLockFile, in the firmware directory, is what the lock is taken on;
// OpenBeside makes it, so that its owner is the service's user.
const backupLockFile = "backup.lock"

// LockFirmwareFiles takes the backup lock, which every process on the
// data directory shares: a backup holds it shared while it copies, a
// removal of firmware files exclusively. With wait false it does not wait
// for it, and reports busy instead. The kernel drops the lock with the
// process.
func (s *Store) LockFirmwareFiles(shared, wait bool) (unlock func(), busy bool, err error) {
	f, err := os.Open(filepath.Join(s.FwDir, backupLockFile))
	if err != nil {
		return nil, false, fmt.Errorf("backup lock: %w", err)
	}
	if busy, err = flockFile(f, shared, wait); err != nil || busy {
		f.Close()
		return nil, busy, err
	}
	return func() { f.Close() }, false, nil
}

// removeAsideFiles removes the firmware files that deleteInTx moved aside
// into tmp/ once their removal committed: at once when no backup runs,
// else when the last backup ends (removeAfterBackups). A command line
// waits for that before it exits (WaitAsideFiles); the service does not,
// and a file left in tmp/ goes at its next start (cleanFirmwareFiles).
func (s *Store) removeAsideFiles(paths []string) error {
	if len(paths) == 0 {
		return nil
	}
	unlock, busy, err := s.LockFirmwareFiles(false, false)
	if err != nil {
		return err
	}
	if !busy {
		defer unlock()
		return removeFiles(paths)
	}
	s.aside.Lock()
	defer s.aside.Unlock()
	s.aside.paths = append(s.aside.paths, paths...)
	if s.aside.removed == nil {
		s.aside.removed = make(chan struct{})
		go s.removeAfterBackups(s.aside.removed)
	}
	return nil
}

// removeAfterBackups waits for the backup lock and, holding it, removes
// the files put aside until none are left; then it closes removed. A
// file it cannot remove stays in tmp/ for the service's next start, and
// is logged. (A backup that starts while it waits may go first: flock
// does not queue.)
func (s *Store) removeAfterBackups(removed chan struct{}) {
	defer close(removed)
	unlock, _, err := s.LockFirmwareFiles(false, true)
	if err == nil {
		defer unlock()
	} else {
		slog.Warn("firmware files deleted during a backup stay in firmware/tmp until the next start", "err", err)
	}
	for {
		s.aside.Lock()
		paths := s.aside.paths
		s.aside.paths = nil
		if len(paths) == 0 {
			s.aside.removed = nil
		}
		s.aside.Unlock()
		if len(paths) == 0 {
			return
		}
		if err == nil {
			if rerr := removeFiles(paths); rerr != nil {
				slog.Warn("remove firmware files after a backup", "err", rerr)
			}
		}
	}
}

// WaitAsideFiles waits until the files put aside for a backup are
// removed, calling waiting first if it has to; it gives up when ctx ends.
func (s *Store) WaitAsideFiles(ctx context.Context, waiting func()) error {
	for said := false; ; said = true {
		s.aside.Lock()
		removed := s.aside.removed
		s.aside.Unlock()
		if removed == nil {
			return nil
		}
		if !said {
			waiting()
		}
		select {
		case <-removed:
		case <-ctx.Done():
			return fmt.Errorf("stopped waiting for the backup: the deleted firmware files stay in firmware/tmp until the service starts next: %w", ctx.Err())
		}
	}
}

func removeFiles(paths []string) error {
	var err error
	for _, p := range paths {
		if rerr := os.Remove(p); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = errors.Join(err, fmt.Errorf("remove firmware file: %w", rerr))
		}
	}
	return err
}

// OpenKeptFirmware opens the firmware file with that sha256: in its place,
// or in tmp/ where a removal moved it that a backup holds back.
func (s *Store) OpenKeptFirmware(sha256sum string) (*os.File, error) {
	f, err := os.Open(s.FirmwarePath(sha256sum))
	if !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	aside, _ := filepath.Glob(filepath.Join(s.FwDir, "tmp", sha256sum+".bin.*"))
	for _, p := range aside {
		if f, aerr := os.Open(p); aerr == nil {
			return f, nil
		}
	}
	return nil, err
}
