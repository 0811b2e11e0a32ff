-- The schema as it stands after the last migration: every table, index
-- and trigger, each table with its own. The store creates and migrates a
-- database with schema.sql, whose "-- version N" sections are the
-- migrations in order; this file is not run. TestSchemaNow checks that a
-- database made from it has the schema of one migrated from version 1:
-- a new migration changes both files.

CREATE TABLE command_buttons (
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	id        TEXT NOT NULL,
	label     TEXT NOT NULL,
	payload   TEXT NOT NULL, -- compact JSON object, published verbatim
	confirm   INTEGER NOT NULL DEFAULT 0,
	seq       INTEGER PRIMARY KEY,
	UNIQUE (device_id, id)
);

CREATE TRIGGER button_added AFTER INSERT ON command_buttons BEGIN
	UPDATE teams SET button_bytes = button_bytes + octet_length(NEW.payload)
		WHERE id = (SELECT team_id FROM devices WHERE id = NEW.device_id);
END;

CREATE TRIGGER button_deleted AFTER DELETE ON command_buttons BEGIN
	UPDATE teams SET button_bytes = button_bytes - octet_length(OLD.payload)
		WHERE id = (SELECT team_id FROM devices WHERE id = OLD.device_id);
END;

CREATE TABLE tokens (
	id           INTEGER PRIMARY KEY AUTOINCREMENT,
	user_id      INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	name         TEXT NOT NULL,
	secret_hash  BLOB NOT NULL UNIQUE,
	last_used_at TEXT,
	created_at   TEXT NOT NULL
);
CREATE INDEX tokens_user ON tokens(user_id);

