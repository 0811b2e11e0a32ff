package main

// simulate.go is `devicehub simulate`, the reference device (README: Commands that report back,
// and OTA updates): a fleet of simulated ESP32s, one MQTT client each, that does what
// the README's device section asks of real firmware, OTA included, over the
// real broker and the real download link. Firmware authors can read it as
// running code; the end-to-end tests and benchmarks use it as the device.

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// simulateOptions configures a simulated fleet.
type simulateOptions struct {
	Owner    string        // email of the user whose devices are simulated
	N        int           // create devices for the owner until there are at least N (esp32/devkit)
	Interval time.Duration // telemetry period (default 10s)
	FailRate float64       // 0..1: that share of commands answers {"ok":false,...}
	// BrokerURL, Password, Prefix: the MQTT broker and topic prefix P. Each
	// device logs in with its uid as user name, as the README's per-device
	// ACL (and use_username_as_clientid) requires; Password, when set, is
	// every simulated device's password.
	BrokerURL, Password, Prefix string
	RebootDelay                 time.Duration // how long a "reboot" keeps the device away (default 2s)
}

const (
	simDefaultInterval    = 10 * time.Second
	simDefaultRebootDelay = 2 * time.Second
	// simBootSpacing paces the first connections, so that 1,000 devices
	// do not connect and publish in the same millisecond.
	simBootSpacing = 2 * time.Millisecond
	// simMinTick is the shortest telemetry tick; each tick publishes for
	// the next few devices in turn.
	simMinTick = 10 * time.Millisecond
	// simAckWait bounds waiting for the broker to acknowledge a publish.
	simAckWait = 5 * time.Second
	// simFirmwareVersion is what every device runs until its first OTA.
	simFirmwareVersion = "sim-1.0"
	// simFirstImageSize is the sketch size reported before the first OTA.
	simFirstImageSize = 917504

	// What the HTTP updater reports about the chip. The free sketch space is
	// the server's upload limit, so every image the server accepts fits.
	simChipSize    = 16 << 20
	simFreeSpace   = maxFirmwareSize
	simSDKVersion  = "v5.1.4"
	simImageMagic  = 0xE9 // first byte of an ESP application image
	simUpdaterWait = 8 * time.Second
	// simReadChunk is how much the updater writes to flash at a time.
	simReadChunk = 4096
)

// runSimulate runs every device of opts.Owner, creating esp32/devkit
// devices until there are opts.N, as simulated ESP32s until ctx is
// cancelled. It returns an error for bad options, an unknown owner, or an
// owner without devices; a broker that cannot be reached is retried in the
// background, like the server's link.
func runSimulate(ctx context.Context, st *store, opts simulateOptions, log *slog.Logger) error {
	if err := opts.normalize(); err != nil {
		return err
	}
	uids, created, err := simFleetUIDs(ctx, st, opts)
	if err != nil {
		return err
	}
	f := &simFleet{ctx: ctx, opts: opts, log: log, http: newSimHTTPClient()}
	for _, uid := range uids {
		f.devices = append(f.devices, newSimDevice(f, uid))
	}
	if opts.Interval > time.Minute {
		log.Warn("simulate: telemetry less often than once a minute; the server may count the devices offline", "interval", opts.Interval)
	}
	f.bootAll()
	log.Info("simulated fleet started", "devices", len(f.devices), "created", created,
		"owner", opts.Owner, "broker", opts.BrokerURL, "interval", opts.Interval, "fail_rate", opts.FailRate)
	f.telemetryLoop()
	f.shutdown()
	log.Info("simulated fleet stopped", "devices", len(f.devices))
	return nil
}

