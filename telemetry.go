package main

// Telemetry read field by field: a field of the wrong type, or a metric
// that is not a finite number, is left out and counted on its own, and
// the message's other fields still apply (CONTRACT §14).

import (
	"bytes"
	"encoding/json"
	"math"
	"regexp"
	"strings"
)

// maxMetrics is how many metrics of one message are kept, and how many
// metric series a device may have (store_history.go).
const maxMetrics = 16

// metricKey is what a metric's name may be.
var metricKey = regexp.MustCompile(`^[a-z0-9_]{1,32}$`)

// metric is one of a device's own readings, in the order it sent them.
type metric struct {
	key   string
	value float64
}

// parseTelemetry reads a telemetry payload. It returns ok false when the
// payload is not a JSON object, or when it has no usable field but a bad
// one (nothing of it applies then); bad counts the fields and metrics
// left out.
func parseTelemetry(payload []byte) (t telemetry, bad int, ok bool) {
	var fields map[string]json.RawMessage
	trimmed := bytes.TrimSpace(payload)
	if len(trimmed) == 0 || trimmed[0] != '{' || json.Unmarshal(trimmed, &fields) != nil {
		return t, 1, false
	}
	text := func(name string, check func(string) bool) *string {
		raw, present := fields[name]
		if !present {
			return nil
		}
		var s string
		if json.Unmarshal(raw, &s) != nil || !check(s) {
			bad++
			return nil
		}
		return &s
	}
	number := func(name string, min float64) *float64 {
		raw, present := fields[name]
		if !present {
			return nil
		}
		v, good := finite(raw)
		if !good || v < min {
			bad++
			return nil
		}
		return &v
	}
	short := func(s string) bool { return len(s) <= 255 }
	t.LocalIP = text("local_ip", short)
	t.PublicIP = text("public_ip", short)
	t.FWVersion = text("fw_version", short)
	if t.FWMD5 = text("fw_md5", isMD5); t.FWMD5 != nil {
		*t.FWMD5 = strings.ToLower(*t.FWMD5)
	}
	// A reason is an esp_reset_reason_t name; newer ESP-IDF releases add
	// names, so any short lower-case word is taken (only the crash names
	// mean something to the server).
	t.ResetReason = text("reset_reason", metricKey.MatchString)
	t.RSSI = number("rssi", math.Inf(-1))
	t.HeapFree = number("heap_free", 0)
	t.UptimeS = number("uptime_s", 0)
	if raw, present := fields["metrics"]; present {
		var n int
		t.Metrics, n = parseMetrics(raw)
		bad += n
	}
	used := t.LocalIP != nil || t.PublicIP != nil || t.FWVersion != nil || t.FWMD5 != nil || t.ResetReason != nil ||
		t.RSSI != nil || t.HeapFree != nil || t.UptimeS != nil || len(t.Metrics) > 0
	return t, bad, used || bad == 0
}

// finite reads a JSON number that is a finite float64.
func finite(raw json.RawMessage) (float64, bool) {
	var v float64
	if json.Unmarshal(raw, &v) != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// parseMetrics reads a metrics object in the order its keys came: at
// most maxMetrics good ones are kept; a bad key or value, a key seen
// before, and a good one past the limit are each counted in bad.
func parseMetrics(raw json.RawMessage) (list []metric, bad int) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, 1
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return list, bad + 1
		}
		key, _ := tok.(string)
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return list, bad + 1
		}
		v, good := finite(value)
		if !good || !metricKey.MatchString(key) || seen[key] || len(list) == maxMetrics {
			bad++
			continue
		}
		seen[key] = true
		list = append(list, metric{key, v})
	}
	return list, bad
}