CREATE TABLE firmwares (
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
CREATE INDEX firmwares_md5 ON firmwares(md5);
CREATE INDEX firmwares_sha256 ON firmwares(sha256);

CREATE TABLE known_clients (
	user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
	addr TEXT NOT NULL,
	at TEXT NOT NULL,
	PRIMARY KEY (user_id, addr)
) WITHOUT ROWID;

CREATE TABLE teams (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	name       TEXT NOT NULL,
	created_at TEXT NOT NULL,
	button_bytes INTEGER NOT NULL DEFAULT 0,
	command_bytes INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE audit (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	team_id    INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	at         TEXT NOT NULL,
	actor_id   INTEGER,
	actor_name TEXT,
	action     TEXT NOT NULL,
	device_uid TEXT,
	detail     TEXT NOT NULL DEFAULT '{}',
	number INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX audit_team ON audit(team_id, number);

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

CREATE TABLE legacy_series (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	name      TEXT NOT NULL,
	UNIQUE (device_id, name)
);

CREATE TABLE legacy_buckets (
	series_id INTEGER NOT NULL REFERENCES legacy_series(id) ON DELETE CASCADE,
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
	from_at INTEGER NOT NULL DEFAULT 0, to_at INTEGER);
CREATE INDEX presence_device ON presence(device_id, to_at);
CREATE INDEX presence_age ON presence(to_at) WHERE to_at IS NOT NULL;

CREATE TABLE boots (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	reason     TEXT NOT NULL,
	crash      INTEGER NOT NULL,
	fw_md5     TEXT,
	fw_version TEXT,
	number INTEGER NOT NULL DEFAULT 0,
	at INTEGER NOT NULL DEFAULT 0,
	uptime_s REAL,
	boot_count INTEGER
);
CREATE UNIQUE INDEX boots_device ON boots(device_id, number);
CREATE INDEX boots_age ON boots(at);

CREATE TABLE firmware_runs (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	md5       TEXT NOT NULL,
	version   TEXT,
	from_at INTEGER NOT NULL DEFAULT 0, to_at INTEGER);
CREATE INDEX firmware_runs_device ON firmware_runs(device_id);
CREATE INDEX firmware_runs_age ON firmware_runs(to_at);

CREATE TABLE users (
	id                INTEGER PRIMARY KEY AUTOINCREMENT,
	name              TEXT NOT NULL,
	email             TEXT NOT NULL UNIQUE, -- stored lowercased
	role              TEXT NOT NULL DEFAULT 'user' CHECK (role IN ('user', 'admin', 'viewer')),
	password_hash     TEXT NOT NULL,
	email_verified_at TEXT,
	last_login_at     TEXT,
	created_at        TEXT NOT NULL,
	team_id           INTEGER NOT NULL REFERENCES teams(id),
	password_version INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX users_team ON users(team_id);

CREATE TRIGGER admin_removed BEFORE DELETE ON users WHEN OLD.role = 'admin' BEGIN
	DELETE FROM invites WHERE invited_by = OLD.id;
	DELETE FROM password_resets WHERE created_by = OLD.id;
END;

CREATE TRIGGER admin_demoted AFTER UPDATE OF role ON users WHEN OLD.role = 'admin' AND NEW.role != 'admin' BEGIN
	DELETE FROM invites WHERE invited_by = OLD.id;
	DELETE FROM password_resets WHERE created_by = OLD.id;
END;

CREATE TABLE devices (
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
CREATE INDEX devices_team ON devices(team_id);
CREATE INDEX devices_team_status ON devices(team_id, status);
CREATE INDEX devices_team_platform ON devices(team_id, platform_id);
CREATE INDEX devices_team_board ON devices(team_id, board_id);

CREATE TRIGGER device_deleted BEFORE DELETE ON devices BEGIN
	UPDATE teams SET
		button_bytes = button_bytes - (SELECT coalesce(sum(octet_length(payload)), 0)
			FROM command_buttons WHERE device_id = OLD.id),
		command_bytes = command_bytes - (SELECT coalesce(sum(octet_length(payload) + coalesce(octet_length(result), 0)), 0)
			FROM commands WHERE device_id = OLD.id)
		WHERE id = OLD.team_id;
END;

CREATE TABLE commands (
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
	team_id INTEGER NOT NULL DEFAULT 0
);
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

CREATE TABLE rollouts (
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
	halt_reason  TEXT,
	gate_from TEXT,
	failures_before INTEGER,
	on_halt TEXT NOT NULL DEFAULT 'stop' CHECK (on_halt IN ('stop', 'revert')),
	reverts INTEGER REFERENCES rollouts(id) ON DELETE SET NULL
);
CREATE INDEX rollouts_team ON rollouts(team_id);
CREATE UNIQUE INDEX rollouts_reverts ON rollouts(reverts) WHERE reverts IS NOT NULL;

CREATE TABLE rollout_devices (
	rollout_id INTEGER NOT NULL REFERENCES rollouts(id) ON DELETE CASCADE,
	position   INTEGER NOT NULL,
	device_id  INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	state      TEXT NOT NULL
		CHECK (state IN ('pending', 'waiting', 'running', 'succeeded', 'failed', 'timed_out', 'skipped')),
	command_id TEXT,
	error      TEXT, md5 TEXT,
	PRIMARY KEY (rollout_id, position),
	UNIQUE (rollout_id, device_id)
);
CREATE INDEX rollout_devices_device ON rollout_devices(device_id);
CREATE INDEX rollout_devices_state ON rollout_devices(rollout_id, state, position);

CREATE TABLE platforms (
	id      INTEGER PRIMARY KEY,
	team_id INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	number  INTEGER NOT NULL,
	key     TEXT NOT NULL,
	name    TEXT NOT NULL,
	UNIQUE (team_id, key),
	UNIQUE (team_id, number)
);

CREATE TABLE boards (
	id      INTEGER PRIMARY KEY,
	team_id INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	number  INTEGER NOT NULL,
	key     TEXT NOT NULL,
	name    TEXT NOT NULL,
	UNIQUE (team_id, key),
	UNIQUE (team_id, number)
);

CREATE TABLE invites (
	id          INTEGER PRIMARY KEY, -- the member's id, drawn from users' AUTOINCREMENT sequence
	team_id     INTEGER NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
	name        TEXT NOT NULL,
	email       TEXT NOT NULL, -- stored lowercased
	role        TEXT NOT NULL CHECK (role IN ('user', 'admin', 'viewer')),
	secret_hash BLOB NOT NULL UNIQUE,
	expires_at  TEXT NOT NULL,
	created_at  TEXT NOT NULL, invited_by INTEGER REFERENCES users(id) ON DELETE SET NULL,
	UNIQUE (team_id, email)
);

CREATE TABLE password_resets (
	user_id     INTEGER PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
	secret_hash BLOB NOT NULL UNIQUE,
	expires_at  TEXT NOT NULL,
	created_by INTEGER REFERENCES users(id) ON DELETE CASCADE
);

CREATE TABLE history_rows (
	id        INTEGER PRIMARY KEY,
	device_id INTEGER NOT NULL REFERENCES devices(id) ON DELETE CASCADE,
	step      INTEGER NOT NULL CHECK (step IN (300, 3600)),
	start     INTEGER NOT NULL,
	slots     BLOB NOT NULL,
	UNIQUE (device_id, step, start)
);
CREATE INDEX history_rows_age ON history_rows(step, start);

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
	type       TEXT NOT NULL CHECK (type IN ('device.status', 'device.boot', 'device.updated', 'command.state', 'rollout.progress', 'audit.entry', 'device.offline', 'ping')),
	body       BLOB NOT NULL
);
CREATE INDEX webhook_queue_webhook ON webhook_queue(webhook_id, seq);

CREATE TABLE webhook_deliveries (
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
CREATE INDEX webhook_deliveries_webhook ON webhook_deliveries(webhook_id, seq);
