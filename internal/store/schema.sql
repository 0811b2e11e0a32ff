-- devicehub's schema: migrations, each a section headed "-- version N",
-- applied in order, each in a transaction; PRAGMA user_version records how
-- many ran. Append a section to change the schema; never edit an applied
-- one. Timestamps are UTC text in one fixed-width ISO 8601 form, so they
-- sort.

-- version 1: users, tokens, devices, their buttons and firmwares.

CREATE TABLE users (
	id                INTEGER PRIMARY KEY,
	name              TEXT NOT NULL,
	email             TEXT NOT NULL UNIQUE, -- stored lowercased
	role              TEXT NOT NULL DEFAULT 'user',
	password_hash     TEXT NOT NULL,
	email_verified_at TEXT,
	last_login_at     TEXT,
	created_at        TEXT NOT NULL
);

-- Personal access tokens. Only the SHA-256 of the secret is kept.
CREATE TABLE tokens (
	id           INTEGER PRIMARY KEY,
	user_id      INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name         TEXT NOT NULL,
	secret_hash  BLOB NOT NULL UNIQUE,
	last_used_at TEXT,
	created_at   TEXT NOT NULL
);
CREATE INDEX tokens_user ON tokens(user_id);

CREATE TABLE platforms (
	id   INTEGER PRIMARY KEY,
	key  TEXT NOT NULL UNIQUE,
	name TEXT NOT NULL
);

CREATE TABLE boards (
	id   INTEGER PRIMARY KEY,
	key  TEXT NOT NULL UNIQUE,
	name TEXT NOT NULL
);

CREATE TABLE devices (
	id                 INTEGER PRIMARY KEY,
	uid                TEXT NOT NULL UNIQUE,
	owner_id           INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name               TEXT NOT NULL,
	description        TEXT,
	status             TEXT NOT NULL DEFAULT 'pending',
	public_ip          TEXT,
	local_ip           TEXT,
	last_rssi          REAL,
	first_seen_at      TEXT,
	last_seen_at       TEXT,
	last_ota_at        TEXT,
	platform_id        INTEGER NOT NULL REFERENCES platforms(id),
	board_id           INTEGER NOT NULL REFERENCES boards(id),
	current_md5        TEXT,   -- as last reported by the device
	current_version    TEXT,   -- as last reported by the device
	target_firmware_id INTEGER REFERENCES firmwares(id),
	meta               TEXT NOT NULL DEFAULT '{}', -- JSON object, holds mqtt_port
	created_at         TEXT NOT NULL
);
CREATE INDEX devices_owner ON devices(owner_id);

-- Firmware rows are per device; the bytes live in <data>/firmware/<md5>.bin
-- and may be shared by rows of several devices.
CREATE TABLE firmwares (
	id         INTEGER PRIMARY KEY,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	name       TEXT NOT NULL,
	version    TEXT,
	notes      TEXT,
	md5        TEXT NOT NULL,
	size       INTEGER NOT NULL,
	created_at TEXT NOT NULL,
	UNIQUE (device_id, md5)
);
CREATE INDEX firmwares_md5 ON firmwares(md5);

CREATE TABLE command_buttons (
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	id        TEXT NOT NULL,
	label     TEXT NOT NULL,
	payload   TEXT NOT NULL, -- compact JSON object, published verbatim
	confirm   INTEGER NOT NULL DEFAULT 0,
	seq       INTEGER PRIMARY KEY,
	UNIQUE (device_id, id)
);

-- version 2: keeps command records. seq orders a device's history; deadline
-- is when an unfinished command times out, on the server's clock, so a
-- restart does not forget it.
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

-- version 3: stores firmware by SHA-256 and keeps rollouts: one firmware
-- for many devices, in batches, in the order given (position).
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

-- version 4: gives AUTOINCREMENT to the tables whose ids the API or the CLI
-- shows, so that a deleted id is never handed out again (without it, SQLite
-- reuses the largest). Buttons and commands are named by text ids; their
-- seq is never shown. SQLite cannot add it in place, so each table is
-- rebuilt as https://sqlite.org/lang_altertable.html ("Making Other Kinds
-- Of Table Schema Changes") says: copied with its ids into a new table that
-- takes its name, its indexes made again. migrate runs it with foreign keys
-- off, as that requires: with them on, dropping users would delete every
-- token and device by ON DELETE CASCADE.
CREATE TABLE new_users (
	id                INTEGER PRIMARY KEY AUTOINCREMENT,
	name              TEXT NOT NULL,
	email             TEXT NOT NULL UNIQUE, -- stored lowercased
	role              TEXT NOT NULL DEFAULT 'user',
	password_hash     TEXT NOT NULL,
	email_verified_at TEXT,
	last_login_at     TEXT,
	created_at        TEXT NOT NULL
);
INSERT INTO new_users (id, name, email, role, password_hash, email_verified_at, last_login_at, created_at)
	SELECT id, name, email, role, password_hash, email_verified_at, last_login_at, created_at FROM users;
DROP TABLE users;
ALTER TABLE new_users RENAME TO users;

CREATE TABLE new_tokens (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
	user_id      INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name         TEXT NOT NULL,
	secret_hash  BLOB NOT NULL UNIQUE,
	last_used_at TEXT,
	created_at   TEXT NOT NULL
);
INSERT INTO new_tokens (id, user_id, name, secret_hash, last_used_at, created_at)
	SELECT id, user_id, name, secret_hash, last_used_at, created_at FROM tokens;
DROP TABLE tokens;
ALTER TABLE new_tokens RENAME TO tokens;
CREATE INDEX tokens_user ON tokens(user_id);

