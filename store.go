package main

import (
	"context"
	"crypto/md5"
	"crypto/sha256"
	"database/sql"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"modernc.org/sqlite"
)

//go:embed schema.sql
var schemaSQL string

// migrations are applied in order; PRAGMA user_version records how many ran.
// Append to this list to change the schema; never edit an applied entry.
var migrations = []string{schemaSQL, commandsSchema, rolloutsSchema}

// commandsSchema (version 2) keeps command records (CONTRACT §6). seq
// orders a device's history; deadline is when an unfinished command times
// out, on the server's clock, so a restart does not forget it.
const commandsSchema = `
CREATE TABLE commands (
	seq         INTEGER PRIMARY KEY,
	id          TEXT NOT NULL UNIQUE,
	device_id   INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	kind        TEXT NOT NULL,
	button_id   TEXT,
	payload     TEXT NOT NULL,
	state       TEXT NOT NULL,
	progress    INTEGER,
	result      TEXT,
	error       TEXT,
	created_at  TEXT NOT NULL,
	updated_at  TEXT NOT NULL,
	finished_at TEXT,
	deadline    TEXT NOT NULL
);
CREATE INDEX commands_device ON commands(device_id, seq);
CREATE INDEX commands_open ON commands(deadline) WHERE finished_at IS NULL;
`

// rolloutsSchema (version 3) stores firmware by SHA-256 (CONTRACT §7; the
// files are renamed at start-up by migrateFirmwareFiles) and keeps
// rollouts (§8): one firmware for many devices, in batches, in the order
// given (position).
const rolloutsSchema = `
ALTER TABLE firmwares ADD COLUMN sha256 TEXT NOT NULL DEFAULT '';
CREATE INDEX firmwares_sha256 ON firmwares(sha256);

CREATE TABLE rollouts (
	id           INTEGER PRIMARY KEY,
	owner_id     INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name         TEXT,
	md5          TEXT NOT NULL,
	sha256       TEXT NOT NULL,
	state        TEXT NOT NULL,
	batch_size   INTEGER NOT NULL,
	max_failures INTEGER NOT NULL,
	created_at   TEXT NOT NULL,
	updated_at   TEXT NOT NULL,
	finished_at  TEXT
);
CREATE INDEX rollouts_owner ON rollouts(owner_id);

CREATE TABLE rollout_devices (
	rollout_id INTEGER NOT NULL REFERENCES rollouts(id) ON DELETE CASCADE,
	position   INTEGER NOT NULL,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	state      TEXT NOT NULL,
	command_id TEXT,
	error      TEXT,
	PRIMARY KEY (rollout_id, position),
	UNIQUE (rollout_id, device_id)
);
CREATE INDEX rollout_devices_device ON rollout_devices(device_id);
`

// Sentinel errors of the store. writeError (handlers.go) maps each one to
// its HTTP status and message; anything else is a 500.
var (
	errDeviceNotFound   = errors.New("device not found")
	errButtonNotFound   = errors.New("command button not found")
	errFirmwareNotFound = errors.New("firmware not found")
	errTokenNotFound    = errors.New("token not found")
	errUserNotFound     = errors.New("user not found")
	errEmailTaken       = errors.New("a user with this email exists")
	errButtonExists     = errors.New("command button exists")
	errFirmwareExists   = errors.New("firmware already uploaded")
	errFirmwareAssigned = errors.New("firmware is assigned")
	errTargetNotFound   = errors.New("no firmware with that md5 for the device")
	errCommandNotFound  = errors.New("command not found")
	errDiskFull         = errors.New("disk full")
	// errNoSuchToken is a token the user has not (GET, DELETE
	// /v1/user/tokens); errTokenNotFound is a token that does not
	// authenticate.
	errNoSuchToken     = errors.New("no such token of the user")
	errRolloutNotFound = errors.New("rollout not found")
	errNoTarget        = errors.New("no target firmware assigned")
)

// sqliteFull is SQLITE_FULL, SQLite's "database or disk is full".
const sqliteFull = 13

// isDiskFull reports whether err is a write that failed for want of space:
// a file write (ENOSPC) or SQLite's (SQLITE_FULL, which a failed write of
// the WAL or database file becomes).
func isDiskFull(err error) bool {
	var se *sqlite.Error
	return errors.Is(err, syscall.ENOSPC) || errors.As(err, &se) && se.Code()&0xff == sqliteFull
}

// quotas are the per-device and per-user limits of CONTRACT §10; 0 is no
// limit.
type quotas struct {
	firmwares   int // firmware rows per device
	buttons     int // command buttons per device
	firmwareMiB int // firmware bytes per user, in MiB, every row counted
	tokens      int // tokens per user
}

// quotaError is a write refused because it would pass a limit. Its
// message, which names the limit, is the client's answer.
type quotaError struct{ msg string }

func (e *quotaError) Error() string { return e.msg }

// notFound turns sql.ErrNoRows into the caller's sentinel.
func notFound(err, sentinel error) error {
	if errors.Is(err, sql.ErrNoRows) {
		return sentinel
	}
	return err
}

// timeFormat is how every timestamp is stored and rendered: UTC, ISO 8601,
// fixed width (so text order is time order).
const timeFormat = "2006-01-02T15:04:05.000000Z"

// maxFirmwareSize is the largest firmware file accepted, in bytes (4 MiB).
const maxFirmwareSize = 4 << 20

// store holds all SQL and the firmware files. Reads go through db, a pool;
// writes go through wdb, a single connection, so that concurrent writers
// queue in Go instead of failing with "database is locked".
type store struct {
	db    *sql.DB
	wdb   *sql.DB
	read  *stmtCache // db with each query prepared once
	cache *readCache // hot reads, kept until the next commit

	// inserts queues new command records for insertLoop's group commit.
	inserts    chan commandInsert
	insertDone chan struct{}
	// commandsChanged wakes requests waiting for a command's end (?wait=).
	commandsChanged notifier
	fwDir           string
	now             func() time.Time
	// limits are the quotas writes are checked against, set once before
	// use; the zero value is no limit.
	limits quotas

	// fwMu orders firmware file changes with their rows: a file is renamed
	// into place or removed only while holding it, together with the
	// transaction that adds or deletes the row that needs it.
	fwMu sync.Mutex
}

// openStore opens (creating if needed) the database and firmware directory
// under dir, migrates the schema and removes firmware files that no row
// needs (left by a crash). Only the service does this, at start.
func openStore(ctx context.Context, dir string, now func() time.Time) (*store, error) {
	s, err := openStoreBeside(ctx, dir, now)
	if err != nil {
		return nil, err
	}
	if err := s.cleanFirmwareFiles(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// openStoreBeside is openStore without the sweep of the firmware
// directory, for admin commands that may run beside the service: a file
// the service has just moved into place, or an upload in progress, looks
// unused until the service's transaction commits.
func openStoreBeside(ctx context.Context, dir string, now func() time.Time) (*store, error) {
	fwDir := filepath.Join(dir, "firmware")
	if err := os.MkdirAll(filepath.Join(fwDir, "tmp"), 0o700); err != nil {
		return nil, fmt.Errorf("create data dir: %w", err)
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
	wdb, err := sql.Open("sqlite", dsn)
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
	s := &store{db: db, wdb: wdb, read: &stmtCache{db: db}, fwDir: fwDir, now: now}
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
	s.inserts, s.insertDone = make(chan commandInsert), make(chan struct{})
	s.commandsChanged.ch = make(chan struct{})
	go s.insertLoop()
	return s, nil
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

// secureDataDir creates the data directory owner-only, or makes an
// existing one that its group or others can enter owner-only, and says so:
// it holds the password hashes and the OTA signing key.
func secureDataDir(dir string, logger *slog.Logger) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create data dir: %w", err)
	}
	info, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	if mode := info.Mode().Perm(); mode&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("make data dir owner-only: %w", err)
		}
		logger.Warn("tightened the data directory to owner-only: it was open to other users",
			"dir", dir, "was", fmt.Sprintf("%04o", mode), "now", "0700")
	}
	return nil
}

// Close stops the command writer and closes both connection pools.
func (s *store) Close() error {
	if s.inserts != nil {
		close(s.inserts)
		<-s.insertDone
	}
	var errs []error
	if s.cache != nil {
		errs = append(errs, s.cache.check.Close(), s.cache.conn.Close())
	}
	return errors.Join(append(errs, s.read.close(), s.db.Close(), s.wdb.Close())...)
}

// readCache keeps hot reads (tokens, rendered device pages and lists)
// until the database changes. Before every use it reads PRAGMA
// data_version on a connection of its own, which changes whenever any
// other connection commits, ours or another process's (the CLI, a sqlite3
// shell); a change empties the cache. So a logout, a revoked token or a
// renamed device shows on the very next request.
type readCache struct {
	mu      sync.Mutex
	conn    *sql.Conn
	check   *sql.Stmt // PRAGMA data_version, prepared on conn
	version int64
	tokens  map[int64]*tokenRecord
	pages   map[pageKey]json.RawMessage
}

// pageKey names a rendered device page of a user; uid "" is their list.
type pageKey struct {
	userID int64
	uid    string
}

// maxCacheEntries bounds each map of the cache between two commits.
const maxCacheEntries = 10_000

func newReadCache(ctx context.Context, db *sql.DB) (*readCache, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("open cache connection: %w", err)
	}
	check, err := conn.PrepareContext(ctx, "PRAGMA data_version")
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("prepare cache check: %w", err)
	}
	return &readCache{conn: conn, check: check, version: -1,
		tokens: map[int64]*tokenRecord{}, pages: map[pageKey]json.RawMessage{}}, nil
}

