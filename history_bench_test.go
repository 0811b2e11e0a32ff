package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"devicehub/internal/history"
)

// historyBenchDays is how much history BenchmarkHistory30Days holds.
const historyBenchDays = 30

// historySeries are the four series each device reports every 30 s.
var historySeries = []string{"rssi", "heap_free", "metrics.temp_c", "metrics.battery_v"}

// historyFleet is a team of devices with historyBenchDays of history of
// historySeries, the store's clock at its end.
type historyFleet struct {
	env      *testEnv
	ids      []int64
	uids     []string
	end      time.Time // the store's clock once filled
	dbBefore int64     // the database's size before the history was written
}

// newHistoryFleet adds n devices to alice's team and fills their history
// as the link would write it: one report per device per 5-minute bucket,
// in time order across the fleet, each report's four samples folded from
// ten readings 30 s apart, through reportStmts.applyHealth (one
// transaction per bucket, as a flush is). Each device ran firmware A,
// then B for the last 5 days, booted once a day (a crash each fifth
// day) and went offline for 5 minutes twice a day.
func newHistoryFleet(b *testing.B, n int) *historyFleet {
	b.Helper()
	env := newTestEnv(b, nil)
	ctx := context.Background()
	addFleet(b, env.st, env.teamOf(env.alice), n)
	f := &historyFleet{env: env}
	rows, err := env.st.writer.Query(`SELECT id, uid FROM devices WHERE uid LIKE '%fleet%' ORDER BY id`)
	must(b, err)
	for rows.Next() {
		var id int64
		var uid string
		must(b, rows.Scan(&id, &uid))
		f.ids, f.uids = append(f.ids, id), append(f.uids, uid)
	}
	must(b, rows.Err())
	f.dbBefore = dbSize(b, env.st)

	f.end = env.clock.now().Truncate(time.Hour)
	start := f.end.AddDate(0, 0, -historyBenchDays)
	switchAt := f.end.AddDate(0, 0, -5)
	ts := func(t time.Time) int64 { return t.Unix() }
	mustExec(b, env.st, `DELETE FROM firmware_runs`)
	mustExec(b, env.st, `INSERT INTO firmware_runs (device_id, md5, version, from_at, to_at)
		SELECT id, printf('%032d', 1), '1.0', ?1, ?2 FROM devices WHERE uid LIKE '%fleet%'`, ts(start), ts(switchAt))
	mustExec(b, env.st, `INSERT INTO firmware_runs (device_id, md5, version, from_at)
		SELECT id, printf('%032d', 2), '2.0', ?1 FROM devices WHERE uid LIKE '%fleet%'`, ts(switchAt))
	for day := range historyBenchDays {
		at := start.AddDate(0, 0, day)
		md5 := fmt.Sprintf("%032d", map[bool]int{true: 1, false: 2}[at.Before(switchAt)])
		reason := map[bool]string{true: "panic", false: "poweron"}[day%5 == 0]
		mustExec(b, env.st, `INSERT INTO boots (device_id, at, reason, crash, fw_md5, fw_version)
			SELECT id, ?1, ?2, ?3, ?4, '' FROM devices WHERE uid LIKE '%fleet%'`, ts(at.Add(time.Hour)), reason, day%5 == 0, md5)
		for _, h := range []int{6, 18} {
			on, off := at.Add(time.Duration(h)*time.Hour), at.Add(time.Duration(h)*time.Hour+5*time.Minute)
			mustExec(b, env.st, `INSERT INTO presence (device_id, online, from_at, to_at)
				SELECT id, 0, ?1, ?2 FROM devices WHERE uid LIKE '%fleet%'`, ts(on), ts(off))
		}
	}

	reports := make([]history.Report, n)
	for t := start; t.Before(f.end); t = t.Add(history.BucketSeconds * time.Second) {
		for i := range reports {
			reports[i].Samples = historySamples(reports[i].Samples[:0], t.Unix(), i)
		}
		var flush *history.Flush
		err := env.st.inTx(ctx, func(tx *sql.Tx) error {
			var err error
			if flush, err = history.Begin(ctx, tx, env.st.history); err != nil {
				return err
			}
			defer flush.Close()
			for i, id := range f.ids {
				if _, _, err := flush.Add(ctx, &history.Report{DeviceID: id, Seen: t, Samples: reports[i].Samples}); err != nil {
					return err
				}
			}
			_, err = flush.Finish(ctx, t)
			return err
		})
		flush.Done(err == nil)
		must(b, err)
	}
	env.clock.set(f.end)
	return f
}

// historySamples appends the four buckets device i reports for bucket
// t: ten readings each, 30 s apart, with the spread of a real device's
// (RSSI in whole dBm, heap in bytes, a temperature and a battery voltage
// with decimals).
func historySamples(h []history.Sample, t int64, i int) []history.Sample {
	k := float64((t/300 + int64(i)) % 17)
	for _, s := range []struct {
		name        string
		lo, hi, sum float64
		last        float64
	}{
		{"rssi", -70 - k, -58 + k, 10*-64 + k, -63 - k},
		{"heap_free", 180000 - 97*k, 182000 + 13*k, 1810000 + 1234*k, 181000 + 7*k},
		{"metrics.temp_c", 21.3 + k/10, 22.9 + k/10, 221.7 + k, 22.1 + k/10},
		{"metrics.battery_v", 3.71 - k/100, 3.74, 37.27 - k/100, 3.72},
	} {
		h = append(h, history.Sample{Series: s.name, Bucket: t, Min: s.lo, Max: s.hi, Sum: s.sum, Count: 10, Last: s.last})
	}
	return h
}

