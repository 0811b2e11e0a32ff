package wire

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
)

func TestEncodeJSON(t *testing.T) {
	t.Parallel()
	b, err := EncodeJSON(map[string]string{"url": "http://h/x?a=1&b=<2>"})
	if err != nil || string(b) != `{"url":"http://h/x?a=1&b=<2>"}` {
		t.Errorf("EncodeJSON = %s, %v; want compact JSON, not HTML-escaped, without a newline", b, err)
	}
}

func TestIsHex(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"0123456789abcdefABCDEF0123456789": true,
		"0123456789abcdefABCDEF012345678":  false,
		"0123456789abcdefABCDEF012345678g": false,
		"0123456789abcdefABCDEF01234567é":  false,
	} {
		if IsHex(s, 32) != want {
			t.Errorf("IsHex(%q, 32) = %v, want %v", s, !want, want)
		}
	}
}

func TestIsTLSURL(t *testing.T) {
	t.Parallel()
	for u, want := range map[string]bool{
		"ssl://h:8883": true, "mqtts://h": true, "tls://h": true,
		"tcp://h:1883": false, "mqtt://h": false, "ws://h": false, "ssl": false,
	} {
		if IsTLSURL(u) != want {
			t.Errorf("IsTLSURL(%q) = %v, want %v", u, !want, want)
		}
	}
}

// TestTopics: a topic made by Topic parses back into its parts; what is
// not under the prefix, or names no uid or kind, does not parse.
func TestTopics(t *testing.T) {
	t.Parallel()
	tests := []struct {
		prefix, topic string
		uid, kind, id string
		ok            bool
	}{
		{"devices", Topic("devices", "esp32_a", StatusKind, ""), "esp32_a", "status", "", true},
		{"devices", Topic("devices", "esp32_a", ResultKind, "c1"), "esp32_a", "result", "c1", true},
		{"a/b", Topic("a/b", "esp32_a", CommandKind, "c1"), "esp32_a", "cmd", "c1", true},
		{"devices", "devices/esp32_a/status/extra", "esp32_a", "status", "extra", true},
		{"devices", "devices//status", "", "", "", false},
		{"devices", "devices/esp32_a", "", "", "", false},
		{"devices", "other/esp32_a/status", "", "", "", false},
		{"devices", "devicesx/esp32_a/status", "", "", "", false},
	}
	for _, tt := range tests {
		uid, kind, id, ok := ParseTopic(tt.prefix, tt.topic)
		if uid != tt.uid || kind != tt.kind || id != tt.id || ok != tt.ok {
			t.Errorf("ParseTopic(%q, %q) = %q %q %q %v, want %q %q %q %v", tt.prefix, tt.topic, uid, kind, id, ok, tt.uid, tt.kind, tt.id, tt.ok)
		}
	}
	if got := DeviceTopic("devices", "esp32_a"); got != "devices/esp32_a" {
		t.Errorf("DeviceTopic = %q", got)
	}
}

// TestParsePayloads: what each check lets through, and how it reads it.
func TestParsePayloads(t *testing.T) {
	t.Parallel()
	for payload, want := range map[string]bool{"online": true, " offline\r\n": true, "reconnecting": true, "Online": false, "": false, "on line": false} {
		if _, ok := ParseStatus([]byte(payload)); ok != want {
			t.Errorf("ParseStatus(%q): %v, want %v", payload, ok, want)
		}
	}
	for payload, want := range map[string]string{
		`{"rssi":-61.5,"fw_md5":"0123456789ABCDEF0123456789abcdef","extra":1}`: `{"local_ip":null,"public_ip":null,"rssi":-61.5,"fw_md5":"0123456789abcdef0123456789abcdef","fw_version":null}`,
		`{}`:                `{"local_ip":null,"public_ip":null,"rssi":null,"fw_md5":null,"fw_version":null}`,
		`{"fw_md5":"xyz"}`:  "",
		`{"rssi":"strong"}`: "",
		`[1,2]`:             "",
		`{"fw_version":"` + strings.Repeat("v", 256) + `"}`: "",
	} {
		tel, _, ok := ParseTelemetry([]byte(payload))
		got := ""
		if ok {
			b, _ := json.Marshal(tel)
			got = string(b)
		}
		if got != want {
			t.Errorf("ParseTelemetry(%.40q) = %s, want %s", payload, got, want)
		}
	}
	for payload, want := range map[string]string{
		`{"ok":true,"result":{"x":1}}`: `{"Progress":null,"OK":true,"Value":{"x":1},"Error":null}`,
		`{"ok":false,"error":"no"}`:    `{"Progress":null,"OK":false,"Value":null,"Error":"no"}`,
		`{"progress":50}`:              `{"Progress":50,"OK":null,"Value":null,"Error":null}`,
		`{"ok":false}`:                 "",
		`{"progress":101}`:             "",
		`{"progress":1.5}`:             "",
		`{}`:                           "",
		`null`:                         "",
		`"ok"`:                         "",
	} {
		r, ok := ParseResult([]byte(payload))
		got := ""
		if ok {
			b, _ := json.Marshal(r)
			got = string(b)
		}
		if got != want {
			t.Errorf("ParseResult(%q) = %s, want %s", payload, got, want)
		}
	}
}

