package mqttlink

import (
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"

	"devicehub/internal/brokertest"
)

// TestRetainedFloodNotDropped: a restart meets more retained statuses
// than a batch holds while the store is slow. The link stops reading
// the broker instead of dropping, and applies every status.
func TestRetainedFloodNotDropped(t *testing.T) {
	t.Parallel()
	const n = maxPendingDevices + 10_000
	b := brokertest.Start(t)
	uids := make([]string, n)
	for i := range uids {
		uids[i] = fmt.Sprintf("esp32_f%d", i)
	}
	fleet := brokertest.Client(t, b, "fleet", "")
	for _, uid := range uids[1:] {
		fleet.Publish("devices/"+uid+"/status", 0, true, "online")
	}
	publishWait(t, fleet, "devices/"+uids[0]+"/status", true, "online") // acknowledged after all the others

	sink := newMemSink()
	release := sink.hold()
	defer release()
	link := linkTo(t, b, sink)
	eventually(t, 2*time.Minute, "a full batch", func() bool { _, p := pendingOf(link, ""); return p == maxPendingDevices })
	time.Sleep(time.Second) // a link that dropped would drop the rest now
	release()
	eventually(t, 5*time.Minute, "every status applied", func() bool { return sink.count("online") == n })
	if d := dropTotal(link); d != 0 {
		t.Errorf("dropped %d messages, want 0", d)
	}
}

// openClient is a client whose connection is open, as paho's is from the
// moment the broker accepts it until the link's onConnect has run.
type openClient struct{ mqtt.Client }

func (openClient) IsConnectionOpen() bool { return true }

// TestNotConnectedBeforeSubscribed: the link is not usable while its first
// connection is open but not yet subscribed (a rollout sending then was
// refused "device link unavailable"), and is once the subscription of
// the connection that is open is in place.
func TestNotConnectedBeforeSubscribed(t *testing.T) {
	t.Parallel()
	l := newLink(Config{Now: time.Now, Log: slog.New(slog.DiscardHandler)})
	l.client = openClient{}
	if l.Connected() {
		t.Fatal("connected before its first subscription")
	}
	l.subscribedOn.Store(l.connection.Add(1)) // what onConnect's subscribe records
	if !l.Connected() {
		t.Fatal("not connected once subscribed")
	}
}

// TestBatchCoalesces: what a device says while a batch is being written
// waits in the next one, merged: its last status, with the telemetry
// before it, in one write of that device.
func TestBatchCoalesces(t *testing.T) {
	t.Parallel()
	b := brokertest.Start(t)
	sink := newMemSink()
	link := linkTo(t, b, sink)
	const uid = "esp32_a"
	dev := brokertest.Client(t, b, "device", "")
	release := sink.hold()
	defer release()
	publishWait(t, dev, "devices/"+uid+"/status", false, "online")
	eventually(t, 5*time.Second, "the flusher to take the first status", func() bool { return sink.entered.Load() == 1 })
	publishWait(t, dev, "devices/"+uid+"/status", false, "offline")
	publishWait(t, dev, "devices/"+uid+"/telemetry", false, `{"rssi":-70}`)
	publishWait(t, dev, "devices/"+uid+"/status", false, "reconnecting")
	eventually(t, 5*time.Second, "the rest pending", func() bool { r, _ := pendingOf(link, uid); return r.Status != nil && *r.Status == "reconnecting" })
	release()
	// Counted once the write has returned: two, online, then the other three merged.
	eventually(t, 5*time.Second, "both batches applied, in two device writes", func() bool {
		return sink.statusOf(uid) == "reconnecting" && link.Stats().Applied == 2
	})
	if rssi := sink.rssiOf(uid); rssi != -70 {
		t.Errorf("rssi: got %v, want -70", rssi)
	}
}