CREATE TABLE new_devices (
	id                 INTEGER PRIMARY KEY AUTOINCREMENT,
	uid                TEXT NOT NULL UNIQUE,
	owner_id           INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name               TEXT NOT NULL,
	description        TEXT,
	status             TEXT NOT NULL DEFAULT 'pending',
	public_ip          TEXT,
	local_ip           TEXT,
	last_rssi          REAL,
	first_seen_at      TEXT,
	last_seen_at       TEXT,
	last_ota_at        TEXT,
	platform_id        INTEGER NOT NULL REFERENCES platforms(id),
	board_id           INTEGER NOT NULL REFERENCES boards(id),
	current_md5        TEXT,   -- as last reported by the device
	current_version    TEXT,   -- as last reported by the device
	target_firmware_id INTEGER REFERENCES firmwares(id),
	meta               TEXT NOT NULL DEFAULT '{}', -- JSON object, holds mqtt_port
	created_at         TEXT NOT NULL
);
INSERT INTO new_devices (id, uid, owner_id, name, description, status, public_ip, local_ip, last_rssi,
		first_seen_at, last_seen_at, last_ota_at, platform_id, board_id, current_md5, current_version,
		target_firmware_id, meta, created_at)
	SELECT id, uid, owner_id, name, description, status, public_ip, local_ip, last_rssi,
		first_seen_at, last_seen_at, last_ota_at, platform_id, board_id, current_md5, current_version,
		target_firmware_id, meta, created_at FROM devices;
DROP TABLE devices;
ALTER TABLE new_devices RENAME TO devices;
CREATE INDEX devices_owner ON devices(owner_id);

CREATE TABLE new_firmwares (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	name       TEXT NOT NULL,
	version    TEXT,
	notes      TEXT,
	md5        TEXT NOT NULL,
	size       INTEGER NOT NULL,
	created_at TEXT NOT NULL,
	sha256     TEXT NOT NULL DEFAULT '',
	UNIQUE (device_id, md5)
);
INSERT INTO new_firmwares (id, device_id, name, version, notes, md5, size, created_at, sha256)
	SELECT id, device_id, name, version, notes, md5, size, created_at, sha256 FROM firmwares;
DROP TABLE firmwares;
ALTER TABLE new_firmwares RENAME TO firmwares;
CREATE INDEX firmwares_md5 ON firmwares(md5);
CREATE INDEX firmwares_sha256 ON firmwares(sha256);

