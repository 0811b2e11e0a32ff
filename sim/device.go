package sim

import (
	"crypto/md5"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/wire"
)

const (
	// firstFirmwareVersion is what every device runs until its first OTA.
	firstFirmwareVersion = "sim-1.0"
	// firstImageSize is the sketch size reported before the first OTA.
	firstImageSize = 917504
)

// firmware is an image as the device knows it: what it last flashed.
type firmware struct {
	md5, sha256 string // lowercase hex
	version     string // "" when the ota command gave none
	size        int64
}

// device is one simulated ESP32. Its fields under mu are what survives a
// reboot (the firmware it flashed, an OTA to confirm) plus the MQTT client
// of the current boot, nil while it is rebooting or stopped.
type device struct {
	fleet   *Fleet
	uid     string
	staMAC  string
	apMAC   string
	localIP string
	// retryJitter, added to the reconnect interval, spreads the fleet's
	// reconnects after a broker restart.
	retryJitter time.Duration

	mu         sync.Mutex
	client     mqtt.Client
	stopped    bool
	fw         firmware
	pendingOTA string      // id of an ota command to confirm after the reboot
	carried    *carriedOTA // an ota command to start once back (carryOTA)
	otaBusy    bool
	otaID      string // the ota command under way, while otaBusy
	// bootedAt is when this boot began; resetReason why (ESP-IDF's
	// esp_reset_reason() in lower case), sent with the boot's first
	// telemetry only; bootCount how many boots there have been, kept
	// across reboots as a device keeps it in NVS.
	bootedAt    time.Time
	resetReason string
	bootCount   int
}

// newDevice derives the device's hardware (MACs, address) from its uid,
// so a device looks the same every time the fleet starts. It runs the
// image it ran before (Options.Running), or the first image, one build
// that every device of the fleet shares, as a factory's would.
func newDevice(f *Fleet, uid string) *device {
	h := md5.Sum([]byte(uid))
	// 24:0A:C4 is an Espressif OUI; the soft-AP MAC is the station's + 1.
	mac := func(last byte) string {
		return fmt.Sprintf("24:0A:C4:%02X:%02X:%02X", h[0], h[1], last)
	}
	d := &device{
		fleet:       f,
		uid:         uid,
		staMAC:      mac(h[2]),
		apMAC:       mac(h[2] + 1),
		localIP:     fmt.Sprintf("192.168.%d.%d", h[3], 2+int(h[4])%252),
		retryJitter: time.Duration(h[5]) * 4 * time.Millisecond,
		fw:          firstImage,
	}
	if img, ok := f.opts.Running[uid]; ok {
		d.fw = firmware{md5: img.MD5, sha256: img.SHA256, version: img.Version, size: img.Size}
	}
	return d
}

// firstImage is what every device runs until its first OTA.
var firstImage = func() firmware {
	m, s := md5.Sum([]byte(firstFirmwareVersion)), sha256.Sum256([]byte(firstFirmwareVersion))
	return firmware{md5: hex.EncodeToString(m[:]), sha256: hex.EncodeToString(s[:]), version: firstFirmwareVersion, size: firstImageSize}
}()

// topic is the device's topic of that kind (wire.Topic).
func (d *device) topic(kind, id string) string {
	return wire.Topic(d.fleet.opts.Prefix, d.uid, kind, id)
}

// boot powers the device on, after a reset for reason: a fresh MQTT client
// that keeps trying to reach the broker in the background. Nothing happens
// when the device is stopped or already on.
func (d *device) boot(reason string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped || d.client != nil {
		return
	}
	d.bootedAt, d.resetReason = time.Now(), reason
	d.bootCount++
	d.client = mqtt.NewClient(d.clientOptions())
	d.client.Connect() // with ConnectRetry it keeps trying; never blocks
}

// clientOptions is the MQTT session of one boot: client id and user name
// are the uid, the Last Will is a retained "offline".
func (d *device) clientOptions() *mqtt.ClientOptions {
	o := d.fleet.opts
	opts := mqtt.NewClientOptions().
		AddBroker(o.BrokerURL).
		SetClientID(d.uid).
		SetUsername(d.uid).
		SetPassword(o.Password).
		SetCleanSession(true).
		SetWill(d.topic(wire.StatusKind, ""), "offline", 1, true).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second + d.retryJitter).
		SetMaxReconnectInterval(10 * time.Second).
		SetConnectTimeout(5 * time.Second).
		SetKeepAlive(15 * time.Second). // PubSubClient's default on an ESP32
		SetWriteTimeout(5 * time.Second).
		SetOnConnectHandler(d.onConnect).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) {
			d.fleet.log.Debug("simulated device lost the broker", "uid", d.uid, "err", err)
		})
	if wire.IsTLSURL(o.BrokerURL) {
		opts.SetTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12})
	}
	return opts
}