// normalize fills in defaults and rejects values that make no sense.
func (o *simulateOptions) normalize() error {
	o.Prefix = strings.Trim(o.Prefix, "/")
	switch {
	case strings.TrimSpace(o.Owner) == "":
		return errors.New("simulate: an owner email is required")
	case o.N < 0:
		return fmt.Errorf("simulate: -n must be 0 or more, not %d", o.N)
	case math.IsNaN(o.FailRate) || o.FailRate < 0 || o.FailRate > 1:
		return fmt.Errorf("simulate: -fail-rate must be between 0 and 1, not %v", o.FailRate)
	case o.Interval < 0 || o.RebootDelay < 0:
		return errors.New("simulate: durations must not be negative")
	case o.BrokerURL == "":
		return errors.New("simulate: a broker URL is required")
	}
	if o.Prefix == "" {
		o.Prefix = "devices"
	}
	if o.Interval == 0 {
		o.Interval = simDefaultInterval
	}
	if o.RebootDelay == 0 {
		o.RebootDelay = simDefaultRebootDelay
	}
	return nil
}

// simFleetUIDs returns the owner's device uids, oldest first, after
// creating esp32/devkit devices until there are opts.N; created is how
// many it made.
func simFleetUIDs(ctx context.Context, st *store, opts simulateOptions) (uids []string, created int, err error) {
	uids, err = st.deviceUIDsOwnedBy(ctx, opts.Owner)
	if errors.Is(err, errUserNotFound) {
		return nil, 0, fmt.Errorf("simulate: no user with email %q", opts.Owner)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("simulate: list devices: %w", err)
	}
	port := simBrokerPort(opts.BrokerURL)
	for len(uids) < opts.N {
		name := fmt.Sprintf("Simulated ESP32 %d", len(uids)+1)
		uid, err := st.createDevice(ctx, opts.Owner, "esp32", "devkit", name, port)
		if err != nil {
			return nil, created, fmt.Errorf("simulate: create device: %w", err)
		}
		uids = append(uids, uid)
		created++
	}
	if len(uids) == 0 {
		return nil, 0, fmt.Errorf("simulate: %s has no devices; use -n to create some", opts.Owner)
	}
	return uids, created, nil
}

// simBrokerPort is the port in a broker URL, recorded as the new devices'
// meta.mqtt_port; 1883 (8883 for TLS) when the URL names none.
func simBrokerPort(broker string) int {
	u, err := url.Parse(broker)
	if err == nil {
		if p, err := strconv.Atoi(u.Port()); err == nil {
			return p
		}
		if simIsTLS(u.Scheme) {
			return 8883
		}
	}
	return 1883
}

func simIsTLS(scheme string) bool { return scheme == "ssl" || scheme == "mqtts" || scheme == "tls" }

// simFleet is what the devices share: the options, one HTTP client for
// downloads, one telemetry ticker, and the bookkeeping that lets shutdown
// wait for every goroutine a device started (a reboot, an OTA).
type simFleet struct {
	ctx     context.Context // the run's; cancels downloads and reboots
	opts    simulateOptions
	log     *slog.Logger
	http    *http.Client
	devices []*simDevice

	mu      sync.Mutex
	closing bool
	wg      sync.WaitGroup
}

// spawn runs fn in a goroutine that shutdown waits for; after shutdown has
// begun it runs nothing and reports false.
func (f *simFleet) spawn(fn func()) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closing {
		return false
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		fn()
	}()
	return true
}

// fails decides, per command, whether it gets the simulated failure.
func (f *simFleet) fails() bool { return rand.Float64() < f.opts.FailRate }