// cached returns m[key] as kept since the last commit, or loads, keeps
// and returns it. m is one of c's maps. Errors are not kept.
func cached[K comparable, V any](ctx context.Context, c *readCache, m map[K]V, key K, load func() (V, error)) (V, error) {
	c.mu.Lock()
	var version int64
	if err := c.check.QueryRowContext(ctx).Scan(&version); err != nil {
		c.mu.Unlock()
		return load()
	}
	if version != c.version {
		clear(c.tokens)
		clear(c.pages)
		c.version = version
	}
	v, ok := m[key]
	c.mu.Unlock()
	if ok {
		return v, nil
	}
	// Loaded after the version was read: at least as new as that version.
	val, err := load()
	if err != nil {
		return val, err
	}
	c.mu.Lock()
	if c.version == version && len(m) < maxCacheEntries {
		m[key] = val
	}
	c.mu.Unlock()
	return val, nil
}

// stmtCache runs queries on db through statements prepared once and kept:
// preparing a query costs SQLite more than running a point lookup.
type stmtCache struct {
	db    *sql.DB
	stmts sync.Map // query text -> *sql.Stmt
}

func (c *stmtCache) prepare(ctx context.Context, query string) (*sql.Stmt, error) {
	if st, ok := c.stmts.Load(query); ok {
		return st.(*sql.Stmt), nil
	}
	st, err := c.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	if prev, loaded := c.stmts.LoadOrStore(query, st); loaded {
		st.Close()
		return prev.(*sql.Stmt), nil
	}
	return st, nil
}

// QueryContext is db.QueryContext through a prepared statement.
func (c *stmtCache) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	st, err := c.prepare(ctx, query)
	if err != nil {
		return nil, err
	}
	return st.QueryContext(ctx, args...)
}

// QueryRowContext is db.QueryRowContext through a prepared statement.
func (c *stmtCache) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	st, err := c.prepare(ctx, query)
	if err != nil {
		return c.db.QueryRowContext(ctx, query, args...) // carries the same error
	}
	return st.QueryRowContext(ctx, args...)
}

func (c *stmtCache) close() error {
	var errs []error
	c.stmts.Range(func(_, st any) bool {
		errs = append(errs, st.(*sql.Stmt).Close())
		return true
	})
	return errors.Join(errs...)
}

func (s *store) migrate(ctx context.Context) error {
	var version int
	if err := s.wdb.QueryRowContext(ctx, "PRAGMA user_version").Scan(&version); err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if version > len(migrations) {
		return fmt.Errorf("database schema version %d is newer than this program (%d)", version, len(migrations))
	}
	for i := version; i < len(migrations); i++ {
		err := s.inTx(ctx, func(tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, migrations[i]); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", i+1))
			return err
		})
		if err != nil {
			return fmt.Errorf("migrate to version %d: %w", i+1, err)
		}
	}
	return nil
}

// inTx runs fn in a write transaction and commits when fn returns nil.
func (s *store) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.wdb.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

func (s *store) timestamp() string { return s.now().UTC().Format(timeFormat) }

// ---- users and tokens ----

type user struct {
	ID              int64   `json:"id"`
	Name            string  `json:"name"`
	Email           string  `json:"email"`
	Role            string  `json:"role"`
	EmailVerifiedAt *string `json:"email_verified_at"`
	LastLoginAt     *string `json:"last_login_at"`
	passwordHash    string
}

// createUser adds a user; errEmailTaken when the email is taken.
func (s *store) createUser(ctx context.Context, name, email, role, passwordHash string) (int64, error) {
	res, err := s.wdb.ExecContext(ctx,
		`INSERT INTO users (name, email, role, password_hash, created_at) VALUES (?, ?, ?, ?, ?)`,
		name, normalizeEmail(email), role, passwordHash, s.timestamp())
	if isUniqueErr(err) {
		return 0, errEmailTaken
	}
	if err != nil {
		return 0, fmt.Errorf("insert user: %w", err)
	}
	return res.LastInsertId()
}

func normalizeEmail(email string) string { return strings.ToLower(strings.TrimSpace(email)) }

// userByEmail returns the user with that email (case-insensitive) or errUserNotFound.
func (s *store) userByEmail(ctx context.Context, email string) (*user, error) {
	u := &user{}
	err := s.read.QueryRowContext(ctx,
		`SELECT id, name, email, role, email_verified_at, last_login_at, password_hash FROM users WHERE email = ?`,
		normalizeEmail(email)).Scan(&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.passwordHash)
	if err != nil {
		return nil, notFound(err, errUserNotFound)
	}
	return u, nil
}

// createToken stores a new token for the user, records the login time when
// login is true, and returns the token's id. At the token limit a login
// deletes the user's least recently used tokens to make room; any other
// new token is refused with a quotaError.
func (s *store) createToken(ctx context.Context, userID int64, name string, secretHash []byte, login bool) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if err := s.makeTokenRoom(ctx, tx, userID, login); err != nil {
			return err
		}
		now := s.timestamp()
		res, err := tx.ExecContext(ctx,
			`INSERT INTO tokens (user_id, name, secret_hash, created_at) VALUES (?, ?, ?, ?)`,
			userID, name, secretHash, now)
		if err != nil {
			return fmt.Errorf("insert token: %w", err)
		}
		if id, err = res.LastInsertId(); err != nil {
			return err
		}
		if login {
			_, err = tx.ExecContext(ctx, `UPDATE users SET last_login_at = ? WHERE id = ?`, now, userID)
		}
		return err
	})
	return id, err
}

// makeTokenRoom checks the user's token count against the limit. For a
// login it deletes the least recently used tokens (never used: by age)
// until one more fits; otherwise it refuses with a quotaError.
func (s *store) makeTokenRoom(ctx context.Context, tx *sql.Tx, userID int64, login bool) error {
	max := s.limits.tokens
	if max <= 0 {
		return nil
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM tokens WHERE user_id = ?`, userID).Scan(&n); err != nil {
		return err
	}
	if n < max {
		return nil
	}
	if !login {
		return &quotaError{fmt.Sprintf("You have reached the limit of %d tokens. Delete a token first.", max)}
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE id IN (SELECT id FROM tokens WHERE user_id = ?
		ORDER BY COALESCE(last_used_at, created_at), id LIMIT ?)`, userID, n-max+1)
	return err
}

// tokenRecord is a stored token with its user, as authentication needs it.
type tokenRecord struct {
	id         int64
	secretHash []byte
	lastUsedAt string
	user       *user
}

const tokenQuery = `SELECT t.id, t.secret_hash, COALESCE(t.last_used_at, ''),
	u.id, u.name, u.email, u.role, u.email_verified_at, u.last_login_at
	FROM tokens t JOIN users u ON u.id = t.user_id WHERE `

// tokenByID returns the token row and its user, or errTokenNotFound.
func (s *store) tokenByID(ctx context.Context, id int64) (*tokenRecord, error) {
	return cached(ctx, s.cache, s.cache.tokens, id, func() (*tokenRecord, error) {
		return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.id = ?`, id))
	})
}

// tokenByHash returns the token whose secret hashes to h and its user, or errTokenNotFound.
func (s *store) tokenByHash(ctx context.Context, h []byte) (*tokenRecord, error) {
	return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.secret_hash = ?`, h))
}

func scanToken(row *sql.Row) (*tokenRecord, error) {
	t := &tokenRecord{user: &user{}}
	u := t.user
	err := row.Scan(&t.id, &t.secretHash, &t.lastUsedAt,
		&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt)
	if err != nil {
		return nil, notFound(err, errTokenNotFound)
	}
	return t, nil
}

// touchToken records a use of the token.
func (s *store) touchToken(ctx context.Context, id int64) error {
	_, err := s.wdb.ExecContext(ctx, `UPDATE tokens SET last_used_at = ? WHERE id = ?`, s.timestamp(), id)
	return err
}

// tokenInfo is the API's view of a personal access token (CONTRACT §9);
// Current is the handler's to set.
type tokenInfo struct {
	ID         int64   `json:"id"`
	Name       string  `json:"name"`
	LastUsedAt *string `json:"last_used_at"`
	CreatedAt  string  `json:"created_at"`
	Current    bool    `json:"current"`
}

const tokenInfoQuery = `SELECT id, name, last_used_at, created_at FROM tokens WHERE user_id = ?`

