// Package wire is the device protocol that the server and the simulator
// (sim/) share: the MQTT topics, the checks a device's messages must pass,
// and the JSON encoding of what goes to and from devices. It knows nothing
// of either side; sim's package comment describes the protocol as a device
// speaks it.
package wire

import (
	"bytes"
	"encoding/json"
	"math"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxPayload is the largest message from a device that is applied.
const MaxPayload = 16 << 10

// The kinds of topic under a device's P/{uid}/.
const (
	StatusKind    = "status"    // P/{uid}/status: "online", "offline" or "reconnecting"
	TelemetryKind = "telemetry" // P/{uid}/telemetry: Telemetry
	CommandKind   = "cmd"       // P/{uid}/cmd/{id}: a command, to the device
	ResultKind    = "result"    // P/{uid}/result/{id}: a command's Result, from the device
)

// DeviceTopic is P/{uid}, under which all of the device's topics are.
func DeviceTopic(prefix, uid string) string { return prefix + "/" + uid }

// Topic is the device's topic of that kind: P/{uid}/{kind}, and
// P/{uid}/{kind}/{id} when id is not empty (a command or a result). uid
// and id may be "+" in a subscription.
func Topic(prefix, uid, kind, id string) string {
	t := DeviceTopic(prefix, uid) + "/" + kind
	if id != "" {
		t += "/" + id
	}
	return t
}

// ParseTopic splits a topic under prefix into the device's uid, the kind
// and what follows it (a command or result id; "" for a status or
// telemetry topic). ok is false for a topic that is not under prefix or
// names no uid or kind; the kind itself is not checked.
func ParseTopic(prefix, topic string) (uid, kind, id string, ok bool) {
	rest, under := strings.CutPrefix(topic, prefix+"/")
	uid, rest, cut := strings.Cut(rest, "/")
	if !under || !cut || uid == "" {
		return "", "", "", false
	}
	kind, id, _ = strings.Cut(rest, "/")
	return uid, kind, id, true
}

// The statuses a device publishes on P/{uid}/status.
const (
	Online       = "online"
	Offline      = "offline"
	Reconnecting = "reconnecting"
)

// ParseStatus reads a status: Online, Offline or Reconnecting.
// Surrounding white space is forgiven: `mosquitto_pub -s` sends "online\n".
func ParseStatus(payload []byte) (string, bool) {
	s := strings.TrimSpace(string(payload))
	return s, s == Online || s == Offline || s == Reconnecting
}

// Telemetry is the JSON a device publishes on P/{uid}/telemetry; every
// field may be left out. A field of the wrong type, or a number outside
// ±MaxReading, is left out and counted on its own (ParseTelemetry), and
// the message's other fields still apply.
type Telemetry struct {
	LocalIP   *string  `json:"local_ip"`
	PublicIP  *string  `json:"public_ip"`
	RSSI      *float64 `json:"rssi"`
	FWMD5     *string  `json:"fw_md5"`
	FWVersion *string  `json:"fw_version"`
	// Health: free heap (bytes), seconds since boot, the reset reason
	// (an esp_reset_reason_t name, lower case, without ESP_RST_; sent in
	// the first telemetry after each boot), how many times the device has
	// booted (kept across reboots, e.g. in NVS) and its own readings.
	HeapFree    *float64 `json:"heap_free,omitempty"`
	UptimeS     *float64 `json:"uptime_s,omitempty"`
	ResetReason *string  `json:"reset_reason,omitempty"`
	BootCount   *int64   `json:"boot_count,omitempty"`
	Metrics     []Metric `json:"-"`
}

// MaxMetrics is how many metrics of one message are kept.
const MaxMetrics = 16

// MaxReading bounds a number in a telemetry (rssi, heap_free, uptime_s, a
// metric): one further from zero is left out. Far past anything a device
// measures, it keeps every sum the server folds readings into finite:
// two readings of 1e308 would make one infinite, and a third of -1e308
// NaN.
const MaxReading = 1e12

// metricKey is what a metric's name may be.
var metricKey = regexp.MustCompile(`^[a-z0-9_]{1,32}$`)

// Metric is one of a device's own readings, in the order it sent them.
type Metric struct {
	Key   string
	Value float64
}

// ParseTelemetry reads a telemetry payload. It returns ok false when the
// payload is not a JSON object, or when it has no usable field but a bad
// one (nothing of it applies then); bad counts the fields and metrics
// left out.
func ParseTelemetry(payload []byte) (t Telemetry, bad int, ok bool) {
	trimmed := bytes.TrimSpace(payload)
	if len(trimmed) == 0 || trimmed[0] != '{' || !json.Valid(trimmed) {
		return t, 1, false
	}
	var room [16]pair // a device's report fits: fields stays on the stack
	fields := pairs(room[:0], trimmed)
	str := func(name string, check func(string) bool) *string {
		raw, present := field(fields, name)
		if !present {
			return nil
		}
		s, good := text(raw)
		if !good || !check(s) {
			bad++
			return nil
		}
		return &s
	}
	number := func(name string, min float64) *float64 {
		raw, present := field(fields, name)
		if !present {
			return nil
		}
		v, good := reading(raw)
		if !good || v < min {
			bad++
			return nil
		}
		return &v
	}
	short := func(s string) bool { return len(s) <= 255 }
	t.LocalIP = str("local_ip", short)
	t.PublicIP = str("public_ip", short)
	t.FWVersion = str("fw_version", short)
	if t.FWMD5 = str("fw_md5", func(s string) bool { return IsHex(s, 32) }); t.FWMD5 != nil {
		*t.FWMD5 = strings.ToLower(*t.FWMD5)
	}
	// A reason is an esp_reset_reason_t name; newer ESP-IDF releases add
	// names, so any short lower-case word is taken (only the crash names
	// mean something to the server).
	t.ResetReason = str("reset_reason", metricKey.MatchString)
	t.RSSI = number("rssi", math.Inf(-1))
	t.HeapFree = number("heap_free", 0)
	t.UptimeS = number("uptime_s", 0)
	if n := number("boot_count", 0); n != nil {
		if c := int64(*n); float64(c) == *n && *n < 1<<53 {
			t.BootCount = &c
		} else {
			bad++
		}
	}
	if raw, present := field(fields, "metrics"); present {
		var n int
		t.Metrics, n = parseMetrics(raw)
		bad += n
	}
	used := t.LocalIP != nil || t.PublicIP != nil || t.FWVersion != nil || t.FWMD5 != nil || t.ResetReason != nil ||
		t.RSSI != nil || t.HeapFree != nil || t.UptimeS != nil || t.BootCount != nil || len(t.Metrics) > 0
	return t, bad, used || bad == 0
}

// reading reads a JSON number within ±MaxReading (so neither NaN nor
// infinite), as json.Unmarshal into a float64 would; a number, a
// device's usual field, without its reflection.
func reading(raw json.RawMessage) (float64, bool) {
	var v float64
	var err error
	if len(raw) > 0 && (raw[0] == '-' || '0' <= raw[0] && raw[0] <= '9') {
		v, err = strconv.ParseFloat(string(raw), 64) // raw is a valid JSON number: the payload was checked
	} else {
		err = json.Unmarshal(raw, &v)
	}
	if err != nil || !(math.Abs(v) <= MaxReading) {
		return 0, false
	}
	return v, true
}

// text reads a JSON string as json.Unmarshal into a string would; one
// without escapes and in valid UTF-8, a device's usual, is its bytes.
func text(raw json.RawMessage) (string, bool) {
	if len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0 && utf8.Valid(raw) {
		return string(raw[1 : len(raw)-1]), true // raw is a valid JSON string: the payload was checked
	}
	var s string
	return s, json.Unmarshal(raw, &s) == nil
}

// parseMetrics reads a metrics object in the order its keys came: at
// most MaxMetrics good ones are kept; a bad key or value, a key seen
// before, and a good one past the limit are each counted in bad. raw is
// a value as pairs found it: valid JSON, no white space around it.
func parseMetrics(raw json.RawMessage) (list []Metric, bad int) {
	if raw[0] != '{' {
		return nil, 1
	}
	var seen []string // at most MaxMetrics, cheaper than a map
	var room [MaxMetrics]pair
	for _, p := range pairs(room[:0], raw) {
		v, good := reading(p.value)
		if !good || !metricKey.MatchString(p.key) || slices.Contains(seen, p.key) || len(list) == MaxMetrics {
			bad++
			continue
		}
		seen = append(seen, p.key)
		list = append(list, Metric{p.key, v})
	}
	return list, bad
}

// pair is a key of a JSON object and its value.
type pair struct {
	key   string
	value json.RawMessage
}

// pairs appends the keys and values of obj, a valid JSON object without
// white space around it, to list, in order. They are found by where each
// ends (jsonValueEnd) instead of by a decoder: a device's every message is
// read so, and json.Unmarshal into a map cost most of the reading.
func pairs(list []pair, obj []byte) []pair {
	rest := bytes.TrimLeft(obj[1:], " \t\r\n")
	for len(rest) > 0 && rest[0] == '"' {
		n := jsonValueEnd(rest)
		key, _ := text(json.RawMessage(rest[:n]))
		rest = bytes.TrimLeft(rest[n:], " \t\r\n:")
		n = jsonValueEnd(rest)
		list = append(list, pair{key, json.RawMessage(rest[:n])})
		rest = bytes.TrimLeft(rest[n:], " \t\r\n,")
	}
	return list
}

// field is the value of the last pair named name, as json.Unmarshal into
// a map keeps the last of a key given twice.
func field(list []pair, name string) (json.RawMessage, bool) {
	for i := len(list) - 1; i >= 0; i-- {
		if list[i].key == name {
			return list[i].value, true
		}
	}
	return nil, false
}

// jsonValueEnd is the length of the JSON value that b, valid JSON, begins
// with (ParseTelemetry checked the payload): a string to its closing
// quote, an object or array to the bracket that closes it, a number or
// literal to the next delimiter.
func jsonValueEnd(b []byte) int {
	depth, inString := 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case inString && c == '\\':
			i++ // the escaped character
		case c == '"':
			if inString = !inString; !inString && depth == 0 {
				return i + 1
			}
		case inString:
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			if depth--; depth == 0 {
				return i + 1
			}
			if depth < 0 {
				return i // a number or literal that ends its object
			}
		case depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\r' || c == '\n'):
			return i
		}
	}
	return len(b)
}

