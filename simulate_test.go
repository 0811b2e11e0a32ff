package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/store"
	"devicehub/sim"
)

const simTestOwner = "sim@example.com"

// What a simulated device runs before its first OTA, the SDK version its
// updater reports, and the first byte of an ESP application image.
const (
	simFirmwareVersion = "sim-1.0"
	simFirstImageSize  = 917504
	simSDKVersion      = "v5.1.4"
	simImageMagic      = 0xE9
)

// simTelemetry is a device's P/{uid}/telemetry.
type simTelemetry struct {
	LocalIP     string             `json:"local_ip"`
	RSSI        int                `json:"rssi"`
	FWMD5       string             `json:"fw_md5"`
	FWVersion   string             `json:"fw_version,omitempty"`
	HeapFree    int                `json:"heap_free"`
	UptimeS     float64            `json:"uptime_s"`
	ResetReason string             `json:"reset_reason"`
	BootCount   int                `json:"boot_count"`
	Metrics     map[string]float64 `json:"metrics"`
}

// simProgress is a report on the way to a command's end.
type simProgress struct {
	Progress int    `json:"progress"`
	State    string `json:"state"`
}

// simMsg is one message seen on the broker.
type simMsg struct {
	topic, payload string
	retained       bool
}

// simRecorder keeps every message on a topic filter, in arrival order.
type simRecorder struct {
	mu   sync.Mutex
	msgs []simMsg
}

func recordTopic(tb testing.TB, c mqtt.Client, filter string) *simRecorder {
	tb.Helper()
	r := &simRecorder{}
	t := c.Subscribe(filter, 1, func(_ mqtt.Client, m mqtt.Message) {
		r.mu.Lock()
		r.msgs = append(r.msgs, simMsg{m.Topic(), string(m.Payload()), m.Retained()})
		r.mu.Unlock()
	})
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("subscribe %s: %v", filter, t.Error())
	}
	return r
}

// since returns the messages from index from on.
func (r *simRecorder) since(from int) []simMsg {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]simMsg(nil), r.msgs[min(from, len(r.msgs)):]...)
}

func (r *simRecorder) mark() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.msgs)
}

// find returns the index (counted from from) of the first message since
// from that matches, or -1.
func (r *simRecorder) find(from int, match func(simMsg) bool) int {
	for i, m := range r.since(from) {
		if match(m) {
			return from + i
		}
	}
	return -1
}

// waitFor waits until a message since from matches and returns its index.
func (r *simRecorder) waitFor(tb testing.TB, from int, what string, match func(simMsg) bool) int {
	tb.Helper()
	i := -1
	eventually(tb, 5*time.Second, what, func() bool { i = r.find(from, match); return i >= 0 })
	return i
}

func (r *simRecorder) at(i int) simMsg {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.msgs[i]
}

// simEnv is a simulated fleet running on a real Mosquitto, and a raw MQTT
// client that plays the server: it sends commands and sees every message
// under the prefix.
type simEnv struct {
	t      *testing.T
	broker *testBroker
	st     *store.Store
	opts   simulateOptions
	uids   []string
	server mqtt.Client
	seen   *simRecorder
	stop   func() error // ends the run; runSimulate's answer
}

// newSimStore is a store with the fleet's owner and no devices.
func newSimStore(t *testing.T) (*store.Store, int64) {
	t.Helper()
	st := newTestStore(t, nil)
	id, err := st.CreateUser(context.Background(), "Sim", simTestOwner, "user", "unused", "")
	must(t, err)
	return st, id
}

// startSim runs a fleet of n devices (short interval and reboot delay,
// adjusted by tweak) and waits until every device is online.
func startSim(t *testing.T, n int, tweak func(*simulateOptions)) *simEnv {
	t.Helper()
	e := newSimEnv(t, n, tweak)
	e.start()
	return e
}

// newSimEnv prepares a broker, a store with the owner, and the observing
// server client; start runs the fleet.
func newSimEnv(t *testing.T, n int, tweak func(*simulateOptions)) *simEnv {
	t.Helper()
	b := startBroker(t)
	st, _ := newSimStore(t)
	e := &simEnv{t: t, broker: b, st: st}
	e.opts = simulateOptions{Owner: simTestOwner, N: n, Options: sim.Options{Interval: 200 * time.Millisecond,
		RebootDelay: 100 * time.Millisecond, BrokerURL: b.URL(), Prefix: "devices"}}
	if tweak != nil {
		tweak(&e.opts)
	}
	e.server = testClient(t, b, "devicehub-test", "")
	e.seen = recordTopic(t, e.server, "devices/#")
	return e
}

// start runs the fleet and waits until its N devices are online.
func (e *simEnv) start() {
	e.t.Helper()
	e.run()
	eventually(e.t, 5*time.Second, "the devices to be created", func() bool {
		e.uids, _ = e.st.DeviceUIDsOwnedBy(context.Background(), simTestOwner)
		return len(e.uids) >= e.opts.N
	})
	for _, uid := range e.uids {
		e.seen.waitFor(e.t, 0, uid+" online", e.isStatus(uid, "online"))
	}
}

