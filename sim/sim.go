// Package sim is the reference ESP32 device: a fleet of simulated devices,
// one MQTT client each, that does what devicehub asks of real firmware, OTA
// included, over the real broker and the real download link. It speaks
// only the device protocol and knows nothing of the server, so a firmware
// author can read it as that protocol in running code. `devicehub simulate`
// runs it; the end-to-end tests and benchmarks use it as the device.
//
// The protocol, for a topic prefix P and a device uid (the device's MQTT
// client id and user name):
//
//   - P/{uid}/status: "online" once connected and "offline" before a clean
//     disconnect, both retained at QoS 1; the Last Will is a retained
//     "offline".
//   - P/{uid}/telemetry: {"local_ip","rssi","fw_md5","fw_version",
//     "heap_free","uptime_s","metrics"} at QoS 0, on connecting and every
//     interval; the first after each boot also "reset_reason".
//   - P/{uid}/cmd/{id}: commands, subscribed at QoS 1, each a JSON object
//     whose "cmd" is "reboot", "wifi_reset", "ota" or anything else (echoed
//     back as the result).
//   - P/{uid}/result/{id}: the answers at QoS 1: {"ok":true[,"result":…]} or
//     {"ok":false,"error":"…"} to end a command, {"progress":n,"state":"…"}
//     on the way.
//   - The OTA download: an HTTP GET of the command's url, as arduino-esp32's
//     HTTPUpdate does it; see download.
//
// JSON on these topics is compact and not HTML-escaped (wire.EncodeJSON).
// The topics, the checks the server makes and the encoding are in
// internal/wire, which the server shares.
package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Options configures a simulated fleet. The zero values of Prefix,
// Interval and RebootDelay stand for their defaults.
type Options struct {
	// BrokerURL is the MQTT broker: tcp://, ssl://, mqtts:// or tls://.
	BrokerURL string
	// Password, when set, is every device's MQTT password. Each device logs
	// in with its uid as user name, as a per-device ACL (and Mosquitto's
	// use_username_as_clientid) requires.
	Password string
	// Prefix is the topic prefix P (default "devices").
	Prefix string
	// Interval is the telemetry period (default 10s).
	Interval time.Duration
	// FailRate, 0..1, is the share of commands answered {"ok":false,...}.
	FailRate float64
	// RebootDelay is how long a "reboot" keeps a device away (default 2s).
	RebootDelay time.Duration
	// FreeSpace is the free sketch space in bytes: what the updater
	// reports, and the largest image it accepts.
	FreeSpace int64
	// CrashMD5 names a firmware that crashes: a device running it resets
	// with reason "panic" about every CrashEvery (half to one and a half
	// of it), as a bad build would.
	CrashMD5   string
	CrashEvery time.Duration
	// Running is the image each device (by uid) ran when the fleet last
	// stopped, as the server recorded it: a device keeps what it flashed
	// across restarts. A device not in it runs the first image.
	Running map[string]Image
}

// Image is a firmware image a device runs, as it reports it.
type Image struct {
	MD5, SHA256, Version string
	Size                 int64
}

const (
	defaultInterval    = 10 * time.Second
	defaultRebootDelay = 2 * time.Second
	// bootSpacing paces the first connections, so that 1,000 devices
	// do not connect and publish in the same millisecond.
	bootSpacing = 2 * time.Millisecond
	// minTick is the shortest telemetry tick; each tick publishes for
	// the next few devices in turn.
	minTick = 10 * time.Millisecond
	// ackWait bounds waiting for the broker to acknowledge a publish.
	ackWait = 5 * time.Second
)

// Normalize fills in the defaults and rejects values that make no sense.
// Start calls it; a caller that must refuse bad options before doing work
// of its own may call it first. Its messages name the flags of
// `devicehub simulate`.
func (o *Options) Normalize() error {
	o.Prefix = strings.Trim(o.Prefix, "/")
	switch {
	case math.IsNaN(o.FailRate) || o.FailRate < 0 || o.FailRate > 1:
		return fmt.Errorf("simulate: -fail-rate must be between 0 and 1, not %v", o.FailRate)
	case o.Interval < 0 || o.RebootDelay < 0:
		return errors.New("simulate: durations must not be negative")
	case o.BrokerURL == "":
		return errors.New("simulate: a broker URL is required")
	case o.FreeSpace <= 0:
		return errors.New("simulate: the free sketch space must be positive")
	case o.CrashMD5 != "" && o.CrashEvery <= 0:
		return errors.New("simulate: -crash-md5 needs a positive -crash-every")
	}
	o.CrashMD5 = strings.ToLower(o.CrashMD5)
	if o.Prefix == "" {
		o.Prefix = "devices"
	}
	if o.Interval == 0 {
		o.Interval = defaultInterval
	}
	if o.RebootDelay == 0 {
		o.RebootDelay = defaultRebootDelay
	}
	return nil
}

// Fleet is a running simulated fleet: the options, one HTTP client for
// downloads, one telemetry ticker, and the bookkeeping that lets it wait
// for every goroutine a device started (a reboot, an OTA) when it stops.
type Fleet struct {
	ctx     context.Context // the run's; cancels downloads and reboots
	opts    Options
	log     *slog.Logger
	http    *http.Client
	devices []*device
	stopped chan struct{} // closed once every device is off

	mu      sync.Mutex
	closing bool
	wg      sync.WaitGroup
}

// Start powers on one simulated ESP32 per uid, one after another, and
// returns once all are on; each keeps trying to reach the broker in the
// background. The fleet runs until ctx is cancelled. Start returns an
// error for bad options or no uids.
func Start(ctx context.Context, uids []string, opts Options, log *slog.Logger) (*Fleet, error) {
	if err := opts.Normalize(); err != nil {
		return nil, err
	}
	if len(uids) == 0 {
		return nil, errors.New("simulate: no devices to run")
	}
	f := &Fleet{ctx: ctx, opts: opts, log: log, http: newHTTPClient(), stopped: make(chan struct{})}
	for _, uid := range uids {
		f.devices = append(f.devices, newDevice(f, uid))
	}
	f.bootAll()
	go func() {
		defer close(f.stopped)
		f.telemetryLoop()
		f.shutdown()
	}()
	return f, nil
}

// Wait returns once the fleet has stopped: its context was cancelled,
// every device said "offline" and disconnected, and every reboot and
// download in progress ended.
func (f *Fleet) Wait() { <-f.stopped }

// spawn runs fn in a goroutine that shutdown waits for; after shutdown has
// begun it runs nothing and reports false.
func (f *Fleet) spawn(fn func()) bool {
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
func (f *Fleet) fails() bool { return rand.Float64() < f.opts.FailRate }

// bootAll powers the devices on one after another, bootSpacing apart.
func (f *Fleet) bootAll() {
	t := time.NewTicker(bootSpacing)
	defer t.Stop()
	for _, d := range f.devices {
		d.boot("poweron")
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
func (f *Fleet) telemetryLoop() {
	n := len(f.devices)
	interval := f.opts.Interval
	tick := max(interval/time.Duration(n), minTick)
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
func (f *Fleet) shutdown() {
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
