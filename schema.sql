-- devicehub schema, version 1. Applied once, in a transaction, when
-- PRAGMA user_version is 0. Later changes go in new migrations (store.go).
-- Timestamps are UTC text in one fixed-width ISO 8601 form, so they sort.

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
