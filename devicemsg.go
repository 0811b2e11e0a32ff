package main

// What a device publishes, as the link reads it: its telemetry and
// command results, checked, and the report that merges what one device
// said between two flushes.

import (
	"bytes"
	"cmp"
	"encoding/json"
)

// deviceReport merges what one device said since the last flush.
type deviceReport struct {
	seen      string // time of the newest message
	live      bool   // a message that was not a retained replay
	status    *string
	localIP   *string
	publicIP  *string
	rssi      *float64
	fwMD5     *string
	fwVersion *string
	history   history // health and readings, in 5-minute buckets (history.go)
	boots     []boot  // reset reasons reported, oldest first (history.go)
}

// telemetry is the JSON a device publishes on P/{uid}/telemetry.
type telemetry struct {
	LocalIP   *string  `json:"local_ip"`
	PublicIP  *string  `json:"public_ip"`
	RSSI      *float64 `json:"rssi"`
	FWMD5     *string  `json:"fw_md5"`
	FWVersion *string  `json:"fw_version"`
	// Health (CONTRACT §14), read only by parseTelemetry.
	HeapFree    *float64 `json:"heap_free"`
	UptimeS     *float64 `json:"uptime_s"`
	ResetReason *string  `json:"reset_reason"`
	Metrics     []metric `json:"-"`
}

// resultMessage is the JSON a device publishes on P/{uid}/result/{id}.
type resultMessage struct {
	OK       *bool           `json:"ok"`
	Result   json.RawMessage `json:"result"`
	Error    *string         `json:"error"`
	Progress *float64        `json:"progress"`
}

// parseResult reads a result: {"ok": true, "result": …}, {"ok": false,
// "error": "…"}, or a progress report {"progress": 0–100} without ok.
func parseResult(payload []byte) (commandResult, bool) {
	var m resultMessage
	if json.Unmarshal(payload, &m) != nil || len(bytes.TrimSpace(payload)) == 0 || bytes.TrimSpace(payload)[0] != '{' {
		return commandResult{}, false
	}
	switch {
	case m.OK != nil && *m.OK:
		return commandResult{ok: m.OK, result: m.Result}, true
	case m.OK != nil:
		if m.Error == nil {
			return commandResult{}, false
		}
		return commandResult{ok: m.OK, error: m.Error}, true
	case m.Progress != nil:
		p := int64(*m.Progress)
		if float64(p) != *m.Progress || p < 0 || p > 100 {
			return commandResult{}, false
		}
		return commandResult{progress: &p}, true
	}
	return commandResult{}, false
}

// merge folds a newer report n into p: each field n has replaces p's.
func (p *deviceReport) merge(n *deviceReport) {
	p.seen = n.seen
	p.live = p.live || n.live
	p.status = cmp.Or(n.status, p.status)
	p.localIP = cmp.Or(n.localIP, p.localIP)
	p.publicIP = cmp.Or(n.publicIP, p.publicIP)
	p.rssi = cmp.Or(n.rssi, p.rssi)
	p.fwMD5 = cmp.Or(n.fwMD5, p.fwMD5)
	p.fwVersion = cmp.Or(n.fwVersion, p.fwVersion)
	p.history = p.history.merge(n.history)
	p.boots = mergeBoots(p.boots, n.boots)
}