// run starts runSimulate in the background; e.stop ends it.
func (e *simEnv) run() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log, _ := captureLogs(e.t)
	go func() { done <- runSimulate(ctx, e.st, e.opts, log) }()
	e.stop = sync.OnceValue(func() error {
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			e.t.Error("runSimulate did not return within 10s of its cancellation")
			return nil
		}
	})
	e.t.Cleanup(func() {
		if err := e.stop(); err != nil {
			e.t.Errorf("runSimulate: %v", err)
		}
	})
}

func (e *simEnv) isStatus(uid, word string) func(simMsg) bool {
	return func(m simMsg) bool { return m.topic == "devices/"+uid+"/status" && m.payload == word }
}

// answers holds a command's answers: progress reports, then the end.
type answers struct {
	progress []simProgress
	end      string // raw JSON
	endIndex int    // of the end in e.seen
}

// command publishes payload on P/{uid}/cmd/{id}, as the server does, and
// waits for the answer that ends it (the first with an "ok" field).
func (e *simEnv) command(uid, id string, payload any) answers {
	e.t.Helper()
	from := e.seen.mark()
	publishWait(e.t, e.server, "devices/"+uid+"/cmd/"+id, false, payload)
	return e.answersTo(uid, id, from)
}

func (e *simEnv) answersTo(uid, id string, from int) answers {
	e.t.Helper()
	topic := "devices/" + uid + "/result/" + id
	var a answers
	a.endIndex = e.seen.waitFor(e.t, from, "the end of command "+id, func(m simMsg) bool {
		return m.topic == topic && strings.Contains(m.payload, `"ok"`)
	})
	for _, m := range e.seen.since(from)[:a.endIndex-from+1] {
		if m.topic != topic {
			continue
		}
		var v map[string]json.RawMessage
		if err := json.Unmarshal([]byte(m.payload), &v); err != nil {
			e.t.Fatalf("answer to %s is not a JSON object: %q", id, m.payload)
		}
		if _, ok := v["ok"]; ok {
			a.end = m.payload
			break
		}
		var p simProgress
		if err := json.Unmarshal([]byte(m.payload), &p); err != nil || p.State == "" {
			e.t.Fatalf("answer to %s is neither an end nor a progress report: %q", id, m.payload)
		}
		a.progress = append(a.progress, p)
	}
	return a
}

// endIs checks a command's end against the JSON want.
func (e *simEnv) endIs(a answers, want string) {
	e.t.Helper()
	if !jsonEqual(e.t, []byte(a.end), []byte(want)) {
		e.t.Errorf("end = %s, want %s", a.end, want)
	}
}

// failedWith checks that a command ended ok:false with an error that
// contains want.
func (e *simEnv) failedWith(a answers, want string) {
	e.t.Helper()
	var end struct {
		OK    *bool   `json:"ok"`
		Error *string `json:"error"`
	}
	json.Unmarshal([]byte(a.end), &end)
	if end.OK == nil || *end.OK || end.Error == nil || !strings.Contains(*end.Error, want) {
		e.t.Errorf("end = %s, want ok:false with an error containing %q", a.end, want)
	}
}

// noStatusSince checks, after long enough for a reboot to show, that uid
// published no status word since from.
func (e *simEnv) noStatusSince(uid string, from int) {
	e.t.Helper()
	time.Sleep(3 * e.opts.RebootDelay)
	if i := e.seen.find(from, func(m simMsg) bool { return m.topic == "devices/"+uid+"/status" }); i >= 0 {
		e.t.Errorf("%s published status %q: it rebooted or went away", uid, e.seen.at(i).payload)
	}
}

// telemetry decodes one telemetry message; have lists the keys present.
func telemetryOf(tb testing.TB, m simMsg) (t simTelemetry, have map[string]bool) {
	tb.Helper()
	var keys map[string]any
	if err := json.Unmarshal([]byte(m.payload), &keys); err != nil {
		tb.Fatalf("telemetry is not a JSON object: %q", m.payload)
	}
	json.Unmarshal([]byte(m.payload), &t)
	have = map[string]bool{}
	for k := range keys {
		have[k] = true
	}
	return t, have
}

