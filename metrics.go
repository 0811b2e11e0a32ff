package main

// GET /metrics in the Prometheus text format 0.0.4, on a listener of its
// own (-metrics-addr), without a token: bind it where only the scraper
// reaches it. The format is written here by hand: it is a few lines of
// text, and a client library would be the third dependency for output
// this small. Counters are kept in a metrics value (no globals); gauges
// are read on each scrape, from the store, the link and the event hub.

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// latencyBuckets are the upper bounds of the request latency histogram,
// in seconds: Prometheus's default buckets.
var latencyBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// metrics counts HTTP requests and reads the rest on scrape.
type metrics struct {
	store  metricsStore
	link   *mqttlink.Link // nil: no link (tests)
	events *eventHub

	mu       sync.Mutex
	requests map[routeStatus]uint64
	latency  map[string]*histogram // by route
}

type routeStatus struct {
	route  string
	status int
}

// histogram counts observations per bucket of latencyBuckets, the last
// one +Inf; cumulated when written.
type histogram struct {
	counts []uint64
	sum    float64
}

// metricsStore is what the metrics read of the store: the fleet's counts.
type metricsStore interface {
	FleetCounts(ctx context.Context) (store.FleetCounts, error)
}

func newMetrics(st metricsStore, link *mqttlink.Link, events *eventHub) *metrics {
	return &metrics{store: st, link: link, events: events,
		requests: map[routeStatus]uint64{}, latency: map[string]*histogram{}}
}

// record counts a request by the route pattern the mux matched and its
// status, and times it (a watcher of observe); a stream's time is no
// latency and is left out.
func (m *metrics) record(_ *http.Request, d requestDone) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.requests[routeStatus{d.route, d.status}]++
	if d.route == "GET /v1/user/events" {
		return
	}
	hg := m.latency[d.route]
	if hg == nil {
		hg = &histogram{counts: make([]uint64, len(latencyBuckets)+1)}
		m.latency[d.route] = hg
	}
	took := d.took.Seconds()
	i, _ := slices.BinarySearch(latencyBuckets, took) // the first bound ≥ took
	hg.counts[i]++
	hg.sum += took
}

// promText writes metric families in the text format.
type promText struct{ bytes.Buffer }

