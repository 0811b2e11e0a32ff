package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"devicehub/internal/history"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

//go:embed schema.sql
var schemaSQL string

// Migrations are the sections of schema.sql, each headed "-- version N",
// applied in order; PRAGMA user_version records how many ran.
var Migrations = regexp.MustCompile(`(?m)^-- version \d+.*$`).Split(schemaSQL, -1)[1:]

// Sentinel errors of the store. writeError (handlers.go) maps each one to
// its HTTP status and message; anything else is a 500.
var (
	ErrDeviceNotFound   = errors.New("device not found")
	ErrButtonNotFound   = errors.New("command button not found")
	ErrFirmwareNotFound = errors.New("firmware not found")
	ErrTokenNotFound    = errors.New("token not found")
	ErrUserNotFound     = errors.New("user not found")
	ErrEmailTaken       = errors.New("a user with this email exists")
	ErrButtonExists     = errors.New("command button exists")
	ErrFirmwareExists   = errors.New("firmware already uploaded")
	ErrFirmwareAssigned = errors.New("firmware is assigned")
	ErrTargetNotFound   = errors.New("no firmware with that md5 for the device")
	ErrCommandNotFound  = errors.New("command not found")
	ErrDiskFull         = errors.New("disk full")
	ErrRolloutNotFound  = errors.New("rollout not found")
	ErrNoTarget         = errors.New("no target firmware assigned")
	errStoreClosed      = errors.New("store closed")
)

// IsDiskFull reports whether err is a write that failed for want of space:
// a file write (ENOSPC) or SQLite's (SQLITE_FULL, which a failed write of
// the WAL or database file becomes).
func IsDiskFull(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || sqliteCode(err)&0xff == sqlite3.SQLITE_FULL
}

// isUniqueErr reports whether err is a write refused by a UNIQUE or
// PRIMARY KEY constraint.
func isUniqueErr(err error) bool {
	code := sqliteCode(err)
	return code == sqlite3.SQLITE_CONSTRAINT_UNIQUE || code == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY
}

// sqliteCode is the extended result code of SQLite's error in err, 0 when
// err holds none.
func sqliteCode(err error) int {
	var se *sqlite.Error
	if errors.As(err, &se) {
		return se.Code()
	}
	return 0
}

// Quotas are the per-device and per-user limits (-max-firmwares and the
// others); 0 is no limit.
type Quotas struct {
	Firmwares   int // firmware rows per device
	Buttons     int // command buttons per device
	FirmwareMiB int // firmware bytes per user, in MiB, every row counted by its disk blocks
	// LibraryFiles is how many files a team's library holds.
	LibraryFiles int
	Tokens       int // tokens per user
	Members      int // members per team, invites not yet used included
	Devices      int // devices a team adds through the API (not the CLI)
	TeamDataMiB  int // JSON a team keeps, in MiB: buttons' payloads, commands' payloads and results
	Webhooks     int // webhooks per team
	// AuditDays is how many days audit entries are kept: not a quota on
	// writes, as the log is pruned by age (PruneAudit), whatever its size.
	AuditDays int
	// HistoryDays is how long history is kept (-history-days); 0 keeps
	// none: no buckets, no presence.
	HistoryDays int
}

// Quota names a limit of quotas.
type Quota int

const (
	QuotaButtons Quota = iota
	QuotaFirmwares
	QuotaFirmwareMiB
	QuotaTokens
	QuotaMembers
	QuotaDevices
	QuotaTeamData
	QuotaLibraryFiles
	QuotaWebhooks
)

// QuotaError is a write refused because it would pass a limit. A
// rollout's names the first device it would take over the limit.
type QuotaError struct {
	Quota  Quota
	Limit  int
	Device string // for a rollout: that device's uid
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("over quota %d (limit %d) at device %q", e.Quota, e.Limit, e.Device)
}

// scanner is a *sql.Row or *sql.Rows.
type scanner interface{ Scan(dest ...any) error }

// queryer is what a query runs on: the reader, the writer or a transaction.
type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// queryAll runs query on q and returns what scan makes of each row, in
// order; never nil.
func queryAll[T any](ctx context.Context, q queryer, scan func(scanner) (T, error), query string, args ...any) ([]T, error) {
	list := []T{}
	err := queryEach(ctx, q, scan, func(v T) error {
		list = append(list, v)
		return nil
	}, query, args...)
	return list, err
}

// queryEach runs query on q and hands what scan makes of each row to fn
// as it is read, in order, until fn returns an error; nothing is held
// between rows.
func queryEach[T any](ctx context.Context, q queryer, scan func(scanner) (T, error), fn func(T) error, query string, args ...any) error {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return err
		}
		if err := fn(v); err != nil {
			return err
		}
	}
	return rows.Err()
}

