package mqttlink

// What the link hands the Sink: the report that merges what one device
// said between two flushes, and a command's result; and why the link
// drops a message. The checks are the device protocol's (internal/wire).

import (
	"cmp"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/wire"
)

// Report merges what one device said since the last flush.
type Report struct {
	Seen   time.Time // when the newest message was taken, on Config.Now's clock
	Live   bool      // a message that was not a retained replay
	Status *string
	wire.Telemetry
	History []history.Sample // health and readings, folded by history's rules
	Boots   []history.Boot   // reset reasons reported, oldest first
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
	dropSeriesLimit    = "series_limit"                // Applied.Unkept
	dropWriteFailed    = "write_failed"                // Sink.Apply failed, or Applied.Failed
)

// maxUIDLength is the longest uid in a topic that is applied.
const maxUIDLength = 128

// dropReasons are every reason there is, in the order Stats lists them.
var dropReasons = []string{dropBadTopic, dropBadStatus, dropBadTelemetry, dropBadResult,
	dropUnknownDevice, dropRejectedResult, dropSeriesLimit, dropWriteFailed}

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
	p.History = history.MergeSamples(p.History, n.History)
	p.Boots = history.MergeBoots(p.Boots, n.Boots)
}
