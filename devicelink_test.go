package main

import (
	"crypto/pbkdf2"
	"crypto/sha512"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"

	"devicehub/internal/brokertest"
	"devicehub/internal/model"
)

// rawDevice connects over a bare socket with a retained Last Will of
// "offline", so that closing the socket is an unclean disconnect.
func rawDevice(t *testing.T, b *testBroker, uid string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", b.Port))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	c := packets.NewControlPacket(packets.Connect).(*packets.ConnectPacket)
	c.ProtocolName, c.ProtocolVersion = "MQTT", 4
	c.CleanSession, c.Keepalive, c.ClientIdentifier = true, 30, "raw-"+uid
	c.WillFlag, c.WillQos, c.WillRetain = true, 1, true
	c.WillTopic, c.WillMessage = "devices/"+uid+"/status", []byte("offline")
	must(t, c.Write(conn))
	if ack, err := packets.ReadPacket(conn); err != nil || ack.(*packets.ConnackPacket).ReturnCode != 0 {
		t.Fatalf("connect: %v %v", ack, err)
	}
	p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
	p.TopicName, p.Payload, p.Retain = "devices/"+uid+"/status", []byte("online"), true
	must(t, p.Write(conn))
	return conn
}

// TestStatusGatesCommands: the status a device publishes decides whether
// it takes commands; white space around the word is forgiven ("online\n"
// is what echo online | mosquitto_pub -s sends), a wrong word is dropped;
// the Last Will of a device that drops off marks it offline.
func TestStatusGatesCommands(t *testing.T) {
	t.Parallel()
	env, link, b := brokerEnv(t)
	a := env.alice
	dev := testClient(t, b, "device", "")
	reboot := "/v1/user/devices/" + a.device + "/reboot"
	tests := []struct {
		payload    string
		wantStatus model.DeviceStatus
		wantCode   int
		wantBody   string
	}{
		{"online", "online", 200, ""},
		{"offline", "offline", 422, `{"message":"Device is offline."}`},
		{"online\n", "online", 200, ""},
		{"reconnecting", "reconnecting", 422, `{"message":"Device is reconnecting."}`},
		{" offline\r\n", "offline", 422, `{"message":"Device is offline."}`},
		{"\treconnecting ", "reconnecting", 422, `{"message":"Device is reconnecting."}`},
		{"  online  \n", "online", 200, ""},
	}
	for _, tt := range tests {
		publishWait(t, dev, "devices/"+a.device+"/status", true, tt.payload)
		eventually(t, 3*time.Second, fmt.Sprintf("status %q applied", tt.payload), func() bool { return env.device(a).Status == tt.wantStatus })
		d := env.device(a)
		if d.IsOnline != (tt.wantStatus == "online") || d.FirstSeenAt == nil || d.LastSeenAt == nil {
			t.Errorf("status %q: is_online %v, first_seen_at %v, last_seen_at %v", tt.payload, d.IsOnline, d.FirstSeenAt, d.LastSeenAt)
		}
		w := env.request("POST", reboot, a.token, nil)
		if w.Code != tt.wantCode || tt.wantBody != "" && strings.TrimSpace(w.Body.String()) != tt.wantBody {
			t.Errorf("status %q: reboot got %d %s, want %d %s", tt.payload, w.Code, w.Body, tt.wantCode, tt.wantBody)
		}
	}

	// A wrong word is dropped, white space or not.
	before := dropTotal(link)
	publishWait(t, dev, "devices/"+a.device+"/status", false, "on line\n")
	eventually(t, 5*time.Second, "the bad word dropped", func() bool { return dropTotal(link) == before+1 })
	if got := env.device(a).Status; got != "online" {
		t.Errorf("after %q: status %q, want it unchanged (online)", "on line\n", got)
	}

	conn := rawDevice(t, b, a.device)
	eventually(t, 3*time.Second, "online via the raw device", func() bool { return env.device(a).Status == "online" })
	conn.Close()
	eventually(t, 5*time.Second, "the Last Will to mark it offline", func() bool { return env.device(a).Status == "offline" })
}

