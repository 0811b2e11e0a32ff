package store

// The firmware files on disk, <data>/firmware/<sha256>.bin: each named by
// the sha256 of its bytes, so that two files never share a name (two with
// one md5 included) and one file serves every row that names it, a
// device's firmware or a library's entry, of any team. firmwareFiles alone
// touches them; a file moves only inside the write transaction that adds
// or deletes a row that needs it (addWithFile, deleteWithFiles), so that
// no committed row lacks its file and no file outlives its last row but
// for a crash, which the next start mends (cleanFirmwareFiles).
//
// The backup lock: a backup (another process, usually) copies the files
// that its copy of the database needs, while the service may delete rows.
// A file deleted after the copy of the database is kept until the backups
// that run then have ended.

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
)

// backupLockFile, in the firmware directory, is what the backup lock is
// taken on.
const backupLockFile = "backup.lock"

// firmwareFiles owns the firmware directory: the files in place, uploads
// in progress and files set aside in tmp/, the in-process lock on changes,
// and the backup lock that every process on the data directory shares.
type firmwareFiles struct {
	dir string
	// mu orders this process's file changes with their rows: a file is
	// moved into place or aside only while holding it, in the transaction
	// that adds or deletes the row that needs it, whose write lock orders
	// them with other processes' (deleteWithFiles).
	mu sync.Mutex
	// aside are the files whose removal waits for a backup to end
	// (removeAside); removed is closed when they are gone.
	aside struct {
		sync.Mutex
		paths   []string
		removed chan struct{}
	}
}

// openFirmwareFiles makes the firmware directory under dataDir, its tmp/
// and the backup lock's file, so that their owner is the service's user.
func openFirmwareFiles(dataDir string) (*firmwareFiles, error) {
	dir := filepath.Join(dataDir, "firmware")
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o700); err != nil {
		return nil, fmt.Errorf("create data dir: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, backupLockFile), os.O_RDONLY|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create backup lock: %w", err)
	}
	lock.Close()
	return &firmwareFiles{dir: dir}, nil
}

// path is where the bytes with that sha256 are kept.
func (ff *firmwareFiles) path(sha256sum string) string {
	return filepath.Join(ff.dir, sha256sum+".bin")
}

// newTemp creates a temporary file for an upload in progress.
func (ff *firmwareFiles) newTemp() (*os.File, error) {
	return os.CreateTemp(filepath.Join(ff.dir, "tmp"), "upload-*")
}

// place moves an upload's fsynced temporary file into its place, named by
// its sha256, and fsyncs the directory. Bytes already there are the same.
func (ff *firmwareFiles) place(tmpPath, sha256sum string) error {
	if err := os.Rename(tmpPath, ff.path(sha256sum)); err != nil {
		return fmt.Errorf("store firmware file: %w", err)
	}
	return SyncDir(ff.dir)
}

// open opens the file with that sha256 in its place.
func (ff *firmwareFiles) open(sha256sum string) (*os.File, error) { return os.Open(ff.path(sha256sum)) }

// openKept opens the file with that sha256: in its place, or in tmp/
// where a removal that a backup holds back set it aside.
func (ff *firmwareFiles) openKept(sha256sum string) (*os.File, error) {
	f, err := ff.open(sha256sum)
	if !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	aside, _ := filepath.Glob(filepath.Join(ff.dir, "tmp", sha256sum+".bin.*"))
	for _, p := range aside {
		if f, aerr := os.Open(p); aerr == nil {
			return f, nil
		}
	}
	return nil, err
}

// setAside moves the file with that sha256 out of its place into tmp/,
// under a name of its own, and returns where it went; "" when it was not
// there.
func (ff *firmwareFiles) setAside(sha256sum string) (string, error) {
	tmp := filepath.Join(ff.dir, "tmp", sha256sum+".bin."+RandomString(8, LowerAlnum))
	err := os.Rename(ff.path(sha256sum), tmp)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("remove firmware file: %w", err)
	}
	return tmp, nil
}

// putBack moves a file that setAside moved to tmp back to its place: the
// removal failed, and its rows are back.
func (ff *firmwareFiles) putBack(tmp, sha256sum string) error {
	return os.Rename(tmp, ff.path(sha256sum))
}

// lock takes the backup lock: a backup holds it shared while it copies,
// a removal of files exclusively. With wait false it does not wait for
// it, and reports busy instead. The kernel drops the lock with the
// process.
func (ff *firmwareFiles) lock(shared, wait bool) (unlock func(), busy bool, err error) {
	f, err := os.Open(filepath.Join(ff.dir, backupLockFile))
	if err != nil {
		return nil, false, fmt.Errorf("backup lock: %w", err)
	}
	if busy, err = flockFile(f, shared, wait); err != nil || busy {
		f.Close()
		return nil, busy, err
	}
	return func() { f.Close() }, false, nil
}

