package main

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.mqtt.golang/packets"
)

// goOnline makes the user's device online the way a device does: a
// retained "online" on its status topic.
func goOnline(t *testing.T, b *testBroker, env *testEnv, u testUser) {
	t.Helper()
	dev := testClient(t, b, "dev-"+u.device, "devices/"+u.device+"/status")
	publishWait(t, dev, "devices/"+u.device+"/status", true, "online")
	eventually(t, 3*time.Second, u.device+" online", func() bool { return env.device(u).Status == "online" })
}

func TestCommandsReachDevice(t *testing.T) {
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	a := env.alice
	goOnline(t, b, env, a)
	obs := testClient(t, b, "observer", "")
	cmds := subscribe(t, obs, "devices/+/cmd/+")

	w := env.request("POST", "/v1/user/devices/"+a.device+"/command-buttons", a.token,
		`{"id":"led-on","label":"LED on","payload":{"cmd":"led","on":true,"n":[1,2]},"confirm":false}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create button: got %d, want 201: %s", w.Code, w.Body)
	}

	base := "/v1/user/devices/" + a.device
	tests := []struct {
		name        string
		path        string
		body        string
		wantMessage string
		wantPayload string
	}{
		{"reboot", base + "/reboot", "", "Reboot command sent.", `{"cmd":"reboot"}`},
		{"wifi reset", base + "/wifi-reset", "", "Wi-Fi reset command sent.", `{"cmd":"wifi_reset"}`},
		{"user command", base + "/commands", `{"payload": {"z": 1, "a": {"deep": [true, null, "x"]}}}`,
			"Command sent.", `{"z":1,"a":{"deep":[true,null,"x"]}}`},
		{"button", base + "/command-buttons/led-on/send", "", "Command sent.", `{"cmd":"led","on":true,"n":[1,2]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var body any
			if tt.body != "" {
				body = tt.body
			}
			w := env.request("POST", tt.path, a.token, body)
			v := decode(t, w)
			id, _ := v["command_id"].(string)
			want := fmt.Sprintf(`{"message":%q,"device_uid":%q,"command_id":%q}`, tt.wantMessage, a.device, id)
			if w.Code != http.StatusOK || id == "" || !jsonEqual(t, w.Body.Bytes(), []byte(want)) {
				t.Fatalf("got %d %s, want 200 %s", w.Code, w.Body, want)
			}
			select {
			case m := <-cmds:
				if m.Topic() != "devices/"+a.device+"/cmd/"+id {
					t.Errorf("topic = %q, want devices/%s/cmd/%s", m.Topic(), a.device, id)
				}
				if string(m.Payload()) != tt.wantPayload {
					t.Errorf("payload = %s, want %s", m.Payload(), tt.wantPayload)
				}
				if m.Qos() != 1 || m.Retained() {
					t.Errorf("qos %d retained %v, want qos 1 not retained", m.Qos(), m.Retained())
				}
			case <-time.After(3 * time.Second):
				t.Fatal("no command arrived on the broker")
			}
		})
	}
	// Bob's device and an unknown button publish nothing.
	for _, path := range []string{
		"/v1/user/devices/" + env.bob.device + "/reboot",
		base + "/command-buttons/nope/send",
	} {
		if w := env.request("POST", path, a.token, nil); w.Code != http.StatusNotFound {
			t.Errorf("POST %s: got %d, want 404", path, w.Code)
		}
	}
	select {
	case m := <-cmds:
		t.Errorf("unexpected command %s on %s", m.Payload(), m.Topic())
	case <-time.After(300 * time.Millisecond):
	}
}