// tokensOf lists the user's tokens, oldest first.
func (s *store) tokensOf(ctx context.Context, userID int64) ([]tokenInfo, error) {
	rows, err := s.read.QueryContext(ctx, tokenInfoQuery+` ORDER BY id`, userID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []tokenInfo{}
	for rows.Next() {
		var t tokenInfo
		if err := rows.Scan(&t.ID, &t.Name, &t.LastUsedAt, &t.CreatedAt); err != nil {
			return nil, err
		}
		list = append(list, t)
	}
	return list, rows.Err()
}

// userToken returns one of the user's tokens, or errNoSuchToken.
func (s *store) userToken(ctx context.Context, userID, id int64) (*tokenInfo, error) {
	var t tokenInfo
	err := s.read.QueryRowContext(ctx, tokenInfoQuery+` AND id = ?`, userID, id).Scan(&t.ID, &t.Name, &t.LastUsedAt, &t.CreatedAt)
	if err != nil {
		return nil, notFound(err, errNoSuchToken)
	}
	return &t, nil
}

// deleteUserToken removes one of the user's tokens, or returns
// errNoSuchToken when the user has no token with that id.
func (s *store) deleteUserToken(ctx context.Context, userID, id int64) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM tokens WHERE id = ? AND user_id = ?`, id, userID)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errNoSuchToken
	}
	return nil
}

// deleteToken removes one token.
func (s *store) deleteToken(ctx context.Context, id int64) error {
	_, err := s.wdb.ExecContext(ctx, `DELETE FROM tokens WHERE id = ?`, id)
	return err
}

// ---- devices ----

type named struct {
	ID   int64  `json:"id"`
	Name string `json:"name"`
	Key  string `json:"key"`
}

// firmware is the API's Firmware object. IsCurrent and IsTarget are nil
// where the object is nested in a device (current_firmware, target_firmware).
// A firmware known only from a device's report has only MD5 and Version.
type firmware struct {
	ID        *int64  `json:"id"`
	Name      *string `json:"name"`
	Version   *string `json:"version"`
	Notes     *string `json:"notes"`
	MD5       string  `json:"md5"`
	SHA256    *string `json:"sha256"`
	Size      *int64  `json:"size"`
	CreatedAt *string `json:"created_at"`
	IsCurrent *bool   `json:"is_current,omitempty"`
	IsTarget  *bool   `json:"is_target,omitempty"`
}

// deviceSummary is the API's Device summary, the item of the device list.
type deviceSummary struct {
	UID          string    `json:"uid"`
	Name         string    `json:"name"`
	Status       string    `json:"status"`
	LastSeenAt   *string   `json:"last_seen_at"`
	Platform     named     `json:"platform"`
	Board        named     `json:"board"`
	BoardVariant *struct{} `json:"board_variant"` // always null: no variants exist
}

// device is the API's Device detail (the summary's fields and more), and
// what the handlers that act on a device use.
type device struct {
	id int64
	deviceSummary
	Description     *string         `json:"description"`
	IsOnline        bool            `json:"is_online"`
	PublicIP        *string         `json:"public_ip"`
	LocalIP         *string         `json:"local_ip"`
	Port            int64           `json:"port"`
	LastRSSI        *float64        `json:"last_rssi"`
	FirstSeenAt     *string         `json:"first_seen_at"`
	LastOTAAt       *string         `json:"last_ota_at"`
	CurrentFirmware *firmware       `json:"current_firmware"`
	TargetFirmware  *firmware       `json:"target_firmware"`
	Meta            json.RawMessage `json:"meta"`
	// OTA is the device's newest ota command (CONTRACT §7); only Device
	// detail answers load it (devicePage, updateDevice).
	OTA *command `json:"ota"`
}

// createDevice adds a pending device owned by the user with that email,
// creating unknown platform and board keys, and returns its uid.
func (s *store) createDevice(ctx context.Context, ownerEmail, platformKey, boardKey, name string, mqttPort int) (string, error) {
	uid := platformKey + "_" + randomString(12, lowerAlnum)
	if name == "" {
		name = uid
	}
	meta, err := json.Marshal(map[string]int{"mqtt_port": mqttPort})
	if err != nil {
		return "", err
	}
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var ownerID int64
		err := tx.QueryRowContext(ctx, `SELECT id FROM users WHERE email = ?`, normalizeEmail(ownerEmail)).Scan(&ownerID)
		if err != nil {
			return notFound(err, errUserNotFound)
		}
		platformID, err := upsertKey(ctx, tx, "platforms", platformKey)
		if err != nil {
			return err
		}
		boardID, err := upsertKey(ctx, tx, "boards", boardKey)
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx,
			`INSERT INTO devices (uid, owner_id, name, platform_id, board_id, meta, created_at)
			 VALUES (?, ?, ?, ?, ?, ?, ?)`,
			uid, ownerID, name, platformID, boardID, string(meta), s.timestamp())
		return err
	})
	return uid, err
}

// upsertKey returns the id of the row with that key in table (platforms or
// boards), creating it with name = key when missing.
func upsertKey(ctx context.Context, tx *sql.Tx, table, key string) (int64, error) {
	var id int64
	err := tx.QueryRowContext(ctx,
		`INSERT INTO `+table+` (key, name) VALUES (?, ?)
		 ON CONFLICT (key) DO UPDATE SET key = excluded.key RETURNING id`, key, key).Scan(&id)
	return id, err
}

const summaryColumns = `d.uid, d.name, d.status, d.last_seen_at, p.id, p.name, p.key, b.id, b.name, b.key`

const summaryFrom = ` FROM devices d
	JOIN platforms p ON p.id = d.platform_id
	JOIN boards b ON b.id = d.board_id`

// scanTargets returns where summaryColumns scan into.
func (d *deviceSummary) scanTargets() []any {
	return []any{&d.UID, &d.Name, &d.Status, &d.LastSeenAt,
		&d.Platform.ID, &d.Platform.Name, &d.Platform.Key, &d.Board.ID, &d.Board.Name, &d.Board.Key}
}

const deviceQuery = `SELECT d.id, ` + summaryColumns + `, d.description, d.public_ip, d.local_ip,
	COALESCE(json_extract(d.meta, '$.mqtt_port'), 0), d.last_rssi, d.first_seen_at, d.last_ota_at, d.meta,
	d.current_md5, d.current_version,
	cf.id, cf.name, cf.version, cf.notes, cf.sha256, cf.size, cf.created_at,
	tf.id, tf.name, tf.version, tf.notes, tf.md5, tf.sha256, tf.size, tf.created_at` + summaryFrom + `
	LEFT JOIN firmwares cf ON cf.device_id = d.id AND cf.md5 = d.current_md5
	LEFT JOIN firmwares tf ON tf.id = d.target_firmware_id
	WHERE d.uid = ? AND d.owner_id = ?`

// deviceRef is what the handlers of a device's commands, buttons and
// firmwares need of it: much less than its Device detail, which costs a
// query of thirty-odd columns to load.
type deviceRef struct {
	id       int64
	uid      string
	status   string
	platform string // its key
	targetID *int64 // its target firmware, if any
}

// deviceRefOf returns the user's device with that uid, or errDeviceNotFound
// when it does not exist or belongs to someone else.
func (s *store) deviceRefOf(ctx context.Context, userID int64, uid string) (*deviceRef, error) {
	d := &deviceRef{}
	err := s.read.QueryRowContext(ctx, `SELECT d.id, d.uid, d.status, p.key, d.target_firmware_id
		FROM devices d JOIN platforms p ON p.id = d.platform_id WHERE d.uid = ? AND d.owner_id = ?`,
		uid, userID).Scan(&d.id, &d.uid, &d.status, &d.platform, &d.targetID)
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
	return firmwareQuery(ctx, s.read, d.id, strconv.FormatInt(*d.targetID, 10))
}

func deviceIn(ctx context.Context, q queryer, userID int64, uid string) (*device, error) {
	d := &device{}
	var meta string
	var curMD5, curVersion, tfMD5 *string
	var cf, tf firmware
	dest := append([]any{&d.id}, d.scanTargets()...)
	dest = append(dest, &d.Description, &d.PublicIP, &d.LocalIP,
		&d.Port, &d.LastRSSI, &d.FirstSeenAt, &d.LastOTAAt, &meta, &curMD5, &curVersion,
		&cf.ID, &cf.Name, &cf.Version, &cf.Notes, &cf.SHA256, &cf.Size, &cf.CreatedAt,
		&tf.ID, &tf.Name, &tf.Version, &tf.Notes, &tfMD5, &tf.SHA256, &tf.Size, &tf.CreatedAt)
	if err := q.QueryRowContext(ctx, deviceQuery, uid, userID).Scan(dest...); err != nil {
		return nil, notFound(err, errDeviceNotFound)
	}
	d.IsOnline = d.Status == "online"
	d.Meta = json.RawMessage(meta)
	if curMD5 != nil {
		cf.MD5 = *curMD5
		if cf.ID == nil { // reported by the device, not uploaded here
			cf.Version = curVersion
		}
		d.CurrentFirmware = &cf
	}
	if tfMD5 != nil {
		tf.MD5 = *tfMD5
		d.TargetFirmware = &tf
	}
	return d, nil
}

// devicePage returns the user's device as Device detail JSON, through the
// read cache; errDeviceNotFound when there is none.
func (s *store) devicePage(ctx context.Context, userID int64, uid string) (json.RawMessage, error) {
	return cached(ctx, s.cache, s.cache.pages, pageKey{userID, uid}, func() (json.RawMessage, error) {
		d, err := deviceIn(ctx, s.read, userID, uid)
		if err != nil {
			return nil, err
		}
		if d.OTA, err = newestOTA(ctx, s.read, d.id); err != nil {
			return nil, err
		}
		return json.Marshal(d)
	})
}

// deviceListPage returns the user's devices, oldest first, as a JSON array
// of Device summaries, through the read cache.
func (s *store) deviceListPage(ctx context.Context, userID int64) (json.RawMessage, error) {
	return cached(ctx, s.cache, s.cache.pages, pageKey{userID, ""}, func() (json.RawMessage, error) {
		rows, err := s.read.QueryContext(ctx, `SELECT `+summaryColumns+summaryFrom+` WHERE d.owner_id = ? ORDER BY d.id`, userID)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		list := []deviceSummary{}
		for rows.Next() {
			var d deviceSummary
			if err := rows.Scan(d.scanTargets()...); err != nil {
				return nil, err
			}
			list = append(list, d)
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
		return json.Marshal(list)
	})
}

// deviceUpdate holds the fields a device PATCH changes; nil leaves one as
// it is, and clearDescription sets the description to null.
type deviceUpdate struct {
	name, description *string
	clearDescription  bool
}

// updateDevice applies u to the user's device and returns the device as
// this update left it.
func (s *store) updateDevice(ctx context.Context, userID int64, uid string, u deviceUpdate) (*device, error) {
	var d *device
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx,
			`UPDATE devices SET name = COALESCE(?, name),
			 description = CASE WHEN ? THEN NULL ELSE COALESCE(?, description) END
			 WHERE uid = ? AND owner_id = ?`, u.name, u.clearDescription, u.description, uid, userID)
		if err != nil {
			return fmt.Errorf("update device: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return errDeviceNotFound
		}
		// Read back in the same transaction: the answer is this update's result.
		if d, err = deviceIn(ctx, tx, userID, uid); err != nil {
			return err
		}
		d.OTA, err = newestOTA(ctx, tx, d.id)
		return err
	})
	return d, err
}

// applyDeviceMessages writes what devices said since the last call in one
// transaction: the command results in the order they came, then the
// merged reports (an updater's progress comes before the md5 it reports
// once it has rebooted). It returns how many reports named no known device
// and how many results matched no unfinished command of the device that
// sent them. Waiters are woken after a result, and after a reported md5,
// which may end an OTA.
func (s *store) applyDeviceMessages(ctx context.Context, reports map[string]*deviceReport, results []commandResult) (unknown, rejected int, err error) {
	now := s.timestamp()
	var otasEnded int64
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		for _, r := range results {
			n, err := applyCommandResult(ctx, tx, r, now)
			if err != nil {
				return err
			}
			if n == 0 {
				rejected++
			}
		}
		for uid, r := range reports {
			n, ended, err := applyDeviceReport(ctx, tx, uid, r)
			if err != nil {
				return err
			}
			if n == 0 {
				unknown++
			}
			otasEnded += ended
		}
		return nil
	})
	if err == nil && (len(results) > 0 || otasEnded > 0) {
		s.commandsChanged.broadcast()
	}
	return unknown, rejected, err
}

// applyDeviceReport applies one merged report and returns how many
// devices it changed (0 or 1) and how many ota commands it ended. A
// retained replay (not live) fills the seen times only where they are
// empty. A reported md5 ends the device's unfinished ota commands for that
// md5 as succeeded (CONTRACT §7). last_ota_at is set when the report ends
// such a command after a flash: its image was downloaded (running), or the
// md5 differs from the one the device ran; so also when the target was
// changed since the command was sent. It is set too, as before commands
// existed, when the reported md5 changes to the target's.
func applyDeviceReport(ctx context.Context, tx *sql.Tx, uid string, r *deviceReport) (n, otasEnded int64, err error) {
	res, err := tx.ExecContext(ctx, `UPDATE devices SET
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
				AND (c.state = 'running' OR ?7 IS NOT current_md5)))
			THEN ?2 ELSE last_ota_at END,
		current_md5 = COALESCE(?7, current_md5),
		current_version = CASE WHEN ?7 IS NOT NULL THEN ?8 ELSE COALESCE(?8, current_version) END
		WHERE uid = ?9`,
		r.status, r.seen, r.live, r.localIP, r.publicIP, r.rssi, r.fwMD5, r.fwVersion, uid)
	if err != nil {
		return 0, 0, err
	}
	n, err = res.RowsAffected()
	if err != nil || n == 0 || r.fwMD5 == nil {
		return n, 0, err
	}
	res, err = tx.ExecContext(ctx, `UPDATE commands SET state = 'succeeded', updated_at = ?1, finished_at = ?1
		WHERE finished_at IS NULL AND kind = 'ota' AND json_extract(payload, '$.md5') = ?2
		AND device_id = (SELECT id FROM devices WHERE uid = ?3)`, r.seen, *r.fwMD5, uid)
	if err != nil {
		return n, 0, err
	}
	otasEnded, err = res.RowsAffected()
	return n, otasEnded, err
}

// applyCommandResult applies one result to its command if the command is
// unfinished and belongs to the device that sent it; it returns the
// number of commands changed (0 or 1).
func applyCommandResult(ctx context.Context, tx *sql.Tx, r commandResult, now string) (int64, error) {
	var result *string
	if r.result != nil {
		v := string(r.result)
		result = &v
	}
	res, err := tx.ExecContext(ctx, `UPDATE commands SET
		state = CASE WHEN ?1 IS NULL THEN 'running' WHEN ?1 THEN 'succeeded' ELSE 'failed' END,
		progress = COALESCE(?2, progress), result = ?3, error = ?4, updated_at = ?5,
		finished_at = CASE WHEN ?1 IS NULL THEN NULL ELSE ?5 END
		WHERE id = ?6 AND finished_at IS NULL AND device_id = (SELECT id FROM devices WHERE uid = ?7)`,
		r.ok, r.progress, result, r.error, now, r.id, r.uid)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// ---- commands ----

// command is the API's Command object (CONTRACT §6).
type command struct {
	ID         string          `json:"id"`
	Kind       string          `json:"kind"`
	ButtonID   *string         `json:"button_id"`
	Payload    json.RawMessage `json:"payload"`
	State      string          `json:"state"`
	Progress   *int64          `json:"progress"`
	Result     json.RawMessage `json:"result"`
	Error      *string         `json:"error"`
	CreatedAt  string          `json:"created_at"`
	UpdatedAt  string          `json:"updated_at"`
	FinishedAt *string         `json:"finished_at"`
	deviceID   int64
	deadline   string
}

// keepCommands is how many of a device's newest commands are kept.
const keepCommands = 200

// notifier wakes every waiter at once: wait returns a channel that the
// next broadcast closes.
type notifier struct {
	mu sync.Mutex
	ch chan struct{}
}

func (n *notifier) wait() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ch
}

func (n *notifier) broadcast() {
	n.mu.Lock()
	defer n.mu.Unlock()
	close(n.ch)
	n.ch = make(chan struct{})
}

// commandInsert is a command record waiting for the next group commit.
type commandInsert struct {
	c    *command
	done chan error
}

// insertCommand stores a new command record and returns once it is
// committed. Concurrent inserts share one transaction, and so one fsync:
// that is what lets thousands of commands a second through.
func (s *store) insertCommand(c *command) error {
	ci := commandInsert{c: c, done: make(chan error, 1)}
	s.inserts <- ci
	return <-ci.done
}

// insertLoop commits queued command records in batches until Close.
func (s *store) insertLoop() {
	defer close(s.insertDone)
	w, prepErr := s.prepareCommandWriter()
	defer w.close()
	for first := range s.inserts {
		batch := []commandInsert{first}
	collect:
		for len(batch) < 1000 {
			select {
			case ci, ok := <-s.inserts:
				if !ok {
					break collect
				}
				batch = append(batch, ci)
			default:
				break collect
			}
		}
		err := prepErr
		if err == nil {
			err = s.inTx(context.Background(), func(tx *sql.Tx) error { return w.write(tx, batch) })
		}
		for _, ci := range batch {
			ci.done <- err
		}
	}
}

// commandWriter holds insertLoop's statements, parsed once: parsing them
// for each command took a fifth of the CPU at a few thousand a second.
type commandWriter struct{ insert, trim *sql.Stmt }

func (s *store) prepareCommandWriter() (*commandWriter, error) {
	ctx := context.Background()
	w := &commandWriter{}
	var err error
	w.insert, err = s.wdb.PrepareContext(ctx, `INSERT INTO commands
		(id, device_id, kind, button_id, payload, state, created_at, updated_at, deadline)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`)
	if err != nil {
		return w, fmt.Errorf("prepare command insert: %w", err)
	}
	// A rollout's running device keeps its ota command: without it the
	// rollout would take the command for one never sent, and send another.
	w.trim, err = s.wdb.PrepareContext(ctx, `DELETE FROM commands WHERE device_id = ?1 AND seq <=
		(SELECT seq FROM commands WHERE device_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2)
		AND NOT EXISTS (SELECT 1 FROM rollout_devices rd WHERE rd.device_id = ?1
			AND rd.command_id = commands.id AND rd.state = 'running')`)
	if err != nil {
		return w, fmt.Errorf("prepare command trim: %w", err)
	}
	return w, nil
}

func (w *commandWriter) close() {
	for _, st := range []*sql.Stmt{w.insert, w.trim} {
		if st != nil {
			st.Close()
		}
	}
}

// write inserts a batch of commands in tx, then deletes each of their
// devices' commands past the newest keepCommands.
func (w *commandWriter) write(tx *sql.Tx, batch []commandInsert) error {
	ctx := context.Background()
	insert, trim := tx.StmtContext(ctx, w.insert), tx.StmtContext(ctx, w.trim)
	devices := map[int64]bool{}
	for _, ci := range batch {
		c := ci.c
		_, err := insert.ExecContext(ctx, c.ID, c.deviceID, c.Kind, c.ButtonID, string(c.Payload), c.State, c.CreatedAt, c.UpdatedAt, c.deadline)
		if err != nil {
			return fmt.Errorf("insert command: %w", err)
		}
		devices[c.deviceID] = true
	}
	for id := range devices {
		if _, err := trim.ExecContext(ctx, id, keepCommands); err != nil {
			return err
		}
	}
	return nil
}

// deleteCommand removes a command that was never published.
func (s *store) deleteCommand(ctx context.Context, id string) error {
	_, err := s.wdb.ExecContext(ctx, `DELETE FROM commands WHERE id = ?`, id)
	return err
}

const commandColumns = `id, kind, button_id, payload, state, progress, result, error, created_at, updated_at, finished_at`

func scanCommand(row interface{ Scan(...any) error }) (*command, error) {
	c := &command{}
	var payload string
	var result *string
	err := row.Scan(&c.ID, &c.Kind, &c.ButtonID, &payload, &c.State, &c.Progress, &result, &c.Error,
		&c.CreatedAt, &c.UpdatedAt, &c.FinishedAt)
	if err != nil {
		return nil, notFound(err, errCommandNotFound)
	}
	c.Payload = json.RawMessage(payload)
	if result != nil {
		c.Result = json.RawMessage(*result)
	}
	return c, nil
}

// commandOf returns the device's command with that id, or errCommandNotFound.
func (s *store) commandOf(ctx context.Context, deviceID int64, id string) (*command, error) {
	return scanCommand(s.read.QueryRowContext(ctx,
		`SELECT `+commandColumns+` FROM commands WHERE device_id = ? AND id = ?`, deviceID, id))
}

// commandsOf lists up to limit of the device's commands, newest first;
// with before, those older than that command (errCommandNotFound when the
// device has no such command).
func (s *store) commandsOf(ctx context.Context, deviceID int64, limit int, before string) ([]*command, error) {
	maxSeq := int64(math.MaxInt64)
	if before != "" {
		err := s.read.QueryRowContext(ctx, `SELECT seq FROM commands WHERE device_id = ? AND id = ?`,
			deviceID, before).Scan(&maxSeq)
		if err != nil {
			return nil, notFound(err, errCommandNotFound)
		}
	}
	rows, err := s.read.QueryContext(ctx, `SELECT `+commandColumns+` FROM commands
		WHERE device_id = ? AND seq < ? ORDER BY seq DESC LIMIT ?`, deviceID, maxSeq, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []*command{}
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, err
		}
		list = append(list, c)
	}
	return list, rows.Err()
}

// commandResult is what a device said about one of its commands: a
// progress report (ok nil) or its end.
type commandResult struct {
	uid, id  string
	progress *int64
	ok       *bool
	result   json.RawMessage
	error    *string
}

// expireCommands ends every unfinished command whose deadline has passed
// on the store's clock as timed_out, and returns how many it ended.
func (s *store) expireCommands(ctx context.Context) (int64, error) {
	now := s.timestamp()
	res, err := s.wdb.ExecContext(ctx, `UPDATE commands SET state = 'timed_out', updated_at = ?1, finished_at = ?1
		WHERE finished_at IS NULL AND deadline <= ?1`, now)
	if err != nil {
		return 0, err
	}
	n, _ := res.RowsAffected()
	if n > 0 {
		s.commandsChanged.broadcast()
	}
	return n, nil
}

// markSilentOffline sets every online or reconnecting device that has sent
// nothing since cutoff offline, and returns how many it changed.
func (s *store) markSilentOffline(ctx context.Context, cutoff time.Time) (int64, error) {
	res, err := s.wdb.ExecContext(ctx, `UPDATE devices SET status = 'offline'
		WHERE status IN ('online', 'reconnecting') AND COALESCE(last_seen_at, '') < ?`,
		cutoff.UTC().Format(timeFormat))
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// ---- OTA progress (CONTRACT §7) ----

// newestOTA returns the device's newest ota command, or nil when it has
// none.
func newestOTA(ctx context.Context, q queryer, deviceID int64) (*command, error) {
	c, err := scanCommand(q.QueryRowContext(ctx, `SELECT `+commandColumns+` FROM commands
		WHERE device_id = ? AND kind = 'ota' ORDER BY seq DESC LIMIT 1`, deviceID))
	if errors.Is(err, errCommandNotFound) {
		return nil, nil
	}
	return c, err
}

// otaCommandFor returns the id of the newest unfinished ota command for
// that md5 of the device with that uid; "" when there is none (a link
// fetched again after its command ended, or by hand).
func (s *store) otaCommandFor(ctx context.Context, uid, md5sum string) (string, error) {
	var id string
	err := s.read.QueryRowContext(ctx, `SELECT c.id FROM commands c JOIN devices d ON d.id = c.device_id
		WHERE d.uid = ? AND c.kind = 'ota' AND c.finished_at IS NULL AND json_extract(c.payload, '$.md5') = ?
		ORDER BY c.seq DESC LIMIT 1`, uid, md5sum).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return id, err
}

// setOTAProgress makes an ota command running with the progress of its
// download; a command that has ended meanwhile keeps its end.
func (s *store) setOTAProgress(ctx context.Context, id string, progress int64) error {
	res, err := s.wdb.ExecContext(ctx, `UPDATE commands SET state = 'running', progress = ?1, updated_at = ?2
		WHERE id = ?3 AND finished_at IS NULL`, progress, s.timestamp(), id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n > 0 {
		s.commandsChanged.broadcast()
	}
	return nil
}

// ---- rollouts ----

// rollout is the API's Rollout object (CONTRACT §8); Devices only in the
// detail.
type rollout struct {
	ID          int64           `json:"id"`
	Name        *string         `json:"name"`
	MD5         string          `json:"md5"`
	SHA256      string          `json:"sha256"`
	State       string          `json:"state"`
	BatchSize   int             `json:"batch_size"`
	MaxFailures int             `json:"max_failures"`
	Counts      map[string]int  `json:"counts"`
	CreatedAt   string          `json:"created_at"`
	UpdatedAt   string          `json:"updated_at"`
	FinishedAt  *string         `json:"finished_at"`
	Devices     []rolloutDevice `json:"devices,omitempty"`
}

// rolloutDevice is one device of a rollout, and what the engine needs
// to know of it.
type rolloutDevice struct {
	UID       string  `json:"uid"`
	State     string  `json:"state"`
	CommandID *string `json:"command_id"`
	Error     *string `json:"error"`
	position  int
	deviceID  int64
	online    bool    // the device's status is online
	runs      bool    // it reports the rollout's md5
	cmdState  *string // its command's state; nil when the command does not exist
	cmdError  *string
	ended     bool // State was running and is now how its command ended, not yet recorded
}

// errMD5OfTwoFiles: the user's firmwares hold two different files under
// the rollout's md5 (an md5 collision), so it could not say which to send.
var errMD5OfTwoFiles = errors.New("the md5 names two different files")

// rolloutDeviceState is a rollout device's state as shown: a device
// recorded as running whose command has ended shows that end, also in a
// rollout that the engine no longer moves (paused, halted, cancelled).
const rolloutDeviceState = `CASE WHEN rd.state = 'running' AND c.state IN ('succeeded', 'failed', 'timed_out')
	THEN c.state ELSE rd.state END`

// rolloutStates are the states a rollout's device can be in; the first
// three are not an end.
var rolloutStates = []string{"pending", "waiting", "running", "succeeded", "failed", "timed_out", "skipped"}

// newRollout is a validated rollout request.
type newRollout struct {
	name                   *string
	md5                    string
	deviceIDs              []int64
	batchSize, maxFailures int
}

// rolloutFirmware returns the sha256 of the user's firmware with that md5,
// errFirmwareNotFound when none of the user's devices has one.
func (s *store) rolloutFirmware(ctx context.Context, ownerID int64, md5sum string) (string, error) {
	var sha string
	err := s.read.QueryRowContext(ctx, `SELECT f.sha256 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.owner_id = ? AND f.md5 = ? ORDER BY f.id LIMIT 1`, ownerID, md5sum).Scan(&sha)
	return sha, notFound(err, errFirmwareNotFound)
}

// deviceIDsByUID maps those of the uids that name the user's devices to
// their ids.
func (s *store) deviceIDsByUID(ctx context.Context, ownerID int64, uids []string) (map[string]int64, error) {
	ids := map[string]int64{}
	for _, uid := range uids {
		var id int64
		err := s.read.QueryRowContext(ctx, `SELECT id FROM devices WHERE uid = ? AND owner_id = ?`, uid, ownerID).Scan(&id)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			return nil, err
		}
		ids[uid] = id
	}
	return ids, nil
}

// createRollout stores a rollout: each device gets a firmware row for the
// file (copied from the user's firmware with that md5, sharing its bytes)
// as its target, and is pending, or skipped when it already reports the md5.
func (s *store) createRollout(ctx context.Context, ownerID int64, nr newRollout) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		now := s.timestamp()
		var srcID int64
		var sha string
		var files int
		err := tx.QueryRowContext(ctx, `SELECT count(DISTINCT f.sha256), coalesce(min(f.id), 0), coalesce(min(f.sha256), '')
			FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE d.owner_id = ? AND f.md5 = ?`, ownerID, nr.md5).Scan(&files, &srcID, &sha)
		switch {
		case err != nil:
			return err
		case files == 0:
			return errFirmwareNotFound
		case files > 1:
			return errMD5OfTwoFiles
		}
		err = tx.QueryRowContext(ctx, `INSERT INTO rollouts (owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at)
			VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?) RETURNING id`,
			ownerID, nr.name, nr.md5, sha, nr.batchSize, nr.maxFailures, now, now).Scan(&id)
		if err != nil {
			return err
		}
		for i, deviceID := range nr.deviceIDs {
			if err := addRolloutDevice(ctx, tx, id, i, deviceID, srcID, nr.md5, now); err != nil {
				return err
			}
		}
		return nil
	})
	return id, err
}

func addRolloutDevice(ctx context.Context, tx *sql.Tx, rolloutID int64, position int, deviceID, srcID int64, md5sum, now string) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
		SELECT ?1, name, version, notes, md5, sha256, size, ?2 FROM firmwares WHERE id = ?3
		AND NOT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ?1 AND md5 = ?4)`, deviceID, now, srcID, md5sum)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
		(SELECT id FROM firmwares WHERE device_id = ?1 AND md5 = ?2) WHERE id = ?1`, deviceID, md5sum)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO rollout_devices (rollout_id, position, device_id, state)
		SELECT ?, ?, id, CASE WHEN current_md5 IS ? THEN 'skipped' ELSE 'pending' END FROM devices WHERE id = ?`,
		rolloutID, position, md5sum, deviceID)
	return err
}