// removeAside removes files set aside by a removal that committed: at
// once when no backup runs, else when the last backup ends
// (removeAfterBackups). A command line waits for that before it exits
// (waitAside); the service does not, and a file left in tmp/ goes at its
// next start (sweep).
func (ff *firmwareFiles) removeAside(paths []string) error {
	if len(paths) == 0 {
		return nil
	}
	unlock, busy, err := ff.lock(false, false)
	if err != nil {
		return err
	}
	if !busy {
		defer unlock()
		return removeFiles(paths)
	}
	ff.aside.Lock()
	defer ff.aside.Unlock()
	ff.aside.paths = append(ff.aside.paths, paths...)
	if ff.aside.removed == nil {
		ff.aside.removed = make(chan struct{})
		go ff.removeAfterBackups(ff.aside.removed)
	}
	return nil
}

// removeAfterBackups waits for the backup lock and, holding it, removes
// the files put aside until none are left; then it closes removed. A
// file it cannot remove stays in tmp/ for the service's next start, and
// is logged. (A backup that starts while it waits may go first: flock
// does not queue.)
func (ff *firmwareFiles) removeAfterBackups(removed chan struct{}) {
	defer close(removed)
	unlock, _, err := ff.lock(false, true)
	if err == nil {
		defer unlock()
	} else {
		slog.Warn("firmware files deleted during a backup stay in firmware/tmp until the next start", "err", err)
	}
	for {
		ff.aside.Lock()
		paths := ff.aside.paths
		ff.aside.paths = nil
		if len(paths) == 0 {
			ff.aside.removed = nil
		}
		ff.aside.Unlock()
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

// waitAside waits until the files put aside for a backup are removed,
// calling waiting first if it has to; it gives up when ctx ends.
func (ff *firmwareFiles) waitAside(ctx context.Context, waiting func()) error {
	for said := false; ; said = true {
		ff.aside.Lock()
		removed := ff.aside.removed
		ff.aside.Unlock()
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

// sweep empties tmp/ and returns the names (sums) of the files in place.
// A file that a removal set aside goes back to its place first, unless
// that is taken: the removal may have crashed before it committed; the
// caller removes it for good if no row needs it.
func (ff *firmwareFiles) sweep() ([]string, error) {
	tmp, err := os.ReadDir(filepath.Join(ff.dir, "tmp"))
	if err != nil {
		return nil, fmt.Errorf("read firmware tmp dir: %w", err)
	}
	for _, e := range tmp {
		p := filepath.Join(ff.dir, "tmp", e.Name())
		if sum, _, aside := strings.Cut(e.Name(), ".bin."); aside {
			if err := os.Link(p, ff.path(sum)); err != nil && !errors.Is(err, os.ErrExist) {
				return nil, fmt.Errorf("put back firmware file: %w", err) // keep the only copy
			}
		}
		os.Remove(p)
	}
	files, err := os.ReadDir(ff.dir)
	if err != nil {
		return nil, fmt.Errorf("read firmware dir: %w", err)
	}
	var sums []string
	for _, e := range files {
		if sum, ok := strings.CutSuffix(e.Name(), ".bin"); ok && !e.IsDir() {
			sums = append(sums, sum)
		}
	}
	return sums, nil
}

// linkBySHA256 gives the file named <md5>.bin, from before version 3, its
// name by sha256 too, durably, and returns its sha256. An error wrapping
// os.ErrNotExist when there is no such file.
func (ff *firmwareFiles) linkBySHA256(md5sum string) (string, error) {
	old := filepath.Join(ff.dir, md5sum+".bin")
	f, err := os.Open(old)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	_, err = io.Copy(h, f)
	f.Close()
	if err != nil {
		return "", err
	}
	sha := hex.EncodeToString(h.Sum(nil))
	if err := os.Link(old, ff.path(sha)); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return sha, SyncDir(ff.dir)
}

// unlinkMD5Name removes the name <md5>.bin, once linkBySHA256's rows
// name the file by its sha256.
func (ff *firmwareFiles) unlinkMD5Name(md5sum string) error {
	if err := os.Remove(filepath.Join(ff.dir, md5sum+".bin")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// SyncDir fsyncs the directory dir, so that a file renamed or linked
// into it is there after a crash.
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

// addWithFile is the one way a row that needs an uploaded file is added,
// a device's firmware or a library's entry, in one write transaction:
// check refuses the upload (a duplicate, a quota) before its file moves;
// then the file moves from nf.TmpPath into its place, named by its sha256,
// and add inserts the row and the write's audit entry. A row never
// commits without its file; a file whose write fails after it moved goes
// again, unless another row needs the same bytes.
func (s *Store) addWithFile(ctx context.Context, nf NewFirmware, check, add func(tx *sql.Tx) error) error {
	moved, err := s.placeWithRow(ctx, nf, check, add)
	if err != nil && moved {
		_, rerr := s.deleteWithFiles(context.WithoutCancel(ctx), func(*sql.Tx) ([]string, error) { return []string{nf.SHA256}, nil })
		err = errors.Join(err, rerr)
	}
	return err
}

// placeWithRow runs addWithFile's transaction; moved says whether the
// file was moved (or tried to be).
func (s *Store) placeWithRow(ctx context.Context, nf NewFirmware, check, add func(tx *sql.Tx) error) (moved bool, err error) {
	s.files.mu.Lock()
	defer s.files.mu.Unlock()
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		if err := check(tx); err != nil {
			return err
		}
		moved = true
		if err := s.files.place(nf.TmpPath, nf.SHA256); err != nil {
			return err
		}
		return add(tx)
	})
	return moved, err
}

// deleteWithFiles runs del in a write transaction, as inTx does; del
// deletes rows that need files and returns the sha256s of those files.
// Those that no row needs then are removed, and deleteWithFiles returns
// how many there were. Each leaves its place before the commit, under
// SQLite's write lock, which an upload holds too from before it moves its
// file into place until its row is committed (addWithFile), in this
// process or another (the CLI): so an upload of the same bytes either
// committed first, and its row keeps the file, or comes after and brings
// its own. The files go into tmp/ and are deleted after the commit
// (removeAside: once no backup runs); back to their place if it fails. A
// crash in between leaves them to the next start (cleanFirmwareFiles).
func (s *Store) deleteWithFiles(ctx context.Context, del func(tx *sql.Tx) ([]string, error)) (int, error) {
	s.files.mu.Lock()
	defer s.files.mu.Unlock()
	var unneeded []string
	aside := map[string]string{} // where a file went -> its sha256
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		sums, err := del(tx)
		if err != nil {
			return err
		}
		if unneeded, err = unusedFiles(ctx, tx, sums); err != nil {
			return err
		}
		for _, sum := range unneeded {
			tmp, err := s.files.setAside(sum)
			if err != nil {
				return err
			}
			if tmp != "" {
				aside[tmp] = sum
			}
		}
		return nil
	})
	if err != nil {
		for tmp, sum := range aside {
			err = errors.Join(err, s.files.putBack(tmp, sum))
		}
		return 0, err
	}
	return len(unneeded), s.files.removeAside(slices.Collect(maps.Keys(aside)))
}

// unusedFiles returns those of the firmware files with these names (the
// sha256 of their bytes) that no row needs.
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

// cleanFirmwareFiles removes unfinished uploads and files that no row
// needs. Only the service runs it, at start; a CLI command beside it
// leaves the files alone.
func (s *Store) cleanFirmwareFiles(ctx context.Context) error {
	sums, err := s.files.sweep()
	if err != nil {
		return err
	}
	_, err = s.deleteWithFiles(ctx, func(*sql.Tx) ([]string, error) { return sums, nil })
	return err
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
	sha, err := s.files.linkBySHA256(md5sum)
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
	_, err = s.writer.ExecContext(ctx, `UPDATE firmwares SET sha256 = ? WHERE md5 = ? AND sha256 = ''`, sha, md5sum)
	if err != nil {
		return err
	}
	return s.files.unlinkMD5Name(md5sum)
}

// NewFirmwareTemp creates a temporary file for an upload in progress.
func (s *Store) NewFirmwareTemp() (*os.File, error) { return s.files.newTemp() }

// LockFirmwareFiles takes the backup lock (firmwareFiles.lock): a backup
// holds it shared, wait true, while it copies.
func (s *Store) LockFirmwareFiles(shared, wait bool) (unlock func(), busy bool, err error) {
	return s.files.lock(shared, wait)
}

// OpenKeptFirmware opens the firmware file with that sha256: in its place,
// or in tmp/ where a removal moved it that a backup holds back.
func (s *Store) OpenKeptFirmware(sha256sum string) (*os.File, error) {
	return s.files.openKept(sha256sum)
}

// WaitAsideFiles waits until the files put aside for a backup are
// removed, calling waiting first if it has to; it gives up when ctx ends.
func (s *Store) WaitAsideFiles(ctx context.Context, waiting func()) error {
	return s.files.waitAside(ctx, waiting)
}

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
	f, err := s.files.open(sha)
	if errors.Is(err, os.ErrNotExist) {
		return nil, "", ErrFirmwareNotFound
	}
	return f, sha, err
}