// TestFastPathsAsUnmarshal: reading and text, which skip json.Unmarshal
// for a plain number or string, answer as it does for every kind of value.
func TestFastPathsAsUnmarshal(t *testing.T) {
	for _, raw := range []string{`0`, `-61`, `3.72`, `1e12`, `-1e12`, `1e13`, `1e400`, `-0`, `181234`,
		`"1.5"`, `null`, `true`, `{}`, `[1]`, `""`, `"esp32"`, `"a\"b"`, `"\u00e9t\u00e9"`, `"été"`, "\"\xff\xfe\"", `"x\\y"`} {
		var f float64
		fErr := json.Unmarshal([]byte(raw), &f)
		wantF, wantFOK := f, fErr == nil && math.Abs(f) <= MaxReading
		if !wantFOK {
			wantF = 0
		}
		if got, ok := reading(json.RawMessage(raw)); got != wantF || ok != wantFOK {
			t.Errorf("reading(%s) = %v, %v; want %v, %v", raw, got, ok, wantF, wantFOK)
		}
		var s string
		sErr := json.Unmarshal([]byte(raw), &s)
		if got, ok := text(json.RawMessage(raw)); got != s || ok != (sErr == nil) {
			t.Errorf("text(%s) = %q, %v; want %q, %v", raw, got, ok, s, sErr == nil)
		}
	}
}

// TestParseMetricsAsDecoder: parseMetrics, which finds where each key and
// value ends, reads every metrics object as json.Decoder reads it.
func TestParseMetricsAsDecoder(t *testing.T) {
	values := []string{`1`, `-2.5e3`, `1e13`, `null`, `"x"`, `"a\"}"`, `{"n":[1,{"m":"]"}]}`, `[]`, `true`, `0`}
	keys := []string{`"t"`, `"temp_c"`, `"Bad"`, `"t"`, `"\u0074"`, `"a\"b"`, `"é"`}
	objects := []string{`{}`, `{ }`, `5`, `[1]`, `null`, `"x"`}
	for i := range 200 {
		var pairs []string
		for j := range i % 20 {
			pairs = append(pairs, keys[(i+j)%len(keys)]+strings.Repeat(" ", j%2)+":"+values[(i*j+j)%len(values)])
		}
		objects = append(objects, "{\n"+strings.Join(pairs, " ,")+"}")
	}
	for _, raw := range objects {
		if !json.Valid([]byte(raw)) {
			t.Fatalf("test object not JSON: %s", raw)
		}
		got, gotBad := parseMetrics(json.RawMessage(raw))
		want, wantBad := decoderMetrics(json.RawMessage(raw))
		if !slices.Equal(got, want) || gotBad != wantBad {
			t.Errorf("parseMetrics(%s) = %v, %d; the decoder's: %v, %d", raw, got, gotBad, want, wantBad)
		}
	}
}

// decoderMetrics is parseMetrics written with json.Decoder, the reference.
func decoderMetrics(raw json.RawMessage) (list []Metric, bad int) {
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
		v, good := reading(value)
		if !good || !metricKey.MatchString(key) || seen[key] || len(list) == MaxMetrics {
			bad++
			continue
		}
		seen[key] = true
		list = append(list, Metric{key, v})
	}
	return list, bad
}

// TestTelemetryKeysAsAMap: a telemetry's keys are read as json.Unmarshal
// into a map reads them: the last of a key given twice, names exact.
func TestTelemetryKeysAsAMap(t *testing.T) {
	tel, bad, ok := ParseTelemetry([]byte(` {"rssi":-1, "RSSI":-3, "metrics":{"a":1}, "rssi" : -2 ,"metrics":{"b":2}} `))
	if !ok || bad != 0 || tel.RSSI == nil || *tel.RSSI != -2 || len(tel.Metrics) != 1 || tel.Metrics[0] != (Metric{"b", 2}) {
		t.Errorf("got %+v (rssi %v), bad %d, ok %v; want rssi -2, metrics [b 2]", tel, tel.RSSI, bad, ok)
	}
}