const rolloutColumns = `id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at`

func scanRollout(row interface{ Scan(...any) error }) (*rollout, error) {
	r := &rollout{Counts: map[string]int{}}
	err := row.Scan(&r.ID, &r.Name, &r.MD5, &r.SHA256, &r.State, &r.BatchSize, &r.MaxFailures,
		&r.CreatedAt, &r.UpdatedAt, &r.FinishedAt)
	if err != nil {
		return nil, notFound(err, errRolloutNotFound)
	}
	for _, st := range rolloutStates {
		r.Counts[st] = 0
	}
	return r, nil
}

// rolloutsOf lists the user's rollouts, newest first, with their counts.
func (s *store) rolloutsOf(ctx context.Context, ownerID int64) ([]*rollout, error) {
	rows, err := s.read.QueryContext(ctx, `SELECT `+rolloutColumns+` FROM rollouts WHERE owner_id = ? ORDER BY id DESC`, ownerID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []*rollout{}
	byID := map[int64]*rollout{}
	for rows.Next() {
		r, err := scanRollout(rows)
		if err != nil {
			return nil, err
		}
		list = append(list, r)
		byID[r.ID] = r
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	counts, err := s.read.QueryContext(ctx, `SELECT rd.rollout_id, `+rolloutDeviceState+`, count(*)
		FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE r.owner_id = ? GROUP BY 1, 2`, ownerID)
	if err != nil {
		return nil, err
	}
	defer counts.Close()
	for counts.Next() {
		var id int64
		var state string
		var n int
		if err := counts.Scan(&id, &state, &n); err != nil {
			return nil, err
		}
		byID[id].Counts[state] = n
	}
	return list, counts.Err()
}

// rolloutOf returns the user's rollout with its devices, in the order
// given, and what the engine needs to know of each; errRolloutNotFound
// when the user has none with that id.
func (s *store) rolloutOf(ctx context.Context, ownerID, id int64) (*rollout, error) {
	r, err := scanRollout(s.read.QueryRowContext(ctx,
		`SELECT `+rolloutColumns+` FROM rollouts WHERE id = ? AND owner_id = ?`, id, ownerID))
	if err != nil {
		return nil, err
	}
	rows, err := s.read.QueryContext(ctx, `SELECT d.uid, rd.state, rd.command_id, rd.error, rd.position, d.id,
		d.status = 'online', d.current_md5 IS ?, c.state, c.error
		FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
		LEFT JOIN commands c ON c.id = rd.command_id
		WHERE rd.rollout_id = ? ORDER BY rd.position`, r.MD5, id)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var d rolloutDevice
		err := rows.Scan(&d.UID, &d.State, &d.CommandID, &d.Error, &d.position, &d.deviceID,
			&d.online, &d.runs, &d.cmdState, &d.cmdError)
		if err != nil {
			return nil, err
		}
		if d.State == "running" && d.cmdState != nil && slices.Contains([]string{"succeeded", "failed", "timed_out"}, *d.cmdState) {
			d.State, d.Error, d.ended = *d.cmdState, d.cmdError, true
		}
		r.Devices = append(r.Devices, d)
		r.Counts[d.State]++
	}
	return r, rows.Err()
}

// activeRollouts returns the ids and owners of the running rollouts.
func (s *store) activeRollouts(ctx context.Context) (map[int64]int64, error) {
	rows, err := s.read.QueryContext(ctx, `SELECT id, owner_id FROM rollouts WHERE state = 'running'`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	active := map[int64]int64{}
	for rows.Next() {
		var id, owner int64
		if err := rows.Scan(&id, &owner); err != nil {
			return nil, err
		}
		active[id] = owner
	}
	return active, rows.Err()
}

// setRolloutDevices records the states of devices of a rollout, in one
// transaction.
func (s *store) setRolloutDevices(ctx context.Context, rolloutID int64, devices []*rolloutDevice) error {
	if len(devices) == 0 {
		return nil
	}
	return s.inTx(ctx, func(tx *sql.Tx) error {
		for _, d := range devices {
			_, err := tx.ExecContext(ctx, `UPDATE rollout_devices SET state = ?, command_id = ?, error = ?
				WHERE rollout_id = ? AND position = ?`, d.State, d.CommandID, d.Error, rolloutID, d.position)
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// moveRollout changes the user's rollout from one of the states in from to
// state to; it reports whether it did. errRolloutNotFound when the user
// has no such rollout.
func (s *store) moveRollout(ctx context.Context, ownerID, id int64, from []string, to string) (bool, error) {
	var moved bool
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var state string
		err := tx.QueryRowContext(ctx, `SELECT state FROM rollouts WHERE id = ? AND owner_id = ?`, id, ownerID).Scan(&state)
		if err != nil {
			return notFound(err, errRolloutNotFound)
		}
		if moved = slices.Contains(from, state); !moved {
			return nil
		}
		now := s.timestamp()
		_, err = tx.ExecContext(ctx, `UPDATE rollouts SET state = ?1, updated_at = ?2,
			finished_at = CASE WHEN ?1 IN ('halted', 'cancelled', 'completed') THEN ?2 END WHERE id = ?3`, to, now, id)
		return err
	})
	return moved, err
}

// ---- command buttons ----

type commandButton struct {
	ID      string          `json:"id"`
	Label   string          `json:"label"`
	Payload json.RawMessage `json:"payload"`
	Confirm bool            `json:"confirm"`
}

// buttonsOf lists a device's buttons in creation order.
func (s *store) buttonsOf(ctx context.Context, deviceID int64) ([]commandButton, error) {
	rows, err := s.read.QueryContext(ctx,
		`SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? ORDER BY seq`, deviceID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []commandButton{}
	for rows.Next() {
		var b commandButton
		var payload string
		if err := rows.Scan(&b.ID, &b.Label, &payload, &b.Confirm); err != nil {
			return nil, err
		}
		b.Payload = json.RawMessage(payload)
		list = append(list, b)
	}
	return list, rows.Err()
}

// button returns one button of the device or errButtonNotFound.
func (s *store) button(ctx context.Context, deviceID int64, id string) (*commandButton, error) {
	var b commandButton
	var payload string
	err := s.read.QueryRowContext(ctx,
		`SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? AND id = ?`,
		deviceID, id).Scan(&b.ID, &b.Label, &payload, &b.Confirm)
	if err != nil {
		return nil, notFound(err, errButtonNotFound)
	}
	b.Payload = json.RawMessage(payload)
	return &b, nil
}

// createButton adds a button; errButtonExists when the device has one with
// that id, a quotaError when it has as many as allowed.
func (s *store) createButton(ctx context.Context, deviceID int64, b commandButton) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.buttons; max > 0 {
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM command_buttons WHERE device_id = ?`, deviceID).Scan(&n); err != nil {
				return err
			}
			if n >= max {
				return &quotaError{fmt.Sprintf("This device has reached its limit of %d command buttons.", max)}
			}
		}
		_, err := tx.ExecContext(ctx,
			`INSERT INTO command_buttons (device_id, id, label, payload, confirm) VALUES (?, ?, ?, ?, ?)`,
			deviceID, b.ID, b.Label, string(b.Payload), b.Confirm)
		if isUniqueErr(err) {
			return errButtonExists
		}
		return err
	})
}

// deleteButton removes a button or returns errButtonNotFound.
func (s *store) deleteButton(ctx context.Context, deviceID int64, id string) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM command_buttons WHERE device_id = ? AND id = ?`, deviceID, id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errButtonNotFound
	}
	return nil
}

// ---- firmwares ----

const firmwareColumns = `f.id, f.name, f.version, f.notes, f.md5, f.sha256, f.size, f.created_at,
	f.md5 IS d.current_md5, f.id IS d.target_firmware_id`

func scanFirmware(row interface{ Scan(...any) error }) (*firmware, error) {
	f := &firmware{ID: new(int64), Name: new(string), SHA256: new(string), Size: new(int64), CreatedAt: new(string),
		IsCurrent: new(bool), IsTarget: new(bool)}
	if err := row.Scan(f.ID, f.Name, &f.Version, &f.Notes, &f.MD5, f.SHA256, f.Size, f.CreatedAt, f.IsCurrent, f.IsTarget); err != nil {
		return nil, notFound(err, errFirmwareNotFound)
	}
	return f, nil
}

// firmwaresOf lists a device's firmwares, newest first.
func (s *store) firmwaresOf(ctx context.Context, deviceID int64) ([]*firmware, error) {
	rows, err := s.read.QueryContext(ctx, `SELECT `+firmwareColumns+`
		FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE f.device_id = ? ORDER BY f.id DESC`, deviceID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []*firmware{}
	for rows.Next() {
		f, err := scanFirmware(rows)
		if err != nil {
			return nil, err
		}
		list = append(list, f)
	}
	return list, rows.Err()
}

// firmwareRef finds the SQL condition for a {firmware_id} path segment: an
// integer id, or an md5 in either case.
func firmwareRef(ref string) (cond string, arg any, ok bool) {
	if isMD5(ref) {
		return `f.md5 = ?`, strings.ToLower(ref), true
	}
	if id, err := strconv.ParseInt(ref, 10, 64); err == nil && id > 0 {
		return `f.id = ?`, id, true
	}
	return "", nil, false
}

type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func firmwareQuery(ctx context.Context, q queryer, deviceID int64, ref string) (*firmware, error) {
	cond, arg, ok := firmwareRef(ref)
	if !ok {
		return nil, errFirmwareNotFound
	}
	return scanFirmware(q.QueryRowContext(ctx, `SELECT `+firmwareColumns+`
		FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE f.device_id = ? AND `+cond, deviceID, arg))
}

// firmwareUpdate holds the fields a PATCH changes; nil leaves one as it is,
// and a pointer to "" clears version or notes.
type firmwareUpdate struct {
	name, version, notes *string
}

// updateFirmware applies u to the device's firmware named by ref and returns it.
func (s *store) updateFirmware(ctx context.Context, deviceID int64, ref string, u firmwareUpdate) (*firmware, error) {
	var f *firmware
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if f, err = firmwareQuery(ctx, tx, deviceID, ref); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `UPDATE firmwares SET name = COALESCE(?, name),
			version = NULLIF(COALESCE(?, version), ''), notes = NULLIF(COALESCE(?, notes), '')
			WHERE id = ?`, u.name, u.version, u.notes, *f.ID)
		if err != nil {
			return err
		}
		f, err = firmwareQuery(ctx, tx, deviceID, fmt.Sprint(*f.ID))
		return err
	})
	return f, err
}

// deleteFirmware removes the device's firmware named by ref, and its file
// when no other row uses it. errFirmwareAssigned when it is a target.
func (s *store) deleteFirmware(ctx context.Context, deviceID int64, ref string) error {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var sha string
	var others int
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		f, err := firmwareQuery(ctx, tx, deviceID, ref)
		if err != nil {
			return err
		}
		var assigned bool
		err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM devices WHERE target_firmware_id = ?1)
			OR EXISTS (SELECT 1 FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id
				WHERE rd.device_id = ?2 AND r.md5 = ?3 AND r.state IN ('running', 'paused'))`,
			*f.ID, deviceID, f.MD5).Scan(&assigned)
		if err != nil {
			return err
		}
		if assigned {
			return errFirmwareAssigned
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM firmwares WHERE id = ?`, *f.ID); err != nil {
			return err
		}
		sha = *f.SHA256
		return tx.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE sha256 = ?`, sha).Scan(&others)
	})
	if err != nil {
		return err
	}
	if others == 0 {
		// The row is gone; a crash before this line leaves a file that
		// cleanFirmwareFiles removes at the next start.
		if err := os.Remove(s.firmwarePath(sha)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove firmware file: %w", err)
		}
	}
	return nil
}

// newFirmware is an upload to be stored: its fields, and its bytes in the
// fsynced temporary file tmpPath.
type newFirmware struct {
	name, version, notes *string
	md5, sha256          string
	size                 int64
	tmpPath              string
}

// createFirmware moves the upload's file into place and adds the firmware
// row, in that order, so that a row never exists without its file.
// errFirmwareExists for a duplicate.
func (s *store) createFirmware(ctx context.Context, deviceID int64, nf newFirmware) (*firmware, error) {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var f *firmware
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var exists bool
		err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ? AND md5 = ?)`,
			deviceID, nf.md5).Scan(&exists)
		if err != nil {
			return err
		}
		if exists {
			return errFirmwareExists
		}
		if err := s.checkFirmwareQuotas(ctx, tx, deviceID, nf.size); err != nil {
			return err
		}
		// Named by sha256: files with the same md5 never share a name.
		if err := os.Rename(nf.tmpPath, s.firmwarePath(nf.sha256)); err != nil {
			return fmt.Errorf("store firmware file: %w", err)
		}
		if err := syncDir(s.fwDir); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, sha256, size, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)`, deviceID, *nf.name, nf.version, nf.notes, nf.md5, nf.sha256, nf.size, s.timestamp())
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
	if err != nil && !errors.Is(err, errFirmwareExists) {
		// The file may now be in place without a row; drop it unless
		// another row uses the same bytes.
		var n int
		if qerr := s.wdb.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE sha256 = ?`, nf.sha256).Scan(&n); qerr == nil && n == 0 {
			os.Remove(s.firmwarePath(nf.sha256))
		}
	}
	return f, err
}