// bootAll powers the devices on one after another, simBootSpacing apart.
func (f *simFleet) bootAll() {
	t := time.NewTicker(simBootSpacing)
	defer t.Stop()
	for _, d := range f.devices {
		d.boot()
		select {
		case <-f.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// telemetryLoop publishes every device's telemetry once per interval until
// the run ends. One ticker serves the whole fleet: each tick publishes for
// the next few devices in turn, so the publishes are spread evenly over
// the interval instead of landing together.
func (f *simFleet) telemetryLoop() {
	n := len(f.devices)
	interval := f.opts.Interval
	tick := max(interval/time.Duration(n), simMinTick)
	perTick := int((int64(n)*int64(tick) + int64(interval) - 1) / int64(interval))
	perTick = min(max(perTick, 1), n)
	t := time.NewTicker(tick)
	defer t.Stop()
	next := 0
	for {
		select {
		case <-f.ctx.Done():
			return
		case <-t.C:
		}
		for range perTick {
			if c := f.devices[next].connectedClient(); c != nil {
				f.devices[next].publishTelemetry(c)
			}
			next = (next + 1) % n
		}
	}
}

// shutdown stops every device (each says "offline", retained, before it
// disconnects, since a clean disconnect does not fire the Last Will) and
// waits for reboots and downloads in progress to end.
func (f *simFleet) shutdown() {
	f.mu.Lock()
	f.closing = true
	f.mu.Unlock()
	var stops sync.WaitGroup
	for _, d := range f.devices {
		stops.Go(d.stop)
	}
	stops.Wait()
	f.wg.Wait()
}

// simFirmware is an image as the device knows it: what it last flashed.
type simFirmware struct {
	md5, sha256 string // lowercase hex
	version     string // "" when the ota command gave none
	size        int64
}

// simDevice is one simulated ESP32. Its fields under mu are what survives a
// reboot (the firmware it flashed, an OTA to confirm) plus the MQTT client
// of the current boot, nil while it is rebooting or stopped.
type simDevice struct {
	fleet   *simFleet
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
	fw         simFirmware
	pendingOTA string // id of an ota command to confirm after the reboot
	otaBusy    bool
}

// newSimDevice derives the device's hardware (MACs, address, first image)
// from its uid, so a device looks the same every time simulate starts.
func newSimDevice(f *simFleet, uid string) *simDevice {
	h := md5.Sum([]byte(uid))
	s := sha256.Sum256([]byte(uid))
	// 24:0A:C4 is an Espressif OUI; the soft-AP MAC is the station's + 1.
	mac := func(last byte) string {
		return fmt.Sprintf("24:0A:C4:%02X:%02X:%02X", h[0], h[1], last)
	}
	return &simDevice{
		fleet:       f,
		uid:         uid,
		staMAC:      mac(h[2]),
		apMAC:       mac(h[2] + 1),
		localIP:     fmt.Sprintf("192.168.%d.%d", h[3], 2+int(h[4])%252),
		retryJitter: time.Duration(h[5]) * 4 * time.Millisecond,
		fw: simFirmware{
			md5:     hex.EncodeToString(h[:]),
			sha256:  hex.EncodeToString(s[:]),
			version: simFirmwareVersion,
			size:    simFirstImageSize,
		},
	}
}

func (d *simDevice) topic(kind string) string {
	return d.fleet.opts.Prefix + "/" + d.uid + "/" + kind
}

// boot powers the device on: a fresh MQTT client that keeps trying to
// reach the broker in the background. Nothing happens when the device is
// stopped or already on.
func (d *simDevice) boot() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped || d.client != nil {
		return
	}
	d.client = mqtt.NewClient(d.clientOptions())
	d.client.Connect() // with ConnectRetry it keeps trying; never blocks
}

// clientOptions is the MQTT session of one boot: client id and user name
// are the uid, the Last Will is a retained "offline".
func (d *simDevice) clientOptions() *mqtt.ClientOptions {
	o := d.fleet.opts
	opts := mqtt.NewClientOptions().
		AddBroker(o.BrokerURL).
		SetClientID(d.uid).
		SetUsername(d.uid).
		SetPassword(o.Password).
		SetCleanSession(true).
		SetWill(d.topic("status"), "offline", 1, true).
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
	if u, err := url.Parse(o.BrokerURL); err == nil && simIsTLS(u.Scheme) {
		opts.SetTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12})
	}
	return opts
}

// onConnect runs on every (re)connection, in its own goroutine: subscribe
// first, so that a device the server sees "online" already hears its
// commands, then say "online", send telemetry, and confirm an OTA that
// the reboot completed.
func (d *simDevice) onConnect(c mqtt.Client) {
	t := c.Subscribe(d.topic("cmd/+"), 1, d.onCommand)
	if !t.WaitTimeout(simAckWait) || t.Error() != nil {
		d.fleet.log.Warn("simulated device could not subscribe", "uid", d.uid, "err", t.Error())
	}
	d.mu.Lock()
	current := d.client == c
	var id string
	if current {
		// "online" is queued under mu: reboot and stop clear d.client under
		// mu before they say "offline", so "offline" always comes after it
		// and a stopped device never stays retained "online".
		c.Publish(d.topic("status"), 1, true, "online")
		id, d.pendingOTA = d.pendingOTA, ""
	}
	d.mu.Unlock()
	if !current {
		return
	}
	d.publishTelemetry(c)
	if id != "" {
		d.answer(c, id, simEnd{OK: true})
	}
}