// onConnect runs on every (re)connection, in its own goroutine: subscribe
// first, so that a device the server sees "online" already hears its
// commands, then say "online", send telemetry, and confirm an OTA that
// the reboot completed.
func (d *device) onConnect(c mqtt.Client) {
	t := c.Subscribe(d.topic(wire.CommandKind, "+"), 1, d.onCommand)
	if !t.WaitTimeout(ackWait) || t.Error() != nil {
		d.fleet.log.Warn("simulated device could not subscribe", "uid", d.uid, "err", t.Error())
	}
	d.mu.Lock()
	current := d.client == c
	var id string
	var carried *carriedOTA
	if current {
		carried, d.carried = d.carried, nil
		// "online" is queued under mu: reboot and stop clear d.client under
		// mu before they say "offline", so "offline" always comes after it
		// and a stopped device never stays retained "online".
		c.Publish(d.topic(wire.StatusKind, ""), 1, true, "online")
		id, d.pendingOTA = d.pendingOTA, ""
	}
	d.mu.Unlock()
	if !current {
		return
	}
	d.publishTelemetry(c)
	if id != "" {
		d.answer(c, id, final{OK: true})
	}
	if carried != nil {
		d.startOTA(c, carried.id, carried.payload)
	}
	if d.runsCrashingFirmware() {
		d.fleet.spawn(func() { d.crashLater(c) })
	}
}

// connectedClient is the current boot's client when its connection is up.
func (d *device) connectedClient() mqtt.Client {
	d.mu.Lock()
	c := d.client
	d.mu.Unlock()
	if c == nil || !c.IsConnectionOpen() {
		return nil
	}
	return c
}

// telemetry is what the device publishes on P/{uid}/telemetry.
// fw_version is left out when the image it flashed came without one, and
// reset_reason after the boot's first message.
type telemetry struct {
	LocalIP     string             `json:"local_ip"`
	RSSI        int                `json:"rssi"`
	FWMD5       string             `json:"fw_md5"`
	FWVersion   string             `json:"fw_version,omitempty"`
	HeapFree    int                `json:"heap_free"` // ESP.getFreeHeap()
	UptimeS     float64            `json:"uptime_s"`  // millis() / 1000.0
	ResetReason string             `json:"reset_reason,omitempty"`
	BootCount   int                `json:"boot_count"` // from NVS
	Metrics     map[string]float64 `json:"metrics"`    // the device's own readings
}

func (d *device) publishTelemetry(c mqtt.Client) {
	d.mu.Lock()
	up := time.Since(d.bootedAt)
	t := telemetry{LocalIP: d.localIP, RSSI: -45 - rand.IntN(40), FWMD5: d.fw.md5, FWVersion: d.fw.version,
		HeapFree: 180_000 + rand.IntN(20_000), UptimeS: float64(up.Milliseconds()) / 1000, ResetReason: d.resetReason,
		BootCount: d.bootCount,
		Metrics:   map[string]float64{"temp_c": math.Round((21+3*math.Sin(up.Hours()))*10) / 10}}
	d.resetReason = ""
	d.mu.Unlock()
	c.Publish(d.topic(wire.TelemetryKind, ""), 0, false, encode(t))
}

// runsCrashingFirmware reports whether the device runs the image that
// -crash-md5 names.
func (d *device) runsCrashingFirmware() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.fleet.opts.CrashMD5 != "" && d.fw.md5 == d.fleet.opts.CrashMD5
}

// crashLater resets the device with "panic" after about CrashEvery (half
// to one and a half of it), unless this boot has ended by then. An update
// in progress holds the crash back to the next interval: the updater runs
// apart from the bad build's code, so that a crashing device can be given
// its earlier firmware back (and, running it, crashes no more).
func (d *device) crashLater(c mqtt.Client) {
	every := d.fleet.opts.CrashEvery
	for {
		select {
		case <-time.After(every/2 + rand.N(every)):
		case <-d.fleet.ctx.Done():
			return
		}
		d.mu.Lock()
		ended, updating := d.client != c, d.otaBusy
		d.mu.Unlock()
		if ended {
			return
		}
		if !updating {
			d.restart(c, "panic")
			return
		}
	}
}