// checkFirmwareQuotas refuses with a quotaError one more firmware of size
// bytes for the device when the device has as many as allowed, or when
// its owner's firmwares, every row counted, would pass the byte limit.
func (s *store) checkFirmwareQuotas(ctx context.Context, tx *sql.Tx, deviceID, size int64) error {
	if max := s.limits.firmwares; max > 0 {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE device_id = ?`, deviceID).Scan(&n); err != nil {
			return err
		}
		if n >= max {
			return &quotaError{fmt.Sprintf("This device has reached its limit of %d firmwares.", max)}
		}
	}
	if mib := s.limits.firmwareMiB; mib > 0 {
		var used int64
		err := tx.QueryRowContext(ctx, `SELECT COALESCE(sum(f.size), 0) FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE d.owner_id = (SELECT owner_id FROM devices WHERE id = ?)`, deviceID).Scan(&used)
		if err != nil {
			return err
		}
		if used+size > int64(mib)<<20 {
			return &quotaError{fmt.Sprintf("This upload would pass your firmware storage limit of %d MiB.", mib)}
		}
	}
	return nil
}

// setTarget makes the device's firmware with that md5 its target.
// errTargetNotFound when the device has no such firmware.
func (s *store) setTarget(ctx context.Context, deviceID int64, md5sum string) error {
	res, err := s.wdb.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
		(SELECT id FROM firmwares WHERE device_id = devices.id AND md5 = ?)
		WHERE id = ? AND EXISTS (SELECT 1 FROM firmwares WHERE device_id = devices.id AND md5 = ?)`,
		md5sum, deviceID, md5sum)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errTargetNotFound
	}
	return nil
}