// connectedClient is the current boot's client when its connection is up.
func (d *simDevice) connectedClient() mqtt.Client {
	d.mu.Lock()
	c := d.client
	d.mu.Unlock()
	if c == nil || !c.IsConnectionOpen() {
		return nil
	}
	return c
}

// simTelemetry is what the device publishes on P/{uid}/telemetry.
// fw_version is left out when the image it flashed came without one.
type simTelemetry struct {
	LocalIP   string `json:"local_ip"`
	RSSI      int    `json:"rssi"`
	FWMD5     string `json:"fw_md5"`
	FWVersion string `json:"fw_version,omitempty"`
}

func (d *simDevice) publishTelemetry(c mqtt.Client) {
	d.mu.Lock()
	t := simTelemetry{LocalIP: d.localIP, RSSI: -45 - rand.IntN(40), FWMD5: d.fw.md5, FWVersion: d.fw.version}
	d.mu.Unlock()
	c.Publish(d.topic("telemetry"), 0, false, simJSON(t))
}

// simEnd is a command's final answer; simProgress a report on the way.
type simEnd struct {
	OK     bool            `json:"ok"`
	Result json.RawMessage `json:"result,omitempty"`
	Error  string          `json:"error,omitempty"`
}

type simProgress struct {
	Progress int    `json:"progress"`
	State    string `json:"state"`
}

// answer publishes v on P/{uid}/result/{id} at QoS 1 and returns the
// publish's token, for callers that must know it left before going away.
func (d *simDevice) answer(c mqtt.Client, id string, v any) mqtt.Token {
	return c.Publish(d.topic("result/"+id), 1, false, simJSON(v))
}

func simFailure(format string, args ...any) simEnd {
	return simEnd{OK: false, Error: fmt.Sprintf(format, args...)}
}

// simJSON is compact JSON without HTML escaping (`&` stays `&`), as the README
// asks of JSON sent to devices and as a device would write it. What cannot
// be encoded (an echoed payload the encoder refuses) becomes a failure.
func simJSON(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return []byte(`{"ok":false,"error":"the answer could not be encoded"}`)
	}
	return bytes.TrimRight(b.Bytes(), "\n")
}