func TestSimulateDevicesComeOnline(t *testing.T) {
	t.Parallel()
	e := startSim(t, 3, nil)
	if len(e.uids) != 3 {
		t.Fatalf("fleet has %d devices, want 3", len(e.uids))
	}
	for _, uid := range e.uids {
		i := e.seen.waitFor(t, 0, uid+" telemetry", func(m simMsg) bool { return m.topic == "devices/"+uid+"/telemetry" })
		tel, have := telemetryOf(t, e.seen.at(i))
		if tel.FWMD5 != md5Hex([]byte(simFirmwareVersion)) || tel.FWVersion != simFirmwareVersion {
			t.Errorf("%s reports fw_md5 %q, fw_version %q; want the first image, one for every device, %q", uid, tel.FWMD5, tel.FWVersion, simFirmwareVersion)
		}
		if !regexp.MustCompile(`^192\.168\.\d+\.\d+$`).MatchString(tel.LocalIP) || tel.RSSI > -30 || tel.RSSI < -100 || len(have) != 9 {
			t.Errorf("%s telemetry = %s, want local_ip, a plausible rssi, fw_md5, fw_version, heap_free, uptime_s, reset_reason, boot_count, metrics",
				uid, e.seen.at(i).payload)
		}
		if tel.ResetReason != "poweron" || tel.BootCount != 1 || tel.HeapFree < 100_000 || tel.UptimeS > 5 || tel.Metrics["temp_c"] < 10 || tel.Metrics["temp_c"] > 30 {
			t.Errorf("%s first telemetry = %s, want reset_reason poweron, boot_count 1, a plausible heap, uptime and temp_c", uid, e.seen.at(i).payload)
		}
		next := e.seen.waitFor(t, i+1, uid+" telemetry", func(m simMsg) bool { return m.topic == "devices/"+uid+"/telemetry" })
		if _, have := telemetryOf(t, e.seen.at(next)); have["reset_reason"] {
			t.Errorf("%s telemetry after the first = %s, want no reset_reason", uid, e.seen.at(next).payload)
		}
	}
	// Telemetry keeps coming, once per interval.
	from := e.seen.mark()
	time.Sleep(5 * e.opts.Interval)
	for _, uid := range e.uids {
		n := 0
		for _, m := range e.seen.since(from) {
			if m.topic == "devices/"+uid+"/telemetry" {
				n++
			}
		}
		if n < 3 || n > 7 {
			t.Errorf("%s sent %d telemetry reports in 5 intervals, want about 5", uid, n)
		}
	}
}

func TestSimulateCommands(t *testing.T) {
	t.Parallel()
	e := startSim(t, 3, nil)
	uid := e.uids[0]
	tests := []struct {
		name, payload, want string
	}{
		{"wifi_reset", `{"cmd":"wifi_reset"}`, `{"ok":true}`},
		{"custom echoed", `{"cmd":"led","on":true,"level":3}`, `{"ok":true,"result":{"cmd":"led","on":true,"level":3}}`},
		{"button payload echoed", `{"relay":2,"state":"toggle"}`, `{"ok":true,"result":{"relay":2,"state":"toggle"}}`},
		{"empty object echoed", `{}`, `{"ok":true,"result":{}}`},
		{"HTML characters echoed unescaped", `{"say":"a&b <c>"}`, `{"ok":true,"result":{"say":"a&b <c>"}}`},
		{"nested and unicode echoed", `{"a":[1,{"b":null}],"s":"grüße \u00e9"}`, `{"ok":true,"result":{"a":[1,{"b":null}],"s":"grüße é"}}`},
		{"invalid UTF-8 echoed as sent", "{\"s\":\"\xff\"}", "{\"ok\":true,\"result\":{\"s\":\"\xff\"}}"},
		{"not JSON", `reboot now`, `{"ok":false,"error":"payload is not a JSON object"}`},
		{"JSON array", `[1,2]`, `{"ok":false,"error":"payload is not a JSON object"}`},
		{"JSON null", `null`, `{"ok":false,"error":"payload is not a JSON object"}`},
		{"ota without url", `{"cmd":"ota","md5":"` + md5Hex(nil) + `"}`, `{"ok":false,"error":"ota: url must be an absolute http or https URL"}`},
		{"ota with a relative url", `{"cmd":"ota","url":"/ota/x.bin","md5":"` + md5Hex(nil) + `"}`, `{"ok":false,"error":"ota: url must be an absolute http or https URL"}`},
		{"ota with a bad md5", `{"cmd":"ota","url":"http://127.0.0.1:1/x.bin","md5":"xyz"}`, `{"ok":false,"error":"ota: md5 must be 32 hex digits"}`},
		{"ota with a bad sha256", `{"cmd":"ota","url":"http://127.0.0.1:1/x.bin","md5":"` + md5Hex(nil) + `","sha256":"abc"}`, `{"ok":false,"error":"ota: sha256 must be 64 hex digits"}`},
		{"ota with a bad size", `{"cmd":"ota","url":"http://127.0.0.1:1/x.bin","md5":"` + md5Hex(nil) + `","size":0}`, `{"ok":false,"error":"ota: size must be a positive number of bytes"}`},
		{"ota with mistyped fields", `{"cmd":"ota","url":5}`, ``},
	}
	from := e.seen.mark()
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := e.command(uid, "c"+strconv.Itoa(i), tt.payload)
			if len(a.progress) != 0 {
				t.Errorf("progress reports %v, want none", a.progress)
			}
			if tt.want == "" {
				e.failedWith(a, "ota: malformed command")
				return
			}
			e.endIs(a, tt.want)
			if strings.Contains(a.end, `\u0026`) || strings.Contains(a.end, `\u003c`) {
				t.Errorf("end = %s, want the payload's text unescaped", a.end)
			}
		})
	}
	e.noStatusSince(uid, from)
}

