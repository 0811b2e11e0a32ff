package main

// The states a device, a command, a rollout and a rollout's device can be
// in, and the roles of a team's members: one list each. The Go code names
// them by these constants, the store's SQL renders them from these lists
// (sqlIn), and schema.sql's CHECK constraints hold the same values
// (TestStatesMatchSchema).

import "devicehub/internal/wire"

// deviceStatus is a device's presence: pending until its first message,
// then the last status word it published, or offline once silent.
type deviceStatus string

const (
	statusPending      deviceStatus = "pending"
	statusOnline       deviceStatus = wire.Online
	statusOffline      deviceStatus = wire.Offline
	statusReconnecting deviceStatus = wire.Reconnecting
)

// deviceStatuses are the statuses a device can be in; the last three are
// the words a device publishes.
var deviceStatuses = []deviceStatus{statusPending, statusOnline, statusOffline, statusReconnecting}

// commandState is a command record's state: sent, running, then one end
// that never changes.
type commandState string

const (
	commandSent      commandState = "sent"
	commandRunning   commandState = "running"
	commandSucceeded commandState = "succeeded"
	commandFailed    commandState = "failed"
	commandTimedOut  commandState = "timed_out"
)

// commandStates are the states a command can be in, commandEnds those of
// them that are an end.
var (
	commandStates = []commandState{commandSent, commandRunning, commandSucceeded, commandFailed, commandTimedOut}
	commandEnds   = []commandState{commandSucceeded, commandFailed, commandTimedOut}
)

// rolloutState is a rollout's state: running or paused, then one end.
type rolloutState string

const (
	rolloutRunning   rolloutState = "running"
	rolloutPaused    rolloutState = "paused"
	rolloutHalted    rolloutState = "halted"
	rolloutCancelled rolloutState = "cancelled"
	rolloutCompleted rolloutState = "completed"
)

// rolloutStates are the states a rollout can be in, rolloutEnds those of
// them that are an end (it has a finished_at).
var (
	rolloutStates = []rolloutState{rolloutRunning, rolloutPaused, rolloutHalted, rolloutCancelled, rolloutCompleted}
	rolloutEnds   = []rolloutState{rolloutHalted, rolloutCancelled, rolloutCompleted}
)

// rolloutDeviceState is the state of one device of a rollout (rd, as
// the SQL calls rollout_devices): pending, waiting while it is not
// online, running while its OTA command runs, then how that command ended,
// or skipped when it already ran the image.
type rolloutDeviceState string

const (
	rdPending   rolloutDeviceState = "pending"
	rdWaiting   rolloutDeviceState = "waiting"
	rdRunning   rolloutDeviceState = "running"
	rdSucceeded rolloutDeviceState = rolloutDeviceState(commandSucceeded)
	rdFailed    rolloutDeviceState = rolloutDeviceState(commandFailed)
	rdTimedOut  rolloutDeviceState = rolloutDeviceState(commandTimedOut)
	rdSkipped   rolloutDeviceState = "skipped"
)

// rolloutDeviceStates are the states a rollout's device can be in,
// rdNotEnded those that are not an end and rdFailures those that count
// against the rollout's max_failures.
var (
	rolloutDeviceStates = []rolloutDeviceState{rdPending, rdWaiting, rdRunning, rdSucceeded, rdFailed, rdTimedOut, rdSkipped}
	rdNotEnded          = []rolloutDeviceState{rdPending, rdWaiting, rdRunning}
	rdFailures          = []rolloutDeviceState{rdFailed, rdTimedOut}
)

// role is what a member of a team may do: a viewer reads, a user also
// writes, an admin also manages the team.
type role string

const (
	roleViewer role = "viewer"
	roleUser   role = "user"
	roleAdmin  role = "admin"
)

// roles are the roles a member can have, the default first, in the order
// the messages name them.
var roles = []role{roleUser, roleAdmin, roleViewer}

// may reports whether a member with role r may do what needs role need:
// each role may do what the ones below it may.
func (r role) may(need role) bool { return r.rank() >= need.rank() }

func (r role) rank() int {
	switch r {
	case roleAdmin:
		return 2
	case roleUser:
		return 1
	}
	return 0
}

// joinStates joins a list of states for a message: "a, b, c".
func joinStates[T ~string](list []T) string {
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
	onHaltStop   = "stop"
	onHaltRevert = "revert"
)