// firmwarePath is where the bytes with that sha256 are kept.
func (s *store) firmwarePath(sha256sum string) string {
	return filepath.Join(s.fwDir, sha256sum+".bin")
}

// newFirmwareTemp creates a temporary file for an upload in progress.
func (s *store) newFirmwareTemp() (*os.File, error) {
	return os.CreateTemp(filepath.Join(s.fwDir, "tmp"), "upload-*")
}

// migrateFirmwareFiles moves the files of a data directory from before
// version 3, named <md5>.bin, to <sha256>.bin. Each file is linked under
// its new name and fsynced before its rows record the sha256, and only
// then is the old name removed: a crash at any point loses no byte, and
// the next start finishes the job (cleanFirmwareFiles drops an old name
// whose rows were already moved).
func (s *store) migrateFirmwareFiles(ctx context.Context) error {
	sums, err := queryStrings(ctx, s.wdb, `SELECT DISTINCT md5 FROM firmwares WHERE sha256 = ''`)
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
func (s *store) migrateFirmwareFile(ctx context.Context, md5sum string) error {
	old := filepath.Join(s.fwDir, md5sum+".bin")
	f, err := os.Open(old)
	if errors.Is(err, os.ErrNotExist) {
		var left bool
		if qerr := s.wdb.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE md5 = ? AND sha256 = '')`,
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
	if err := os.Link(old, s.firmwarePath(sha)); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := syncDir(s.fwDir); err != nil {
		return err
	}
	_, err = s.wdb.ExecContext(ctx, `UPDATE firmwares SET sha256 = ? WHERE md5 = ? AND sha256 = ''`, sha, md5sum)
	if err != nil {
		return err
	}
	if err := os.Remove(old); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// cleanFirmwareFiles removes unfinished uploads and files that no row needs.
// It runs at start, before anything else can write.
func (s *store) cleanFirmwareFiles(ctx context.Context) error {
	tmp, err := os.ReadDir(filepath.Join(s.fwDir, "tmp"))
	if err != nil {
		return fmt.Errorf("read firmware tmp dir: %w", err)
	}
	for _, e := range tmp {
		os.Remove(filepath.Join(s.fwDir, "tmp", e.Name()))
	}
	files, err := os.ReadDir(s.fwDir)
	if err != nil {
		return fmt.Errorf("read firmware dir: %w", err)
	}
	for _, e := range files {
		sum, ok := strings.CutSuffix(e.Name(), ".bin")
		if e.IsDir() || !ok {
			continue
		}
		var used bool
		if err := s.read.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE sha256 = ?)`, sum).Scan(&used); err != nil {
			return fmt.Errorf("check firmware file: %w", err)
		}
		if !used {
			if err := os.Remove(filepath.Join(s.fwDir, e.Name())); err != nil {
				return fmt.Errorf("remove orphan firmware file: %w", err)
			}
		}
	}
	return nil
}

