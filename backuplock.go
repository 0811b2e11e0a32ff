package main

// The backup lock: a backup (another process, usually) copies the
// firmware files that its copy of the database needs, while the service
// may delete firmwares. A file deleted after the copy of the database is
// kept until the backups that run then have ended.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// backupLockFile, in the firmware directory, is what the lock is taken on;
// openStoreBeside makes it, so that its owner is the service's user.
const backupLockFile = "backup.lock"

// lockFirmwareFiles takes the backup lock, which every process on the
// data directory shares: a backup holds it shared while it copies, a
// removal of firmware files exclusively. With wait false it does not wait
// for it, and reports busy instead. The kernel drops the lock with the
// process.
func (s *store) lockFirmwareFiles(shared, wait bool) (unlock func(), busy bool, err error) {
	f, err := os.Open(filepath.Join(s.fwDir, backupLockFile))
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
// else when the last backup ends (one goroutine waits for that, and Close
// waits for it). A file it cannot remove, or one left by a process that
// ended first, stays in tmp/ for the service's next start
// (cleanFirmwareFiles).
func (s *store) removeAsideFiles(paths []string) error {
	if len(paths) == 0 {
		return nil
	}
	unlock, busy, err := s.lockFirmwareFiles(false, false)
	if err != nil {
		return nil // the removal committed; the files wait for the next start
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

// removeAfterBackups waits for the backup lock, removes the files put
// aside until then, and closes removed.
func (s *store) removeAfterBackups(removed chan struct{}) {
	defer close(removed)
	unlock, _, err := s.lockFirmwareFiles(false, true)
	s.aside.Lock()
	paths := s.aside.paths
	s.aside.paths, s.aside.removed = nil, nil
	s.aside.Unlock()
	if err == nil {
		defer unlock()
		removeFiles(paths)
	}
}

// waitAsideFiles waits until the files put aside for a backup are removed.
func (s *store) waitAsideFiles() {
	s.aside.Lock()
	removed := s.aside.removed
	s.aside.Unlock()
	if removed != nil {
		<-removed
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

// openKeptFirmware opens the firmware file with that sha256: in its place,
// or in tmp/ where a removal moved it that a backup holds back.
func (s *store) openKeptFirmware(sha256sum string) (*os.File, error) {
	f, err := os.Open(s.firmwarePath(sha256sum))
	if !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	aside, _ := filepath.Glob(filepath.Join(s.fwDir, "tmp", sha256sum+".bin.*"))
	for _, p := range aside {
		if f, aerr := os.Open(p); aerr == nil {
			return f, nil
		}
	}
	return nil, err
}