var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// family starts a metric family: its HELP and TYPE lines.
func (p *promText) family(name, typ, help string) {
	fmt.Fprintf(p, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}

// sample writes one sample; labels are name, value pairs.
func (p *promText) sample(name string, v float64, labels ...string) {
	p.WriteString(name)
	for i := 0; i < len(labels); i += 2 {
		sep := ","
		if i == 0 {
			sep = "{"
		}
		fmt.Fprintf(p, `%s%s="%s"`, sep, labels[i], labelEscaper.Replace(labels[i+1]))
	}
	if len(labels) > 0 {
		p.WriteByte('}')
	}
	p.WriteString(" " + strconv.FormatFloat(v, 'g', -1, 64) + "\n")
}

// write renders every metric.
func (m *metrics) write(ctx context.Context) ([]byte, error) {
	counts, err := m.store.FleetCounts(ctx)
	if err != nil {
		return nil, err
	}
	var p promText

	m.mu.Lock()
	p.family("devicehub_http_requests_total", "counter", "HTTP requests answered, by route pattern and status.")
	var loginFailures, throttled uint64
	for _, k := range slices.SortedFunc(maps.Keys(m.requests), func(a, b routeStatus) int {
		return strings.Compare(a.route+strconv.Itoa(a.status), b.route+strconv.Itoa(b.status))
	}) {
		n := m.requests[k]
		p.sample("devicehub_http_requests_total", float64(n), "route", k.route, "status", strconv.Itoa(k.status))
		if k.route == "POST /v1/auth/login" && k.status == http.StatusUnprocessableEntity {
			loginFailures += n
		}
		if k.status == http.StatusTooManyRequests {
			throttled += n
		}
	}
	p.family("devicehub_http_request_duration_seconds", "histogram", "Time to answer an HTTP request, by route pattern (event streams left out).")
	for _, route := range slices.Sorted(maps.Keys(m.latency)) {
		hg, cum := m.latency[route], uint64(0)
		for i, n := range hg.counts {
			cum += n
			le := "+Inf"
			if i < len(latencyBuckets) {
				le = strconv.FormatFloat(latencyBuckets[i], 'g', -1, 64)
			}
			p.sample("devicehub_http_request_duration_seconds_bucket", float64(cum), "route", route, "le", le)
		}
		p.sample("devicehub_http_request_duration_seconds_sum", hg.sum, "route", route)
		p.sample("devicehub_http_request_duration_seconds_count", float64(cum), "route", route)
	}
	m.mu.Unlock()
	p.family("devicehub_login_failures_total", "counter", "Logins refused with 422: wrong email or password, or a malformed request.")
	p.sample("devicehub_login_failures_total", float64(loginFailures))
	p.family("devicehub_throttled_total", "counter", "Requests answered 429 Too Many Attempts, any route.")
	p.sample("devicehub_throttled_total", float64(throttled))

	p.family("devicehub_devices", "gauge", "Devices, by status.")
	for _, st := range model.DeviceStatuses {
		p.sample("devicehub_devices", float64(counts.Devices[st]), "status", string(st))
	}
	p.family("devicehub_commands", "gauge", "Command records kept (each device's newest 200), by kind and state.")
	for _, k := range slices.SortedFunc(maps.Keys(counts.Commands), func(a, b [2]string) int {
		return strings.Compare(a[0]+" "+a[1], b[0]+" "+b[1])
	}) {
		p.sample("devicehub_commands", float64(counts.Commands[k]), "kind", k[0], "state", k[1])
	}
	p.family("devicehub_rollouts", "gauge", "Rollouts, by state.")
	for _, st := range model.RolloutStates {
		p.sample("devicehub_rollouts", float64(counts.Rollouts[st]), "state", string(st))
	}

	if m.link != nil {
		s := m.link.Stats()
		p.family("devicehub_device_boots_total", "counter", "Device boots recorded (a reset_reason in telemetry, the same boot told twice counted once), by whether each was a crash.")
		p.sample("devicehub_device_boots_total", float64(s.Boots-s.Crashes), "crash", "false")
		p.sample("devicehub_device_boots_total", float64(s.Crashes), "crash", "true")
		p.family("devicehub_mqtt_messages_applied_total", "counter", "Device reports and command results written to the database; what one device sent between two writes (100 ms) counts once.")
		p.sample("devicehub_mqtt_messages_applied_total", float64(s.Applied))
		p.family("devicehub_mqtt_messages_dropped_total", "counter", "Device messages dropped, by reason.")
		for _, reason := range slices.Sorted(maps.Keys(s.Drops)) {
			p.sample("devicehub_mqtt_messages_dropped_total", float64(s.Drops[reason]), "reason", reason)
		}
		connected := 0.0
		if s.Connected {
			connected = 1
		}
		p.family("devicehub_mqtt_connected", "gauge", "1 while the broker connection is up and the device topics are subscribed, else 0.")
		p.sample("devicehub_mqtt_connected", connected)
		p.family("devicehub_mqtt_reconnects_total", "counter", "Connections to the broker after the first.")
		p.sample("devicehub_mqtt_reconnects_total", float64(s.Reconnects))
	}

	p.family("devicehub_event_streams", "gauge", "Open event streams (GET /v1/user/events).")
	p.sample("devicehub_event_streams", float64(m.events.streams()))
	p.family("devicehub_webhook_dropped_total", "counter", "Events dropped from a full webhook queue (-webhook-queue).")
	p.sample("devicehub_webhook_dropped_total", float64(m.events.webhookDrops()))

	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	p.family("go_goroutines", "gauge", "Goroutines that currently exist.")
	p.sample("go_goroutines", float64(runtime.NumGoroutine()))
	p.family("go_memstats_heap_alloc_bytes", "gauge", "Bytes of allocated heap objects.")
	p.sample("go_memstats_heap_alloc_bytes", float64(ms.HeapAlloc))
	p.family("go_memstats_sys_bytes", "gauge", "Bytes of memory obtained from the OS.")
	p.sample("go_memstats_sys_bytes", float64(ms.Sys))
	p.family("go_gc_cycles_total", "counter", "Completed GC cycles.")
	p.sample("go_gc_cycles_total", float64(ms.NumGC))
	if rss, ok := residentBytes(); ok {
		p.family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.")
		p.sample("process_resident_memory_bytes", float64(rss))
	}
	return p.Bytes(), nil
}

// residentBytes is the process's resident set size, from /proc (Linux).
func residentBytes() (int64, bool) {
	b, err := os.ReadFile("/proc/self/statm")
	f := strings.Fields(string(b))
	if err != nil || len(f) < 2 {
		return 0, false
	}
	pages, err := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize()), err == nil
}

// ServeHTTP serves GET /metrics; anything else is a 404.
func (m *metrics) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/metrics" || (r.Method != http.MethodGet && r.Method != http.MethodHead) {
		http.NotFound(w, r)
		return
	}
	b, err := m.write(r.Context())
	if err != nil {
		http.Error(w, "reading the database failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Write(b)
}

// listenMetrics listens on addr for serveMetrics; nil when addr is "".
func listenMetrics(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for metrics: %w", err)
	}
	return ln, nil
}

// serveMetrics serves m on ln (nothing when ln is nil) and returns the
// function that stops it.
func serveMetrics(ln net.Listener, m *metrics, logger *slog.Logger) (stop func()) {
	if ln == nil {
		return func() {}
	}
	srv := &http.Server{Handler: m, ReadHeaderTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second,
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	go srv.Serve(ln)
	logger.Info("metrics listening", "addr", ln.Addr().String())
	return func() { srv.Close() }
}
