package mqttlink

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/brokertest"
)

// newTestLogins connects Logins to b as user, with the topic prefix
// "devices"; it is closed at cleanup.
func newTestLogins(tb testing.TB, b *brokertest.Broker, user, password string) *Logins {
	tb.Helper()
	l := NewLogins(Broker{URL: b.URL(), User: user, Password: password, Prefix: "devices"},
		"tcp://hub.example:1883", slog.New(slog.DiscardHandler))
	tb.Cleanup(l.Close)
	return l
}

// waitReady waits until l has subscribed to the response topic.
func waitReady(tb testing.TB, l *Logins) {
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

// dialDevice connects as the device with its credentials, or fails.
func dialDevice(tb testing.TB, b *brokertest.Broker, cr Credentials) mqtt.Client {
	tb.Helper()
	return brokertest.MustDial(tb, b, cr.ClientID, cr.Username, cr.Password)
}

// issue creates uid's broker login, or fails.
func issue(tb testing.TB, l *Logins, uid string) Credentials {
	tb.Helper()
	pw, err := l.Create(context.Background(), uid)
	if err != nil {
		tb.Fatalf("create %s: %v", uid, err)
	}
	return l.Credentials(uid, pw)
}

// TestBrokerLoginsDevice: a device logs in with its credentials and its
// Last Will, its status, telemetry and results reach devicehub and
// devicehub's commands reach it; it can neither publish on nor subscribe
// to another device's topics, nor to its own beyond the protocol's (issue
// 28: before, anything under devices/{uid}/#).
func TestBrokerLoginsDevice(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	cr := issue(t, l, "esp32_aaa")
	issue(t, l, "esp32_bbb")
	want := Credentials{MQTTURL: "tcp://hub.example:1883", Username: "esp32_aaa", Password: cr.Password,
		ClientID: "esp32_aaa", TopicPrefix: "devices/esp32_aaa"}
	if cr != want || len(cr.Password) < 22 {
		t.Fatalf("credentials: got %+v, want %+v with a password of 128 bits or more", cr, want)
	}

	service, err := brokertest.Dial(t, b.Broker, "devicehub-test", b.User, b.Password)
	must(t, err)
	seen := brokertest.Subscribe(t, service, "devices/#")
	device := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.URL()).SetClientID(cr.ClientID).
		SetUsername(cr.Username).SetPassword(cr.Password).SetProtocolVersion(4).
		SetWill("devices/esp32_aaa/status", "offline", 1, true))
	if tok := device.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("the device connects with its Last Will: %v", tok.Error())
	}
	t.Cleanup(func() { device.Disconnect(50) })
	publishWait(t, device, "devices/esp32_aaa/status", false, "online")
	select {
	case m := <-seen:
		if m.Topic() != "devices/esp32_aaa/status" || string(m.Payload()) != "online" {
			t.Fatalf("got %s %q, want the device's status", m.Topic(), m.Payload())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the device's status never reached devicehub")
	}
	for _, topic := range []string{"devices/esp32_aaa/telemetry", "devices/esp32_aaa/result/1"} {
		brokertest.Denied(t, device, seen, "devices/esp32_aaa/other", topic)
	}
	cmds := brokertest.Subscribe(t, device, "devices/esp32_aaa/cmd/+")
	publishWait(t, service, "devices/esp32_aaa/cmd/1", false, "{}")
	select {
	case <-cmds:
	case <-time.After(5 * time.Second):
		t.Fatal("devicehub's command never reached the device")
	}

	for _, topic := range []string{"devices/esp32_bbb/status", "devices/esp32_bbb/cmd/1", "devices/status", "other",
		"devices/esp32_aaa/other", "devices/esp32_aaa/cmd/1", "devices/esp32_aaa/status/x", "devices/esp32_aaa/result"} {
		brokertest.Denied(t, device, seen, topic, "devices/esp32_aaa/status")
	}
	for _, topic := range []string{"devices/esp32_bbb/#", "devices/+/status", "devices/#", "#",
		"devices/esp32_aaa/#", "devices/esp32_aaa/cmd/#", "devices/esp32_aaa/status", "devices/esp32_aaa/other"} {
		tok := device.Subscribe(topic, 0, nil)
		if !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
			t.Fatalf("subscribe %s: %v", topic, tok.Error())
		}
		if got := tok.(*mqtt.SubscribeToken).Result()[topic]; got != 0x80 {
			t.Errorf("subscribe %s: got granted QoS %#x, want 0x80 (refused)", topic, got)
		}
	}
}

