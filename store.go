package main

import (
	"context"
	"crypto/md5"
	"database/sql"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	_ "modernc.org/sqlite"
)

//go:embed schema.sql
var schemaSQL string

// migrations are applied in order; PRAGMA user_version records how many ran.
// Append to this list to change the schema; never edit an applied entry.
var migrations = []string{schemaSQL}

// Sentinel errors of the store; writeError maps them to HTTP statuses.
var (
	errNotFound = errors.New("not found")
	errConflict = errors.New("conflict")
)

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
	fwDir string
	now   func() time.Time

	// fwMu orders firmware file changes with their rows: a file is renamed
	// into place or removed only while holding it, together with the
	// transaction that adds or deletes the row that needs it.
	fwMu sync.Mutex
}

// openStore opens (creating if needed) the database and firmware directory
// under dir, migrates the schema and removes firmware files that no row
// needs (left by a crash).
func openStore(ctx context.Context, dir string, now func() time.Time) (*store, error) {
	fwDir := filepath.Join(dir, "firmware")
	if err := os.MkdirAll(filepath.Join(fwDir, "tmp"), 0o700); err != nil {
		return nil, fmt.Errorf("create data dir: %w", err)
	}
	// Pragmas go in the DSN so that every pooled connection gets them.
	// synchronous(FULL): an answered write survives a power cut, not just a crash.
	dsn := "file:" + filepath.Join(dir, "devicehub.db") +
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
	if err := s.cleanFirmwareFiles(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// Close closes both connection pools.
func (s *store) Close() error {
	var errs []error
	if s.cache != nil {
		errs = append(errs, s.cache.check.Close(), s.cache.conn.Close())
	}
	return errors.Join(append(errs, s.read.close(), s.db.Close(), s.wdb.Close())...)
}

// readCache keeps the results of hot reads (tokens, device pages) until the
// database changes. Before every use it asks SQLite for PRAGMA
// data_version on a connection of its own: the value changes whenever any
// other connection commits, ours or another process's (the CLI, a sqlite3
// shell). A change empties the cache, so an answer from it is never older
// than the last commit before the request: a logout, a deleted token or a
// renamed device shows on the very next request.
type readCache struct {
	mu      sync.Mutex
	conn    *sql.Conn
	check   *sql.Stmt // PRAGMA data_version, prepared on conn
	version int64
	entries map[string]any
}

// maxCacheEntries bounds the cache between two commits.
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
	return &readCache{conn: conn, check: check, version: -1, entries: map[string]any{}}, nil
}

// cached returns the value kept under key, or loads, keeps and returns it.
// Errors are not kept.
func cached[T any](ctx context.Context, c *readCache, key string, load func() (T, error)) (T, error) {
	c.mu.Lock()
	var version int64
	err := c.check.QueryRowContext(ctx).Scan(&version)
	if err != nil {
		c.mu.Unlock()
		return load()
	}
	if version != c.version || len(c.entries) >= maxCacheEntries {
		clear(c.entries)
		c.version = version
	}
	v, ok := c.entries[key]
	c.mu.Unlock()
	if ok {
		return v.(T), nil
	}
	// Loaded after the version was read: at least as new as that version.
	val, err := load()
	if err != nil {
		return val, err
	}
	c.mu.Lock()
	if c.version == version {
		c.entries[key] = val
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

// createUser adds a user; errConflict when the email is taken.
func (s *store) createUser(ctx context.Context, name, email, role, passwordHash string) (int64, error) {
	res, err := s.wdb.ExecContext(ctx,
		`INSERT INTO users (name, email, role, password_hash, created_at) VALUES (?, ?, ?, ?, ?)`,
		name, normalizeEmail(email), role, passwordHash, s.timestamp())
	if isUniqueErr(err) {
		return 0, errConflict
	}
	if err != nil {
		return 0, fmt.Errorf("insert user: %w", err)
	}
	return res.LastInsertId()
}

func normalizeEmail(email string) string { return strings.ToLower(strings.TrimSpace(email)) }

const userColumns = `id, name, email, role, email_verified_at, last_login_at, password_hash`

func scanUser(row interface{ Scan(...any) error }) (*user, error) {
	u := &user{}
	err := row.Scan(&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.passwordHash)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	return u, err
}

// userByEmail returns the user with that email (case-insensitive) or errNotFound.
func (s *store) userByEmail(ctx context.Context, email string) (*user, error) {
	return scanUser(s.read.QueryRowContext(ctx,
		`SELECT `+userColumns+` FROM users WHERE email = ?`, normalizeEmail(email)))
}

// createToken stores a new token for the user, records the login time when
// login is true, and returns the token's id.
func (s *store) createToken(ctx context.Context, userID int64, name string, secretHash []byte, login bool) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
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

// tokenRecord is a stored token with its user, as authentication needs it.
type tokenRecord struct {
	id         int64
	secretHash []byte
	lastUsedAt string
	user       *user
}

const tokenQuery = `SELECT t.id, t.secret_hash, COALESCE(t.last_used_at, ''),
	u.id, u.name, u.email, u.role, u.email_verified_at, u.last_login_at, u.password_hash
	FROM tokens t JOIN users u ON u.id = t.user_id WHERE `

// tokenByID returns the token row and its user, or errNotFound.
func (s *store) tokenByID(ctx context.Context, id int64) (*tokenRecord, error) {
	return cached(ctx, s.cache, "token "+strconv.FormatInt(id, 10), func() (*tokenRecord, error) {
		return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.id = ?`, id))
	})
}

// tokenByHash returns the token whose secret hashes to h and its user, or errNotFound.
func (s *store) tokenByHash(ctx context.Context, h []byte) (*tokenRecord, error) {
	return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.secret_hash = ?`, h))
}

func scanToken(row *sql.Row) (*tokenRecord, error) {
	t := &tokenRecord{user: &user{}}
	u := t.user
	err := row.Scan(&t.id, &t.secretHash, &t.lastUsedAt,
		&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.passwordHash)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	return t, err
}

// touchToken records a use of the token.
func (s *store) touchToken(ctx context.Context, id int64) error {
	_, err := s.wdb.ExecContext(ctx, `UPDATE tokens SET last_used_at = ? WHERE id = ?`, s.timestamp(), id)
	return err
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
	Size      *int64  `json:"size"`
	CreatedAt *string `json:"created_at"`
	IsCurrent *bool   `json:"is_current,omitempty"`
	IsTarget  *bool   `json:"is_target,omitempty"`
}

// device is one device row with its joined names and firmwares, for the
// handlers that act on a device. Its JSON form is the API's Device detail,
// the same as deviceJSONExpr renders.
type device struct {
	id              int64
	ownerID         int64
	UID             string          `json:"uid"`
	Name            string          `json:"name"`
	Description     *string         `json:"description"`
	Status          string          `json:"status"`
	IsOnline        bool            `json:"is_online"`
	PublicIP        *string         `json:"public_ip"`
	LocalIP         *string         `json:"local_ip"`
	Port            int64           `json:"port"`
	LastRSSI        *float64        `json:"last_rssi"`
	FirstSeenAt     *string         `json:"first_seen_at"`
	LastSeenAt      *string         `json:"last_seen_at"`
	LastOTAAt       *string         `json:"last_ota_at"`
	Platform        named           `json:"platform"`
	Board           named           `json:"board"`
	BoardVariant    json.RawMessage `json:"board_variant"`
	CurrentFirmware *firmware       `json:"current_firmware"`
	TargetFirmware  *firmware       `json:"target_firmware"`
	Meta            json.RawMessage `json:"meta"`
}

var jsonNull = json.RawMessage("null")

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
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("no user with email %q", ownerEmail)
		}
		if err != nil {
			return err
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

const deviceColumns = `d.id, d.owner_id, d.uid, d.name, d.description, d.status, d.public_ip, d.local_ip,
	COALESCE(json_extract(d.meta, '$.mqtt_port'), 0), d.last_rssi, d.first_seen_at, d.last_seen_at, d.last_ota_at,
	p.id, p.name, p.key, b.id, b.name, b.key, d.meta, d.current_md5, d.current_version,
	cf.id, cf.name, cf.version, cf.notes, cf.size, cf.created_at,
	tf.id, tf.name, tf.version, tf.notes, tf.md5, tf.size, tf.created_at`

const deviceFrom = ` FROM devices d
	JOIN platforms p ON p.id = d.platform_id
	JOIN boards b ON b.id = d.board_id
	LEFT JOIN firmwares cf ON cf.device_id = d.id AND cf.md5 = d.current_md5
	LEFT JOIN firmwares tf ON tf.id = d.target_firmware_id`

func scanDevice(row interface{ Scan(...any) error }) (*device, error) {
	d := &device{BoardVariant: jsonNull}
	var meta string
	var curMD5, curVersion *string
	var cf, tf firmware
	var tfMD5 *string
	err := row.Scan(&d.id, &d.ownerID, &d.UID, &d.Name, &d.Description, &d.Status, &d.PublicIP, &d.LocalIP,
		&d.Port, &d.LastRSSI, &d.FirstSeenAt, &d.LastSeenAt, &d.LastOTAAt,
		&d.Platform.ID, &d.Platform.Name, &d.Platform.Key, &d.Board.ID, &d.Board.Name, &d.Board.Key,
		&meta, &curMD5, &curVersion,
		&cf.ID, &cf.Name, &cf.Version, &cf.Notes, &cf.Size, &cf.CreatedAt,
		&tf.ID, &tf.Name, &tf.Version, &tf.Notes, &tfMD5, &tf.Size, &tf.CreatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	if err != nil {
		return nil, err
	}
	d.IsOnline = d.Status == "online"
	d.Meta = json.RawMessage(meta)
	if curMD5 != nil {
		cf.MD5 = *curMD5
		if cf.ID == nil {
			// Reported by the device but not uploaded here.
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

// firmwareJSON renders firmware row f (a table alias) as the API's
// Firmware object, without is_current and is_target.
func firmwareJSON(f string) string {
	return `json_object('id', ` + f + `.id, 'name', ` + f + `.name, 'version', ` + f + `.version, 'notes', ` + f + `.notes, 'md5', ` +
		f + `.md5, 'size', ` + f + `.size, 'created_at', ` + f + `.created_at)`
}

// deviceJSONExpr renders a device (d, with p, b, cf and tf of deviceFrom)
// as the API's Device detail, in SQLite: the hot reads then return one
// text column instead of thirty-five, which is most of their cost.
// TestDeviceJSONMatchesStruct holds it to the device struct's JSON form.
var deviceJSONExpr = `json_object(
	'uid', d.uid, 'name', d.name, 'description', d.description, 'status', d.status,
	'is_online', json(CASE WHEN d.status = 'online' THEN 'true' ELSE 'false' END),
	'public_ip', d.public_ip, 'local_ip', d.local_ip,
	'port', COALESCE(json_extract(d.meta, '$.mqtt_port'), 0), 'last_rssi', d.last_rssi,
	'first_seen_at', d.first_seen_at, 'last_seen_at', d.last_seen_at, 'last_ota_at', d.last_ota_at,
	'platform', json_object('id', p.id, 'name', p.name, 'key', p.key),
	'board', json_object('id', b.id, 'name', b.name, 'key', b.key),
	'board_variant', NULL,
	'current_firmware', json(CASE
		WHEN d.current_md5 IS NULL THEN NULL
		WHEN cf.id IS NULL THEN json_object('id', NULL, 'name', NULL, 'version', d.current_version,
			'notes', NULL, 'md5', d.current_md5, 'size', NULL, 'created_at', NULL)
		ELSE ` + firmwareJSON("cf") + ` END),
	'target_firmware', json(CASE WHEN tf.id IS NULL THEN NULL ELSE ` + firmwareJSON("tf") + ` END),
	'meta', json(d.meta))`

// deviceJSON returns the user's device with that uid as Device detail
// JSON, or errNotFound.
func deviceJSON(ctx context.Context, q queryer, userID int64, uid string) (json.RawMessage, error) {
	var j string
	err := q.QueryRowContext(ctx, `SELECT `+deviceJSONExpr+deviceFrom+` WHERE d.uid = ? AND d.owner_id = ?`, uid, userID).Scan(&j)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	return json.RawMessage(j), err
}

// deviceJSON is deviceJSON on the read pool, through the cache.
func (s *store) deviceJSON(ctx context.Context, userID int64, uid string) (json.RawMessage, error) {
	return cached(ctx, s.cache, "device "+strconv.FormatInt(userID, 10)+" "+uid, func() (json.RawMessage, error) {
		return deviceJSON(ctx, s.read, userID, uid)
	})
}

// devicesJSON lists the user's devices, oldest first, as a JSON array of
// Device summaries.
func (s *store) devicesJSON(ctx context.Context, userID int64) (json.RawMessage, error) {
	return cached(ctx, s.cache, "devices "+strconv.FormatInt(userID, 10), func() (json.RawMessage, error) {
		return s.loadDevicesJSON(ctx, userID)
	})
}

func (s *store) loadDevicesJSON(ctx context.Context, userID int64) (json.RawMessage, error) {
	var j string
	err := s.read.QueryRowContext(ctx, `SELECT json_group_array(json_object(
		'uid', d.uid, 'name', d.name, 'status', d.status, 'last_seen_at', d.last_seen_at,
		'platform', json_object('id', p.id, 'name', p.name, 'key', p.key),
		'board', json_object('id', b.id, 'name', b.name, 'key', b.key),
		'board_variant', NULL) ORDER BY d.id)
		FROM devices d JOIN platforms p ON p.id = d.platform_id JOIN boards b ON b.id = d.board_id
		WHERE d.owner_id = ?`, userID).Scan(&j)
	return json.RawMessage(j), err
}

// deviceOf returns the user's device with that uid, or errNotFound when it
// does not exist or belongs to someone else.
func (s *store) deviceOf(ctx context.Context, userID int64, uid string) (*device, error) {
	return scanDevice(s.read.QueryRowContext(ctx,
		`SELECT `+deviceColumns+deviceFrom+` WHERE d.uid = ? AND d.owner_id = ?`, uid, userID))
}

// updateDevice sets the name and/or description (nil: unchanged; clearDesc:
// set description to null) of the user's device and returns the device as
// this update left it, as Device detail JSON.
func (s *store) updateDevice(ctx context.Context, userID int64, uid string, name, desc *string, clearDesc bool) (json.RawMessage, error) {
	var d json.RawMessage
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx,
			`UPDATE devices SET name = COALESCE(?, name),
			 description = CASE WHEN ? THEN NULL ELSE COALESCE(?, description) END
			 WHERE uid = ? AND owner_id = ?`, name, clearDesc, desc, uid, userID)
		if err != nil {
			return fmt.Errorf("update device: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return errNotFound
		}
		// Read back in the same transaction: the answer is this update's result.
		d, err = deviceJSON(ctx, tx, userID, uid)
		return err
	})
	return d, err
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

// button returns one button of the device or errNotFound.
func (s *store) button(ctx context.Context, deviceID int64, id string) (*commandButton, error) {
	var b commandButton
	var payload string
	err := s.read.QueryRowContext(ctx,
		`SELECT id, label, payload, confirm FROM command_buttons WHERE device_id = ? AND id = ?`,
		deviceID, id).Scan(&b.ID, &b.Label, &payload, &b.Confirm)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	b.Payload = json.RawMessage(payload)
	return &b, err
}

// createButton adds a button; errConflict when the device has one with that id.
func (s *store) createButton(ctx context.Context, deviceID int64, b commandButton) error {
	_, err := s.wdb.ExecContext(ctx,
		`INSERT INTO command_buttons (device_id, id, label, payload, confirm) VALUES (?, ?, ?, ?, ?)`,
		deviceID, b.ID, b.Label, string(b.Payload), b.Confirm)
	if isUniqueErr(err) {
		return errConflict
	}
	return err
}

// deleteButton removes a button or returns errNotFound.
func (s *store) deleteButton(ctx context.Context, deviceID int64, id string) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM command_buttons WHERE device_id = ? AND id = ?`, deviceID, id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errNotFound
	}
	return nil
}

// ---- firmwares ----

const firmwareColumns = `f.id, f.name, f.version, f.notes, f.md5, f.size, f.created_at,
	f.md5 IS d.current_md5, f.id IS d.target_firmware_id`

func scanFirmware(row interface{ Scan(...any) error }) (*firmware, error) {
	f := &firmware{ID: new(int64), Name: new(string), Size: new(int64), CreatedAt: new(string),
		IsCurrent: new(bool), IsTarget: new(bool)}
	err := row.Scan(f.ID, f.Name, &f.Version, &f.Notes, &f.MD5, f.Size, f.CreatedAt, f.IsCurrent, f.IsTarget)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNotFound
	}
	return f, err
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

// firmwareOf returns the device's firmware named by ref (id or md5), or errNotFound.
func (s *store) firmwareOf(ctx context.Context, deviceID int64, ref string) (*firmware, error) {
	return firmwareQuery(ctx, s.db, deviceID, ref)
}

type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func firmwareQuery(ctx context.Context, q queryer, deviceID int64, ref string) (*firmware, error) {
	cond, arg, ok := firmwareRef(ref)
	if !ok {
		return nil, errNotFound
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

// errFirmwareAssigned is returned when deleting a firmware that is a target.
var errFirmwareAssigned = errors.New("firmware is assigned")

// deleteFirmware removes the device's firmware named by ref, and its file
// when no other row uses it. errFirmwareAssigned when it is a target.
func (s *store) deleteFirmware(ctx context.Context, deviceID int64, ref string) error {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var md5sum string
	var others int
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		f, err := firmwareQuery(ctx, tx, deviceID, ref)
		if err != nil {
			return err
		}
		var assigned bool
		err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM devices WHERE target_firmware_id = ?)`, *f.ID).Scan(&assigned)
		if err != nil {
			return err
		}
		if assigned {
			return errFirmwareAssigned
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM firmwares WHERE id = ?`, *f.ID); err != nil {
			return err
		}
		md5sum = f.MD5
		return tx.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE md5 = ?`, md5sum).Scan(&others)
	})
	if err != nil {
		return err
	}
	if others == 0 {
		// The row is gone; a crash before this line leaves a file that
		// cleanFirmwareFiles removes at the next start.
		if err := os.Remove(s.firmwarePath(md5sum)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove firmware file: %w", err)
		}
	}
	return nil
}

// errFirmwareExists is returned when a device already has a firmware with that md5.
var errFirmwareExists = errors.New("firmware already uploaded")

// createFirmware moves the fsynced temporary file tmpPath into place as the
// file for md5sum and adds the firmware row, in that order, so that a row
// never exists without its file. errFirmwareExists for a duplicate.
func (s *store) createFirmware(ctx context.Context, deviceID int64, name string, version, notes *string, md5sum string, size int64, tmpPath string) (*firmware, error) {
	s.fwMu.Lock()
	defer s.fwMu.Unlock()
	var f *firmware
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var exists bool
		err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE device_id = ? AND md5 = ?)`,
			deviceID, md5sum).Scan(&exists)
		if err != nil {
			return err
		}
		if exists {
			return errFirmwareExists
		}
		if err := os.Rename(tmpPath, s.firmwarePath(md5sum)); err != nil {
			return fmt.Errorf("store firmware file: %w", err)
		}
		if err := syncDir(s.fwDir); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO firmwares (device_id, name, version, notes, md5, size, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?)`, deviceID, name, version, notes, md5sum, size, s.timestamp())
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
		if qerr := s.wdb.QueryRowContext(ctx, `SELECT count(*) FROM firmwares WHERE md5 = ?`, md5sum).Scan(&n); qerr == nil && n == 0 {
			os.Remove(s.firmwarePath(md5sum))
		}
	}
	return f, err
}

