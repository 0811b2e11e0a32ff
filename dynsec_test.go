package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// newTestLogins connects brokerLogins to b as user, with the topic
// prefix "devices", and waits until it can send requests.
func newTestLogins(tb testing.TB, b *testBroker, user, password string) *brokerLogins {
	tb.Helper()
	l := newBrokerLogins(mqttConfig{url: b.url(), user: user, password: password, prefix: "devices"},
		"tcp://hub.example:1883", slog.New(slog.NewTextHandler(io.Discard, nil)))
	tb.Cleanup(l.close)
	return l
}

// waitReady waits until l has subscribed to the response topic.
func waitReady(tb testing.TB, l *brokerLogins) {
	tb.Helper()
	eventually(tb, 5*time.Second, "the dynsec connection", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		select {
		case <-l.ready:
			return true
		default:
			return false
		}
	})
}

// dial connects to b as user with client id id, without retrying: a
// refused login is its error.
func dial(tb testing.TB, b *testBroker, id, user, password string) (mqtt.Client, error) {
	tb.Helper()
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.url()).SetClientID(id).
		SetUsername(user).SetPassword(password).SetProtocolVersion(4).
		SetCleanSession(true).SetAutoReconnect(false).SetKeepAlive(2 * time.Second))
	t := c.Connect()
	if !t.WaitTimeout(5 * time.Second) {
		return nil, errors.New("connect: no answer")
	}
	if t.Error() != nil {
		return nil, t.Error()
	}
	tb.Cleanup(func() { c.Disconnect(50) })
	return c, nil
}

// dialDevice connects as the device with its credentials, or fails.
func dialDevice(tb testing.TB, b *testBroker, cr credentials) mqtt.Client {
	tb.Helper()
	c, err := dial(tb, b, cr.ClientID, cr.Username, cr.Password)
	if err != nil {
		tb.Fatalf("device %s connects with its credentials: %v", cr.Username, err)
	}
	return c
}

// issue creates uid's broker login, or fails.
func issue(tb testing.TB, l *brokerLogins, uid string) credentials {
	tb.Helper()
	pw, err := l.create(context.Background(), uid)
	if err != nil {
		tb.Fatalf("create %s: %v", uid, err)
	}
	return l.credentials(uid, pw)
}

// denied publishes on denied from c, then on allowed, and fails when
// sub, which sees both topics, receives the first: messages from one
// client arrive in order, so the second's arrival proves the first's
// absence.
func denied(tb testing.TB, c mqtt.Client, sub <-chan mqtt.Message, denied, allowed string) {
	tb.Helper()
	publishWait(tb, c, denied, false, "forbidden")
	publishWait(tb, c, allowed, false, "marker")
	for {
		select {
		case m := <-sub:
			if m.Topic() == denied {
				tb.Fatalf("a message on %s reached the subscriber", denied)
			}
			if m.Topic() == allowed {
				return
			}
		case <-time.After(5 * time.Second):
			tb.Fatalf("the marker on %s never arrived", allowed)
		}
	}
}

