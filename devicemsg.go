package main

// What a device publishes, as the link reads it: the report that merges
// what one device said between two flushes. The checks are the device
// protocol's (internal/wire).

import (
	"cmp"

	"devicehub/internal/wire"
)

// deviceReport merges what one device said since the last flush.
type deviceReport struct {
	seen   string // time of the newest message
	live   bool   // a message that was not a retained replay
	status *string
	wire.Telemetry
	history history // health and readings, in 5-minute buckets (history.go)
	boots   []boot  // reset reasons reported, oldest first (history.go)
}

// merge folds a newer report n into p: each field n has replaces p's.
func (p *deviceReport) merge(n *deviceReport) {
	p.seen = n.seen
	p.live = p.live || n.live
	p.status = cmp.Or(n.status, p.status)
	p.LocalIP = cmp.Or(n.LocalIP, p.LocalIP)
	p.PublicIP = cmp.Or(n.PublicIP, p.PublicIP)
	p.RSSI = cmp.Or(n.RSSI, p.RSSI)
	p.FWMD5 = cmp.Or(n.FWMD5, p.FWMD5)
	p.FWVersion = cmp.Or(n.FWVersion, p.FWVersion)
	p.history = p.history.merge(n.history)
	p.boots = mergeBoots(p.boots, n.boots)
}
