package main

import (
	"bytes"
	"context"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	runtimemetrics "runtime/metrics"
	"strconv"
	"testing"
	"time"
)

// Benchmarks of the hot paths. Each HTTP benchmark X has a partner
// X-ceiling: a bare net/http handler that writes the same bytes with the
// same headers. The ratio of the two is the figure that matters; it holds
// on a noisy machine where absolute numbers do not. BENCHMARKS.md has the
// figures.

// ceiling returns a handler that answers every request with body, the way
// the real handler does (headers, status, bytes), and does nothing else.
func ceiling(status int, body []byte) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil {
			io.Copy(io.Discard, r.Body)
		}
		h := w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(status)
		w.Write(body)
	})
}

// benchRequests sends the request through h in parallel, each answered 200.
func benchRequests(b *testing.B, h http.Handler, method, path, token string, body []byte) {
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, newRequest(method, path, "Bearer "+token, "application/json", bytes.NewReader(body)))
			if w.Code != http.StatusOK {
				b.Fatalf("%s %s: %d %s", method, path, w.Code, w.Body)
			}
		}
	})
}

// benchUser gives alice 25 devices with some telemetry, as in the load goals.
func benchUser(b *testing.B) (*testEnv, []string) {
	env := newTestEnv(b, nil)
	uids := []string{env.alice.device}
	for i := 1; i < 25; i++ {
		uid, err := createDeviceOf(context.Background(), env.st, env.alice.email, "esp32", "devkit", fmt.Sprintf("device %d", i))
		must(b, err)
		uids = append(uids, uid)
	}
	mustExec(b, env.st, `UPDATE devices SET status = 'online', first_seen_at = created_at, last_seen_at = created_at,
		local_ip = '192.168.1.20', public_ip = '203.0.113.7', last_rssi = -60`)
	return env, uids
}

func BenchmarkAPI(b *testing.B) {
	env, uids := benchUser(b)
	paths := []struct{ name, path string }{
		{"me", "/v1/auth/me"},
		{"devices", "/v1/user/devices"},
		{"device", "/v1/user/devices/" + uids[3]},
	}
	for _, p := range paths {
		w := env.request("GET", p.path, env.alice.token, nil)
		b.Run(p.name, func(b *testing.B) { benchRequests(b, env.srv, "GET", p.path, env.alice.token, nil) })
		b.Run(p.name+"-ceiling", func(b *testing.B) {
			benchRequests(b, ceiling(200, w.Body.Bytes()), "GET", p.path, env.alice.token, nil)
		})
	}
}

