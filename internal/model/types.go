package model

import (
	"encoding/json"

	"devicehub/internal/history"
)

// The API's shapes: what the handlers answer with, and what the store
// reads rows into. One type per thing.

// hardware is a platform (esp32) or a board (devkit) as a device names it.
// ID is the key's number in the team, counted by the team's own keys.
type hardware struct {
	ID   int64  `json:"id"`
	Name string `json:"name"`
	Key  string `json:"key"`
}

// Firmware is the API's Firmware object. IsCurrent and IsTarget are nil
// where the object is nested in a device (current_firmware, target_firmware).
// A firmware known only from a device's report has only MD5 and Version,
// and MD5 is nil when the device reported only a version.
type Firmware struct {
	ID        *int64  `json:"id"`
	Name      *string `json:"name"`
	Version   *string `json:"version"`
	Notes     *string `json:"notes"`
	MD5       *string `json:"md5"`
	SHA256    *string `json:"sha256"`
	Size      *int64  `json:"size"`
	CreatedAt *string `json:"created_at"`
	IsCurrent *bool   `json:"is_current,omitempty"`
	IsTarget  *bool   `json:"is_target,omitempty"`
}

// FirmwareLabel names a firmware file as people know it.
type FirmwareLabel struct {
	Name    string  `json:"name"`
	Version *string `json:"version"`
}

// LibraryFirmware is an entry of the team's firmware library: a file
// the team holds, uploaded to the library or to one of its devices.
type LibraryFirmware struct {
	SHA256           string    `json:"sha256"`
	MD5              string    `json:"md5"`
	Name             string    `json:"name"`
	Version          *string   `json:"version"`
	Notes            *string   `json:"notes"`
	Platform         *string   `json:"platform"` // the platform key its image was checked for; null for none
	Size             int64     `json:"size"`
	UploadedBy       *ActorRef `json:"uploaded_by"`
	CreatedAt        string    `json:"created_at"`
	DevicesRunning   int64     `json:"devices_running"`
	DevicesTargeting int64     `json:"devices_targeting"`
}

// DeviceSummary is the API's Device summary, the item of the device list.
type DeviceSummary struct {
	UID          string       `json:"uid"`
	Name         string       `json:"name"`
	Status       DeviceStatus `json:"status"`
	LastSeenAt   *string      `json:"last_seen_at"`
	Platform     hardware     `json:"platform"`
	Board        hardware     `json:"board"`
	BoardVariant *struct{}    `json:"board_variant"` // always null: no variants exist
	// CurrentFirmware is what the device last reported running (see
	// device): in the summary too, so that a list labels firmware without
	// a request per device.
	CurrentFirmware *Firmware `json:"current_firmware"`
	TeamName        string    `json:"-"` // its team's name, for 'device list'
	ID              int64     `json:"-"` // its row id: the list's order and its cursor
}

// Device is the API's Device detail (the summary's fields and more), and
// what the handlers that act on a device use.
type Device struct {
	DeviceSummary
	Description    *string         `json:"description"`
	IsOnline       bool            `json:"is_online"`
	PublicIP       *string         `json:"public_ip"`
	LocalIP        *string         `json:"local_ip"`
	Port           int64           `json:"port"`
	LastRSSI       *float64        `json:"last_rssi"`
	FirstSeenAt    *string         `json:"first_seen_at"`
	LastOTAAt      *string         `json:"last_ota_at"`
	TargetFirmware *Firmware       `json:"target_firmware"`
	Meta           json.RawMessage `json:"meta"`
	// OTA is the device's newest ota command; only Device detail answers
	// load it.
	OTA *Command `json:"ota"`
}

// CommandButton is the API's saved command of a device.
type CommandButton struct {
	ID      string          `json:"id"`
	Label   string          `json:"label"`
	Payload json.RawMessage `json:"payload"`
	Confirm bool            `json:"confirm"`
}

// Command is the API's Command object.
type Command struct {
	ID         string          `json:"id"`
	Kind       CommandKind     `json:"kind"`
	ButtonID   *string         `json:"button_id"`
	Payload    json.RawMessage `json:"payload"`
	State      CommandState    `json:"state"`
	Progress   *int64          `json:"progress"`
	Result     json.RawMessage `json:"result"`
	Error      *string         `json:"error"`
	CreatedAt  string          `json:"created_at"`
	UpdatedAt  string          `json:"updated_at"`
	FinishedAt *string         `json:"finished_at"`
	SentBy     *ActorRef       `json:"sent_by"` // nil: sent by nobody known
}