func TestSimulateIgnoresUnusableCommandIDs(t *testing.T) {
	t.Parallel()
	e := startSim(t, 1, nil)
	uid := e.uids[0]
	from := e.seen.mark()
	for _, id := range []string{"has.dot", strings.Repeat("x", 33)} {
		publishWait(t, e.server, "devices/"+uid+"/cmd/"+id, false, `{"cmd":"reboot"}`)
	}
	e.endIs(e.command(uid, "after", `{"cmd":"wifi_reset"}`), `{"ok":true}`)
	if i := e.seen.find(from, func(m simMsg) bool {
		return strings.Contains(m.topic, "/result/") && !strings.HasSuffix(m.topic, "/after")
	}); i >= 0 {
		t.Errorf("answered %s: %s", e.seen.at(i).topic, e.seen.at(i).payload)
	}
	e.noStatusSince(uid, from)
}

// A retained command (the server never sends one) that the broker replays
// on subscribing is ignored: obeying a retained reboot would reboot the
// device on every connect.
func TestSimulateIgnoresRetainedCommands(t *testing.T) {
	t.Parallel()
	e := newSimEnv(t, 1, nil)
	uid, err := createDeviceOf(context.Background(), e.st, simTestOwner, "esp32", "devkit", "")
	must(t, err)
	publishWait(t, e.server, "devices/"+uid+"/cmd/kept", true, `{"cmd":"reboot"}`)
	e.start()
	e.endIs(e.command(uid, "after", `{"cmd":"wifi_reset"}`), `{"ok":true}`)
	if i := e.seen.find(0, func(m simMsg) bool { return strings.HasSuffix(m.topic, "/result/kept") }); i >= 0 {
		t.Errorf("answered the retained command: %s", e.seen.at(i).payload)
	}
	e.noStatusSince(uid, e.seen.find(0, e.isStatus(uid, "online"))+1)
}

func TestSimulateReboot(t *testing.T) {
	t.Parallel()
	e := startSim(t, 2, nil)
	uid, other := e.uids[0], e.uids[1]
	from := e.seen.mark()
	a := e.command(uid, "r1", `{"cmd":"reboot"}`)
	e.endIs(a, `{"ok":true}`)
	off := e.seen.waitFor(t, from, "offline", e.isStatus(uid, "offline"))
	on := e.seen.waitFor(t, off, "online again", e.isStatus(uid, "online"))
	tel := e.seen.waitFor(t, on, "telemetry after the reboot", func(m simMsg) bool { return m.topic == "devices/"+uid+"/telemetry" })
	if !(a.endIndex < off && off < on && on < tel) {
		t.Errorf("order: ok at %d, offline at %d, online at %d, telemetry at %d; want in that order", a.endIndex, off, on, tel)
	}
	if e.seen.at(off).retained || e.seen.at(on).retained {
		t.Error("status words arrived as retained replays, want live messages")
	}
	// The broker keeps "online" for whoever subscribes next.
	late := recordTopic(t, testClient(t, e.broker, "late", ""), "devices/"+uid+"/status")
	late.waitFor(t, 0, "retained online", func(m simMsg) bool { return m.retained && m.payload == "online" })
	// The other device did not reboot, and the rebooted one answers again.
	if i := e.seen.find(from, e.isStatus(other, "offline")); i >= 0 {
		t.Errorf("%s went offline too", other)
	}
	e.endIs(e.command(uid, "r2", `{"cmd":"wifi_reset"}`), `{"ok":true}`)
}

func TestSimulateFailRate(t *testing.T) {
	t.Parallel()
	var downloads sync.Map
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		downloads.Store(r.URL.Path, true)
	}))
	defer srv.Close()
	e := startSim(t, 2, func(o *simulateOptions) { o.FailRate = 1 })
	uid := e.uids[1]
	from := e.seen.mark()
	ota := fmt.Sprintf(`{"cmd":"ota","url":%q,"md5":%q,"size":10,"version":"9"}`, srv.URL+"/fw.bin", md5Hex([]byte("x")))
	for i, p := range []string{`{"cmd":"reboot"}`, `{"cmd":"wifi_reset"}`, `{"led":1}`, ota} {
		e.endIs(e.command(uid, "f"+strconv.Itoa(i), p), `{"ok":false,"error":"simulated failure"}`)
	}
	e.noStatusSince(uid, from)
	if _, ok := downloads.Load("/fw.bin"); ok {
		t.Error("the failed ota downloaded the image")
	}
}

