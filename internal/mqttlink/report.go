package mqttlink

// What a device publishes, as the link reads it (Read), and the report
// that merges what one device said between two flushes. The checks are
// the device protocol's (internal/wire).

import (
	"cmp"
	"time"

	"devicehub/internal/wire"
)

// Report merges what one device said since the last flush.
type Report struct {
	Seen   time.Time // when the newest message was taken, on Config.Now's clock
	Live   bool      // a message that was not a retained replay
	Status *string
	wire.Telemetry
}

// Result is what a device said about one of its commands.
type Result struct {
	UID, ID string // the device, and the command
	wire.Result
}

// Why the link drops a message; Stats counts them by these reasons.
const (
	dropBadTopic       = "bad_topic_or_size"
	dropBadStatus      = "bad_status"
	dropBadTelemetry   = "bad_telemetry"
	dropBadResult      = "bad_result"
	dropUnknownDevice  = "unknown_device"              // Applied.Unknown
	dropRejectedResult = "unknown_or_finished_command" // Applied.Rejected
	dropWriteFailed    = "write_failed"                // Sink.Apply failed
)

// maxUIDLength is the longest uid in a topic that is applied.
const maxUIDLength = 128

// dropReasons are every reason there is, in the order Stats lists them.
var dropReasons = []string{dropBadTopic, dropBadStatus, dropBadTelemetry, dropBadResult,
	dropUnknownDevice, dropRejectedResult, dropWriteFailed}

// Read reads one message from a device topic under prefix: the uid of the
// device that sent it, what it reports (a result is a sign of life too:
// an empty report; Seen and Live are the taker's to set) and, from a
// result topic, the result. drop is why the message cannot be applied
// (one of dropReasons), "" when it can.
func Read(prefix, topic string, payload []byte) (uid string, rep Report, res *Result, drop string) {
	uid, kind, id, ok := wire.ParseTopic(prefix, topic)
	if !ok || len(uid) > maxUIDLength || len(payload) > wire.MaxPayload {
		return "", Report{}, nil, dropBadTopic
	}
	switch {
	case kind == wire.ResultKind && id != "":
		r, ok := wire.ParseResult(payload)
		if !ok {
			return "", Report{}, nil, dropBadResult
		}
		return uid, rep, &Result{UID: uid, ID: id, Result: r}, ""
	case kind == wire.StatusKind && id == "":
		s, ok := wire.ParseStatus(payload)
		if !ok {
			return "", Report{}, nil, dropBadStatus
		}
		rep.Status = &s
	case kind == wire.TelemetryKind && id == "":
		t, ok := wire.ParseTelemetry(payload)
		if !ok {
			return "", Report{}, nil, dropBadTelemetry
		}
		rep.Telemetry = t
	default:
		return "", Report{}, nil, dropBadTopic
	}
	return uid, rep, nil, ""
}

// merge folds a newer report n into p: each field n has replaces p's.
func (p *Report) merge(n *Report) {
	p.Seen = n.Seen
	p.Live = p.Live || n.Live
	p.Status = cmp.Or(n.Status, p.Status)
	p.LocalIP = cmp.Or(n.LocalIP, p.LocalIP)
	p.PublicIP = cmp.Or(n.PublicIP, p.PublicIP)
	p.RSSI = cmp.Or(n.RSSI, p.RSSI)
	p.FWMD5 = cmp.Or(n.FWMD5, p.FWMD5)
	p.FWVersion = cmp.Or(n.FWVersion, p.FWVersion)
}