// ActorRef names the user who did something: who sent a command, who
// wrote an audit entry.
type ActorRef struct {
	ID   int64  `json:"id"`
	Name string `json:"name"`
}

// Team is the API's Team object: the team and its members.
type Team struct {
	ID      int64     `json:"id"`
	Name    string    `json:"name"`
	Members []*Member `json:"members"`
}

// Member is a user as their team sees them.
type Member struct {
	ID          int64   `json:"id"`
	Name        string  `json:"name"`
	Email       string  `json:"email"`
	Role        Role    `json:"role"`
	LastLoginAt *string `json:"last_login_at"`
	CreatedAt   string  `json:"created_at"`
	Pending     bool    `json:"pending"` // invited, their link not used yet
	// ResetPending: a password-reset link of theirs works.
	ResetPending bool `json:"reset_pending"`
}

// AuditEntry is one write in a team's audit log. Detail is a JSON object
// and never holds a secret.
type AuditEntry struct {
	ID        int64           `json:"id"`
	At        string          `json:"at"`
	Actor     *ActorRef       `json:"actor"`
	Action    string          `json:"action"`
	DeviceUID *string         `json:"device_uid"`
	Detail    json.RawMessage `json:"detail"`
	TeamID    int64           `json:"-"`
}

// Rollout is the API's Rollout object; Devices only in the detail.
type Rollout struct {
	ID          int64                      `json:"id"`
	Name        *string                    `json:"name"`
	MD5         *string                    `json:"md5"`    // nil: its devices are sent different firmwares (a revert)
	SHA256      *string                    `json:"sha256"` // nil with md5
	State       RolloutState               `json:"state"`
	BatchSize   int                        `json:"batch_size"`
	MaxFailures int                        `json:"max_failures"`
	Counts      map[RolloutDeviceState]int `json:"counts"`
	CreatedAt   string                     `json:"created_at"`
	UpdatedAt   string                     `json:"updated_at"`
	FinishedAt  *string                    `json:"finished_at"`
	Health      *RolloutHealth             `json:"health"`
	HaltReason  json.RawMessage            `json:"halt_reason"` // haltReason, null unless halted
	Firmware    *FirmwareLabel             `json:"firmware"`    // nil once the team no longer holds the file
	OnHalt      string                     `json:"on_halt"`     // stop, or revert (rollout_revert.go)
	Reverts     *int64                     `json:"reverts"`     // the rollout it reverts
	RevertedBy  *int64                     `json:"reverted_by"` // the rollout that reverts it
	Devices     []RolloutDevice            `json:"devices,omitempty"`
	// HealthStatus is where its health gate stands; in the detail only.
	HealthStatus *HealthStatus `json:"health_status,omitempty"`
	CreatedBy    *int64        `json:"-"` // the user who made it; nil once they are removed
	// GateFrom is when its gates began to count, its creation or the
	// resume of its latest halt; FailuresBefore how many of its devices
	// had failed by then.
	GateFrom       string `json:"-"`
	FailuresBefore int    `json:"-"`
}

// RolloutDevice is one device of a rollout.
type RolloutDevice struct {
	UID       string             `json:"uid"`
	Name      string             `json:"name"`
	Progress  *int64             `json:"progress"` // its OTA command's download progress, percent
	State     RolloutDeviceState `json:"state"`
	MD5       *string            `json:"md5"` // the firmware it is sent
	CommandID *string            `json:"command_id"`
	Error     *string            `json:"error"`
}

// User is the API's User object (GET /v1/auth/me), and the user a
// request is made by: TeamID is their team.
type User struct {
	ID              int64   `json:"id"`
	Name            string  `json:"name"`
	Email           string  `json:"email"`
	Role            Role    `json:"role"`
	EmailVerifiedAt *string `json:"email_verified_at"`
	LastLoginAt     *string `json:"last_login_at"`
	TeamID          int64   `json:"-"`
}

// TokenInfo is a personal access token as the API shows it (Current is the
// handler's to set).
type TokenInfo struct {
	ID         int64   `json:"id"`
	Name       string  `json:"name"`
	LastUsedAt *string `json:"last_used_at"`
	CreatedAt  string  `json:"created_at"`
	Current    bool    `json:"current"`
}