// scanString reads a row of one text column.
func scanString(row scanner) (string, error) {
	var v string
	return v, row.Scan(&v)
}

// SQLIn renders values as an SQL list for IN, ('a', 'b'), and sqlString
// one of them as an SQL string, 'a': the SQL names states from the lists
// of states.go. The values are those constants, never input.
func SQLIn[T ~string](values ...T) string {
	quoted := make([]string, len(values))
	for i, v := range values {
		quoted[i] = sqlString(v)
	}
	return "(" + strings.Join(quoted, ", ") + ")"
}

func sqlString[T ~string](v T) string { return "'" + string(v) + "'" }

// notFound turns sql.ErrNoRows into the caller's sentinel.
func notFound(err, sentinel error) error {
	if errors.Is(err, sql.ErrNoRows) {
		return sentinel
	}
	return err
}

// TimeFormat is how every timestamp is stored and rendered: UTC, ISO 8601,
// fixed width (so text order is time order); the history renders its
// times so too.
const TimeFormat = history.TimeFormat

// MaxFirmwareSize is the largest firmware file accepted, in bytes (4 MiB).
const MaxFirmwareSize = 4 << 20

// Store holds all SQL and the firmware files. Reads go through reader,
// statements prepared once on a pool of query-only connections; writes go
// through writer, a single connection, so that concurrent writers queue in
// Go instead of failing with "database is locked".
type Store struct {
	writer *sql.DB
	reader *stmtCache
	cache  *readCache // hot reads, kept until the next commit

	// inserts queues new command records for insertLoop's group commit;
	// closing ends it (Close), and insertDone says it has ended.
	inserts    chan CommandInsert
	closing    chan struct{}
	insertDone chan struct{}
	// commandEnds wakes whoever waits for a command's end (CommandsChanged).
	commandEnds notifier
	// files are the firmware files on disk, which only its methods touch.
	files *firmwareFiles
	clock func() time.Time // Now reads it
	// limits are the quotas writes are checked against, given to Open;
	// the zero value is no limit.
	limits Quotas
	// engine holds each device's open 5-minute bucket until it closes.
	engine *history.Engine
}