CREATE TABLE new_rollouts (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
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
INSERT INTO new_rollouts (id, owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at)
	SELECT id, owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at, finished_at FROM rollouts;
DROP TABLE rollouts;
ALTER TABLE new_rollouts RENAME TO rollouts;
CREATE INDEX rollouts_owner ON rollouts(owner_id);

-- version 5: remembers where each user logged in with the right password
-- (the login pool keeps a share for known clients), so that a restart does
-- not forget them.
CREATE TABLE known_clients (
	user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	addr TEXT NOT NULL,
	at TEXT NOT NULL,
	PRIMARY KEY (user_id, addr)
) WITHOUT ROWID;

-- version 6: teams. Every user is in one team, and the team owns the
-- fleet: owner_id of devices and rollouts now names a team. An upgrade
-- gives each user a team of their own, with the user's id and name, and
-- makes them its admin, so nobody sees anything new. Devices and
-- rollouts are rebuilt (as in version 4) for their foreign key to point
-- at teams. Commands record who sent them and rollouts who made them;
-- invites and the audit log are new.
CREATE TABLE teams (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	name       TEXT NOT NULL,
	created_at TEXT NOT NULL
);
INSERT INTO teams (id, name, created_at) SELECT id, name, created_at FROM users;

ALTER TABLE users ADD COLUMN team_id INTEGER NOT NULL DEFAULT 0 REFERENCES teams(id);
UPDATE users SET team_id = id, role = 'admin';
CREATE INDEX users_team ON users(team_id);

CREATE TABLE new_devices (
	id                 INTEGER PRIMARY KEY AUTOINCREMENT,
	uid                TEXT NOT NULL UNIQUE,
	owner_id           INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name               TEXT NOT NULL,
	description        TEXT,
	status             TEXT NOT NULL DEFAULT 'pending',
	public_ip          TEXT,
	local_ip           TEXT,
	last_rssi          REAL,
	first_seen_at      TEXT,
	last_seen_at       TEXT,
	last_ota_at        TEXT,
	platform_id        INTEGER NOT NULL REFERENCES platforms(id),
	board_id           INTEGER NOT NULL REFERENCES boards(id),
	current_md5        TEXT,   -- as last reported by the device
	current_version    TEXT,   -- as last reported by the device
	target_firmware_id INTEGER REFERENCES firmwares(id),
	meta               TEXT NOT NULL DEFAULT '{}', -- JSON object, holds mqtt_port
	created_at         TEXT NOT NULL
);
INSERT INTO new_devices SELECT * FROM devices;
DROP TABLE devices;
ALTER TABLE new_devices RENAME TO devices;
CREATE INDEX devices_owner ON devices(owner_id);

CREATE TABLE new_rollouts (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
	owner_id     INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name         TEXT,
	md5          TEXT NOT NULL,
	sha256       TEXT NOT NULL,
	state        TEXT NOT NULL,
	batch_size   INTEGER NOT NULL,
	max_failures INTEGER NOT NULL,
	created_at   TEXT NOT NULL,
	updated_at   TEXT NOT NULL,
	finished_at  TEXT,
	created_by   INTEGER REFERENCES users(id) ON DELETE SET NULL
);
INSERT INTO new_rollouts SELECT *, NULL FROM rollouts;
DROP TABLE rollouts;
ALTER TABLE new_rollouts RENAME TO rollouts;
CREATE INDEX rollouts_owner ON rollouts(owner_id);

-- sent_by is a user id without a foreign key, which would cost every
-- command an index: a removed user's commands show no sender, as user ids
-- are never handed out again (version 4).
ALTER TABLE commands ADD COLUMN sent_by INTEGER;

-- An invite is a member's only way to set a first password: single use,
-- until expires_at; only the SHA-256 of its secret is kept.
CREATE TABLE invites (
	user_id     INTEGER PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
	secret_hash BLOB NOT NULL UNIQUE,
	expires_at  TEXT NOT NULL
);

-- The audit log: one entry per write. The actor's name is copied, so an
-- entry still says who after the member is removed. detail is a JSON
-- object and never holds a secret.
CREATE TABLE audit (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	team_id    INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	at         TEXT NOT NULL,
	actor_id   INTEGER,
	actor_name TEXT,
	action     TEXT NOT NULL,
	device_uid TEXT,
	detail     TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_team ON audit(team_id, id);

-- version 7: a fleet of a million devices. The device list's order is
-- id, and a page is a walk from its cursor along an index that ends with
-- id (as every index does, with the rowid), whatever the page's number:
-- one per filter, for the team's devices of a status, a platform or a
-- board. A rollout's engine finds its current batch, and counts its
-- failures, through rollout_devices_state.
CREATE INDEX devices_owner_status ON devices(owner_id, status);
CREATE INDEX devices_owner_platform ON devices(owner_id, platform_id);
CREATE INDEX devices_owner_board ON devices(owner_id, board_id);
CREATE INDEX rollout_devices_state ON rollout_devices(rollout_id, state, position);

-- version 8: the team's firmware library: files uploaded to the team, not
-- to a device, that rollouts can send. Their bytes live beside the
-- devices' firmware files, named by sha256, and are shared with them.
CREATE TABLE library_firmwares (
	id          INTEGER PRIMARY KEY AUTOINCREMENT,
	team_id     INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name        TEXT NOT NULL,
	version     TEXT,
	notes       TEXT,
	platform    TEXT,   -- the platform key the image was checked for, or NULL
	md5         TEXT NOT NULL,
	sha256      TEXT NOT NULL,
	size        INTEGER NOT NULL,
	uploaded_by INTEGER REFERENCES users(id) ON DELETE SET NULL,
	created_at  TEXT NOT NULL,
	UNIQUE (team_id, sha256)
);
CREATE INDEX library_firmwares_sha256 ON library_firmwares(sha256);

-- version 9: fleet health (docs/api.md, "History and release health"). A series is one of a device's
-- readings (rssi, heap_free, metrics.<key>); its buckets are 5 minutes
-- wide, keyed by their start in Unix seconds, and keep the sum, not the
-- mean, so that a bucket folds in more values by addition. presence is
-- the device's online and offline intervals (to_at NULL: the current
-- one). A boot is charged to the firmware the device reported then. A
-- firmware run is a span of time a device reported one md5: what release
-- health and a rollout's health gate count device-days on.
CREATE TABLE series (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	name      TEXT NOT NULL,
	UNIQUE (device_id, name)
);
CREATE TABLE buckets (
	series_id INTEGER NOT NULL REFERENCES series(id) ON DELETE CASCADE,
	t         INTEGER NOT NULL,
	min       REAL NOT NULL,
	max       REAL NOT NULL,
	sum       REAL NOT NULL,
	count     INTEGER NOT NULL,
	last      REAL NOT NULL,
	PRIMARY KEY (series_id, t)
) WITHOUT ROWID;
CREATE TABLE presence (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	online    INTEGER NOT NULL,
	from_at   TEXT NOT NULL,
	to_at     TEXT
);
CREATE INDEX presence_device ON presence(device_id);
CREATE INDEX presence_open ON presence(device_id) WHERE to_at IS NULL;
CREATE TABLE boots (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	at         TEXT NOT NULL,
	reason     TEXT NOT NULL,
	crash      INTEGER NOT NULL,
	fw_md5     TEXT,
	fw_version TEXT
);
CREATE INDEX boots_device ON boots(device_id);
CREATE TABLE firmware_runs (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	md5       TEXT NOT NULL,
	version   TEXT,
	from_at   TEXT NOT NULL,
	to_at     TEXT
);
CREATE INDEX firmware_runs_device ON firmware_runs(device_id);
-- A device that reports an md5 today has run it since it was first seen,
-- as far as anyone knows.
INSERT INTO firmware_runs (device_id, md5, version, from_at)
	SELECT id, current_md5, current_version, COALESCE(first_seen_at, created_at) FROM devices WHERE current_md5 IS NOT NULL;
-- A rollout's health gate (NULL: none), and why it halted.
ALTER TABLE rollouts ADD COLUMN health TEXT;
ALTER TABLE rollouts ADD COLUMN halt_reason TEXT;

-- version 10: CHECK constraints on the states and the roles (states.go
-- holds the same lists: TestStatesMatchSchema), and team_id for the column
-- that names a device's or a rollout's team, owner_id before. SQLite adds a
-- CHECK only by rebuilding the table, as in version 4. A rebuilt table
-- takes over the old one's sqlite_sequence row before the old one is
-- dropped (which would delete it), so that an id deleted before the
-- upgrade is still never handed out again.
CREATE TABLE new_users (
	id                INTEGER PRIMARY KEY AUTOINCREMENT,
	name              TEXT NOT NULL,
	email             TEXT NOT NULL UNIQUE, -- stored lowercased
	role              TEXT NOT NULL DEFAULT 'user' CHECK (role IN ('user', 'admin', 'viewer')),
	password_hash     TEXT NOT NULL,
	email_verified_at TEXT,
	last_login_at     TEXT,
	created_at        TEXT NOT NULL,
	team_id           INTEGER NOT NULL REFERENCES teams(id)
);
INSERT INTO new_users (id, name, email, role, password_hash, email_verified_at, last_login_at, created_at, team_id)
	SELECT id, name, email, role, password_hash, email_verified_at, last_login_at, created_at, team_id FROM users;
DELETE FROM sqlite_sequence WHERE name = 'new_users';
UPDATE sqlite_sequence SET name = 'new_users' WHERE name = 'users';
DROP TABLE users;
ALTER TABLE new_users RENAME TO users;
CREATE INDEX users_team ON users(team_id);

CREATE TABLE new_devices (
	id                 INTEGER PRIMARY KEY AUTOINCREMENT,
	uid                TEXT NOT NULL UNIQUE,
	team_id            INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name               TEXT NOT NULL,
	description        TEXT,
	status             TEXT NOT NULL DEFAULT 'pending'
		CHECK (status IN ('pending', 'online', 'offline', 'reconnecting')),
	public_ip          TEXT,
	local_ip           TEXT,
	last_rssi          REAL,
	first_seen_at      TEXT,
	last_seen_at       TEXT,
	last_ota_at        TEXT,
	platform_id        INTEGER NOT NULL REFERENCES platforms(id),
	board_id           INTEGER NOT NULL REFERENCES boards(id),
	current_md5        TEXT,   -- as last reported by the device
	current_version    TEXT,   -- as last reported by the device
	target_firmware_id INTEGER REFERENCES firmwares(id),
	meta               TEXT NOT NULL DEFAULT '{}', -- JSON object, holds mqtt_port
	created_at         TEXT NOT NULL
);
INSERT INTO new_devices (id, uid, team_id, name, description, status, public_ip, local_ip, last_rssi,
		first_seen_at, last_seen_at, last_ota_at, platform_id, board_id, current_md5, current_version,
		target_firmware_id, meta, created_at)
	SELECT id, uid, owner_id, name, description, status, public_ip, local_ip, last_rssi,
		first_seen_at, last_seen_at, last_ota_at, platform_id, board_id, current_md5, current_version,
		target_firmware_id, meta, created_at FROM devices;
DELETE FROM sqlite_sequence WHERE name = 'new_devices';
UPDATE sqlite_sequence SET name = 'new_devices' WHERE name = 'devices';
DROP TABLE devices;
ALTER TABLE new_devices RENAME TO devices;
CREATE INDEX devices_team ON devices(team_id);
CREATE INDEX devices_team_status ON devices(team_id, status);
CREATE INDEX devices_team_platform ON devices(team_id, platform_id);
CREATE INDEX devices_team_board ON devices(team_id, board_id);

CREATE TABLE new_commands (
	seq         INTEGER PRIMARY KEY,
	id          TEXT NOT NULL UNIQUE,
	device_id   INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	kind        TEXT NOT NULL,
	button_id   TEXT,
	payload     TEXT NOT NULL,
	state       TEXT NOT NULL CHECK (state IN ('sent', 'running', 'succeeded', 'failed', 'timed_out')),
	progress    INTEGER,
	result      TEXT,
	error       TEXT,
	created_at  TEXT NOT NULL,
	updated_at  TEXT NOT NULL,
	finished_at TEXT,
	deadline    TEXT NOT NULL,
	sent_by     INTEGER
);
INSERT INTO new_commands (seq, id, device_id, kind, button_id, payload, state, progress, result, error,
		created_at, updated_at, finished_at, deadline, sent_by)
	SELECT seq, id, device_id, kind, button_id, payload, state, progress, result, error,
		created_at, updated_at, finished_at, deadline, sent_by FROM commands;
DROP TABLE commands;
ALTER TABLE new_commands RENAME TO commands;
CREATE INDEX commands_device ON commands(device_id, seq);
CREATE INDEX commands_open ON commands(deadline) WHERE finished_at IS NULL;

CREATE TABLE new_rollouts (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
	team_id      INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name         TEXT,
	md5          TEXT NOT NULL,
	sha256       TEXT NOT NULL,
	state        TEXT NOT NULL CHECK (state IN ('running', 'paused', 'halted', 'cancelled', 'completed')),
	batch_size   INTEGER NOT NULL,
	max_failures INTEGER NOT NULL,
	created_at   TEXT NOT NULL,
	updated_at   TEXT NOT NULL,
	finished_at  TEXT,
	created_by   INTEGER REFERENCES users(id) ON DELETE SET NULL,
	health       TEXT,
	halt_reason  TEXT
);
INSERT INTO new_rollouts (id, team_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at,
		finished_at, created_by, health, halt_reason)
	SELECT id, owner_id, name, md5, sha256, state, batch_size, max_failures, created_at, updated_at,
		finished_at, created_by, health, halt_reason FROM rollouts;
DELETE FROM sqlite_sequence WHERE name = 'new_rollouts';
UPDATE sqlite_sequence SET name = 'new_rollouts' WHERE name = 'rollouts';
DROP TABLE rollouts;
ALTER TABLE new_rollouts RENAME TO rollouts;
CREATE INDEX rollouts_team ON rollouts(team_id);

CREATE TABLE new_rollout_devices (
	rollout_id INTEGER NOT NULL REFERENCES rollouts(id) ON DELETE CASCADE,
	position   INTEGER NOT NULL,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	state      TEXT NOT NULL
		CHECK (state IN ('pending', 'waiting', 'running', 'succeeded', 'failed', 'timed_out', 'skipped')),
	command_id TEXT,
	error      TEXT,
	PRIMARY KEY (rollout_id, position),
	UNIQUE (rollout_id, device_id)
);
INSERT INTO new_rollout_devices (rollout_id, position, device_id, state, command_id, error)
	SELECT rollout_id, position, device_id, state, command_id, error FROM rollout_devices;
DROP TABLE rollout_devices;
ALTER TABLE new_rollout_devices RENAME TO rollout_devices;
CREATE INDEX rollout_devices_device ON rollout_devices(device_id);
CREATE INDEX rollout_devices_state ON rollout_devices(rollout_id, state, position);

-- version 11: platform and board keys belong to a team. Before, one row of
-- a key served every team, and the id a new key got told whether another
-- team had used it. Now each team has its own row of each key its devices
-- name: number is the id the API shows, counted per team (the team's
-- highest plus one), so it says nothing of other teams; id is the row's
-- own, which devices refer to, and is never shown. An upgrade gives each
-- team a row of each key its devices use, numbered with the key's old id,
-- so that no id a client has seen changes: the team of the lowest id that
-- used a key keeps its row, the other teams' devices move to rows of their
-- own. A key that no device uses goes.
CREATE TABLE new_platforms (
	id      INTEGER PRIMARY KEY,
	team_id INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	number  INTEGER NOT NULL,
	key     TEXT NOT NULL,
	name    TEXT NOT NULL,
	UNIQUE (team_id, key),
	UNIQUE (team_id, number)
);
INSERT INTO new_platforms (id, team_id, number, key, name)
	SELECT p.id, min(d.team_id), p.id, p.key, p.name FROM platforms p JOIN devices d ON d.platform_id = p.id GROUP BY p.id;
INSERT INTO new_platforms (team_id, number, key, name)
	SELECT DISTINCT d.team_id, p.id, p.key, p.name FROM devices d JOIN platforms p ON p.id = d.platform_id
	WHERE d.team_id != (SELECT team_id FROM new_platforms WHERE id = p.id);
UPDATE devices SET platform_id = (SELECT id FROM new_platforms WHERE team_id = devices.team_id AND number = devices.platform_id)
	WHERE devices.team_id != (SELECT team_id FROM new_platforms WHERE id = devices.platform_id);
DROP TABLE platforms;
ALTER TABLE new_platforms RENAME TO platforms;

CREATE TABLE new_boards (
	id      INTEGER PRIMARY KEY,
	team_id INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	number  INTEGER NOT NULL,
	key     TEXT NOT NULL,
	name    TEXT NOT NULL,
	UNIQUE (team_id, key),
	UNIQUE (team_id, number)
);
INSERT INTO new_boards (id, team_id, number, key, name)
	SELECT b.id, min(d.team_id), b.id, b.key, b.name FROM boards b JOIN devices d ON d.board_id = b.id GROUP BY b.id;
INSERT INTO new_boards (team_id, number, key, name)
	SELECT DISTINCT d.team_id, b.id, b.key, b.name FROM devices d JOIN boards b ON b.id = d.board_id
	WHERE d.team_id != (SELECT team_id FROM new_boards WHERE id = b.id);
UPDATE devices SET board_id = (SELECT id FROM new_boards WHERE team_id = devices.team_id AND number = devices.board_id)
	WHERE devices.team_id != (SELECT team_id FROM new_boards WHERE id = devices.board_id);
DROP TABLE boards;
ALTER TABLE new_boards RENAME TO boards;

-- version 12: a pending invite claims nothing. An invited member is no
-- user until their link is used: the invite holds their name, email and
-- role, so that another team may invite the same email, and an email
-- with an account is no longer told apart by an invite's answer (the
-- link then answers as invalid). Their id is drawn from the users'
-- sequence when they are invited (inviteMember), and becomes their
-- user's id, so it never changes. An upgrade moves every member without
-- a password to an invite, with their id.
CREATE TABLE new_invites (
	id          INTEGER PRIMARY KEY, -- the member's id, drawn from users' AUTOINCREMENT sequence
	team_id     INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name        TEXT NOT NULL,
	email       TEXT NOT NULL, -- stored lowercased
	role        TEXT NOT NULL CHECK (role IN ('user', 'admin', 'viewer')),
	secret_hash BLOB NOT NULL UNIQUE,
	expires_at  TEXT NOT NULL,
	created_at  TEXT NOT NULL,
	UNIQUE (team_id, email)
);
INSERT INTO new_invites (id, team_id, name, email, role, secret_hash, expires_at, created_at)
	SELECT u.id, u.team_id, u.name, u.email, u.role, i.secret_hash, i.expires_at, u.created_at
	FROM invites i JOIN users u ON u.id = i.user_id WHERE u.password_hash = '';