// BenchmarkAuthenticate is the token check alone: parse, look up, compare.
func BenchmarkAuthenticate(b *testing.B) {
	env := newTestEnv(b, nil)
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := authenticate(ctx, env.st, env.alice.token); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkTelemetryApply feeds telemetry for 1,000 devices into the link's
// message handler and flushes, without a broker: the cost of applying.
func BenchmarkTelemetryApply(b *testing.B) {
	env := newTestEnv(b, nil)
	uids := env.addDevices(env.alice, 1000)
	payload := []byte(`{"local_ip":"192.168.1.20","public_ip":"203.0.113.7","rssi":-61,"fw_md5":"0123456789abcdef0123456789abcdef","fw_version":"1.2.3"}`)
	b.ReportAllocs()
	applyTelemetry(b, newOfflineLink(env.st, env.log), uids, payload, nil)
}

// applyTelemetry hands the link b.N telemetry messages, payload from each
// of uids in turn with a flush after each round (then round, if not nil),
// fails on a message dropped, and reports and returns msgs/s.
func applyTelemetry(b *testing.B, l *mqttlink.Offline, uids []string, payload []byte, round func()) float64 {
	topics := make([]string, len(uids))
	for i, uid := range uids {
		topics[i] = "devices/" + uid + "/telemetry"
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		l.Handle(topics[i%len(topics)], payload, false)
		if i%len(topics) == len(topics)-1 {
			l.Flush()
			if round != nil {
				round()
			}
		}
	}
	l.Flush()
	b.StopTimer()
	if got := dropTotal(l); got != 0 {
		b.Fatalf("%d messages dropped", got)
	}
	rate := float64(b.N) / b.Elapsed().Seconds()
	b.ReportMetric(rate, "msgs/s")
	return rate
}

// fourSeriesReport is a device's telemetry with health and two metrics:
// four series of history.
var fourSeriesReport = []byte(`{"rssi":-61,"fw_md5":"0123456789abcdef0123456789abcdef","fw_version":"1.2.3",` +
	`"heap_free":181234,"uptime_s":3600,"metrics":{"temp_c":22.4,"battery_v":3.72}}`)

// BenchmarkTelemetryHistory is BenchmarkTelemetryApply with telemetry that
// carries health and two metrics (four series), with history kept
// (-history-days 30) and not (0): the cost of writing the buckets, the
// two paired in one run.
func BenchmarkTelemetryHistory(b *testing.B) {
	for _, days := range []int{0, 30} {
		b.Run(fmt.Sprintf("history-days=%d", days), func(b *testing.B) {
			env := newTestEnv(b, nil, withQuotas(store.Quotas{HistoryDays: days}))
			uids := env.addDevices(env.alice, 1000)
			applyTelemetry(b, newOfflineLink(env.st, env.log), uids, fourSeriesReport, nil)
		})
	}
}

// BenchmarkCommandPublish sends user commands to an online device through
// a real Mosquitto, QoS 1, each waiting for the broker's acknowledgement.
func BenchmarkCommandPublish(b *testing.B) {
	br := startBroker(b)
	env, _ := newLinkedEnv(b, br)
	env.setStatus(env.alice.device, "online")
	path := "/v1/user/devices/" + env.alice.device + "/commands"
	body := []byte(`{"payload":{"cmd":"led","on":true}}`)
	run := func(b *testing.B, h http.Handler) {
		b.SetParallelism(16) // requests wait on the broker; keep several in flight
		benchRequests(b, h, "POST", path, env.alice.token, body)
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cmds/s")
	}
	w := env.request("POST", path, env.alice.token, body)
	b.Run("publish", func(b *testing.B) { run(b, env.srv) })
	b.Run("publish-ceiling", func(b *testing.B) { run(b, ceiling(200, w.Body.Bytes())) })
}

// BenchmarkUpload uploads a 4 MiB firmware against a ceiling that reads
// the same body and answers. After each upload the row is deleted (untimed)
// so that the same bytes are stored again, not refused as a duplicate.
func BenchmarkUpload(b *testing.B) {
	env := newTestEnv(b, nil)
	file := otaFirmware(store.MaxFirmwareSize, 1) // an ESP image
	body, ct := multipartForm(map[string]string{"name": "bench"}, file)
	path := "/v1/user/devices/" + env.alice.device + "/firmwares"
	send := func(h http.Handler) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, newRequest("POST", path, "Bearer "+env.alice.token, ct, bytes.NewReader(body)))
		return w
	}
	first := send(env.srv)
	if first.Code != http.StatusCreated {
		b.Fatalf("upload: %d %s", first.Code, first.Body)
	}
	md5sum := decode(b, first)["data"].(map[string]any)["md5"].(string)
	ctx := context.Background()
	run := func(b *testing.B, h http.Handler, real bool) {
		b.ReportAllocs()
		b.SetBytes(store.MaxFirmwareSize)
		for i := 0; i < b.N; i++ {
			if real {
				b.StopTimer()
				must(b, env.st.DeleteFirmware(ctx, env.deviceRef(env.alice), md5sum, nil))
				b.StartTimer()
			}
			if w := send(h); w.Code != http.StatusCreated {
				b.Fatalf("upload: %d %s", w.Code, w.Body)
			}
		}
	}
	b.Run("upload", func(b *testing.B) { run(b, env.srv, true) })
	// The ceiling reads the body into a buffer, as a handler that looked
	// at the bytes would; io.Discard would skip the work entirely.
	b.Run("upload-ceiling", func(b *testing.B) {
		run(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(new(bytes.Buffer), r.Body)
			ceiling(http.StatusCreated, first.Body.Bytes()).ServeHTTP(w, r)
		}), false)
	})
}

// countingWriter is a ResponseWriter that keeps only the status and the
// number of bytes: a million devices' list is not held in a recorder.
type countingWriter struct {
	header http.Header
	status int
	n      int64
}

func (w *countingWriter) Header() http.Header         { return w.header }
func (w *countingWriter) WriteHeader(status int)      { w.status = status }
func (w *countingWriter) Write(b []byte) (int, error) { w.n += int64(len(b)); return len(b), nil }

// peakHeap samples the bytes of live heap objects every 5 ms until stop
// is called, which returns the largest sample.
func peakHeap() (stop func() uint64) {
	done, peak := make(chan struct{}), make(chan uint64)
	go func() {
		sample := []runtimemetrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
		var top uint64
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			runtimemetrics.Read(sample)
			top = max(top, sample[0].Value.Uint64())
			select {
			case <-t.C:
			case <-done:
				peak <- top
				return
			}
		}
	}()
	return func() uint64 { close(done); return <-peak }
}