// setTarget makes the device's firmware with that md5 its target.
// errNotFound when the device has no such firmware.
func (s *store) setTarget(ctx context.Context, deviceID int64, md5sum string) error {
	res, err := s.wdb.ExecContext(ctx, `UPDATE devices SET target_firmware_id =
		(SELECT id FROM firmwares WHERE device_id = devices.id AND md5 = ?)
		WHERE id = ? AND EXISTS (SELECT 1 FROM firmwares WHERE device_id = devices.id AND md5 = ?)`,
		md5sum, deviceID, md5sum)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errNotFound
	}
	return nil
}

// firmwarePath is where the bytes with that md5 are kept.
func (s *store) firmwarePath(md5sum string) string {
	return filepath.Join(s.fwDir, md5sum+".bin")
}

// newFirmwareTemp creates a temporary file for an upload in progress.
func (s *store) newFirmwareTemp() (*os.File, error) {
	return os.CreateTemp(filepath.Join(s.fwDir, "tmp"), "upload-*")
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
		if err := s.read.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares WHERE md5 = ?)`, sum).Scan(&used); err != nil {
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

// hashToTemp streams r (at most limit bytes) into f while computing its md5,
// then fsyncs f. tooBig reports that r had more than limit bytes.
func hashToTemp(f *os.File, r io.Reader, limit int64) (md5sum string, size int64, tooBig bool, err error) {
	h := md5.New()
	size, err = io.Copy(io.MultiWriter(f, h), io.LimitReader(r, limit+1))
	if err != nil {
		return "", size, false, err
	}
	if size > limit {
		return "", size, true, nil
	}
	if err := f.Sync(); err != nil {
		return "", size, false, err
	}
	return hex.EncodeToString(h.Sum(nil)), size, false, nil
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
// device with that uid; errNotFound when either is gone.
func (s *store) openFirmwareFile(ctx context.Context, uid, md5sum string) (*os.File, error) {
	var ok bool
	err := s.read.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares f JOIN devices d ON d.id = f.device_id
		WHERE d.uid = ? AND f.md5 = ?)`, uid, md5sum).Scan(&ok)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, errNotFound
	}
	f, err := os.Open(s.firmwarePath(md5sum))
	if errors.Is(err, os.ErrNotExist) {
		return nil, errNotFound
	}
	return f, err
}

// deviceUIDsOwnedBy returns the uids of the devices of the user with that
// email, oldest first (`devicehub simulate` runs them); errNotFound when no
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
		return nil, errNotFound
	}
	return uids, nil
}