// TestTelemetryApplied: telemetry sets the device's addresses, signal and
// firmware (md5 lowercased; a version alone is a firmware too); garbage on the device's topics changes
// nothing and is counted as dropped.
func TestTelemetryApplied(t *testing.T) {
	t.Parallel()
	env, link, b := brokerEnv(t)
	a := env.alice
	dev := testClient(t, b, "device", "")
	// A device that reports a version and no md5 runs that version.
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, `{"fw_version":"0.9.0"}`)
	eventually(t, 3*time.Second, "the version applied", func() bool { return env.device(a).CurrentFirmware != nil })
	if cf := env.device(a).CurrentFirmware; cf.MD5 != nil || cf.Version == nil || *cf.Version != "0.9.0" || cf.ID != nil {
		t.Errorf("current_firmware after a version alone: got %s, want version 0.9.0, md5 and id null", apiJSON(cf))
	}
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false,
		`{"local_ip":"192.168.1.20","public_ip":"203.0.113.7","rssi":-61.5,"fw_md5":"0123456789ABCDEF0123456789abcdef","fw_version":"1.2.3","extra":{"ignored":true}}`)
	eventually(t, 3*time.Second, "telemetry applied", func() bool { return env.device(a).LocalIP != nil })
	d := env.device(a)
	if *d.LocalIP != "192.168.1.20" || *d.PublicIP != "203.0.113.7" || *d.LastRSSI != -61.5 || d.Status != "pending" ||
		d.FirstSeenAt == nil || d.LastSeenAt == nil {
		t.Errorf("device after telemetry: %s", apiJSON(d))
	}
	if cf := d.CurrentFirmware; cf == nil || cf.MD5 == nil || *cf.MD5 != "0123456789abcdef0123456789abcdef" || *cf.Version != "1.2.3" || cf.ID != nil {
		t.Errorf("current_firmware: got %s, want md5 lowercased, version 1.2.3, id null", apiJSON(cf))
	}

	before := apiJSON(env.device(a))
	dropped := dropTotal(link)
	env.clock.advance(time.Hour) // any applied message would move last_seen_at
	garbage := []struct{ topic, payload string }{
		{"status", "ONLINE"},
		{"status", ""},
		{"telemetry", "not json"},
		{"telemetry", "[1,2]"},
		{"telemetry", `{"rssi":"strong"}`},
		{"telemetry", `{"fw_md5":"xyz"}`},
		{"telemetry", `{"local_ip":"` + strings.Repeat("1", 300) + `"}`},
		{"telemetry", `{"local_ip":"` + strings.Repeat("x", 17<<10) + `"}`},
	}
	for _, g := range garbage {
		publishWait(t, dev, "devices/"+a.device+"/"+g.topic, false, g.payload)
	}
	publishWait(t, dev, "devices/esp32_doesnotexist/status", false, "online")
	eventually(t, 3*time.Second, "every garbage message counted", func() bool { return dropTotal(link)-dropped == int64(len(garbage)+1) })
	if after := apiJSON(env.device(a)); after != before {
		t.Errorf("garbage changed the device:\nbefore %s\nafter  %s", before, after)
	}
}

