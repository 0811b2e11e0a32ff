package main

import (
	"context"
	"crypto/pbkdf2"
	"crypto/sha512"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
)

// rawDevice connects over a bare socket with a retained Last Will of
// "offline", so that closing the socket is an unclean disconnect.
func rawDevice(t *testing.T, b *testBroker, uid string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", b.port))
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
	env, link, b := brokerEnv(t)
	a := env.alice
	dev := testClient(t, b, "device", "")
	reboot := "/v1/user/devices/" + a.device + "/reboot"
	tests := []struct {
		payload    string
		wantStatus deviceStatus
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
// firmware (md5 lowercased); garbage on the device's topics changes
// nothing and is counted as dropped.
func TestTelemetryApplied(t *testing.T) {
	env, link, b := brokerEnv(t)
	a := env.alice
	dev := testClient(t, b, "device", "")
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false,
		`{"local_ip":"192.168.1.20","public_ip":"203.0.113.7","rssi":-61.5,"fw_md5":"0123456789ABCDEF0123456789abcdef","fw_version":"1.2.3","extra":{"ignored":true}}`)
	eventually(t, 3*time.Second, "telemetry applied", func() bool { return env.device(a).LocalIP != nil })
	d := env.device(a)
	if *d.LocalIP != "192.168.1.20" || *d.PublicIP != "203.0.113.7" || *d.LastRSSI != -61.5 || d.Status != "pending" ||
		d.FirstSeenAt == nil || d.LastSeenAt == nil {
		t.Errorf("device after telemetry: %s", apiJSON(d))
	}
	if cf := d.CurrentFirmware; cf == nil || cf.MD5 != "0123456789abcdef0123456789abcdef" || *cf.Version != "1.2.3" || cf.ID != nil {
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
	env, link, b := brokerEnv(t)
	a := env.alice
	// No Last Will here: Mosquitto sends wills when it shuts down, and this
	// test is about the retained "online" surviving the restart.
	publishWait(t, testClient(t, b, "device", ""), "devices/"+a.device+"/status", true, "online")
	eventually(t, 3*time.Second, "online", func() bool { return env.device(a).Status == "online" })
	reboot := "/v1/user/devices/" + a.device + "/reboot"

	b.stop()
	eventually(t, 5*time.Second, "the link to notice", func() bool { return !link.connected() })
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)
	start := time.Now()
	checkAnswer(t, env.request("POST", reboot, a.token, nil), 503, "")
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("command without broker took %v, want under 2s", d)
	}
	env.setStatus(a.device, "pending") // only the retained message can bring it back

	b.start()
	eventually(t, 15*time.Second, "the link to reconnect", link.connected)
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
	b := newBroker(t, "") // configured, not started
	env := newTestEnv(t, nil)
	link := newMQTTLink(mqttConfig{url: b.url(), prefix: "devices"}, env.st, env.log)
	t.Cleanup(link.close)
	env.rebuild(withLink(link))
	env.setStatus(env.alice.device, "online")
	reboot := "/v1/user/devices/" + env.alice.device + "/reboot"
	checkAnswer(t, env.request("POST", reboot, env.alice.token, nil), 503, "")
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)

	time.Sleep(1500 * time.Millisecond) // a failed attempt or two
	b.start()
	eventually(t, 10*time.Second, "the link to connect to the late broker", link.connected)
	checkAnswer(t, env.request("POST", reboot, env.alice.token, nil), 200, "")
}