// fileSums are what hashToTemp learns of a file.
type fileSums struct {
	md5, sha256 string
	size        int64
	head        [2]byte // the first bytes: an image's magic number
}

// hashToTemp streams r (at most limit bytes) into f while computing its
// md5 and sha256, then fsyncs f. tooBig reports that r had more than limit
// bytes.
func hashToTemp(f *os.File, r io.Reader, limit int64) (sums fileSums, tooBig bool, err error) {
	m, sh := md5.New(), sha256.New()
	head := &headWriter{b: sums.head[:0]}
	sums.size, err = io.Copy(io.MultiWriter(f, m, sh, head), io.LimitReader(r, limit+1))
	if err != nil {
		return sums, false, err
	}
	if sums.size > limit {
		return sums, true, nil
	}
	if err := f.Sync(); err != nil {
		return sums, false, err
	}
	copy(sums.head[:], head.b)
	sums.md5, sums.sha256 = hex.EncodeToString(m.Sum(nil)), hex.EncodeToString(sh.Sum(nil))
	return sums, false, nil
}

// headWriter keeps the first cap(b) bytes written to it.
type headWriter struct{ b []byte }

func (w *headWriter) Write(p []byte) (int, error) {
	n := min(cap(w.b)-len(w.b), len(p))
	w.b = append(w.b, p[:n]...)
	return len(p), nil
}