// TestBrokerRestart: while the broker is down the link says so and
// commands answer 503 at once; after it is back, the link resubscribes,
// the retained status comes back and commands go through.
func TestBrokerRestart(t *testing.T) {
	t.Parallel()
	env, link, b := brokerEnv(t)
	a := env.alice
	// No Last Will here: Mosquitto sends wills when it shuts down, and this
	// test is about the retained "online" surviving the restart.
	publishWait(t, testClient(t, b, "device", ""), "devices/"+a.device+"/status", true, "online")
	eventually(t, 3*time.Second, "online", func() bool { return env.device(a).Status == "online" })
	reboot := "/v1/user/devices/" + a.device + "/reboot"

	b.Stop()
	eventually(t, 5*time.Second, "the link to notice", func() bool { return !link.Connected() })
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)
	start := time.Now()
	checkAnswer(t, env.request("POST", reboot, a.token, nil), 503, "")
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("command without broker took %v, want under 2s", d)
	}
	env.setStatus(a.device, "pending") // only the retained message can bring it back

	b.Start()
	eventually(t, 15*time.Second, "the link to reconnect", link.Connected)
	eventually(t, 5*time.Second, "the retained status to come back", func() bool { return env.device(a).Status == "online" })
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"connected"}`)
	cmds := subscribe(t, testClient(t, b, "observer", ""), "devices/"+a.device+"/cmd/+")
	checkAnswer(t, env.request("POST", reboot, a.token, nil), 200, "")
	if m := receive(t, cmds, 3*time.Second, "command after the restart"); string(m.Payload()) != `{"cmd":"reboot"}` {
		t.Errorf("payload %s", m.Payload())
	}
}

// TestLinkStartsWithoutBroker: the service starts while the broker is
// down, answers 503 to commands, and connects once the broker is up.
func TestLinkStartsWithoutBroker(t *testing.T) {
	t.Parallel()
	b := brokertest.New(t, "") // configured, not started
	env := newTestEnv(t, nil)
	link := newLink(t, env, b, "", "")
	env.rebuild(withLink(link))
	env.setStatus(env.alice.device, "online")
	reboot := "/v1/user/devices/" + env.alice.device + "/reboot"
	checkAnswer(t, env.request("POST", reboot, env.alice.token, nil), 503, "")
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)

	time.Sleep(1500 * time.Millisecond) // a failed attempt or two
	b.Start()
	eventually(t, 10*time.Second, "the link to connect to the late broker", link.Connected)
	checkAnswer(t, env.request("POST", reboot, env.alice.token, nil), 200, "")
}

// TestSubscribeRefused: a broker that refuses the device topics answers
// the SUBACK with 0x80 (here Mosquitto's dynamic security plugin, whose
// default denies subscriptions; its acl_file never refuses one). The link
// then does not count as connected: healthz says "disconnected" and
// commands answer 503. It tries again on the same connection, and is
// connected once the broker allows the subscription.
func TestSubscribeRefused(t *testing.T) {
	t.Parallel()
	plugin := brokertest.DynsecPlugin(t)
	// An admin that may send dynamic security commands; everyone else
	// may publish, but not subscribe.
	salt := []byte("12-byte-salt") // the plugin takes salts of exactly 12 bytes
	key, _ := pbkdf2.Key(sha512.New, "admin-password", salt, 101, 64)
	conf := filepath.Join(t.TempDir(), "dynsec.json")
	control := "$CONTROL/dynamic-security/#"
	os.WriteFile(conf, []byte(apiJSON(map[string]any{
		"defaultACLAccess": map[string]bool{"publishClientSend": true, "publishClientReceive": true, "subscribe": false, "unsubscribe": true},
		"clients": []any{map[string]any{"username": "admin", "password": base64.StdEncoding.EncodeToString(key),
			"salt": base64.StdEncoding.EncodeToString(salt), "iterations": 101, "roles": []any{map[string]string{"rolename": "admin"}}}},
		"roles": []any{map[string]any{"rolename": "admin", "acls": []any{
			map[string]any{"acltype": "publishClientSend", "topic": control, "allow": true},
			map[string]any{"acltype": "subscribePattern", "topic": control, "allow": true}}}},
	})), 0o600)
	b := startBrokerWith(t, "plugin "+plugin+"\nplugin_opt_config_file "+conf+"\n")
	env := newTestEnv(t, nil)
	link := newLink(t, env, b, "", "")
	env.rebuild(withLink(link))
	env.setStatus(env.alice.device, "online")

	eventually(t, 10*time.Second, "a second refused subscription", func() bool {
		return strings.Count(env.logs.String(), "broker refused the subscription") >= 2
	})
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)
	checkAnswer(t, env.request("POST", "/v1/user/devices/"+env.alice.device+"/reboot", env.alice.token, nil), 503, "")

	admin := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.URL()).SetClientID("admin").SetUsername("admin").SetPassword("admin-password"))
	if tok := admin.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("connect as admin: %v", tok.Error())
	}
	defer admin.Disconnect(50)
	publishWait(t, admin, "$CONTROL/dynamic-security/v1", false,
		`{"commands":[{"command":"setDefaultACLAccess","acls":[{"acltype":"subscribe","allow":true}]}]}`)
	eventually(t, 10*time.Second, "the subscription once the broker allows it", link.Connected)
	if n := strings.Count(env.logs.String(), "mqtt connected"); n != 1 {
		t.Errorf("the link connected %d times; want it to retry on its one connection:\n%s", n, env.logs)
	}
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"connected"}`)
}