// TestBrokerLoginsNarrow: a device's role as earlier versions made it,
// everything under its prefix, is narrowed to the protocol's topics;
// narrowing again only reads it, and a device without a role is no error.
func TestBrokerLoginsNarrow(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	role := l.role("esp32_old")
	b.Ctrl("createRole", role)
	b.Ctrl("addRoleACL", role, "publishClientSend", "devices/esp32_old/#", "allow")
	b.Ctrl("addRoleACL", role, "subscribePattern", "devices/esp32_old/#", "allow")
	b.Ctrl("createClient", "esp32_old", "-p", "old-password", "-c", "esp32_old")
	b.Ctrl("addClientRole", "esp32_old", role)
	cr := l.Credentials("esp32_old", "old-password")
	service, err := brokertest.Dial(t, b.Broker, "devicehub-test", b.User, b.Password)
	must(t, err)
	seen := brokertest.Subscribe(t, service, "devices/#")
	publishWait(t, dialDevice(t, b.Broker, cr), "devices/esp32_old/other", false, "wide")
	select {
	case m := <-seen:
		if m.Topic() != "devices/esp32_old/other" {
			t.Fatalf("got a message on %s, want the old role's", m.Topic())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the old role did not allow devices/esp32_old/other: the test's role is not the old one")
	}

	for i, want := range []bool{true, false} { // changed, then only read
		if has, changed, err := l.Narrow(context.Background(), "esp32_old"); !has || changed != want || err != nil {
			t.Fatalf("narrow %d: has %v, changed %v, %v; want true, %v, nil", i+1, has, changed, err, want)
		}
	}
	device := dialDevice(t, b.Broker, cr)
	brokertest.Denied(t, device, seen, "devices/esp32_old/other", "devices/esp32_old/status")
	for _, topic := range []string{"devices/esp32_old/#", "devices/esp32_old/cmd/1/x"} {
		tok := device.Subscribe(topic, 0, nil)
		if !tok.WaitTimeout(5*time.Second) || tok.Error() != nil || tok.(*mqtt.SubscribeToken).Result()[topic] != 0x80 {
			t.Errorf("subscribe %s after narrowing: %v, want refused", topic, tok.Error())
		}
	}
	if has, changed, err := l.Narrow(context.Background(), "esp32_none"); has || changed || err != nil {
		t.Fatalf("narrow a device without a role: %v, %v, %v; want false, false, nil", has, changed, err)
	}
}

// TestBrokerLoginsClientID: the broker refuses a device's login under
// any client id but its uid.
func TestBrokerLoginsClientID(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	cr := issue(t, l, "esp32_aaa")
	if _, err := brokertest.Dial(t, b.Broker, "someone-else", cr.Username, cr.Password); err == nil {
		t.Fatal("a device logged in under another client id")
	}
	dialDevice(t, b.Broker, cr)
}

// TestBrokerLoginsRotate: after rotate the old password is refused and
// the new one works; a device without a login gets one, also when its
// client was deleted by hand and its role left.
func TestBrokerLoginsRotate(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	old := issue(t, l, "esp32_aaa")
	pw, err := l.Rotate(context.Background(), "esp32_aaa")
	must(t, err)
	if pw == old.Password {
		t.Fatal("rotate kept the password")
	}
	if _, err := brokertest.Dial(t, b.Broker, old.ClientID, old.Username, old.Password); err == nil {
		t.Fatal("the old password still logs in")
	}
	dialDevice(t, b.Broker, l.Credentials("esp32_aaa", pw))

	pw, err = l.Rotate(context.Background(), "esp32_new")
	must(t, err)
	dialDevice(t, b.Broker, l.Credentials("esp32_new", pw))

	b.Ctrl("deleteClient", "esp32_aaa") // by hand: its role is left
	pw, err = l.Rotate(context.Background(), "esp32_aaa")
	must(t, err)
	dialDevice(t, b.Broker, l.Credentials("esp32_aaa", pw))
}

// TestBrokerLoginsRemove: removing a login disconnects the device and
// refuses its next connect; its role goes too, so the uid can be created
// again, and removing it twice is no error.
func TestBrokerLoginsRemove(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	cr := issue(t, l, "esp32_aaa")
	device := dialDevice(t, b.Broker, cr)
	must(t, l.Remove(context.Background(), "esp32_aaa"))
	eventually(t, 5*time.Second, "the device to be disconnected", func() bool { return !device.IsConnectionOpen() })
	if _, err := brokertest.Dial(t, b.Broker, cr.ClientID, cr.Username, cr.Password); err == nil {
		t.Fatal("a removed device logged in")
	}
	must(t, l.Remove(context.Background(), "esp32_aaa"))
	dialDevice(t, b.Broker, issue(t, l, "esp32_aaa"))
}

// TestBrokerLoginsCreateFails: a create that fails leaves nothing it
// made and spoils nothing that was there: a second create of a uid keeps
// the first's role, and of a role and a client one made, the other is
// deleted again.
func TestBrokerLoginsCreateFails(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	cr := issue(t, l, "esp32_aaa")
	if _, err := l.Create(context.Background(), "esp32_aaa"); err == nil {
		t.Fatal("a second create of one uid succeeded")
	}
	service, err := brokertest.Dial(t, b.Broker, "devicehub-test", b.User, b.Password)
	must(t, err)
	seen := brokertest.Subscribe(t, service, "devices/#")
	publishWait(t, dialDevice(t, b.Broker, cr), "devices/esp32_aaa/status", false, "online")
	select {
	case <-seen:
	case <-time.After(5 * time.Second):
		t.Fatal("the first device lost its rights to a failed second create")
	}

	// A client without a role, as another tool might leave it: the role
	// is made, the client is not.
	b.Ctrl("createClient", "esp32_bbb", "-p", "x")
	if _, err := l.Create(context.Background(), "esp32_bbb"); err == nil {
		t.Fatal("create over an existing client succeeded")
	}
	b.Ctrl("deleteClient", "esp32_bbb")
	issue(t, l, "esp32_bbb") // fails with "Role already exists" if the role stayed

	// A role left over: the client is made, with that role, and deleted.
	b.Ctrl("createRole", l.role("esp32_ccc"))
	if _, err := l.Create(context.Background(), "esp32_ccc"); err == nil {
		t.Fatal("create over an existing role succeeded")
	}
	b.Ctrl("deleteRole", l.role("esp32_ccc"))
	issue(t, l, "esp32_ccc") // fails with "Client already exists" if the client stayed
}

// TestBrokerLoginsUnavailable: a broker that does not answer the control
// topic (no plugin), or cannot be reached, is ErrBrokerUnavailable
// within the timeout.
func TestBrokerLoginsUnavailable(t *testing.T) {
	t.Parallel()
	plain := brokertest.StartDefault(t)
	down := &brokertest.Broker{Port: brokertest.FreePort(t)}
	for name, b := range map[string]*brokertest.Broker{"no plugin": plain, "unreachable": down} {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // each has its own connection
			l := newTestLogins(t, b, "", "")
			if b == plain {
				waitReady(t, l)
			}
			l.timeout = 300 * time.Millisecond
			errc := make(chan error, 1)
			go func() { _, err := l.Create(context.Background(), "esp32_aaa"); errc <- err }()
			select {
			case err := <-errc:
				if !errors.Is(err, ErrBrokerUnavailable) {
					t.Fatalf("got %v, want ErrBrokerUnavailable", err)
				}
			case <-time.After(2 * time.Second):
				t.Fatal("no answer after 2 s, with a timeout of 300 ms")
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if err := l.Remove(ctx, "esp32_aaa"); !errors.Is(err, context.Canceled) {
				t.Fatalf("with a cancelled context: got %v, want context.Canceled", err)
			}
		})
	}
}

// TestBrokerLoginsLateAnswer: a create the broker answers too late is
// undone, so the uid can be created again.
func TestBrokerLoginsLateAnswer(t *testing.T) {
	t.Parallel()
	b := brokertest.StartDynsec(t)
	l := newTestLogins(t, b.Broker, b.User, b.Password)
	waitReady(t, l)
	l.timeout = 300 * time.Millisecond
	b.Signal(syscall.SIGSTOP)
	_, err := l.Create(context.Background(), "esp32_aaa")
	b.Signal(syscall.SIGCONT)
	if !errors.Is(err, ErrBrokerUnavailable) {
		t.Fatalf("got %v, want ErrBrokerUnavailable", err)
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
	l := NewLogins(Broker{URL: "tcp://" + ln.Addr().String(), Prefix: "devices"},
		"tcp://hub.example:1883", slog.New(slog.NewTextHandler(&log, nil)))
	select {
	case <-subscribing:
	case <-time.After(5 * time.Second):
		t.Fatal("no subscribe to the response topic within 5s")
	}
	l.Close()
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