// TestBrokerLoginsDevice: a device logs in with its credentials, its
// status reaches devicehub and devicehub's commands reach it; it can
// neither publish on nor subscribe to another device's topics.
func TestBrokerLoginsDevice(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	cr := issue(t, l, "esp32_aaa")
	issue(t, l, "esp32_bbb")
	want := credentials{MQTTURL: "tcp://hub.example:1883", Username: "esp32_aaa", Password: cr.Password,
		ClientID: "esp32_aaa", TopicPrefix: "devices/esp32_aaa"}
	if cr != want || len(cr.Password) < 22 {
		t.Fatalf("credentials: got %+v, want %+v with a password of 128 bits or more", cr, want)
	}

	service, err := dial(t, b.testBroker, "devicehub-test", b.user, b.password)
	must(t, err)
	seen := subscribe(t, service, "devices/#")
	device := dialDevice(t, b.testBroker, cr)
	publishWait(t, device, "devices/esp32_aaa/status", false, "online")
	select {
	case m := <-seen:
		if m.Topic() != "devices/esp32_aaa/status" || string(m.Payload()) != "online" {
			t.Fatalf("got %s %q, want the device's status", m.Topic(), m.Payload())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the device's status never reached devicehub")
	}
	cmds := subscribe(t, device, "devices/esp32_aaa/cmd/#")
	publishWait(t, service, "devices/esp32_aaa/cmd/1", false, "{}")
	select {
	case <-cmds:
	case <-time.After(5 * time.Second):
		t.Fatal("devicehub's command never reached the device")
	}

	for _, topic := range []string{"devices/esp32_bbb/status", "devices/esp32_bbb/cmd/1", "devices/status", "other"} {
		denied(t, device, seen, topic, "devices/esp32_aaa/status")
	}
	for _, topic := range []string{"devices/esp32_bbb/#", "devices/+/status", "devices/#", "#"} {
		tok := device.Subscribe(topic, 0, nil)
		if !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
			t.Fatalf("subscribe %s: %v", topic, tok.Error())
		}
		if got := tok.(*mqtt.SubscribeToken).Result()[topic]; got != 0x80 {
			t.Errorf("subscribe %s: got granted QoS %#x, want 0x80 (refused)", topic, got)
		}
	}
}

// TestBrokerLoginsClientID: the broker refuses a device's login under
// any client id but its uid.
func TestBrokerLoginsClientID(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	cr := issue(t, l, "esp32_aaa")
	if _, err := dial(t, b.testBroker, "someone-else", cr.Username, cr.Password); err == nil {
		t.Fatal("a device logged in under another client id")
	}
	dialDevice(t, b.testBroker, cr)
}

// TestBrokerLoginsRotate: after rotate the old password is refused and
// the new one works; a device without a login gets one, also when its
// client was deleted by hand and its role left.
func TestBrokerLoginsRotate(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	old := issue(t, l, "esp32_aaa")
	pw, err := l.rotate(context.Background(), "esp32_aaa")
	must(t, err)
	if pw == old.Password {
		t.Fatal("rotate kept the password")
	}
	if _, err := dial(t, b.testBroker, old.ClientID, old.Username, old.Password); err == nil {
		t.Fatal("the old password still logs in")
	}
	dialDevice(t, b.testBroker, l.credentials("esp32_aaa", pw))

	pw, err = l.rotate(context.Background(), "esp32_new")
	must(t, err)
	dialDevice(t, b.testBroker, l.credentials("esp32_new", pw))

	b.ctrl("deleteClient", "esp32_aaa") // by hand: its role is left
	pw, err = l.rotate(context.Background(), "esp32_aaa")
	must(t, err)
	dialDevice(t, b.testBroker, l.credentials("esp32_aaa", pw))
}

// TestBrokerLoginsRemove: removing a login disconnects the device and
// refuses its next connect; its role goes too, so the uid can be created
// again, and removing it twice is no error.
func TestBrokerLoginsRemove(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	cr := issue(t, l, "esp32_aaa")
	device := dialDevice(t, b.testBroker, cr)
	must(t, l.remove(context.Background(), "esp32_aaa"))
	eventually(t, 5*time.Second, "the device to be disconnected", func() bool { return !device.IsConnectionOpen() })
	if _, err := dial(t, b.testBroker, cr.ClientID, cr.Username, cr.Password); err == nil {
		t.Fatal("a removed device logged in")
	}
	must(t, l.remove(context.Background(), "esp32_aaa"))
	dialDevice(t, b.testBroker, issue(t, l, "esp32_aaa"))
}