DELETE FROM users WHERE password_hash = '';
DROP TABLE invites;
ALTER TABLE new_invites RENAME TO invites;

-- version 13: links a team's admin makes for a member: an invite names
-- who made it, and a password-reset link (one per member, the newest)
-- lets a member who forgot their password set a new one without the
-- operator's shell. Only the SHA-256 of a link's secret is stored.
ALTER TABLE invites ADD COLUMN invited_by INTEGER REFERENCES users(id) ON DELETE SET NULL;
CREATE TABLE password_resets (
	user_id     INTEGER PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
	secret_hash BLOB NOT NULL UNIQUE,
	expires_at  TEXT NOT NULL
);

-- version 14: what the JSON a team keeps weighs (-max-team-data-mib), in
-- bytes: its buttons' payloads, and its commands' payloads and results.
-- Triggers keep the sums, so that a write reads one row instead of
-- summing the team's. A device's delete subtracts its buttons and
-- commands before they go: the cascade that deletes them runs after the
-- device is gone, so their own triggers find no team and count nothing.
-- A command records its device's team (devices never change teams), so
-- that a team past its limit finds its oldest finished commands along
-- commands_team_finished, without sorting the team's history.
ALTER TABLE teams ADD COLUMN button_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE teams ADD COLUMN command_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE commands ADD COLUMN team_id INTEGER NOT NULL DEFAULT 0;
UPDATE commands SET team_id = (SELECT team_id FROM devices WHERE id = device_id);
CREATE INDEX commands_team_finished ON commands(team_id, seq) WHERE finished_at IS NOT NULL;
UPDATE teams SET
	button_bytes = (SELECT coalesce(sum(octet_length(b.payload)), 0)
		FROM devices d JOIN command_buttons b ON b.device_id = d.id WHERE d.team_id = teams.id),
	command_bytes = (SELECT coalesce(sum(octet_length(c.payload) + coalesce(octet_length(c.result), 0)), 0)
		FROM devices d JOIN commands c ON c.device_id = d.id WHERE d.team_id = teams.id);
