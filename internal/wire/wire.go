// Package wire is the device protocol that the server and the simulator
// (sim/) share: the MQTT topics, the checks a device's messages must pass,
// and the JSON encoding of what goes to and from devices. It knows nothing
// of either side; sim's package comment describes the protocol as a device
// speaks it.
package wire

import (
	"bytes"
	"encoding/json"
	"net/url"
	"strings"
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
// field may be left out.
type Telemetry struct {
	LocalIP   *string  `json:"local_ip"`
	PublicIP  *string  `json:"public_ip"`
	RSSI      *float64 `json:"rssi"`
	FWMD5     *string  `json:"fw_md5"`
	FWVersion *string  `json:"fw_version"`
}

// ParseTelemetry reads telemetry, its fw_md5 lowercased. It refuses text
// fields over 255 bytes and an fw_md5 that is no md5.
func ParseTelemetry(payload []byte) (Telemetry, bool) {
	var t Telemetry
	if json.Unmarshal(payload, &t) != nil {
		return Telemetry{}, false
	}
	for _, s := range []*string{t.LocalIP, t.PublicIP, t.FWVersion} {
		if s != nil && len(*s) > 255 {
			return Telemetry{}, false
		}
	}
	if t.FWMD5 != nil {
		if !IsHex(*t.FWMD5, 32) {
			return Telemetry{}, false
		}
		*t.FWMD5 = strings.ToLower(*t.FWMD5)
	}
	return t, true
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