// rawDevice connects over a bare socket with a retained Last Will of
// "offline", so that closing the socket is an unclean disconnect.
func rawDevice(t *testing.T, b *testBroker, uid string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", b.port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := packets.NewControlPacket(packets.Connect).(*packets.ConnectPacket)
	c.ProtocolName, c.ProtocolVersion = "MQTT", 4
	c.CleanSession, c.Keepalive, c.ClientIdentifier = true, 30, "raw-"+uid
	c.WillFlag, c.WillQos, c.WillRetain = true, 1, true
	c.WillTopic, c.WillMessage = "devices/"+uid+"/status", []byte("offline")
	if err := c.Write(conn); err != nil {
		t.Fatal(err)
	}
	ack, err := packets.ReadPacket(conn)
	if err != nil {
		t.Fatalf("read connack: %v", err)
	}
	if ca, ok := ack.(*packets.ConnackPacket); !ok || ca.ReturnCode != 0 {
		t.Fatalf("connect refused: %v", ack)
	}
	p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
	p.TopicName, p.Payload, p.Retain = "devices/"+uid+"/status", []byte("online"), true
	if err := p.Write(conn); err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestStatusGatesCommands(t *testing.T) {
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	a := env.alice
	dev := testClient(t, b, "device", "")
	statusTopic := "devices/" + a.device + "/status"
	reboot := "/v1/user/devices/" + a.device + "/reboot"

	if w := env.request("POST", reboot, a.token, nil); w.Code != 422 || w.Body.String() != `{"message":"Device is offline."}`+"\n" {
		t.Errorf("pending device: got %d %s, want 422 Device is offline.", w.Code, w.Body)
	}
	tests := []struct {
		status     string
		wantCode   int
		wantOnline bool
		wantBody   string
	}{
		{"online", 200, true, ""},
		{"offline", 422, false, `{"message":"Device is offline."}`},
		{"online", 200, true, ""},
		{"reconnecting", 422, false, `{"message":"Device is reconnecting."}`},
	}
	for _, tt := range tests {
		publishWait(t, dev, statusTopic, true, tt.status)
		eventually(t, 3*time.Second, "status "+tt.status, func() bool { return env.device(a).Status == tt.status })
		d := decode(t, env.request("GET", "/v1/user/devices/"+a.device, a.token, nil))["data"].(map[string]any)
		if d["is_online"] != tt.wantOnline || d["first_seen_at"] == nil || d["last_seen_at"] == nil {
			t.Errorf("status %s: is_online %v first_seen %v last_seen %v", tt.status, d["is_online"], d["first_seen_at"], d["last_seen_at"])
		}
		w := env.request("POST", reboot, a.token, nil)
		if w.Code != tt.wantCode || (tt.wantBody != "" && strings.TrimSpace(w.Body.String()) != tt.wantBody) {
			t.Errorf("status %s: got %d %s, want %d %s", tt.status, w.Code, w.Body, tt.wantCode, tt.wantBody)
		}
	}

	// The Last Will: a device that drops off without saying goodbye.
	conn := rawDevice(t, b, a.device)
	eventually(t, 3*time.Second, "online via raw device", func() bool { return env.device(a).Status == "online" })
	conn.Close()
	eventually(t, 5*time.Second, "the Last Will to mark it offline", func() bool { return env.device(a).Status == "offline" })
	if w := env.request("POST", reboot, a.token, nil); w.Code != 422 {
		t.Errorf("after Last Will: got %d, want 422", w.Code)
	}
}

func TestTelemetryApplied(t *testing.T) {
	b := startBroker(t)
	env, link := newLinkedEnv(t, b)
	a := env.alice
	dev := testClient(t, b, "device", "")
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false,
		`{"local_ip":"192.168.1.20","public_ip":"203.0.113.7","rssi":-61.5,"fw_md5":"0123456789ABCDEF0123456789abcdef","fw_version":"1.2.3","extra":{"ignored":true}}`)
	eventually(t, 3*time.Second, "telemetry applied", func() bool { return env.device(a).LocalIP != nil })

	w := env.request("GET", "/v1/user/devices/"+a.device, a.token, nil)
	d := decode(t, w)["data"].(map[string]any)
	want := map[string]any{
		"local_ip": "192.168.1.20", "public_ip": "203.0.113.7", "last_rssi": -61.5,
		"status": "pending", // telemetry says nothing about presence
	}
	for k, v := range want {
		if d[k] != v {
			t.Errorf("%s = %v, want %v", k, d[k], v)
		}
	}
	cf, _ := d["current_firmware"].(map[string]any)
	if cf == nil || cf["md5"] != "0123456789abcdef0123456789abcdef" || cf["version"] != "1.2.3" || cf["id"] != nil {
		t.Errorf("current_firmware = %v, want md5 lowercased, version 1.2.3, id null", d["current_firmware"])
	}
	if d["first_seen_at"] == nil || d["last_seen_at"] == nil {
		t.Errorf("seen times not set: %v %v", d["first_seen_at"], d["last_seen_at"])
	}

	// Garbage on every device topic changes nothing.
	before := env.request("GET", "/v1/user/devices/"+a.device, a.token, nil).Body.String()
	droppedBefore := dropTotal(link)
	env.clock.advance(time.Hour) // any applied message would move last_seen_at
	garbage := []struct{ topic, payload string }{
		{"status", "ONLINE"},
		{"status", ""},
		{"telemetry", "not json"},
		{"telemetry", "[1,2]"},
		{"telemetry", `{"rssi":"strong"}`},
		{"telemetry", `{"fw_md5":"xyz"}`},
		{"telemetry", `{"local_ip":` + fmt.Sprintf("%q", strings.Repeat("1", 300)) + `}`},
		{"telemetry", `{"local_ip":"` + strings.Repeat("x", 17<<10) + `"}`},
		{"cmd/extra", "{}"},
		{"whatever", "{}"},
	}
	for _, g := range garbage {
		publishWait(t, dev, "devices/"+a.device+"/"+g.topic, false, g.payload)
	}
	publishWait(t, dev, "devices/esp32_doesnotexist/status", false, "online")
	// The unknown uid is dropped at the flush: wait for all of them.
	eventually(t, 3*time.Second, "every garbage message counted", func() bool {
		return dropTotal(link)-droppedBefore >= int64(len(garbage)-2+1)
	})
	time.Sleep(2 * flushInterval)
	if after := env.request("GET", "/v1/user/devices/"+a.device, a.token, nil).Body.String(); after != before {
		t.Errorf("garbage changed the device:\nbefore %s\nafter  %s", before, after)
	}
}