// Result is what a device says about one of its commands on
// P/{uid}/result/{id}: a progress report (OK nil) or the command's end.
type Result struct {
	Progress *int64
	OK       *bool
	Value    json.RawMessage // "result", with OK true, if the device sent one
	Error    *string         // with OK false
}

// resultMessage is the JSON of a Result.
type resultMessage struct {
	OK       *bool           `json:"ok"`
	Result   json.RawMessage `json:"result"`
	Error    *string         `json:"error"`
	Progress *float64        `json:"progress"`
}

// ParseResult reads a result: {"ok": true, "result": …}, {"ok": false,
// "error": "…"}, or a progress report {"progress": 0–100} without ok.
func ParseResult(payload []byte) (Result, bool) {
	var m resultMessage
	if json.Unmarshal(payload, &m) != nil || len(bytes.TrimSpace(payload)) == 0 || bytes.TrimSpace(payload)[0] != '{' {
		return Result{}, false
	}
	switch {
	case m.OK != nil && *m.OK:
		return Result{OK: m.OK, Value: m.Result}, true
	case m.OK != nil:
		if m.Error == nil {
			return Result{}, false
		}
		return Result{OK: m.OK, Error: m.Error}, true
	case m.Progress != nil:
		p := int64(*m.Progress)
		if float64(p) != *m.Progress || p < 0 || p > 100 {
			return Result{}, false
		}
		return Result{Progress: &p}, true
	}
	return Result{}, false
}

// EncodeJSON encodes v as JSON sent to and by devices: compact and without
// HTML escaping, so that a hand-written parser on a device sees "&" in a
// URL, not "\u0026".
func EncodeJSON(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// IsHex reports whether s is exactly n hex digits, in either case, as an
// md5 (32) or sha256 (64) is written in telemetry and commands.
func IsHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// IsTLSURL reports whether a broker URL asks for TLS: its scheme is ssl,
// mqtts or tls, read as the MQTT client reads it.
func IsTLSURL(broker string) bool {
	u, err := url.Parse(broker)
	return err == nil && (u.Scheme == "ssl" || u.Scheme == "mqtts" || u.Scheme == "tls")
}