func syncDir(dir string) error {
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

func isMD5(s string) bool {
	if len(s) != 32 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

func isUniqueErr(err error) bool {
	return err != nil && strings.Contains(err.Error(), "UNIQUE constraint failed")
}

// openFirmwareFile opens the file of the firmware with that md5 of the
// device with that uid, and returns its sha256 too; errFirmwareNotFound
// when either is gone.
func (s *store) openFirmwareFile(ctx context.Context, uid, md5sum string) (*os.File, string, error) {
	var sha string
	err := s.read.QueryRowContext(ctx, `SELECT f.sha256 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.uid = ? AND f.md5 = ?`, uid, md5sum).Scan(&sha)
	if err != nil {
		return nil, "", notFound(err, errFirmwareNotFound)
	}
	f, err := os.Open(s.firmwarePath(sha))
	if errors.Is(err, os.ErrNotExist) {
		return nil, "", errFirmwareNotFound
	}
	return f, sha, err
}

// deviceUIDsOwnedBy returns the uids of the devices of the user with that
// email, oldest first (`devicehub simulate` runs them); errUserNotFound when no
// user has that email, an empty list when the user has no devices.
func (s *store) deviceUIDsOwnedBy(ctx context.Context, email string) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT d.uid FROM users u LEFT JOIN devices d ON d.owner_id = u.id
		WHERE u.email = ? ORDER BY d.id`, normalizeEmail(email))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	found := false
	uids := []string{}
	for rows.Next() {
		found = true
		var uid sql.NullString // NULL: the user exists and has no devices
		if err := rows.Scan(&uid); err != nil {
			return nil, err
		}
		if uid.Valid {
			uids = append(uids, uid.String)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if !found {
		return nil, errUserNotFound
	}
	return uids, nil
}

// ---- administration (the CLI's user, device, token and backup commands) ----

// errUserHasDevices refuses to delete a user who still owns devices.
var errUserHasDevices = errors.New("the user owns devices")

// userRow is a user as 'user list' shows it.
type userRow struct {
	ID                int64
	Email, Name, Role string
	Devices, Tokens   int
	CreatedAt         string
	LastLoginAt       *string
}

// listUsers returns every user, oldest first, with how many devices and
// tokens each has.
func (s *store) listUsers(ctx context.Context) ([]userRow, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT u.id, u.email, u.name, u.role, u.created_at, u.last_login_at,
		(SELECT count(*) FROM devices WHERE owner_id = u.id), (SELECT count(*) FROM tokens WHERE user_id = u.id)
		FROM users u ORDER BY u.id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var list []userRow
	for rows.Next() {
		var u userRow
		if err := rows.Scan(&u.ID, &u.Email, &u.Name, &u.Role, &u.CreatedAt, &u.LastLoginAt, &u.Devices, &u.Tokens); err != nil {
			return nil, err
		}
		list = append(list, u)
	}
	return list, rows.Err()
}

// setPassword replaces the password hash of the user with that email and
// deletes all their tokens, in one transaction, so that a reset locks out
// whoever knew the old password. It returns how many tokens it deleted;
// errUserNotFound when there is no such user.
func (s *store) setPassword(ctx context.Context, email, passwordHash string) (revoked int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		err := tx.QueryRowContext(ctx, `UPDATE users SET password_hash = ? WHERE email = ? RETURNING id`,
			passwordHash, normalizeEmail(email)).Scan(&id)
		if err != nil {
			return notFound(err, errUserNotFound)
		}
		res, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE user_id = ?`, id)
		if err != nil {
			return err
		}
		revoked, err = res.RowsAffected()
		return err
	})
	return revoked, err
}

// deleteUser deletes the user with that email with their tokens and, when
// withDevices is set, their devices and the firmware files no other row
// needs. errUserHasDevices when they own devices and withDevices is not
// set; errUserNotFound when there is no such user.
func (s *store) deleteUser(ctx context.Context, email string, withDevices bool) (devices int, files int, err error) {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var unneeded []string
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		err := tx.QueryRowContext(ctx, `SELECT id, (SELECT count(*) FROM devices WHERE owner_id = users.id)
			FROM users WHERE email = ?`, normalizeEmail(email)).Scan(&id, &devices)
		if err != nil {
			return notFound(err, errUserNotFound)
		}
		if devices > 0 && !withDevices {
			return errUserHasDevices
		}
		sums, err := queryStrings(ctx, tx, `SELECT DISTINCT f.sha256 FROM firmwares f
			JOIN devices d ON d.id = f.device_id WHERE d.owner_id = ?`, id)
		if err != nil {
			return err
		}
		// Devices, their firmware rows and buttons, and tokens go by ON DELETE CASCADE.
		if _, err := tx.ExecContext(ctx, `DELETE FROM users WHERE id = ?`, id); err != nil {
			return err
		}
		unneeded, err = unusedFirmwareFiles(ctx, tx, sums)
		return err
	})
	if err != nil {
		return devices, 0, err
	}
	return devices, len(unneeded), s.removeFirmwareFiles(unneeded)
}

// deviceRow is a device as 'device list' shows it.
type deviceRow struct {
	UID, Name, Status, Owner, Platform, Board string
	LastSeenAt                                *string
}

// listDevices returns the devices of the user with email ownerEmail, or
// every device when it is empty, oldest first. errUserNotFound when
// there is no such user.
func (s *store) listDevices(ctx context.Context, ownerEmail string) ([]deviceRow, error) {
	if ownerEmail != "" {
		if _, err := s.userByEmail(ctx, ownerEmail); err != nil {
			return nil, err
		}
	}
	rows, err := s.db.QueryContext(ctx, `SELECT d.uid, d.name, d.status, u.email, p.key, b.key, d.last_seen_at
		FROM devices d JOIN users u ON u.id = d.owner_id
		JOIN platforms p ON p.id = d.platform_id JOIN boards b ON b.id = d.board_id
		WHERE ? = '' OR u.email = ? ORDER BY d.id`, ownerEmail, normalizeEmail(ownerEmail))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var list []deviceRow
	for rows.Next() {
		var d deviceRow
		if err := rows.Scan(&d.UID, &d.Name, &d.Status, &d.Owner, &d.Platform, &d.Board, &d.LastSeenAt); err != nil {
			return nil, err
		}
		list = append(list, d)
	}
	return list, rows.Err()
}

// deleteDevice deletes the device with that uid, its firmware rows and
// buttons, and then the firmware files that no other row needs; it
// returns how many files it removed. errDeviceNotFound when there is no
// such device.
func (s *store) deleteDevice(ctx context.Context, uid string) (files int, err error) {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var unneeded []string
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		if err := tx.QueryRowContext(ctx, `SELECT id FROM devices WHERE uid = ?`, uid).Scan(&id); err != nil {
			return notFound(err, errDeviceNotFound)
		}
		sums, err := queryStrings(ctx, tx, `SELECT DISTINCT sha256 FROM firmwares WHERE device_id = ?`, id)
		if err != nil {
			return err
		}
		// Firmware rows and buttons go by ON DELETE CASCADE.
		if _, err := tx.ExecContext(ctx, `DELETE FROM devices WHERE id = ?`, id); err != nil {
			return err
		}
		unneeded, err = unusedFirmwareFiles(ctx, tx, sums)
		return err
	})
	if err != nil {
		return 0, err
	}
	return len(unneeded), s.removeFirmwareFiles(unneeded)
}

// unusedFirmwareFiles returns those of the files with these sha256s that
// no firmware row uses.
func unusedFirmwareFiles(ctx context.Context, tx *sql.Tx, sums []string) ([]string, error) {
	var unused []string
	for _, sum := range sums {
		var used bool
		if err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE sha256 = ?)`, sum).Scan(&used); err != nil {
			return nil, err
		}
		if !used {
			unused = append(unused, sum)
		}
	}
	return unused, nil
}

// removeFirmwareFiles removes the files with these sha256s, after the
// transaction that deleted their last rows committed; a crash in between
// leaves files that cleanFirmwareFiles removes at the next start. The
// caller holds fwMu.
func (s *store) removeFirmwareFiles(sums []string) error {
	var errs []error
	for _, sum := range sums {
		if err := os.Remove(s.firmwarePath(sum)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove firmware file: %w", err))
		}
	}
	return errors.Join(errs...)
}

// queryStrings returns the first column of every row of a query.
func queryStrings(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, query string, args ...any) ([]string, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var list []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		list = append(list, v)
	}
	return list, rows.Err()
}

// tokenRow is a token as 'token list' shows it; the secret is never kept.
type tokenRow struct {
	ID                     int64
	Email, Name, CreatedAt string
	LastUsedAt             *string
}

// listTokens returns the tokens of the user with that email, or every
// token when it is empty, oldest first. errUserNotFound when there is no
// such user.
func (s *store) listTokens(ctx context.Context, email string) ([]tokenRow, error) {
	if email != "" {
		if _, err := s.userByEmail(ctx, email); err != nil {
			return nil, err
		}
	}
	rows, err := s.db.QueryContext(ctx, `SELECT t.id, u.email, t.name, t.created_at, t.last_used_at
		FROM tokens t JOIN users u ON u.id = t.user_id
		WHERE ? = '' OR u.email = ? ORDER BY t.id`, email, normalizeEmail(email))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var list []tokenRow
	for rows.Next() {
		var t tokenRow
		if err := rows.Scan(&t.ID, &t.Email, &t.Name, &t.CreatedAt, &t.LastUsedAt); err != nil {
			return nil, err
		}
		list = append(list, t)
	}
	return list, rows.Err()
}

// revokeToken deletes the token with that id; errTokenNotFound when there
// is none.
func (s *store) revokeToken(ctx context.Context, id int64) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM tokens WHERE id = ?`, id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errTokenNotFound
	}
	return nil
}

// vacuumInto writes a consistent copy of the database to path, a file
// that must not exist: SQLite copies one read transaction's view, so
// writes that go on meanwhile are either wholly in it or not at all.
func (s *store) vacuumInto(ctx context.Context, path string) error {
	if _, err := s.wdb.ExecContext(ctx, `VACUUM INTO ?`, path); err != nil {
		return fmt.Errorf("copy database: %w", err)
	}
	return nil
}

// snapshotFirmwareSHA256s checks the database copy at path and returns
// the sha256 of every firmware file its rows need.
func snapshotFirmwareSHA256s(ctx context.Context, path string) ([]string, error) {
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		return nil, err
	}
	defer db.Close()
	var check string
	if err := db.QueryRowContext(ctx, `PRAGMA quick_check`).Scan(&check); err != nil {
		return nil, fmt.Errorf("check database copy: %w", err)
	}
	if check != "ok" {
		return nil, fmt.Errorf("check database copy: %s", check)
	}
	return queryStrings(ctx, db, `SELECT DISTINCT sha256 FROM firmwares ORDER BY sha256`)
}