func TestBrokerRestart(t *testing.T) {
	b := startBroker(t)
	env, link := newLinkedEnv(t, b)
	a := env.alice
	// No Last Will here: Mosquitto sends wills when it shuts down, and this
	// test is about the retained "online" surviving the restart.
	dev := testClient(t, b, "device", "")
	publishWait(t, dev, "devices/"+a.device+"/status", true, "online")
	eventually(t, 3*time.Second, "online", func() bool { return env.device(a).Status == "online" })
	reboot := "/v1/user/devices/" + a.device + "/reboot"

	b.stop()
	eventually(t, 5*time.Second, "the link to notice", func() bool { return !link.connected() })
	w := env.request("GET", "/healthz", "", nil)
	if got := strings.TrimSpace(w.Body.String()); w.Code != 200 || got != `{"mqtt":"disconnected","status":"ok"}` {
		t.Errorf("healthz: got %d %s", w.Code, got)
	}
	start := time.Now()
	w = env.request("POST", reboot, a.token, nil)
	if w.Code != http.StatusServiceUnavailable {
		t.Errorf("command without broker: got %d %s, want 503", w.Code, w.Body)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("command without broker took %v, want under 2s", d)
	}
	if w := env.request("GET", "/v1/user/devices", a.token, nil); w.Code != 200 {
		t.Errorf("device list without broker: got %d, want 200", w.Code)
	}
	// Forget the status, so that only the retained message can bring it back.
	env.setStatus(a.device, "pending")

	b.start()
	eventually(t, 15*time.Second, "the link to reconnect", link.connected)
	eventually(t, 5*time.Second, "the retained status to come back", func() bool { return env.device(a).Status == "online" })
	if w := env.request("GET", "/healthz", "", nil); !strings.Contains(w.Body.String(), `"mqtt":"connected"`) {
		t.Errorf("healthz after restart: %s", w.Body)
	}
	obs := testClient(t, b, "observer", "")
	cmds := subscribe(t, obs, "devices/"+a.device+"/cmd/+")
	if w := env.request("POST", reboot, a.token, nil); w.Code != 200 {
		t.Fatalf("command after restart: got %d %s, want 200", w.Code, w.Body)
	}
	select {
	case m := <-cmds:
		if string(m.Payload()) != `{"cmd":"reboot"}` {
			t.Errorf("payload %s", m.Payload())
		}
	case <-time.After(3 * time.Second):
		t.Fatal("no command after restart")
	}
}

func TestLinkStartsWithoutBroker(t *testing.T) {
	env := newTestEnv(t, nil)
	port := freePort(t) // nothing listens here
	link := newMQTTLink(mqttConfig{url: fmt.Sprintf("tcp://127.0.0.1:%d", port), prefix: "devices"}, env.st, testLogger(t))
	defer link.close()
	env.srv.link = link
	env.setStatus(env.alice.device, "online")
	if w := env.request("POST", "/v1/user/devices/"+env.alice.device+"/reboot", env.alice.token, nil); w.Code != 503 {
		t.Errorf("got %d, want 503", w.Code)
	}
	time.Sleep(time.Second) // a few connection attempts
	if link.connected() {
		t.Error("connected to nothing")
	}
}
