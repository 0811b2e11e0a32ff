package main

import (
	"context"
	"database/sql"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
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

// commandsSchema (version 2) keeps command records (README: Commands that report back). seq
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

// rolloutsSchema (version 3) stores firmware by SHA-256 (README: OTA updates; the
// files are renamed at start-up by migrateFirmwareFiles) and keeps
// rollouts (README: Rollouts): one firmware for many devices, in batches, in the order
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
	errStoreClosed     = errors.New("store closed")
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

// quotas are the per-device and per-user limits of README: Configuration; 0 is no
// limit.
type quotas struct {
	firmwares   int // firmware rows per device
	buttons     int // command buttons per device
	firmwareMiB int // firmware bytes per user, in MiB, every row counted
	tokens      int // tokens per user
}

// quota names a limit of quotas.
type quota int

const (
	quotaButtons quota = iota
	quotaFirmwares
	quotaFirmwareMiB
	quotaTokens
)

// quotaError is a write refused because it would pass a limit.
type quotaError struct {
	quota quota
	limit int
}

func (e *quotaError) Error() string { return fmt.Sprintf(quotaMessages[e.quota], e.limit) }

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

// store holds all SQL and the firmware files: this file has the database,
// its migrations, devices and buttons; store_*.go the other concerns, one
// file each (users, commands, rollouts, firmware, administration). Reads
// go through db, a pool;
// writes go through wdb, a single connection, so that concurrent writers
// queue in Go instead of failing with "database is locked".
type store struct {
	db    *sql.DB
	wdb   *sql.DB
	read  *stmtCache // db with each query prepared once
	cache *readCache // hot reads, kept until the next commit

	// inserts queues new command records for insertLoop's group commit;
	// closing ends it (Close), and insertDone says it has ended.
	inserts    chan commandInsert
	closing    chan struct{}
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
	s.inserts, s.closing, s.insertDone = make(chan commandInsert), make(chan struct{}), make(chan struct{})
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
	if s.closing != nil {
		close(s.closing)
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
	// OTA is the device's newest ota command (README: OTA updates); only Device
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
// md5 as succeeded (README: OTA updates). last_ota_at is set when the report ends
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
				return &quotaError{quotaButtons, max}
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