// Open opens (creating if needed) the database and firmware directory
// under dir, migrates the schema and removes firmware files that no row
// needs (left by a crash). Only the service does this, at start. Writes
// are checked against limits.
func Open(ctx context.Context, dir string, now func() time.Time, limits Quotas) (*Store, error) {
	s, err := OpenBeside(ctx, dir, now, limits)
	if err != nil {
		return nil, err
	}
	if err := s.cleanFirmwareFiles(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// OpenBeside is Open without the sweep of the firmware
// directory, for admin commands that may run beside the service: a file
// the service has just moved into place, or an upload in progress, looks
// unused until the service's transaction commits.
func OpenBeside(ctx context.Context, dir string, now func() time.Time, limits Quotas) (*Store, error) {
	files, err := openFirmwareFiles(dir)
	if err != nil {
		return nil, err
	}
	dbPath := filepath.Join(dir, "devicehub.db")
	if err := createOwnerOnly(dbPath); err != nil {
		return nil, err
	}
	// Pragmas go in the DSN so that every pooled connection gets them.
	// synchronous(FULL): an answered write survives a power cut, not just a crash.
	dsn := "file:" + dbPath +
		"?_pragma=foreign_keys(1)&_pragma=busy_timeout(10000)" +
		"&_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_txlock=immediate"
	// wal_autocheckpoint(0): the writer does not checkpoint inside a
	// commit, holding the write lock; checkpoint does, from a reader.
	wdb, err := sql.Open("sqlite", dsn+"&_pragma=wal_autocheckpoint(0)")
	if err != nil {
		return nil, fmt.Errorf("open db: %w", err)
	}
	wdb.SetMaxOpenConns(1)
	wdb.SetConnMaxIdleTime(0)
	db, err := sql.Open("sqlite", dsn+"&_pragma=query_only(1)")
	if err != nil {
		wdb.Close()
		return nil, fmt.Errorf("open db: %w", err)
	}
	s := &Store{writer: wdb, reader: &stmtCache{DB: db}, files: files, clock: now, limits: limits, engine: history.NewEngine()}
	if s.cache, err = newReadCache(ctx, db); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.migrate(ctx); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.migrateFirmwareFiles(ctx); err != nil {
		s.Close()
		return nil, err
	}
	s.inserts, s.closing, s.insertDone = make(chan CommandInsert), make(chan struct{}), make(chan struct{})
	go s.insertLoop()
	return s, nil
}

// Checkpoint copies what the WAL holds into the database, PASSIVE, from
// a reader connection: it waits for no writer and stalls none (server.run
// calls it every checkpointEvery). SQLite checkpoints the rest when the
// last connection closes.
func (s *Store) Checkpoint(ctx context.Context) error {
	_, err := s.reader.DB.ExecContext(ctx, "PRAGMA wal_checkpoint(PASSIVE)")
	return err
}

// createOwnerOnly creates the database file readable by its owner only,
// whatever the umask, before SQLite opens it: SQLite creates the -wal and
// -shm files with the database file's mode. Files of an older version that
// others could read are tightened.
func createOwnerOnly(dbPath string) error {
	f, err := os.OpenFile(dbPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("create db: %w", err)
	}
	f.Close()
	for _, p := range []string{dbPath, dbPath + "-wal", dbPath + "-shm"} {
		info, err := os.Stat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err == nil && info.Mode().Perm()&0o077 != 0 {
			err = os.Chmod(p, 0o600)
		}
		if err != nil {
			return fmt.Errorf("make db owner-only: %w", err)
		}
	}
	return nil
}

// Close stops the command writer, writes the history buckets held in
// memory (history.Engine.WriteAll) and closes both connection pools.
func (s *Store) Close() error {
	if s.closing != nil {
		close(s.closing)
		<-s.insertDone
	}
	var errs []error
	if s.limits.HistoryDays > 0 {
		errs = append(errs, s.inTx(context.Background(), func(tx *sql.Tx) error {
			_, err := s.engine.WriteAll(context.Background(), tx)
			return err
		}))
	}
	if s.cache != nil {
		errs = append(errs, s.cache.close())
	}
	return errors.Join(append(errs, s.reader.close(), s.writer.Close())...)
}

// migrate applies the migrations the database lacks, each in a write
// transaction of its own, on the writer's one connection with its foreign
// keys off: SQLite's table rebuild needs them off, and PRAGMA foreign_keys
// cannot change inside a transaction. Instead PRAGMA foreign_key_check must
// find nothing before each commits. On an error the caller closes the
// store, connection and all.
func (s *Store) migrate(ctx context.Context) error {
	conn, err := s.writer.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	var version int
	if err := conn.QueryRowContext(ctx, "PRAGMA user_version").Scan(&version); err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if version > len(Migrations) {
		return fmt.Errorf("database schema version %d is newer than this program (%d)", version, len(Migrations))
	}
	if version == len(Migrations) {
		return nil
	}
	if _, err := conn.ExecContext(ctx, "PRAGMA foreign_keys = OFF"); err != nil {
		return err
	}
	// The writer's one connection goes back to the pool: never with them off.
	defer conn.ExecContext(context.WithoutCancel(ctx), "PRAGMA foreign_keys = ON")
	for i := version; i < len(Migrations); i++ {
		if err := migrateTo(ctx, conn, i+1); err != nil {
			return fmt.Errorf("migrate to version %d: %w", i+1, err)
		}
	}
	return nil
}

// migrateTo applies migration number version (from 1) in a transaction.
func migrateTo(ctx context.Context, conn *sql.Conn, version int) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, Migrations[version-1]); err != nil {
		return err
	}
	var table, parent string
	var rowid, fk sql.NullInt64
	err = tx.QueryRowContext(ctx, "PRAGMA foreign_key_check").Scan(&table, &rowid, &parent, &fk)
	if err == nil {
		return fmt.Errorf("row %d of %s refers to a missing row of %s", rowid.Int64, table, parent)
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return err
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", version)); err != nil {
		return err
	}
	return tx.Commit()
}

// inTx runs fn in a write transaction and commits when fn returns nil.
func (s *Store) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.writer.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

func (s *Store) Timestamp() string { return s.Now().UTC().Format(TimeFormat) }

// kept is how many days audit entries and device history are kept
// (-audit-days, -history-days; 0: audit entries forever, no history).
func (s *Store) Kept() (auditDays, historyDays int) {
	return s.limits.AuditDays, s.limits.HistoryDays
}

// Now is the store's clock: the time its writes record.
func (s *Store) Now() time.Time { return s.clock() }

// CommandsChanged is closed when a command has ended or changed since it
// was called: take it before a read, so that no change is missed.
func (s *Store) CommandsChanged() <-chan struct{} { return s.commandEnds.wait() }

const (
	LowerAlnum = "abcdefghijklmnopqrstuvwxyz0123456789"
	Alnum      = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
)

// RandomString returns n characters drawn uniformly from alphabet.
func RandomString(n int, alphabet string) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[randIntn(len(alphabet))]
	}
	return string(b)
}

func randIntn(n int) int {
	// Rejection sampling over one byte keeps the draw uniform.
	limit := 256 - 256%n
	var b [1]byte
	for {
		rand.Read(b[:])
		if int(b[0]) < limit {
			return int(b[0]) % n
		}
	}
}
