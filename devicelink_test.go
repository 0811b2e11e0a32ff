package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestStatusWhiteSpaceForgiven: a status word with white space around it
// (echo online | mosquitto_pub -s sends "online\n") counts, through a
// real broker; a wrong word is still dropped.
func TestStatusWhiteSpaceForgiven(t *testing.T) {
	b := startBroker(t)
	env, link := newLinkedEnv(t, b)
	uid := env.alice.device
	dev := testClient(t, b, "ws-device", "")
	for _, tt := range []struct{ payload, want string }{
		{"online\n", "online"},
		{" offline\r\n", "offline"},
		{"\treconnecting ", "reconnecting"},
		{"  online  \n", "online"},
	} {
		publishWait(t, dev, "devices/"+uid+"/status", true, tt.payload)
		eventually(t, 5*time.Second, "status "+tt.want+" from "+strings.TrimSpace(tt.payload), func() bool { return env.device(env.alice).Status == tt.want })
	}
	before := dropTotal(link)
	publishWait(t, dev, "devices/"+uid+"/status", false, "on line\n")
	eventually(t, 5*time.Second, "the bad word dropped", func() bool { return dropTotal(link) == before+1 })
	if got := env.device(env.alice).Status; got != "online" {
		t.Errorf("after %q: status %q, want it unchanged (online)", "on line\n", got)
	}
}

// TestOTAVersionNull: the ota command for a firmware uploaded without a
// version carries "version": null, not "", and the version otherwise.
func TestOTAVersionNull(t *testing.T) {
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	a := env.alice
	dev := ota11Online(t, b, env, a)
	cmds := subscribe(t, dev, "devices/"+a.device+"/cmd/#")

	for _, tt := range []struct {
		fields      map[string]string
		wantVersion string
	}{
		{map[string]string{"name": "no version"}, `null`},
		{map[string]string{"name": "empty version", "version": ""}, `null`},
		{map[string]string{"name": "versioned", "version": "2.1.0"}, `"2.1.0"`},
	} {
		content := []byte("\xe9 firmware: " + tt.fields["name"])
		if w := env.upload(a, tt.fields, content); w.Code != 201 {
			t.Fatalf("upload %q: %d %s", tt.fields, w.Code, w.Body)
		}
		if w := env.request("POST", "/v1/user/devices/"+a.device+"/firmwares/set-target", a.token, map[string]string{"md5": md5Hex(content)}); w.Code != 200 {
			t.Fatalf("set-target: %d %s", w.Code, w.Body)
		}
		if w := env.request("POST", "/v1/user/devices/"+a.device+"/ota", a.token, nil); w.Code != 200 {
			t.Fatalf("ota: %d %s", w.Code, w.Body)
		}
		select {
		case m := <-cmds:
			var cmd map[string]json.RawMessage
			if err := json.Unmarshal(m.Payload(), &cmd); err != nil {
				t.Fatalf("ota command %s: %v", m.Payload(), err)
			}
			if v, ok := cmd["version"]; !ok || string(v) != tt.wantVersion {
				t.Errorf("ota command for %q: version %s (present: %v), want %s; command %s", tt.fields, v, ok, tt.wantVersion, m.Payload())
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no ota command for %q", tt.fields)
		}
	}
}