// dbSize is the size of the store's database file with its WAL
// checkpointed into it.
func dbSize(b *testing.B, st *store) int64 {
	b.Helper()
	_, err := st.writer.Exec(`PRAGMA wal_checkpoint(TRUNCATE)`)
	must(b, err)
	fi, err := os.Stat(filepath.Join(filepath.Dir(st.fwDir), "devicehub.db"))
	must(b, err)
	return fi.Size()
}

// historyBenchDevices is how many devices BenchmarkHistory30Days fills:
// DEVICEHUB_BENCH_HISTORY_DEVICES (a comma-separated list); 2 by default,
// so that CI's single run stays short.
func historyBenchDevices(b *testing.B) []int {
	list := cmp.Or(os.Getenv("DEVICEHUB_BENCH_HISTORY_DEVICES"), "2")
	var ns []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(f)
		must(b, err)
		ns = append(ns, n)
	}
	return ns
}

// BenchmarkHistory30Days fills 30 days of history of four series reported
// every 30 s for a fleet (newHistoryFleet; historyBenchDevices), then
// measures (CONTRACT §14, issue 29's goals):
//   - disk: the database's growth per device (KiB-per-device), its rows
//     and bytes per bucket row;
//   - chart-30d: GET …/history of one series over 30 days, points=300,
//     the median of the runs (median-ms), devices in turn;
//   - firmware-health-7d: GET /v1/user/firmware-health?hours=168, the
//     median (median-ms);
//   - prune: each run moves the clock on an hour and makes a retention
//     pass, step by step as the pruner does; the longest step
//     (max-step-ms) is the longest the write lock is held.
//
// Filling takes about 4 s per device on a loaded 2-core machine: run it
// with -benchtime 10x or so.
func BenchmarkHistory30Days(b *testing.B) {
	for _, n := range historyBenchDevices(b) {
		b.Run(fmt.Sprintf("devices=%d", n), func(b *testing.B) { benchHistory(b, n) })
	}
}

func benchHistory(b *testing.B, n int) {
	begun := time.Now()
	f := newHistoryFleet(b, n)
	b.Logf("filled %d devices in %s", n, time.Since(begun).Round(time.Second))
	env, ctx := f.env, context.Background()
	b.Run("disk", func(b *testing.B) {
		var rows int64
		must(b, env.st.writer.QueryRow(`SELECT count(*) FROM history_rows`).Scan(&rows))
		grown := dbSize(b, env.st) - f.dbBefore
		for range b.N {
		}
		b.ReportMetric(float64(grown)/float64(n)/1024, "KiB-per-device")
		b.ReportMetric(float64(rows)/float64(n), "rows-per-device")
		b.ReportMetric(float64(grown)/float64(rows), "bytes-per-row")
	})
	get := func(b *testing.B, path string) {
		w := env.request("GET", path, env.alice.token, nil)
		if w.Code != http.StatusOK {
			b.Fatalf("GET %s: %d %s", path, w.Code, w.Body)
		}
	}
	from, to := f.end.AddDate(0, 0, -historyBenchDays).Format(time.RFC3339), f.end.Format(time.RFC3339)
	b.Run("chart-30d", func(b *testing.B) {
		medianOf(b, func(i int) {
			get(b, "/v1/user/devices/"+f.uids[(i*7919)%n]+"/history?series=heap_free&points=300&from="+from+"&to="+to)
		})
	})
	b.Run("firmware-health-7d", func(b *testing.B) {
		medianOf(b, func(int) { get(b, "/v1/user/firmware-health?hours=168") })
	})
	b.Run("prune", func(b *testing.B) {
		var longest time.Duration
		steps := 0
		for i := range b.N {
			env.clock.set(f.end.Add(time.Duration(i+1) * time.Hour))
			cutoff := env.clock.now().AddDate(0, 0, -historyBenchDays)
			for pass := (&history.Pass{}); ; steps++ {
				t0 := time.Now()
				done, err := env.st.retentionStep(ctx, pass, cutoff)
				must(b, err)
				longest = max(longest, time.Since(t0))
				if done {
					break
				}
			}
		}
		b.ReportMetric(float64(longest.Microseconds())/1000, "max-step-ms")
		b.ReportMetric(float64(steps)/float64(b.N), "steps-per-pass")
	})
}

// medianOf runs op b.N times and reports the median run's time.
func medianOf(b *testing.B, op func(i int)) {
	times := make([]time.Duration, b.N)
	for i := range b.N {
		t0 := time.Now()
		op(i)
		times[i] = time.Since(t0)
	}
	slices.Sort(times)
	b.ReportMetric(float64(times[len(times)/2].Microseconds())/1000, "median-ms")
}
