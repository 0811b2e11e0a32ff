package model

// The states a device, a command, a rollout and a rollout's device can be
// in, the kinds of a command, and the roles of a team's members: one list
// each. The Go code names
// them by these constants, the store's SQL renders them from these lists
// (store.SQLIn), and internal/store/schema.sql's CHECK constraints hold the same values
// (TestStatesMatchSchema).

import "devicehub/internal/wire"

// DeviceStatus is a device's presence: pending until its first message,
// then the last status word it published, or offline once silent.
type DeviceStatus string

const (
	StatusPending      DeviceStatus = "pending"
	StatusOnline       DeviceStatus = wire.Online
	StatusOffline      DeviceStatus = wire.Offline
	StatusReconnecting DeviceStatus = wire.Reconnecting
)

// DeviceStatuses are the statuses a device can be in; the last three are
// the words a device publishes.
var DeviceStatuses = []DeviceStatus{StatusPending, StatusOnline, StatusOffline, StatusReconnecting}

// CommandKind is what a command record is: a reboot or a Wi-Fi reset, an
// OTA update, a custom payload, or a command button's payload.
type CommandKind string

const (
	KindReboot    CommandKind = "reboot"
	KindWifiReset CommandKind = "wifi_reset"
	KindOTA       CommandKind = "ota"
	KindCustom    CommandKind = "custom"
	KindButton    CommandKind = "button"
)

// CommandKinds are the kinds a command can be.
var CommandKinds = []CommandKind{KindReboot, KindWifiReset, KindOTA, KindCustom, KindButton}

// CommandState is a command record's state: sent, running, then one end
// that never changes.
type CommandState string

const (
	CommandSent      CommandState = "sent"
	CommandRunning   CommandState = "running"
	CommandSucceeded CommandState = "succeeded"
	CommandFailed    CommandState = "failed"
	CommandTimedOut  CommandState = "timed_out"
)

// CommandStates are the states a command can be in, CommandEnds those of
// them that are an end.
var (
	CommandStates = []CommandState{CommandSent, CommandRunning, CommandSucceeded, CommandFailed, CommandTimedOut}
	CommandEnds   = []CommandState{CommandSucceeded, CommandFailed, CommandTimedOut}
)

// RolloutState is a rollout's state: running or paused, then one end.
type RolloutState string

const (
	RolloutRunning   RolloutState = "running"
	RolloutPaused    RolloutState = "paused"
	RolloutHalted    RolloutState = "halted"
	RolloutCancelled RolloutState = "cancelled"
	RolloutCompleted RolloutState = "completed"
)

// RolloutStates are the states a rollout can be in, RolloutEnds those of
// them that are an end (it has a finished_at).
var (
	RolloutStates = []RolloutState{RolloutRunning, RolloutPaused, RolloutHalted, RolloutCancelled, RolloutCompleted}
	RolloutEnds   = []RolloutState{RolloutHalted, RolloutCancelled, RolloutCompleted}
)

// RolloutDeviceState is the state of one device of a rollout (rd, as
// the SQL calls rollout_devices): pending, waiting while it is not
// online, running while its OTA command runs, then how that command ended,
// or skipped when it already ran the image.
type RolloutDeviceState string

const (
	RdPending   RolloutDeviceState = "pending"
	RdWaiting   RolloutDeviceState = "waiting"
	RdRunning   RolloutDeviceState = "running"
	RdSucceeded RolloutDeviceState = RolloutDeviceState(CommandSucceeded)
	rdFailed    RolloutDeviceState = RolloutDeviceState(CommandFailed)
	rdTimedOut  RolloutDeviceState = RolloutDeviceState(CommandTimedOut)
	RdSkipped   RolloutDeviceState = "skipped"
)

// RolloutDeviceStates are the states a rollout's device can be in,
// RdNotEnded those that are not an end and RdFailures those that count
// against the rollout's max_failures.
var (
	RolloutDeviceStates = []RolloutDeviceState{RdPending, RdWaiting, RdRunning, RdSucceeded, rdFailed, rdTimedOut, RdSkipped}
	RdNotEnded          = []RolloutDeviceState{RdPending, RdWaiting, RdRunning}
	RdFailures          = []RolloutDeviceState{rdFailed, rdTimedOut}
)

// Role is what a member of a team may do: a viewer reads, a user also
// writes, an admin also manages the team.
type Role string

const (
	RoleViewer Role = "viewer"
	RoleUser   Role = "user"
	RoleAdmin  Role = "admin"
)

// Roles are the roles a member can have, the default first, in the order
// the messages name them.
var Roles = []Role{RoleUser, RoleAdmin, RoleViewer}

// May reports whether a member with role r may do what needs role need:
// each role may do what the ones below it may.
func (r Role) May(need Role) bool { return r.rank() >= need.rank() }

func (r Role) rank() int {
	switch r {
	case RoleAdmin:
		return 2
	case RoleUser:
		return 1
	}
	return 0
}

// JoinStates joins a list of states for a message: "a, b, c".
func JoinStates[T ~string](list []T) string {
	s := ""
	for i, v := range list {
		if i > 0 {
			s += ", "
		}
		s += string(v)
	}
	return s
}

// A rollout's on_halt: what it does when it halts.
const (
	OnHaltStop   = "stop"
	OnHaltRevert = "revert"
)