// TestBrokerLoginsCreateFails: a create that fails leaves nothing it
// made and spoils nothing that was there: a second create of a uid keeps
// the first's role, and of a role and a client one made, the other is
// deleted again.
func TestBrokerLoginsCreateFails(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	cr := issue(t, l, "esp32_aaa")
	if _, err := l.create(context.Background(), "esp32_aaa"); err == nil {
		t.Fatal("a second create of one uid succeeded")
	}
	service, err := dial(t, b.testBroker, "devicehub-test", b.user, b.password)
	must(t, err)
	seen := subscribe(t, service, "devices/#")
	publishWait(t, dialDevice(t, b.testBroker, cr), "devices/esp32_aaa/status", false, "online")
	select {
	case <-seen:
	case <-time.After(5 * time.Second):
		t.Fatal("the first device lost its rights to a failed second create")
	}

	// A client without a role, as another tool might leave it: the role
	// is made, the client is not.
	b.ctrl("createClient", "esp32_bbb", "-p", "x")
	if _, err := l.create(context.Background(), "esp32_bbb"); err == nil {
		t.Fatal("create over an existing client succeeded")
	}
	b.ctrl("deleteClient", "esp32_bbb")
	issue(t, l, "esp32_bbb") // fails with "Role already exists" if the role stayed

	// A role left over: the client is made, with that role, and deleted.
	b.ctrl("createRole", l.role("esp32_ccc"))
	if _, err := l.create(context.Background(), "esp32_ccc"); err == nil {
		t.Fatal("create over an existing role succeeded")
	}
	b.ctrl("deleteRole", l.role("esp32_ccc"))
	issue(t, l, "esp32_ccc") // fails with "Client already exists" if the client stayed
}