// simCommandID is the {id} of a P/{uid}/cmd/{id} topic when it is a valid
// command id (1–32 of [A-Za-z0-9_-]).
func simCommandID(topic string) (string, bool) {
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
func (d *simDevice) onCommand(c mqtt.Client, m mqtt.Message) {
	log := d.fleet.log
	id, ok := simCommandID(m.Topic())
	if !ok || m.Retained() {
		log.Debug("simulated device ignored a message", "uid", d.uid, "topic", m.Topic(), "retained", m.Retained())
		return
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(m.Payload(), &obj); err != nil || obj == nil {
		log.Debug("simulated command malformed", "uid", d.uid, "id", id)
		d.answer(c, id, simFailure("payload is not a JSON object"))
		return
	}
	var name string
	json.Unmarshal(obj["cmd"], &name) // absent or not a string: a custom command
	log.Debug("simulated command", "uid", d.uid, "id", id, "cmd", name)
	if d.fleet.fails() {
		d.answer(c, id, simFailure("simulated failure"))
		return
	}
	switch name {
	case "reboot":
		t := d.answer(c, id, simEnd{OK: true})
		d.fleet.spawn(func() { d.reboot(c, t) })
	case "wifi_reset":
		d.answer(c, id, simEnd{OK: true})
	case "ota":
		d.startOTA(c, id, m.Payload())
	default:
		d.answer(c, id, simEnd{OK: true, Result: json.RawMessage(m.Payload())})
	}
}

// reboot waits for the answer that announced it to leave, then takes the
// device off the broker (saying "offline" first) and boots it again after
// RebootDelay. It does nothing if this boot has already ended.
func (d *simDevice) reboot(c mqtt.Client, announced mqtt.Token) {
	announced.WaitTimeout(simAckWait)
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
		d.boot()
	case <-d.fleet.ctx.Done():
	}
}

// stop powers the device off for good.
func (d *simDevice) stop() {
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
func (d *simDevice) goOffline(c mqtt.Client) {
	if c.IsConnectionOpen() {
		c.Publish(d.topic("status"), 1, true, "offline").WaitTimeout(simAckWait)
	}
	c.Disconnect(100)
}

// simOTACommand is {"cmd":"ota",...}. sha256 and size are checked when
// present (the server sends both; an older server sends no sha256).
type simOTACommand struct {
	URL     string  `json:"url"`
	MD5     string  `json:"md5"`
	SHA256  string  `json:"sha256"`
	Size    *int64  `json:"size"`
	Version *string `json:"version"`
}

func (o *simOTACommand) validate() error {
	u, err := url.Parse(o.URL)
	switch {
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		return errors.New("ota: url must be an absolute http or https URL")
	case !isMD5(o.MD5):
		return errors.New("ota: md5 must be 32 hex digits")
	case o.SHA256 != "" && !simIsHex(o.SHA256, 64):
		return errors.New("ota: sha256 must be 64 hex digits")
	case o.Size != nil && *o.Size <= 0:
		return errors.New("ota: size must be a positive number of bytes")
	}
	return nil
}

func simIsHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// errSimNotModified is a 304: the server says the device runs that image.
var errSimNotModified = errors.New("not modified")

// startOTA checks the command and starts the update in its own goroutine;
// one update at a time, as the single-threaded updater would.
func (d *simDevice) startOTA(c mqtt.Client, id string, payload []byte) {
	var cmd simOTACommand
	if err := json.Unmarshal(payload, &cmd); err != nil {
		d.answer(c, id, simFailure("ota: malformed command: %v", err))
		return
	}
	if err := cmd.validate(); err != nil {
		d.answer(c, id, simFailure("%v", err))
		return
	}
	d.mu.Lock()
	busy := d.otaBusy
	d.otaBusy = true
	d.mu.Unlock()
	if busy {
		d.answer(c, id, simFailure("ota: an update is already in progress"))
		return
	}
	if !d.fleet.spawn(func() { d.runOTA(c, id, cmd) }) {
		d.setOTABusy(false)
	}
}

func (d *simDevice) setOTABusy(b bool) {
	d.mu.Lock()
	d.otaBusy = b
	d.mu.Unlock()
}

// runOTA downloads and checks the image, then "flashes" it: it records the
// image as the one it runs (non-volatile, kept across the reboot), reboots,
// and confirms with ok once it is back and has reported the new fw_md5.
func (d *simDevice) runOTA(c mqtt.Client, id string, cmd simOTACommand) {
	defer d.setOTABusy(false)
	progress := func(p int) { d.answer(c, id, simProgress{Progress: p, State: "downloading"}) }
	fw, err := d.download(cmd, progress)
	if errors.Is(err, errSimNotModified) {
		d.answer(c, id, simEnd{OK: true})
		return
	}
	if err != nil {
		d.fleet.log.Debug("simulated ota failed", "uid", d.uid, "id", id, "err", err)
		d.answer(c, id, simFailure("%v", err))
		return
	}
	d.mu.Lock()
	d.fw = fw
	d.pendingOTA = id
	d.mu.Unlock()
	t := d.answer(c, id, simProgress{Progress: 100, State: "rebooting"})
	d.reboot(c, t)
}

// download fetches cmd.URL the way arduino-esp32's HTTPUpdate does (its
// request headers, no redirects, no compression, one request per
// connection) and checks what it gets: status 200, Content-Length equal to
// the command's size and within the free space, x-MD5 equal to the
// command's md5, the image magic byte, and the md5 and sha256 of the bytes.
// It calls progress at every 10% read, short of 100.
func (d *simDevice) download(cmd simOTACommand, progress func(int)) (simFirmware, error) {
	req, err := http.NewRequestWithContext(d.fleet.ctx, http.MethodGet, cmd.URL, nil)
	if err != nil {
		return simFirmware{}, fmt.Errorf("ota: %v", err)
	}
	d.setUpdaterHeaders(req.Header)
	resp, err := d.fleet.http.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL holds the link's signature: keep it out of results and logs
		}
		return simFirmware{}, fmt.Errorf("download failed: %v", err)
	}
	defer resp.Body.Close()
	if err := simCheckResponse(resp, cmd); err != nil {
		return simFirmware{}, err
	}
	progress(0)
	md5sum, sha, err := simReadImage(resp.Body, resp.ContentLength, progress)
	if err != nil {
		return simFirmware{}, err
	}
	if md5sum != strings.ToLower(cmd.MD5) {
		return simFirmware{}, fmt.Errorf("md5 mismatch: the image's is %s, the command's %s", md5sum, strings.ToLower(cmd.MD5))
	}
	if cmd.SHA256 != "" && sha != strings.ToLower(cmd.SHA256) {
		return simFirmware{}, fmt.Errorf("sha256 mismatch: the image's is %s, the command's %s", sha, strings.ToLower(cmd.SHA256))
	}
	fw := simFirmware{md5: md5sum, sha256: sha, size: resp.ContentLength}
	if cmd.Version != nil {
		fw.version = *cmd.Version
	}
	return fw, nil
}