// TestSubscribeRefused: a broker that refuses the device topics answers
// the SUBACK with 0x80 (here Mosquitto's dynamic security plugin, whose
// default denies subscriptions; its acl_file never refuses one). The link
// then does not count as connected: healthz says "disconnected" and
// commands answer 503. It tries again on the same connection, and is
// connected once the broker allows the subscription.
func TestSubscribeRefused(t *testing.T) {
	const plugin = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so"
	if _, err := os.Stat(plugin); err != nil {
		t.Skipf("Mosquitto's dynamic security plugin: %v", err)
	}
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
	link := newMQTTLink(mqttConfig{url: b.url(), prefix: "devices"}, env.st, env.log)
	t.Cleanup(link.close)
	env.rebuild(withLink(link))
	env.setStatus(env.alice.device, "online")

	eventually(t, 10*time.Second, "a second refused subscription", func() bool {
		return strings.Count(env.logs.String(), "broker refused the subscription") >= 2
	})
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)
	checkAnswer(t, env.request("POST", "/v1/user/devices/"+env.alice.device+"/reboot", env.alice.token, nil), 503, "")

	admin := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.url()).SetClientID("admin").SetUsername("admin").SetPassword("admin-password"))
	if tok := admin.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("connect as admin: %v", tok.Error())
	}
	defer admin.Disconnect(50)
	publishWait(t, admin, "$CONTROL/dynamic-security/v1", false,
		`{"commands":[{"command":"setDefaultACLAccess","acls":[{"acltype":"subscribe","allow":true}]}]}`)
	eventually(t, 10*time.Second, "the subscription once the broker allows it", link.connected)
	if n := strings.Count(env.logs.String(), "mqtt connected"); n != 1 {
		t.Errorf("the link connected %d times; want it to retry on its one connection:\n%s", n, env.logs)
	}
	checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"connected"}`)
}

// holdWriter makes the store slow: it holds the writer's one connection
// in a transaction until release, so the link's flushes wait for it.
func holdWriter(t *testing.T, st *store) (release func()) {
	t.Helper()
	tx, err := st.writer.BeginTx(context.Background(), nil)
	must(t, err)
	return func() { tx.Rollback() }
}

// pendingOf returns what the link holds for uid, unwritten, and the
// number of devices pending.
func pendingOf(l *mqttLink, uid string) (deviceReport, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if p := l.pending[uid]; p != nil {
		return *p, len(l.pending)
	}
	return deviceReport{}, len(l.pending)
}

// TestRetainedFloodNotDropped: a restart meets more retained statuses
// than a batch holds while the store is slow. The link stops reading
// the broker instead of dropping, and applies every status.
func TestRetainedFloodNotDropped(t *testing.T) {
	const n = maxPendingDevices + 10_000
	b := startBroker(t)
	env := newTestEnv(t, nil)
	ctx := context.Background()
	alice, err := env.st.userByEmail(ctx, env.alice.email)
	must(t, err)
	uids := make([]string, n)
	_, err = env.st.importDevices(ctx, alice.teamID, 1883, func(add func(newDevice) error) error {
		for i := range uids {
			uids[i] = fmt.Sprintf("esp32_f%d", i)
			if err := add(newDevice{uid: uids[i], platform: "esp32", board: "devkit"}); err != nil {
				return err
			}
		}
		return nil
	})
	must(t, err)
	fleet := testClient(t, b, "fleet", "")
	for _, uid := range uids[1:] {
		fleet.Publish("devices/"+uid+"/status", 0, true, "online")
	}
	publishWait(t, fleet, "devices/"+uids[0]+"/status", true, "online") // acknowledged after all the others

	release := holdWriter(t, env.st)
	link := linkTo(t, env, b, 0)
	eventually(t, 2*time.Minute, "a full batch", func() bool { _, p := pendingOf(link, ""); return p == maxPendingDevices })
	time.Sleep(time.Second) // a link that dropped would drop the rest now
	release()
	eventually(t, 5*time.Minute, "every status applied", func() bool {
		return scalar(t, env.st, `SELECT count(*) FROM devices WHERE status = 'online'`) == strconv.Itoa(n)
	})
	if d := dropTotal(link); d != 0 {
		t.Errorf("dropped %d messages, want 0", d)
	}
}

// TestBatchCoalesces: what a device says while a batch is being written
// waits in the next one, merged: its last status, with the telemetry
// before it, in one write of that device.
func TestBatchCoalesces(t *testing.T) {
	env, link, b := brokerEnv(t)
	uid := env.alice.device
	dev := testClient(t, b, "device", "")
	release := holdWriter(t, env.st)
	publishWait(t, dev, "devices/"+uid+"/status", false, "online")
	eventually(t, 5*time.Second, "the flusher to take the first status", func() bool { _, p := pendingOf(link, uid); return p == 0 })
	publishWait(t, dev, "devices/"+uid+"/status", false, "offline")
	publishWait(t, dev, "devices/"+uid+"/telemetry", false, `{"rssi":-70}`)
	publishWait(t, dev, "devices/"+uid+"/status", false, "reconnecting")
	eventually(t, 5*time.Second, "the rest pending", func() bool { r, _ := pendingOf(link, uid); return r.status != nil && *r.status == "reconnecting" })
	release()
	eventually(t, 5*time.Second, "both batches applied", func() bool { return env.device(env.alice).Status == "reconnecting" })
	if d := env.device(env.alice); d.LastRSSI == nil || *d.LastRSSI != -70 {
		t.Errorf("last_rssi: got %v, want -70", d.LastRSSI)
	}
	link.mu.Lock()
	defer link.mu.Unlock()
	if link.applied != 2 {
		t.Errorf("device writes: got %d, want 2 (online, then the other three merged)", link.applied)
	}
}

// TestBrokerDropsLogged: when the broker drops messages for want of
// queue room (here those of a subscriber that does not read), the link
// says so, naming the README section to read.
func TestBrokerDropsLogged(t *testing.T) {
	b := startBrokerWith(t, "sys_interval 1\n") // the default queue of 1,000
	env, _ := newLinkedEnv(t, b)
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", b.port))
	must(t, err)
	defer conn.Close()
	c := packets.NewControlPacket(packets.Connect).(*packets.ConnectPacket)
	c.ProtocolName, c.ProtocolVersion, c.CleanSession, c.ClientIdentifier = "MQTT", 4, true, "sleeper"
	must(t, c.Write(conn))
	s := packets.NewControlPacket(packets.Subscribe).(*packets.SubscribePacket)
	s.MessageID, s.Topics, s.Qoss = 1, []string{"flood/#"}, []byte{0}
	must(t, s.Write(conn)) // and never read again
	pub := testClient(t, b, "flooder", "")
	for range 3000 {
		pub.Publish("flood/x", 0, false, strings.Repeat("x", 10<<10))
	}
	publishWait(t, pub, "flood/x", false, "last")
	eventually(t, 15*time.Second, "a warning", func() bool {
		return strings.Contains(env.logs.String(), `the broker is dropping messages for want of queue room: device statuses may be lost; configure it as the README's section \"Large fleets\" says`)
	})
}