// TestBrokerDropsLogged: when the broker drops messages for want of
// queue room (here those of a subscriber that does not read), the link
// says so, naming the README section to read.
func TestBrokerDropsLogged(t *testing.T) {
	t.Parallel()
	b := brokertest.StartWith(t, "sys_interval 1\n") // the default queue of 1,000
	l, _, log := watchedLink(t, b.URL(), "", "")
	eventually(t, 5*time.Second, "the link to connect", l.Connected)
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", b.Port))
	must(t, err)
	defer conn.Close()
	c := packets.NewControlPacket(packets.Connect).(*packets.ConnectPacket)
	c.ProtocolName, c.ProtocolVersion, c.CleanSession, c.ClientIdentifier = "MQTT", 4, true, "sleeper"
	must(t, c.Write(conn))
	s := packets.NewControlPacket(packets.Subscribe).(*packets.SubscribePacket)
	s.MessageID, s.Topics, s.Qoss = 1, []string{"flood/#"}, []byte{0}
	must(t, s.Write(conn)) // and never read again
	pub := brokertest.Client(t, b, "flooder", "")
	for range 3000 {
		pub.Publish("flood/x", 0, false, strings.Repeat("x", 10<<10))
	}
	publishWait(t, pub, "flood/x", false, "last")
	eventually(t, 15*time.Second, "a warning", func() bool {
		return strings.Contains(log.String(), `the broker is dropping messages for want of queue room: device statuses may be lost; configure it as the README's section \"Large fleets\" says`)
	})
}

// failures is how many connection attempts of l failed since its last connect.
func failures(l *Link) int {
	l.watch.mu.Lock()
	defer l.watch.mu.Unlock()
	return l.watch.failures
}

// checkLoggedOncePerMinute: while the cause stays the same, the attempts
// go on and no second line comes until the test clock passes a minute;
// then one comes, counting every failed attempt.
func checkLoggedOncePerMinute(t *testing.T, l *Link, clock *testClock, log *brokertest.LogBuffer, line string) {
	t.Helper()
	n := failures(l)
	eventually(t, 15*time.Second, "two more failed attempts", func() bool { return failures(l) >= n+2 })
	if got := brokertest.LogLines(log, line); len(got) != 1 {
		t.Fatalf("after %d failed attempts within the minute: %d lines %q, want 1", failures(l), len(got), got)
	}
	clock.advance(brokerLogInterval)
	eventually(t, 10*time.Second, "the line again a minute later", func() bool { return len(brokertest.LogLines(log, line)) == 2 })
	second := brokertest.LogLines(log, line)[1]
	m := regexp.MustCompile(`failed_attempts=(\d+)`).FindStringSubmatch(second)
	if m == nil || m[1] == "1" {
		t.Errorf("the line a minute later %q: want failed_attempts counting every attempt", second)
	}
}

// TestLogBrokerUnreachable: a broker that is not listening is named in a
// warn line at the first attempt, repeated once a minute; a connect
// is logged, and a broker gone again is logged at once.
func TestLogBrokerUnreachable(t *testing.T) {
	t.Parallel()
	b := brokertest.Start(t)
	b.Stop() // its port is free: nothing listens there
	start := time.Now()
	l, clock, log := watchedLink(t, b.URL(), "", "")

	unreachable := `level=WARN msg="mqtt broker unreachable" broker=` + regexp.QuoteMeta(b.URL()) + ` err=.*connection refused.* failed_attempts=\d+`
	eventually(t, 10*time.Second, "a warn line naming the broker", func() bool { return len(brokertest.LogLines(log, unreachable)) == 1 })
	t.Logf("logged %v after start: %s", time.Since(start).Round(time.Millisecond), brokertest.LogLines(log, unreachable)[0])
	checkLoggedOncePerMinute(t, l, clock, log, unreachable)

	b.Start()
	eventually(t, 15*time.Second, "the connect line", func() bool {
		return len(brokertest.LogLines(log, `level=INFO msg="mqtt connected" broker=`+regexp.QuoteMeta(b.URL())+` failed_attempts=[1-9]`)) == 1
	})
	b.Stop()
	// The clock has not moved: the new outage is logged because the
	// connect ended the old one.
	eventually(t, 15*time.Second, "the lost line and a new unreachable line", func() bool {
		return len(brokertest.LogLines(log, `level=WARN msg="mqtt connection lost"`)) == 1 && len(brokertest.LogLines(log, unreachable)) == 3
	})
}