// TestBrokerLoginsUnavailable: a broker that does not answer the control
// topic (no plugin), or cannot be reached, is errBrokerUnavailable
// within the timeout.
func TestBrokerLoginsUnavailable(t *testing.T) {
	plain := startDefaultBroker(t)
	down := &testBroker{port: freePort(t)}
	for name, b := range map[string]*testBroker{"no plugin": plain, "unreachable": down} {
		t.Run(name, func(t *testing.T) {
			l := newTestLogins(t, b, "", "")
			if b == plain {
				waitReady(t, l)
			}
			l.timeout = 300 * time.Millisecond
			errc := make(chan error, 1)
			go func() { _, err := l.create(context.Background(), "esp32_aaa"); errc <- err }()
			select {
			case err := <-errc:
				if !errors.Is(err, errBrokerUnavailable) {
					t.Fatalf("got %v, want errBrokerUnavailable", err)
				}
			case <-time.After(2 * time.Second):
				t.Fatal("no answer after 2 s, with a timeout of 300 ms")
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if err := l.remove(ctx, "esp32_aaa"); !errors.Is(err, context.Canceled) {
				t.Fatalf("with a cancelled context: got %v, want context.Canceled", err)
			}
		})
	}
}

// TestBrokerLoginsLateAnswer: a create the broker answers too late is
// undone, so the uid can be created again.
func TestBrokerLoginsLateAnswer(t *testing.T) {
	b := startDynsecBroker(t)
	l := newTestLogins(t, b.testBroker, b.user, b.password)
	waitReady(t, l)
	l.timeout = 300 * time.Millisecond
	b.signal(syscall.SIGSTOP)
	_, err := l.create(context.Background(), "esp32_aaa")
	b.signal(syscall.SIGCONT)
	if !errors.Is(err, errBrokerUnavailable) {
		t.Fatalf("got %v, want errBrokerUnavailable", err)
	}
	l.timeout = dynsecTimeout
	issue(t, l, "esp32_aaa") // fails with "Role already exists" if the late create stayed
}

// TestBrokerLoginsCloseWaits: close returns only when the connection's
// goroutines have ended, and a subscribe its own disconnect cut short is
// not logged: the CLI reads its stderr, a plain buffer, as soon as a
// command returns. The broker answers the connect and never the
// subscribe, so that the subscribe is waiting when close comes. Under
// the race detector a log line written after close is a race.
func TestBrokerLoginsCloseWaits(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	defer ln.Close()
	subscribing := make(chan struct{}, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r := bufio.NewReader(c)
		for {
			kind, err := readMQTTPacket(r)
			if err != nil {
				return
			}
			switch kind {
			case 1: // CONNECT: accepted
				c.Write([]byte{0x20, 2, 0, 0})
			case 8: // SUBSCRIBE: never answered
				subscribing <- struct{}{}
			}
		}
	}()
	var log bytes.Buffer // not safe for concurrent use, as the CLI's stderr in cliRun
	l := newBrokerLogins(mqttConfig{url: "tcp://" + ln.Addr().String(), prefix: "devices"},
		"tcp://hub.example:1883", slog.New(slog.NewTextHandler(&log, nil)))
	receive(t, subscribing, 5*time.Second, "the subscribe to the response topic")
	l.close()
	if log.Len() > 0 {
		t.Errorf("logged at close:\n%s", log.String())
	}
}

// readMQTTPacket reads one MQTT control packet and returns its type (the
// high four bits of its first byte).
func readMQTTPacket(r *bufio.Reader) (kind byte, err error) {
	first, err := r.ReadByte()
	if err != nil {
		return 0, err
	}
	n, err := binary.ReadUvarint(r) // MQTT's remaining length is a base-128 varint
	if err == nil {
		_, err = r.Discard(int(n))
	}
	return first >> 4, err
}

// TestPublicBrokerURL: devices get -public-mqtt-url, or the public
// URL's host with -mqtt's scheme and port.
func TestPublicBrokerURL(t *testing.T) {
	tests := []struct{ name, public, mqtt, publicURL, want string }{
		{"given", "mqtts://broker.example:8883", "tcp://127.0.0.1:1883", "https://hub.example", "mqtts://broker.example:8883"},
		{"derived", "", "tcp://127.0.0.1:1883", "https://hub.example:8443/x", "tcp://hub.example:1883"},
		{"tls", "", "ssl://localhost:8883", "http://10.0.0.5:8080", "ssl://10.0.0.5:8883"},
		{"no port", "", "tcp://localhost", "http://[fd00::1]:8080", "tcp://[fd00::1]"},
		{"no host", "", "tcp://localhost:1883", "/", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := config{publicMQTTURL: tt.public, mqttURL: tt.mqtt}
			got, err := cfg.publicBrokerURL(tt.publicURL)
			if got != tt.want || (err != nil) != (tt.want == "") {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// TestCLIBrokerLogins: with -mqtt-dynsec, device add makes the device's
// login, device credentials prints a password it logs in with, and device
// remove deletes it; a device remove of a uid that is no device touches no
// broker client, even one of that name.
func TestCLIBrokerLogins(t *testing.T) {
	b := startDynsecBroker(t)
	env := map[string]string{"DEVICEHUB_DATA": t.TempDir(), "DEVICEHUB_MQTT_URL": b.url(), "DEVICEHUB_MQTT_USER": b.user,
		"DEVICEHUB_MQTT_PASSWORD": b.password, "DEVICEHUB_MQTT_DYNSEC": "true", "DEVICEHUB_PUBLIC_MQTT_URL": "tcp://hub.example:1883"}
	cliOKIn(t, env, "a password\n", "user", "add", "-email", "ann@example.com", "-name", "Ann")
	uid := strings.TrimSpace(cliOKIn(t, env, "", "device", "add", "-owner", "ann@example.com", "-platform", "esp32", "-board", "devkit"))
	var cr credentials
	must(t, json.Unmarshal([]byte(cliOKIn(t, env, "", "device", "credentials", uid)), &cr))
	if cr.Username != uid || cr.MQTTURL != "tcp://hub.example:1883" {
		t.Errorf("credentials: got %+v, want the login of %s at the public URL", cr, uid)
	}
	dialDevice(t, b.testBroker, cr)

	b.ctrl("createClient", "victim", "-p", "victim password")
	if _, _, err := cliRun(t, env, "", "device", "remove", "victim"); err == nil || !strings.Contains(err.Error(), `no device with uid "victim"`) {
		t.Errorf("device remove victim: got %v, want no such device", err)
	}
	if _, err := dial(t, b.testBroker, "victim", "victim", "victim password"); err != nil {
		t.Errorf("the broker client victim, after a device remove of that name: %v, want it untouched", err)
	}
	cliOKIn(t, env, "", "device", "remove", uid)
	if _, err := dial(t, b.testBroker, uid, cr.Username, cr.Password); err == nil {
		t.Error("a removed device still logs in")
	}
}
