package wire

import (
	"encoding/json"
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