// TestLogBrokerRefuses: wrong credentials are logged with the broker's
// answer (CONNACK code) and a hint, once a minute, never the password;
// a broker that was down and then refuses is logged at once (a new
// cause); the right credentials connect.
func TestLogBrokerRefuses(t *testing.T) {
	t.Parallel()
	b := brokertest.StartAuth(t, "devicehub", "right-password")
	b.Stop()
	l, clock, log := watchedLink(t, b.URL(), "devicehub", "wrong-password")
	eventually(t, 10*time.Second, "the unreachable line", func() bool { return len(brokertest.LogLines(log, `msg="mqtt broker unreachable"`)) == 1 })

	b.Start()
	refused := `level=WARN msg="mqtt broker refused the connection" broker=` + regexp.QuoteMeta(b.URL()) +
		` code=(4|5) reason="(bad user name or password|not Authorized)" hint=".*DEVICEHUB_MQTT_PASSWORD.*" user=devicehub failed_attempts=\d+`
	eventually(t, 10*time.Second, "the refusal, at once after the broker came up", func() bool { return len(brokertest.LogLines(log, refused)) == 1 })
	t.Logf("refusal: %s", brokertest.LogLines(log, refused)[0])
	checkLoggedOncePerMinute(t, l, clock, log, refused)
	if l.Connected() {
		t.Error("connected with a wrong password")
	}
	if strings.Contains(log.String(), "password=") || strings.Contains(log.String(), "wrong-password") {
		t.Errorf("the log shows the password:\n%s", log)
	}

	good, _, goodLog := watchedLink(t, b.URL(), "devicehub", "right-password")
	eventually(t, 10*time.Second, "the right password to connect", good.Connected)
	if lines := brokertest.LogLines(goodLog, `level=WARN`); len(lines) != 0 {
		t.Errorf("the right password logged warnings: %q", lines)
	}
}

// TestLogDrops: dropped device messages are logged by reason once the
// fake clock passes a minute, and only when there were new ones.
func TestLogDrops(t *testing.T) {
	t.Parallel()
	b := brokertest.Start(t)
	l, clock, log := watchedLink(t, b.URL(), "", "")
	quiet, quietClock, quietLog := watchedLink(t, b.URL(), "", "")
	eventually(t, 10*time.Second, "the links to connect", func() bool { return l.Connected() && quiet.Connected() })
	dropped := `level=WARN msg="mqtt messages dropped since start"`

	dev := brokertest.Client(t, b, "dropper", "")
	publishWait(t, dev, "devices/nobody_1/status", false, "asleep")
	publishWait(t, dev, "devices/nobody_1/telemetry", false, "{not json")
	publishWait(t, dev, "devices/nobody_1/telemetry", false, `{"rssi":"strong"}`)
	eventually(t, 5*time.Second, "three drops counted", func() bool { return dropTotal(l) == 3 && dropTotal(quiet) == 3 })
	// Drain the quiet link's count into its log first, so that its next
	// minute has nothing new.
	quietClock.advance(dropLogInterval)
	eventually(t, 5*time.Second, "the quiet link's first drop line", func() bool { return len(brokertest.LogLines(quietLog, dropped)) == 1 })

	time.Sleep(5 * flushInterval)
	if lines := brokertest.LogLines(log, dropped); len(lines) != 0 {
		t.Fatalf("drops logged before a minute passed: %q", lines)
	}
	clock.advance(dropLogInterval)
	eventually(t, 5*time.Second, "the drop line", func() bool { return len(brokertest.LogLines(log, dropped)) == 1 })
	line := brokertest.LogLines(log, dropped)[0]
	for _, want := range []string{"bad_status=1", "bad_telemetry=2", "total=3"} {
		if !strings.Contains(line, want) {
			t.Errorf("drop line %q: want %s", line, want)
		}
	}

	// A minute with no new drops logs nothing, on either link.
	clock.advance(dropLogInterval)
	quietClock.advance(dropLogInterval)
	time.Sleep(5 * flushInterval)
	if n, q := len(brokertest.LogLines(log, dropped)), len(brokertest.LogLines(quietLog, dropped)); n != 1 || q != 1 {
		t.Errorf("after a minute without drops: %d and %d drop lines, want 1 and 1", n, q)
	}
}