CREATE TRIGGER button_added AFTER INSERT ON command_buttons BEGIN
	UPDATE teams SET button_bytes = button_bytes + octet_length(NEW.payload)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;
CREATE TRIGGER button_deleted AFTER DELETE ON command_buttons BEGIN
	UPDATE teams SET button_bytes = button_bytes - octet_length(OLD.payload)
		WHERE id = (SELECT team_id FROM devices WHERE id = OLD.device_id);
END;
CREATE TRIGGER command_added AFTER INSERT ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes + octet_length(NEW.payload) + coalesce(octet_length(NEW.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;
CREATE TRIGGER command_changed AFTER UPDATE OF payload, result ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes
			+ octet_length(NEW.payload) + coalesce(octet_length(NEW.result), 0)
			- octet_length(OLD.payload) - coalesce(octet_length(OLD.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;
CREATE TRIGGER command_deleted AFTER DELETE ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes - octet_length(OLD.payload) - coalesce(octet_length(OLD.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = OLD.device_id);
END;
CREATE TRIGGER device_deleted BEFORE DELETE ON devices BEGIN
	UPDATE teams SET
		button_bytes = button_bytes - (SELECT coalesce(sum(octet_length(payload)), 0)
			FROM command_buttons WHERE device_id = OLD.id),
		command_bytes = command_bytes - (SELECT coalesce(sum(octet_length(payload) + coalesce(octet_length(result), 0)), 0)
			FROM commands WHERE device_id = OLD.id)
		WHERE id = OLD.team_id;
END;

-- version 15: a link ends with its maker's admin role, a login can tell
-- that the password it checked has changed since, and the ids a team sees
-- say nothing of other teams.
-- A reset link records the admin who made it, as an invite has done
-- since version 13. Removing an admin, or taking their admin role, ends
-- the invites and reset links they made, by the triggers below, in the
-- statement that removes or changes them (BEFORE DELETE: the invites'
-- ON DELETE SET NULL would otherwise forget who made them first). Links
-- whose maker is unknown end here: none could be ended with its maker.
-- password_version grows with every change of a user's password
-- (changePassword in store_users.go); a login stores its token only if
-- the version it read with the hash it checked is still the user's.
-- audit.number numbers a team's entries and boots.number a device's
-- boots, each from 1: they are the API's ids, the table's own ids being
-- global (docs/security.md). Each is the largest of its team's or
-- device's plus one, so it starts again at 1 only once all of them were
-- pruned.
ALTER TABLE password_resets ADD COLUMN created_by INTEGER REFERENCES users(id) ON DELETE CASCADE;
DELETE FROM password_resets;
DELETE FROM invites WHERE invited_by IS NULL;
CREATE TRIGGER admin_removed BEFORE DELETE ON users WHEN OLD.role = 'admin' BEGIN
	DELETE FROM invites WHERE invited_by = OLD.id;
	DELETE FROM password_resets WHERE created_by = OLD.id;
END;
CREATE TRIGGER admin_demoted AFTER UPDATE OF role ON users WHEN OLD.role = 'admin' AND NEW.role != 'admin' BEGIN
	DELETE FROM invites WHERE invited_by = OLD.id;
	DELETE FROM password_resets WHERE created_by = OLD.id;
END;
ALTER TABLE users ADD COLUMN password_version INTEGER NOT NULL DEFAULT 0;
ALTER TABLE audit ADD COLUMN number INTEGER NOT NULL DEFAULT 0;
UPDATE audit SET number = n.rn FROM (SELECT id, row_number() OVER (PARTITION BY team_id ORDER BY id) AS rn FROM audit) n
	WHERE n.id = audit.id;
DROP INDEX audit_team;
CREATE UNIQUE INDEX audit_team ON audit(team_id, number);
ALTER TABLE boots ADD COLUMN number INTEGER NOT NULL DEFAULT 0;
UPDATE boots SET number = n.rn FROM (SELECT id, row_number() OVER (PARTITION BY device_id ORDER BY id) AS rn FROM boots) n
	WHERE n.id = boots.id;
DROP INDEX boots_device;
CREATE UNIQUE INDEX boots_device ON boots(device_id, number);

-- version 16: fleet health's history (internal/history) packs a device's
-- readings: a row of history_rows holds the slots of all its series for
-- an hour (step 300: 5-minute slots) or, after 7 days, a day (step 3600:
-- hourly slots), as internal/history/slab.go encodes them. The buckets
-- of before (a row per series and 5 minutes) wait in legacy_buckets and
-- legacy_series, which the retention steps convert and then drop. Times
-- of boots, presence and firmware runs are Unix seconds, and a boot keeps
-- the uptime_s and boot_count that tell a boot from a message sent again.
CREATE TABLE history_rows (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	step      INTEGER NOT NULL CHECK (step IN (300, 3600)),
	start     INTEGER NOT NULL,
	slots     BLOB NOT NULL,
	UNIQUE (device_id, step, start)
);
CREATE INDEX history_rows_age ON history_rows(step, start);
-- Release health's hours (internal/history/rollup.go): per team, firmware
-- (md5, '' for none) and hour, the boots and crashes charged to it, the
-- offline intervals begun and the histograms of the devices' 5-minute
-- means of rssi and heap_free.
CREATE TABLE fleet_hours (
	id      INTEGER PRIMARY KEY,
	team_id INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	md5     TEXT NOT NULL,
	hour    INTEGER NOT NULL,
	boots   INTEGER NOT NULL DEFAULT 0,
	crashes INTEGER NOT NULL DEFAULT 0,
	offline INTEGER NOT NULL DEFAULT 0,
	rssi    BLOB,
	heap    BLOB,
	UNIQUE (team_id, md5, hour)
);
ALTER TABLE buckets RENAME TO legacy_buckets;
ALTER TABLE series RENAME TO legacy_series;
-- Each time column is changed in place (added as an integer, filled,
-- the text one dropped, the new one renamed), so that the tables keep
-- their other columns, indexes and sequences as they are.
ALTER TABLE boots ADD COLUMN at_s INTEGER NOT NULL DEFAULT 0;
UPDATE boots SET at_s = unixepoch(at);
ALTER TABLE boots DROP COLUMN at;
ALTER TABLE boots RENAME COLUMN at_s TO at;
ALTER TABLE boots ADD COLUMN uptime_s REAL;
ALTER TABLE boots ADD COLUMN boot_count INTEGER;
CREATE INDEX boots_age ON boots(at);
DROP INDEX presence_open;
ALTER TABLE presence ADD COLUMN from_s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE presence ADD COLUMN to_s INTEGER;
UPDATE presence SET from_s = unixepoch(from_at), to_s = unixepoch(to_at);
ALTER TABLE presence DROP COLUMN from_at;
ALTER TABLE presence DROP COLUMN to_at;
ALTER TABLE presence RENAME COLUMN from_s TO from_at;
ALTER TABLE presence RENAME COLUMN to_s TO to_at;
CREATE INDEX presence_open ON presence(device_id) WHERE to_at IS NULL;
CREATE INDEX presence_age ON presence(to_at);
ALTER TABLE firmware_runs ADD COLUMN from_s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE firmware_runs ADD COLUMN to_s INTEGER;
UPDATE firmware_runs SET from_s = unixepoch(from_at), to_s = unixepoch(to_at);
ALTER TABLE firmware_runs DROP COLUMN from_at;
ALTER TABLE firmware_runs DROP COLUMN to_at;
ALTER TABLE firmware_runs RENAME COLUMN from_s TO from_at;
ALTER TABLE firmware_runs RENAME COLUMN to_s TO to_at;
CREATE INDEX firmware_runs_age ON firmware_runs(to_at);
-- The hours of the boots and offline intervals kept so far.
INSERT INTO fleet_hours (team_id, md5, hour, boots, crashes)
	SELECT d.team_id, b.fw_md5, b.at - b.at % 3600, count(*), sum(b.crash) FROM boots b JOIN devices d ON d.id = b.device_id
	WHERE b.fw_md5 IS NOT NULL GROUP BY d.team_id, b.fw_md5, b.at - b.at % 3600;
INSERT INTO fleet_hours (team_id, md5, hour, offline)
	SELECT d.team_id, r.md5, p.from_at - p.from_at % 3600, count(*) FROM presence p JOIN devices d ON d.id = p.device_id
	JOIN firmware_runs r ON r.device_id = p.device_id AND p.from_at >= r.from_at AND (r.to_at IS NULL OR p.from_at < r.to_at)
	WHERE NOT p.online GROUP BY d.team_id, r.md5, p.from_at - p.from_at % 3600
	ON CONFLICT (team_id, md5, hour) DO UPDATE SET offline = excluded.offline;

-- version 17: a halted rollout can be resumed, and its gates then count
-- from the resume (rollout_engine.go): gate_from is when (NULL: since
-- created_at), failures_before how many of its devices had failed by then
-- (NULL: none).
ALTER TABLE rollouts ADD COLUMN gate_from TEXT;
ALTER TABLE rollouts ADD COLUMN failures_before INTEGER;

-- version 18: webhooks (webhooks.go). A team's admins add endpoints that
-- devicehub POSTs the team's events to, signed with the endpoint's secret
-- (kept as it is given: signing needs it). Each endpoint's queue of events
-- not yet delivered is kept here, so that a restart loses none;
-- queued and queued_bytes count it, for its bound. The last deliveries of
-- each endpoint are kept for the page. offline_checked_at is how far the
-- device.offline check has looked (webhook_engine.go).
CREATE TABLE webhooks (
	id                 INTEGER PRIMARY KEY AUTOINCREMENT,
	team_id            INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	url                TEXT NOT NULL,
	events             TEXT NOT NULL,
	offline_minutes    INTEGER NOT NULL,
	secret             TEXT NOT NULL,
	enabled            INTEGER NOT NULL DEFAULT 1,
	disabled_reason    TEXT,
	created_at         TEXT NOT NULL,
	last_delivery_at   TEXT,
	offline_checked_at TEXT NOT NULL,
	queued             INTEGER NOT NULL DEFAULT 0,
	queued_bytes       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX webhooks_team ON webhooks(team_id);
CREATE TABLE webhook_queue (
	seq        INTEGER PRIMARY KEY AUTOINCREMENT,
	webhook_id INTEGER NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
	event_id   TEXT NOT NULL,
	type       TEXT NOT NULL,
	body       BLOB NOT NULL
);
CREATE INDEX webhook_queue_webhook ON webhook_queue(webhook_id, seq);
CREATE TABLE webhook_deliveries (
	seq         INTEGER PRIMARY KEY AUTOINCREMENT,
	id          TEXT NOT NULL,
	webhook_id  INTEGER NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
	event_id    TEXT NOT NULL,
	type        TEXT NOT NULL,
	at          TEXT NOT NULL,
	status      INTEGER,
	error       TEXT,
	duration_ms INTEGER NOT NULL,
	attempt     INTEGER NOT NULL
);
CREATE INDEX webhook_deliveries_webhook ON webhook_deliveries(webhook_id, seq);

-- version 19: revert (rollout_revert.go). on_halt is what a rollout does
-- when it halts: stop, or revert. reverts is the rollout a revert undoes
-- (one revert each: rollouts_reverts); a revert's devices go back to
-- different firmwares, so each of its devices names the md5 it is sent
-- (rollout_devices.md5; NULL: the rollout's; '': nothing, a device that
-- ran nothing before), and its own md5 and sha256 are '' when they differ.
ALTER TABLE rollouts ADD COLUMN on_halt TEXT NOT NULL DEFAULT 'stop' CHECK (on_halt IN ('stop', 'revert'));
ALTER TABLE rollouts ADD COLUMN reverts INTEGER REFERENCES rollouts(id) ON DELETE SET NULL;
CREATE UNIQUE INDEX rollouts_reverts ON rollouts(reverts) WHERE reverts IS NOT NULL;
ALTER TABLE rollout_devices ADD COLUMN md5 TEXT;

-- version 20: CHECK constraints on what the tables added since version 10
-- hold of a list: the type of a webhook's queued event and of a delivery
-- (webhookQueuedTypes in webhooks.go: TestStatesMatchSchema), and the kind
-- of a command (commandKinds in states.go). The tables are rebuilt as the
-- tenth version rebuilt its own, each taking over its sqlite_sequence row,
-- with their indexes; the triggers on commands (version 14) are made
-- again, and device_deleted, which names commands, goes while commands
-- is rebuilt.
CREATE TABLE new_webhook_queue (
	seq        INTEGER PRIMARY KEY AUTOINCREMENT,
	webhook_id INTEGER NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
	event_id   TEXT NOT NULL,
	type       TEXT NOT NULL CHECK (type IN ('device.status', 'device.boot', 'device.updated', 'command.state', 'rollout.progress', 'audit.entry', 'device.offline', 'ping')),
	body       BLOB NOT NULL
);
INSERT INTO new_webhook_queue (seq, webhook_id, event_id, type, body)
	SELECT seq, webhook_id, event_id, type, body FROM webhook_queue;
DELETE FROM sqlite_sequence WHERE name = 'new_webhook_queue';
UPDATE sqlite_sequence SET name = 'new_webhook_queue' WHERE name = 'webhook_queue';
DROP TABLE webhook_queue;
ALTER TABLE new_webhook_queue RENAME TO webhook_queue;
CREATE INDEX webhook_queue_webhook ON webhook_queue(webhook_id, seq);

CREATE TABLE new_webhook_deliveries (
	seq         INTEGER PRIMARY KEY AUTOINCREMENT,
	id          TEXT NOT NULL,
	webhook_id  INTEGER NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
	event_id    TEXT NOT NULL,
	type        TEXT NOT NULL CHECK (type IN ('device.status', 'device.boot', 'device.updated', 'command.state', 'rollout.progress', 'audit.entry', 'device.offline', 'ping')),
	at          TEXT NOT NULL,
	status      INTEGER,
	error       TEXT,
	duration_ms INTEGER NOT NULL,
	attempt     INTEGER NOT NULL
);
INSERT INTO new_webhook_deliveries (seq, id, webhook_id, event_id, type, at, status, error, duration_ms, attempt)
	SELECT seq, id, webhook_id, event_id, type, at, status, error, duration_ms, attempt FROM webhook_deliveries;
DELETE FROM sqlite_sequence WHERE name = 'new_webhook_deliveries';
UPDATE sqlite_sequence SET name = 'new_webhook_deliveries' WHERE name = 'webhook_deliveries';
DROP TABLE webhook_deliveries;
ALTER TABLE new_webhook_deliveries RENAME TO webhook_deliveries;
CREATE INDEX webhook_deliveries_webhook ON webhook_deliveries(webhook_id, seq);

DROP TRIGGER device_deleted;
CREATE TABLE new_commands (
	seq         INTEGER PRIMARY KEY,
	id          TEXT NOT NULL UNIQUE,
	device_id   INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	kind        TEXT NOT NULL CHECK (kind IN ('reboot', 'wifi_reset', 'ota', 'custom', 'button')),
	button_id   TEXT,
	payload     TEXT NOT NULL,
	state       TEXT NOT NULL CHECK (state IN ('sent', 'running', 'succeeded', 'failed', 'timed_out')),
	progress    INTEGER,
	result      TEXT,
	error       TEXT,
	created_at  TEXT NOT NULL,
	updated_at  TEXT NOT NULL,
	finished_at TEXT,
	deadline    TEXT NOT NULL,
	sent_by     INTEGER,
	team_id     INTEGER NOT NULL DEFAULT 0
);
INSERT INTO new_commands (seq, id, device_id, kind, button_id, payload, state, progress, result, error,
		created_at, updated_at, finished_at, deadline, sent_by, team_id)
	SELECT seq, id, device_id, kind, button_id, payload, state, progress, result, error,
		created_at, updated_at, finished_at, deadline, sent_by, team_id FROM commands;
DROP TABLE commands;
ALTER TABLE new_commands RENAME TO commands;
CREATE INDEX commands_device ON commands(device_id, seq);
CREATE INDEX commands_open ON commands(deadline) WHERE finished_at IS NULL;
CREATE INDEX commands_team_finished ON commands(team_id, seq) WHERE finished_at IS NOT NULL;
CREATE TRIGGER command_added AFTER INSERT ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes + octet_length(NEW.payload) + coalesce(octet_length(NEW.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;
CREATE TRIGGER command_changed AFTER UPDATE OF payload, result ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes
			+ octet_length(NEW.payload) + coalesce(octet_length(NEW.result), 0)
			- octet_length(OLD.payload) - coalesce(octet_length(OLD.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;
CREATE TRIGGER command_deleted AFTER DELETE ON commands BEGIN
	UPDATE teams SET command_bytes = command_bytes - octet_length(OLD.payload) - coalesce(octet_length(OLD.result), 0)
		WHERE id = (SELECT team_id FROM devices WHERE id = OLD.device_id);
END;
CREATE TRIGGER device_deleted BEFORE DELETE ON devices BEGIN
	UPDATE teams SET
		button_bytes = button_bytes - (SELECT coalesce(sum(octet_length(payload)), 0)
			FROM command_buttons WHERE device_id = OLD.id),
		command_bytes = command_bytes - (SELECT coalesce(sum(octet_length(payload) + coalesce(octet_length(result), 0)), 0)
			FROM commands WHERE device_id = OLD.id)
		WHERE id = OLD.team_id;
END;

-- version 21: a presence interval is found by its device and its end, in
-- one index: the open interval (to_at IS NULL sorts first), a device's
-- intervals, the trim. The age index holds only the closed intervals it
-- prunes, so that opening an interval writes two b-trees, not four: a
-- restart opens one for each device of the fleet.
DROP INDEX presence_open;
DROP INDEX presence_device;
DROP INDEX presence_age;
CREATE INDEX presence_device ON presence(device_id, to_at);
CREATE INDEX presence_age ON presence(to_at) WHERE to_at IS NOT NULL;