// setUpdaterHeaders sets the request headers of HTTPUpdate::handleUpdate,
// spelled as it spells them, with this device's values. The sketch md5 and
// sha256 are those of the image it last flashed (the sha256 in upper case,
// as the core renders it); x-ESP32-version is sent when the device knows
// its version, as when a sketch passes currentVersion.
func (d *simDevice) setUpdaterHeaders(h http.Header) {
	d.mu.Lock()
	fw := d.fw
	d.mu.Unlock()
	set := func(k, v string) { h[k] = []string{v} }
	set("User-Agent", "ESP32-http-Update")
	set("Cache-Control", "no-cache")
	set("x-ESP32-BASE-MAC", d.staMAC) // 3.x cores; the base MAC is the station's
	set("x-ESP32-STA-MAC", d.staMAC)
	set("x-ESP32-AP-MAC", d.apMAC)
	set("x-ESP32-free-space", strconv.Itoa(simFreeSpace))
	set("x-ESP32-sketch-size", strconv.FormatInt(fw.size, 10))
	set("x-ESP32-sketch-md5", fw.md5)
	set("x-ESP32-sketch-sha256", strings.ToUpper(fw.sha256))
	set("x-ESP32-chip-size", strconv.Itoa(simChipSize))
	set("x-ESP32-sdk-version", simSDKVersion)
	set("x-ESP32-mode", "sketch")
	if fw.version != "" {
		set("x-ESP32-version", fw.version)
	}
}

// simCheckResponse applies the updater's checks on the status and headers,
// and the command's: errSimNotModified for a 304.
func simCheckResponse(resp *http.Response, cmd simOTACommand) error {
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotModified:
		return errSimNotModified
	case http.StatusNotFound:
		return errors.New("download failed: file not found (404)")
	case http.StatusForbidden:
		return errors.New("download failed: forbidden (403)")
	default:
		return fmt.Errorf("download failed: wrong HTTP code (%d)", resp.StatusCode)
	}
	n := resp.ContentLength
	xmd5 := resp.Header.Get("x-MD5")
	switch {
	case n <= 0:
		return errors.New("download failed: the server did not report a size (Content-Length)")
	case n > simFreeSpace:
		return fmt.Errorf("not enough space: the image has %d bytes, %d are free", n, simFreeSpace)
	case cmd.Size != nil && n != *cmd.Size:
		return fmt.Errorf("size mismatch: Content-Length is %d, the command's size %d", n, *cmd.Size)
	case xmd5 == "":
		return errors.New("download failed: the response has no x-MD5 header")
	case !strings.EqualFold(xmd5, cmd.MD5):
		return fmt.Errorf("md5 mismatch: x-MD5 is %s, the command's md5 %s", xmd5, strings.ToLower(cmd.MD5))
	}
	return nil
}