// final is a command's last answer; progress a report on the way.
type final struct {
	OK     bool            `json:"ok"`
	Result json.RawMessage `json:"result,omitempty"`
	Error  string          `json:"error,omitempty"`
}

type progress struct {
	Progress int    `json:"progress"`
	State    string `json:"state"`
}

// answer publishes v on P/{uid}/result/{id} at QoS 1 and returns the
// publish's token, for callers that must know it left before going away.
func (d *device) answer(c mqtt.Client, id string, v any) mqtt.Token {
	return c.Publish(d.topic(wire.ResultKind, id), 1, false, encode(v))
}

func failure(format string, args ...any) final {
	return final{OK: false, Error: fmt.Sprintf(format, args...)}
}

// encode is wire.EncodeJSON for what the device publishes: what cannot be
// encoded (an echoed payload the encoder refuses) becomes a failure.
func encode(v any) []byte {
	b, err := wire.EncodeJSON(v)
	if err != nil {
		return []byte(`{"ok":false,"error":"the answer could not be encoded"}`)
	}
	return b
}

// commandID is the {id} of a P/{uid}/cmd/{id} topic when it is a valid
// command id (1–32 of [A-Za-z0-9_-]).
func commandID(topic string) (string, bool) {
	id := topic[strings.LastIndexByte(topic, '/')+1:]
	if len(id) < 1 || len(id) > 32 {
		return "", false
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return "", false
		}
	}
	return id, true
}

// onCommand answers one command. It runs in paho's delivery goroutine, so
// it must not block: a reboot or a download goes to a goroutine of its own.
// A retained command is ignored: the server never retains one, and obeying
// a retained reboot would reboot the device on every connect.
func (d *device) onCommand(c mqtt.Client, m mqtt.Message) {
	log := d.fleet.log
	id, ok := commandID(m.Topic())
	if !ok || m.Retained() {
		log.Debug("simulated device ignored a message", "uid", d.uid, "topic", m.Topic(), "retained", m.Retained())
		return
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(m.Payload(), &obj); err != nil || obj == nil {
		log.Debug("simulated command malformed", "uid", d.uid, "id", id)
		d.answer(c, id, failure("payload is not a JSON object"))
		return
	}
	var name string
	json.Unmarshal(obj["cmd"], &name) // absent or not a string: a custom command
	log.Debug("simulated command", "uid", d.uid, "id", id, "cmd", name)
	if d.fleet.fails() {
		d.answer(c, id, failure("simulated failure"))
		return
	}
	switch name {
	case "reboot":
		t := d.answer(c, id, final{OK: true})
		d.fleet.spawn(func() { d.reboot(c, t) })
	case "wifi_reset":
		d.answer(c, id, final{OK: true})
	case "ota":
		d.startOTA(c, id, m.Payload())
	default:
		d.answer(c, id, final{OK: true, Result: json.RawMessage(m.Payload())})
	}
}

// reboot waits for the answer that announced it to leave, then restarts
// the device as esp_restart() does (reset reason "sw").
func (d *device) reboot(c mqtt.Client, announced mqtt.Token) {
	announced.WaitTimeout(ackWait)
	d.restart(c, "sw")
}

// restart takes the device off the broker (saying "offline" first) and
// boots it again after RebootDelay, reset for reason. It does nothing if
// this boot has already ended.
func (d *device) restart(c mqtt.Client, reason string) {
	d.mu.Lock()
	if d.client != c {
		d.mu.Unlock()
		return
	}
	d.client = nil
	d.mu.Unlock()
	d.goOffline(c)
	select {
	case <-time.After(d.fleet.opts.RebootDelay):
		d.boot(reason)
	case <-d.fleet.ctx.Done():
	}
}

// stop powers the device off for good.
func (d *device) stop() {
	d.mu.Lock()
	d.stopped = true
	c := d.client
	d.client = nil
	d.mu.Unlock()
	if c != nil {
		d.goOffline(c)
	}
}

// goOffline publishes the retained "offline" that a clean disconnect would
// not (the Last Will is for unclean ones), then disconnects c.
func (d *device) goOffline(c mqtt.Client) {
	if c.IsConnectionOpen() {
		c.Publish(d.topic(wire.StatusKind, ""), 1, true, "offline").WaitTimeout(ackWait)
	}
	c.Disconnect(100)
}