// UserSummary is the user as a login answers with it.
type UserSummary struct {
	ID    int64  `json:"id"`
	Name  string `json:"name"`
	Email string `json:"email"`
	Role  Role   `json:"role"`
}

// CommandAnswer is a command endpoint's 200 answer; Command only with ?wait=.
type CommandAnswer struct {
	Message   string   `json:"message"`
	DeviceUID string   `json:"device_uid"`
	CommandID string   `json:"command_id"`
	Command   *Command `json:"command,omitempty"`
}

// Credentials is the API's Credentials object: a device's broker login,
// shown once, in the answer that creates it (brokerLogins.credentials).
type Credentials struct {
	MQTTURL     string `json:"mqtt_url"`
	Username    string `json:"username"`
	Password    string `json:"password"`
	ClientID    string `json:"client_id"`
	TopicPrefix string `json:"topic_prefix"` // {prefix}/{uid}, without a trailing slash
}

// BrokerInfo is the API's Broker object: where a new device reaches the
// broker (null when this server cannot say: -public-url has no host and
// no -public-mqtt-url is set) and the prefix of its topics. The answer
// that creates a device has it, with or without a broker login.
type BrokerInfo struct {
	MQTTURL     *string `json:"mqtt_url"`
	TopicPrefix string  `json:"topic_prefix"` // {prefix}/{uid}, without a trailing slash
}

// The fleet health routes' answers are internal/history's.
type (
	SeriesInfo       = history.SeriesInfo
	historyData      = history.Chart
	PresenceInterval = history.Interval
	BootEntry        = history.BootEntry
	FirmwareHealth   = history.FirmwareHealth
)

// DeviceStatusEvent is the data of device.status.
type DeviceStatusEvent struct {
	UID        string       `json:"uid"`
	Status     DeviceStatus `json:"status"`
	LastSeenAt *string      `json:"last_seen_at"`
	LastRSSI   *float64     `json:"last_rssi"`
}

// AwaitsRevert reports whether the rollout has halted, asking to be
// reverted then, and is not reverted yet.
func (ro *Rollout) AwaitsRevert() bool {
	return ro.State == RolloutHalted && ro.OnHalt == OnHaltRevert && ro.RevertedBy == nil
}

// RolloutHealth is a rollout's health gate, as asked for and shown.
type RolloutHealth struct {
	MaxCrashRate float64 `json:"max_crash_rate"`
	MinCrashes   int     `json:"min_crashes"`
	WatchMinutes int     `json:"watch_minutes"`
}

// HealthStatus is where a rollout's health gate stands (the detail's
// health_status): the figures it halts on, counted since since, and the
// batch it watches while a running rollout waits for the watch to end.
type HealthStatus struct {
	Since      string      `json:"since"`
	Crashes    int         `json:"crashes"`
	DeviceDays float64     `json:"device_days"`
	Rate       float64     `json:"rate"`
	Watching   *BatchWatch `json:"watching"`
}

// BatchWatch is the batch (numbered from 1) whose devices a health gate
// watches, and when the watch ends.
type BatchWatch struct {
	Batch int    `json:"batch"`
	Until string `json:"until"`
}

// Webhook is the API's Webhook object.
type Webhook struct {
	ID               int64    `json:"id"`
	URL              string   `json:"url"`
	Events           []string `json:"events"`
	OfflineMinutes   int      `json:"offline_minutes"`
	Enabled          bool     `json:"enabled"`
	DisabledReason   *string  `json:"disabled_reason"`
	CreatedAt        string   `json:"created_at"`
	LastDeliveryAt   *string  `json:"last_delivery_at"`
	TeamID           int64    `json:"-"`
	Secret           string   `json:"-"` // signs each delivery; shown once, when made
	OfflineCheckedAt string   `json:"-"` // how far its device.offline check has looked
}

// WebhookDelivery is one attempt to deliver an event, or an event dropped
// from a full queue (no status, attempt 0).
type WebhookDelivery struct {
	ID         string  `json:"id"`
	EventID    string  `json:"event_id"`
	Type       string  `json:"type"`
	At         string  `json:"at"`
	Status     *int    `json:"status"`
	Error      *string `json:"error"`
	DurationMS int64   `json:"duration_ms"`
	Attempt    int     `json:"attempt"`
}