// BenchmarkDeviceList1M: the device list of a team of 1,000,000 devices
// (addFleet's). full is the whole list, streamed: its bytes, allocations
// and the peak of the live heap while it is written. The pages are
// ?limit=100 at the start and at the end of the list (after the cursor of
// the millionth device but 100), whole and with a filter; each also
// counts meta.total. Setting up the fleet takes about a minute.
func BenchmarkDeviceList1M(b *testing.B) {
	const n = 1_000_000
	env := newTestEnv(b, nil)
	addFleet(b, env.st, env.teamOf(env.alice), n)
	var last int64
	must(b, storeReader(env.st).QueryRow(`SELECT max(id) FROM devices`).Scan(&last))
	get := func(b *testing.B, query string) *countingWriter {
		w := &countingWriter{header: http.Header{}}
		env.srv.ServeHTTP(w, newRequest("GET", "/v1/user/devices"+query, "Bearer "+env.alice.token, "", nil))
		if w.status != http.StatusOK {
			b.Fatalf("GET %s: %d", query, w.status)
		}
		return w
	}
	b.Run("full", func(b *testing.B) {
		b.ReportAllocs()
		stop := peakHeap()
		for range b.N {
			b.SetBytes(get(b, "").n)
		}
		b.ReportMetric(float64(stop())/(1<<20), "peak-heap-MiB")
	})
	end := pageCursor(last - 100)
	for _, p := range []struct{ name, query string }{
		{"page-first", "?limit=100"},
		{"page-last", "?limit=100&after=" + end},
		{"status-first", "?limit=100&status=online"},
		{"status-last", "?limit=100&status=online&after=" + end},
		{"board-first", "?limit=100&board=wroom"},
		{"board-last", "?limit=100&board=wroom&after=" + end},
		{"q-rare", "?limit=100&q=fleet%20999999"},
	} {
		b.Run(p.name, func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				get(b, p.query)
			}
		})
	}
}

// BenchmarkRolloutAdvance moves on a running rollout whose current batch
// of 1,000 devices waits (no broker), at 1,000 and 100,000 devices: the
// engine reads the batch, never the whole rollout, so the two cost the same.
func BenchmarkRolloutAdvance(b *testing.B) {
	for _, n := range []int{1_000, 100_000} {
		b.Run(fmt.Sprintf("devices=%d", n), func(b *testing.B) {
			env := newTestEnv(b, nil)
			img := newOTAImage(41, 1<<10)
			env.uploadImage(env.alice, env.alice.device, img, "fw", "1")
			addFleet(b, env.st, env.teamOf(env.alice), n)
			env.want(b, http.StatusCreated, "POST", "/v1/user/rollouts", env.alice.token,
				map[string]any{"md5": img.md5, "select": map[string]string{"q": "fleet"}, "batch_size": 1000})
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				env.srv.rollouts.advance(ctx)
			}
		})
	}
}

// BenchmarkLibraryList: GET /v1/user/firmwares of a team with 200
// library files on 10,000 devices, each device running one of them and
// one in ten targeting one (docs/security.md: at most 50 ms).
func BenchmarkLibraryList(b *testing.B) {
	env := newTestEnv(b, nil)
	team := env.teamOf(env.alice)
	addLibraryFleet(b, env, team, 200, 10_000)
	b.ReportAllocs()
	for range b.N {
		w := env.request("GET", "/v1/user/firmwares", env.alice.token, nil)
		if w.Code != http.StatusOK {
			b.Fatalf("list: %d %s", w.Code, w.Body)
		}
	}
}

// addLibraryFleet gives the team files library entries (md5 and sha256
// made of the entry's number) and devices devices: device i runs entry
// i % files, and one in ten has a firmware row of that entry as target.
func addLibraryFleet(tb testing.TB, env *testEnv, team int64, files, devices int) {
	addFleet(tb, env.st, team, devices)
	mustExec(tb, env.st, `WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq WHERE i < ?2 - 1)
		INSERT INTO library_firmwares (team_id, name, md5, sha256, size, created_at)
		SELECT ?1, 'lib ' || i, printf('%032d', i), printf('%064d', i), 1000, '2026-01-01T00:00:00.000000Z' FROM seq`, team, files)
	mustExec(tb, env.st, `UPDATE devices SET current_md5 = printf('%032d', id % ?2) WHERE team_id = ?1`, team, files)
	mustExec(tb, env.st, `INSERT INTO firmwares (device_id, name, md5, sha256, size, created_at)
		SELECT id, 'row', printf('%032d', id % ?2), printf('%064d', id % ?2), 1000, '2026-01-01T00:00:00.000000Z'
		FROM devices WHERE team_id = ?1 AND id % 10 = 0`, team, files)
	mustExec(tb, env.st, `UPDATE devices SET target_firmware_id = (SELECT id FROM firmwares f WHERE f.device_id = devices.id)
		WHERE team_id = ?1 AND id % 10 = 0`, team)
}