// simReadImage reads exactly size bytes in flash-sector chunks, as the
// updater writes them, and returns their md5 and sha256. The first byte
// must be the ESP image magic.
func simReadImage(body io.Reader, size int64, progress func(int)) (md5sum, sha string, err error) {
	hm, hs := md5.New(), sha256.New()
	meter := &simProgressMeter{total: size, report: progress}
	w := io.MultiWriter(&simMagicCheck{}, hm, hs, meter)
	n, err := io.CopyBuffer(w, io.LimitReader(body, size), make([]byte, simReadChunk))
	if errors.Is(err, errSimNotImage) {
		return "", "", err
	}
	if err != nil || n < size {
		return "", "", fmt.Errorf("download failed after %d of %d bytes: %v", n, size, simOr(err, io.ErrUnexpectedEOF))
	}
	return simHex(hm), simHex(hs), nil
}

func simOr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

func simHex(h hash.Hash) string { return hex.EncodeToString(h.Sum(nil)) }

var errSimNotImage = fmt.Errorf("not an ESP32 image: the first byte is not 0x%02X", simImageMagic)

// simMagicCheck refuses a stream whose first byte is not the image magic,
// as the updater does before it writes anything.
type simMagicCheck struct{ checked bool }

func (m *simMagicCheck) Write(p []byte) (int, error) {
	if !m.checked && len(p) > 0 {
		m.checked = true
		if p[0] != simImageMagic {
			return 0, errSimNotImage
		}
	}
	return len(p), nil
}

// simProgressMeter counts bytes and reports each 10% step once, below 100
// (100 is reported after the checks, as "rebooting").
type simProgressMeter struct {
	total, done int64
	last        int
	report      func(int)
}

func (m *simProgressMeter) Write(p []byte) (int, error) {
	m.done += int64(len(p))
	step := int(m.done*10/m.total) * 10
	if step > m.last && step < 100 {
		m.last = step
		m.report(step)
	}
	return len(p), nil
}

// newSimHTTPClient is the fleet's download client, shaped like the
// updater's: no redirects followed, no compression asked for, no proxy, one
// request per connection (it speaks HTTP/1.0, which Go's client cannot;
// HTTP/1.1 with "Connection: close" is the nearest), and its 8 s timeout
// applied to every read rather than to the whole download.
func newSimHTTPClient() *http.Client {
	dialer := &net.Dialer{Timeout: simUpdaterWait}
	return &http.Client{
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := dialer.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return &simIdleConn{Conn: c}, nil
			},
			DisableKeepAlives:     true,
			DisableCompression:    true,
			TLSHandshakeTimeout:   simUpdaterWait,
			ResponseHeaderTimeout: simUpdaterWait,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

// simIdleConn fails a read that waits longer than the updater would.
type simIdleConn struct{ net.Conn }

func (c *simIdleConn) Read(p []byte) (int, error) {
	c.SetReadDeadline(time.Now().Add(simUpdaterWait))
	return c.Conn.Read(p)
}

func cmdSimulate(ctx context.Context, c *cli, args []string) error {
	owner := c.fs.String("owner", "", "email of the user whose devices are simulated (required)")
	n := c.fs.Int("n", 0, "create devices for the owner until there are at least this many")
	interval := c.fs.Duration("interval", 10*time.Second, "telemetry period")
	failRate := c.fs.Float64("fail-rate", 0, "share of commands (0-1) that fail")
	if err := c.parse(args); err != nil {
		return err
	}
	if err := required("simulate", [2]string{"owner", *owner}); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	return runSimulate(ctx, st, simulateOptions{Owner: *owner, N: *n, Interval: *interval, FailRate: *failRate,
		BrokerURL: c.cfg.mqttURL, Password: c.cfg.mqttPassword, Prefix: c.cfg.topicPrefix}, c.logger())
}