func TestSimulateOptionsRejected(t *testing.T) {
	t.Parallel()
	st, _ := newSimStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ok := simulateOptions{Owner: simTestOwner, N: 1, Options: sim.Options{BrokerURL: "tcp://127.0.0.1:1"}}
	tests := []struct {
		name    string
		edit    func(*simulateOptions)
		wantErr string
	}{
		{"unknown owner", func(o *simulateOptions) { o.Owner = "nobody@example.com" }, `no user with email "nobody@example.com"`},
		{"owner without devices and no -n", func(o *simulateOptions) { o.N = 0 }, "has no devices"},
		{"no owner", func(o *simulateOptions) { o.Owner = " " }, "owner email is required"},
		{"negative n", func(o *simulateOptions) { o.N = -1 }, "-n must be 0 or more"},
		{"fail rate above 1", func(o *simulateOptions) { o.FailRate = 1.5 }, "-fail-rate must be between 0 and 1"},
		{"negative fail rate", func(o *simulateOptions) { o.FailRate = -0.1 }, "-fail-rate must be between 0 and 1"},
		{"negative interval", func(o *simulateOptions) { o.Interval = -time.Second }, "must not be negative"},
		{"no broker", func(o *simulateOptions) { o.BrokerURL = "" }, "broker URL is required"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := ok
			tt.edit(&opts)
			log, _ := captureLogs(t)
			err := runSimulate(ctx, st, opts, log)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("runSimulate = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
	if uids, _ := st.DeviceUIDsOwnedBy(ctx, simTestOwner); len(uids) != 0 {
		t.Errorf("refused runs created devices: %v", uids)
	}
}

func TestSimulateCreatesDevicesUntilN(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st, teamID := newSimStore(t)
	first, err := createDeviceOf(ctx, st, simTestOwner, "esp8266", "d1_mini", "mine")
	must(t, err)
	opts := simulateOptions{Owner: simTestOwner, N: 3, Options: sim.Options{BrokerURL: "tcp://127.0.0.1:18830"}}
	uids, created, err := simFleetUIDs(ctx, st, opts)
	if err != nil || created != 2 || len(uids) != 3 || uids[0] != first {
		t.Fatalf("simFleetUIDs = %v, %d, %v; want the existing device first and 2 created", uids, created, err)
	}
	for _, uid := range uids[1:] {
		d, err := st.Device(ctx, teamID, uid)
		must(t, err)
		if d.Platform.Key != "esp32" || d.Board.Key != "devkit" || d.Port != 18830 || d.Status != "pending" {
			t.Errorf("created %s: platform %s, board %s, port %d, status %s; want esp32, devkit, 18830, pending",
				uid, d.Platform.Key, d.Board.Key, d.Port, d.Status)
		}
	}
	opts.N = 2
	again, created, err := simFleetUIDs(ctx, st, opts)
	if err != nil || created != 0 || strings.Join(again, ",") != strings.Join(uids, ",") {
		t.Errorf("with n=2: %v, %d, %v; want the same 3 devices and none created", again, created, err)
	}
}

func TestSimulateStopSaysOffline(t *testing.T) {
	t.Parallel()
	e := startSim(t, 3, nil)
	if err := e.stop(); err != nil {
		t.Fatalf("runSimulate: %v", err)
	}
	late := recordTopic(t, testClient(t, e.broker, "late", ""), "devices/+/status")
	for _, uid := range e.uids {
		late.waitFor(t, 0, uid+" retained offline", func(m simMsg) bool {
			return m.topic == "devices/"+uid+"/status" && m.retained && m.payload == "offline"
		})
	}
}

func TestSimulateWaitsForTheBroker(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.Stop()
	st, _ := newSimStore(t)
	e := &simEnv{t: t, broker: b, st: st, opts: simulateOptions{Owner: simTestOwner, N: 2,
		Options: sim.Options{Interval: 200 * time.Millisecond, BrokerURL: b.URL()}}}
	e.run()
	time.Sleep(500 * time.Millisecond) // the devices try and fail
	b.Start()
	seen := recordTopic(t, testClient(t, b, "observer", ""), "devices/+/status")
	eventually(t, 8*time.Second, "both devices online", func() bool {
		n := 0
		for _, m := range seen.since(0) {
			if m.payload == "online" {
				n++
			}
		}
		return n >= 2
	})
}

// otaImage is a firmware image as the server stores it.
type otaImage struct {
	bytes       []byte
	md5, sha256 string
}

func newOTAImage(seed uint64, size int) otaImage {
	b := make([]byte, size)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.UintN(256))
	}
	b[0] = simImageMagic
	return otaImage{b, md5Hex(b), sha256Hex(b)}
}

// command is the ota command for the image served at url.
func (img otaImage) command(url string, version any) string {
	v, _ := json.Marshal(version)
	return fmt.Sprintf(`{"cmd":"ota","url":%q,"md5":%q,"sha256":%q,"size":%d,"version":%s}`,
		url, img.md5, img.sha256, len(img.bytes), v)
}

// otaServer serves images the way devicehub's download link does (200 with
// Content-Length and x-MD5, 304 when the sketch md5 or sha256 header names
// the image), records each request's headers, and serves broken answers
// under /broken/{how}.
type otaServer struct {
	*httptest.Server
	mu      sync.Mutex
	images  map[string]otaImage
	headers []http.Header
}

func newOTAServer(t *testing.T, images map[string]otaImage) *otaServer {
	s := &otaServer{images: images}
	s.Server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

func (s *otaServer) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.headers = append(s.headers, r.Header.Clone())
	s.mu.Unlock()
	name := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
	img, ok := s.images[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	if strings.EqualFold(r.Header.Get("x-ESP32-sketch-md5"), img.md5) || strings.EqualFold(r.Header.Get("x-ESP32-sketch-sha256"), img.sha256) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	body, xmd5 := img.bytes, img.md5
	switch {
	case strings.HasPrefix(r.URL.Path, "/broken/forbidden/"):
		http.Error(w, "no", http.StatusForbidden)
		return
	case strings.HasPrefix(r.URL.Path, "/broken/redirect/"):
		http.Redirect(w, r, "/"+name, http.StatusFound)
		return
	case strings.HasPrefix(r.URL.Path, "/broken/no-x-md5/"):
		xmd5 = ""
	case strings.HasPrefix(r.URL.Path, "/broken/other-x-md5/"):
		xmd5 = md5Hex([]byte("other"))
	case strings.HasPrefix(r.URL.Path, "/broken/corrupt/"):
		body = append([]byte(nil), body...)
		body[len(body)/2] ^= 0xFF
	case strings.HasPrefix(r.URL.Path, "/broken/not-esp/"):
		body = append([]byte{0x7F}, body[1:]...)
	case strings.HasPrefix(r.URL.Path, "/broken/cut/"):
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Header().Set("x-MD5", xmd5)
		w.Write(body[:len(body)/2])
		return // the connection closes short of Content-Length
	}
	if xmd5 != "" {
		w.Header().Set("x-MD5", xmd5)
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	writeInParts(w, body, strings.HasPrefix(r.URL.Path, "/slow/"))
}

// writeInParts sends body in ten parts, pausing between them when slow.
func writeInParts(w http.ResponseWriter, body []byte, slow bool) {
	step := (len(body) + 9) / 10
	for off := 0; off < len(body); off += step {
		w.Write(body[off:min(off+step, len(body))])
		w.(http.Flusher).Flush()
		if slow {
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func (s *otaServer) lastHeaders() http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.headers[len(s.headers)-1]
}

func (s *otaServer) requests() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.headers)
}

// fwReported waits for uid's telemetry, since from, to report md5.
func (e *simEnv) fwReported(uid, md5sum string, from int) (int, simTelemetry, map[string]bool) {
	e.t.Helper()
	i := e.seen.waitFor(e.t, from, uid+" reporting fw_md5 "+md5sum, func(m simMsg) bool {
		return m.topic == "devices/"+uid+"/telemetry" && strings.Contains(m.payload, `"fw_md5":"`+md5sum+`"`)
	})
	tel, have := telemetryOf(e.t, e.seen.at(i))
	return i, tel, have
}

// runs records that the device uid runs img, version, as its telemetry
// would have: the image simulate starts it with.
func (e *simEnv) runs(uid string, img otaImage, version string) {
	e.t.Helper()
	mustExec(e.t, e.st, `INSERT INTO firmwares (device_id, name, version, md5, sha256, size, created_at)
		SELECT id, 'fw', ?, ?, ?, ?, '2026-01-01T00:00:00.000000Z' FROM devices WHERE uid = ?`, version, img.md5, img.sha256, len(img.bytes), uid)
	mustExec(e.t, e.st, `UPDATE devices SET current_md5 = ?, current_version = ? WHERE uid = ?`, img.md5, version, uid)
}

// TestSimulateRestartKeepsFirmware: every device starts on one first
// image; restarted, a device runs the image the server recorded it
// running (a real device keeps what it flashed).
func TestSimulateRestartKeepsFirmware(t *testing.T) {
	t.Parallel()
	e := startSim(t, 2, nil)
	first := md5Hex([]byte(simFirmwareVersion))
	for _, uid := range e.uids {
		e.fwReported(uid, first, 0)
	}
	must(t, e.stop())
	img := newOTAImage(41, 4096)
	e.runs(e.uids[0], img, "2.0")
	from := e.seen.mark()
	e.run()
	if _, got, _ := e.fwReported(e.uids[0], img.md5, from); got.FWVersion != "2.0" {
		t.Errorf("restarted: fw_version %q, want 2.0", got.FWVersion)
	}
	e.fwReported(e.uids[1], first, from)
}

func TestSimulateOTA(t *testing.T) {
	t.Parallel()
	imgA, imgB := newOTAImage(1, 50_000), newOTAImage(2, 30_000)
	srv := newOTAServer(t, map[string]otaImage{"a.bin": imgA, "b.bin": imgB})
	e := startSim(t, 1, nil)
	uid := e.uids[0]

	t.Run("flashes, reboots and reports the new image", func(t *testing.T) {
		from := e.seen.mark()
		a := e.command(uid, "ota1", imgA.command(srv.URL+"/a.bin?sig=secret", "2.0"))
		e.endIs(a, `{"ok":true}`)
		checkProgress(t, a.progress, 2)
		off := e.seen.waitFor(t, from, "offline", e.isStatus(uid, "offline"))
		on := e.seen.waitFor(t, off, "online again", e.isStatus(uid, "online"))
		tel, got, _ := e.fwReported(uid, imgA.md5, on)
		if !(off < on && on < tel && tel < a.endIndex) {
			t.Errorf("order: offline %d, online %d, telemetry %d, ok %d; want the ok last", off, on, tel, a.endIndex)
		}
		if got.FWVersion != "2.0" {
			t.Errorf("fw_version = %q, want 2.0", got.FWVersion)
		}
		checkUpdaterHeaders(t, srv.lastHeaders(), map[string]string{
			"x-ESP32-sketch-md5":    md5Hex([]byte(simFirmwareVersion)),
			"x-ESP32-sketch-sha256": strings.ToUpper(sha256Hex([]byte(simFirmwareVersion))),
			"x-ESP32-sketch-size":   strconv.Itoa(simFirstImageSize),
			"x-ESP32-version":       simFirmwareVersion,
		})
	})

	t.Run("304: it runs that image already", func(t *testing.T) {
		from := e.seen.mark()
		a := e.command(uid, "ota2", imgA.command(srv.URL+"/a.bin", "2.0"))
		e.endIs(a, `{"ok":true}`)
		if len(a.progress) != 0 {
			t.Errorf("progress %v, want none", a.progress)
		}
		// The flashed image survived the reboot: the updater says so.
		checkUpdaterHeaders(t, srv.lastHeaders(), map[string]string{
			"x-ESP32-sketch-md5":    imgA.md5,
			"x-ESP32-sketch-sha256": strings.ToUpper(imgA.sha256),
			"x-ESP32-sketch-size":   strconv.Itoa(len(imgA.bytes)),
			"x-ESP32-version":       "2.0",
		})
		e.noStatusSince(uid, from)
	})

	refused := closedURL()
	tests := []struct {
		name, cmd, wantErr string
	}{
		{"wrong sha256", strings.Replace(imgB.command(srv.URL+"/b.bin", "3"), imgB.sha256, imgA.sha256, 1), "sha256 mismatch"},
		{"x-MD5 not the command's", imgB.command(srv.URL+"/broken/other-x-md5/b.bin", "3"), "md5 mismatch: x-MD5 is"},
		{"no x-MD5", imgB.command(srv.URL+"/broken/no-x-md5/b.bin", "3"), "no x-MD5 header"},
		{"bytes not matching the md5", imgB.command(srv.URL+"/broken/corrupt/b.bin", "3"), "md5 mismatch: the image's is"},
		{"size not the command's", strings.Replace(imgB.command(srv.URL+"/b.bin", "3"), `"size":30000`, `"size":29999`, 1), "size mismatch"},
		{"not an ESP image", imgB.command(srv.URL+"/broken/not-esp/b.bin", "3"), "not an ESP32 image"},
		{"download cut short", imgB.command(srv.URL+"/broken/cut/b.bin", "3"), "download failed after"},
		{"404", imgB.command(srv.URL+"/gone.bin", "3"), "file not found (404)"},
		{"403", imgB.command(srv.URL+"/broken/forbidden/b.bin", "3"), "forbidden (403)"},
		{"redirect not followed", imgB.command(srv.URL+"/broken/redirect/b.bin", "3"), "wrong HTTP code (302)"},
		{"nothing listening", imgB.command(refused+"/b.bin?sig=secret", "3"), "download failed"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			from := e.seen.mark()
			a := e.command(uid, "bad"+strconv.Itoa(i), tt.cmd)
			e.failedWith(a, tt.wantErr)
			if strings.Contains(a.end, "secret") {
				t.Errorf("the error shows the link's signature: %s", a.end)
			}
			e.noStatusSince(uid, from)
			e.fwReported(uid, imgA.md5, from) // still runs A
		})
	}

	t.Run("without a version, fw_version is left out", func(t *testing.T) {
		from := e.seen.mark()
		a := e.command(uid, "ota3", imgB.command(srv.URL+"/b.bin", nil))
		e.endIs(a, `{"ok":true}`)
		_, got, have := e.fwReported(uid, imgB.md5, from)
		if have["fw_version"] {
			t.Errorf("telemetry has fw_version %q, want it left out", got.FWVersion)
		}
		if h := srv.lastHeaders(); h.Get("x-ESP32-version") != "2.0" {
			t.Errorf("x-ESP32-version = %q, want 2.0 (what it ran before)", h.Get("x-ESP32-version"))
		}
	})
}

func TestSimulateOTASlowDownloadReportsProgress(t *testing.T) {
	t.Parallel()
	img := newOTAImage(3, 200_000)
	srv := newOTAServer(t, map[string]otaImage{"slow.bin": img})
	e := startSim(t, 1, nil)
	a := e.command(e.uids[0], "slow", img.command(srv.URL+"/slow/slow.bin", "4"))
	e.endIs(a, `{"ok":true}`)
	checkProgress(t, a.progress, 8)
	if srv.requests() != 1 {
		t.Errorf("%d downloads, want 1", srv.requests())
	}
}

// checkProgress checks the reports of a successful OTA: 0 first, rising,
// at most 10 points apart, 100 "rebooting" last, and at least min between.
func checkProgress(t *testing.T, got []simProgress, min int) {
	t.Helper()
	if len(got) < min+2 || got[0] != (simProgress{0, "downloading"}) || got[len(got)-1] != (simProgress{100, "rebooting"}) {
		t.Fatalf("progress = %v, want 0 downloading, at least %d steps, then 100 rebooting", got, min)
	}
	for i := 1; i < len(got); i++ {
		if got[i].Progress <= got[i-1].Progress {
			t.Errorf("progress = %v, want it rising", got)
		}
	}
}

// checkUpdaterHeaders checks the request headers of arduino-esp32's
// HTTPUpdate, with the device-specific values in want.
func checkUpdaterHeaders(t *testing.T, h http.Header, want map[string]string) {
	t.Helper()
	mac := regexp.MustCompile(`^24:0A:C4(:[0-9A-F]{2}){3}$`)
	if !mac.MatchString(h.Get("x-ESP32-STA-MAC")) || !mac.MatchString(h.Get("x-ESP32-AP-MAC")) || h.Get("x-ESP32-STA-MAC") == h.Get("x-ESP32-AP-MAC") {
		t.Errorf("MACs: STA %q, AP %q; want two different Espressif MACs", h.Get("x-ESP32-STA-MAC"), h.Get("x-ESP32-AP-MAC"))
	}
	if h.Get("x-ESP32-BASE-MAC") != h.Get("x-ESP32-STA-MAC") {
		t.Errorf("base MAC %q, want the station's %q", h.Get("x-ESP32-BASE-MAC"), h.Get("x-ESP32-STA-MAC"))
	}
	fixed := map[string]string{
		"User-Agent":          "ESP32-http-Update",
		"Cache-Control":       "no-cache",
		"x-ESP32-free-space":  strconv.Itoa(store.MaxFirmwareSize),
		"x-ESP32-chip-size":   strconv.Itoa(16 << 20),
		"x-ESP32-sdk-version": simSDKVersion,
		"x-ESP32-mode":        "sketch",
		"Accept-Encoding":     "",
	}
	for k, v := range want {
		fixed[k] = v
	}
	for k, v := range fixed {
		if got := h.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
}

// closedURL is an http URL where nothing listens any more.
func closedURL() string {
	s := httptest.NewServer(http.NotFoundHandler())
	s.Close()
	return s.URL
}

// TestSimulateCrashingFirmware: a device running -crash-md5 resets with
// "panic" about every -crash-every, and says so in its next boot's first
// telemetry, its boot_count one more each time; a reboot command is a
// "sw" reset.
func TestSimulateCrashingFirmware(t *testing.T) {
	t.Parallel()
	var crashing string
	e := newSimEnv(t, 2, nil)
	e.start() // first, to learn the uids; then the first runs an image of its own
	must(t, e.stop())
	img := newOTAImage(42, 4096)
	e.runs(e.uids[0], img, "2.0")
	crashing = img.md5
	e.opts.CrashMD5, e.opts.CrashEvery = strings.ToUpper(crashing), 300*time.Millisecond
	from := e.seen.mark()
	e.run()
	isBoot := func(uid, reason string) func(simMsg) bool {
		return func(m simMsg) bool {
			if m.topic != "devices/"+uid+"/telemetry" {
				return false
			}
			tel, _ := telemetryOf(t, m)
			return tel.ResetReason == reason
		}
	}
	i := e.seen.waitFor(t, from, "a panic reset", isBoot(e.uids[0], "panic"))
	j := e.seen.waitFor(t, i+1, "another panic reset", isBoot(e.uids[0], "panic"))
	first, _ := telemetryOf(t, e.seen.at(i))
	if next, _ := telemetryOf(t, e.seen.at(j)); next.BootCount != first.BootCount+1 {
		t.Errorf("boot_count of two boots in a row: %d then %d", first.BootCount, next.BootCount)
	}
	if j := e.seen.find(from, isBoot(e.uids[1], "panic")); j >= 0 {
		t.Errorf("%s runs another image, but crashed: %s", e.uids[1], e.seen.at(j).payload)
	}
	id := "rebootcmd"
	publishWait(t, e.server, "devices/"+e.uids[1]+"/cmd/"+id, false, `{"cmd":"reboot"}`)
	e.seen.waitFor(t, from, "a sw reset after the reboot command", isBoot(e.uids[1], "sw"))
}
