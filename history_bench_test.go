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
	"devicehub/internal/store"
)

// historyBenchDays is how much history BenchmarkHistory30Days holds.
const historyBenchDays = 30

// historySeries are the four series each device reports every 30 s.
var historySeries = []string{"rssi", "heap_free", "metrics.temp_c", "metrics.battery_v"}

// historyFleet is a team of devices with historyBenchDays of history of
// historySeries, the store's clock at its end.
type historyFleet struct {
	env      *testEnv
	team     int64
	ids      []int64
	uids     []string
	end      time.Time // the store's clock once filled
	dbBefore int64     // the database's size before the history was written
}

// newHistoryFleet adds n devices to alice's team and fills their history
// of series series (4 or 18) through the history's write path: each
// device's report for a 5-minute bucket folds 30 readings 10 s apart
// (historySamples), handed to history.Flush.Add and written as its
// bucket closes (Finish), one flush per bucket across the fleet, with a
// retention pass every simulated hour (hours rolled up into days). The
// first device is so filled for all but the last day; the others get
// copies of its rows, the same bytes, in time order (a bulk fill with
// the same encoding); then the whole fleet reports the last day through
// the write path. Each device ran firmware A, then B for the last 5
// days, booted once a day (a crash each fifth day) and went offline for
// 5 minutes twice a day.
func newHistoryFleet(b *testing.B, n, series int) *historyFleet {
	b.Helper()
	env := newTestEnv(b, nil)
	addFleet(b, env.st, env.teamOf(env.alice), n)
	f := &historyFleet{env: env, team: env.teamOf(env.alice)}
	rows, err := storeWriter(env.st).Query(`SELECT id, uid FROM devices WHERE uid LIKE '%fleet%' ORDER BY id`)
	must(b, err)
	for rows.Next() {
		var id int64
		var uid string
		must(b, rows.Scan(&id, &uid))
		f.ids, f.uids = append(f.ids, id), append(f.uids, uid)
	}
	must(b, rows.Err())
	f.dbBefore = dbSize(b, env.st)

	f.end = env.clock.now().Truncate(24 * time.Hour)
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
		mustExec(b, env.st, `INSERT INTO boots (device_id, number, at, reason, crash, fw_md5, fw_version)
			SELECT id, ?5, ?1, ?2, ?3, ?4, '' FROM devices WHERE uid LIKE '%fleet%'`, ts(at.Add(time.Hour)), reason, day%5 == 0, md5, day+1)
		for _, h := range []int{6, 18} {
			on, off := at.Add(time.Duration(h)*time.Hour), at.Add(time.Duration(h)*time.Hour+5*time.Minute)
			mustExec(b, env.st, `INSERT INTO presence (device_id, online, from_at, to_at)
				SELECT id, 0, ?1, ?2 FROM devices WHERE uid LIKE '%fleet%'`, ts(on), ts(off))
		}
	}
	// Their hours, as the flushes that record them would count them.
	mustExec(b, env.st, `INSERT INTO fleet_hours (team_id, md5, hour, boots, crashes)
		SELECT d.team_id, b.fw_md5, b.at - b.at % 3600, count(*), sum(b.crash) FROM boots b JOIN devices d ON d.id = b.device_id
		WHERE b.fw_md5 IS NOT NULL GROUP BY d.team_id, b.fw_md5, b.at - b.at % 3600`)
	mustExec(b, env.st, `INSERT INTO fleet_hours (team_id, md5, hour, offline)
		SELECT d.team_id, r.md5, p.from_at - p.from_at % 3600, count(*) FROM presence p JOIN devices d ON d.id = p.device_id
		JOIN firmware_runs r ON r.device_id = p.device_id AND p.from_at >= r.from_at AND (r.to_at IS NULL OR p.from_at < r.to_at)
		WHERE NOT p.online GROUP BY d.team_id, r.md5, p.from_at - p.from_at % 3600
		ON CONFLICT (team_id, md5, hour) DO UPDATE SET offline = excluded.offline`)
	lastDay := f.end.AddDate(0, 0, -1)
	f.report(b, f.ids[:1], series, start, lastDay)
	mustExec(b, env.st, `INSERT INTO history_rows (device_id, step, start, slots)
		SELECT d.id, h.step, h.start, h.slots FROM history_rows h, devices d
		WHERE h.device_id = ?1 AND d.uid LIKE '%fleet%' AND d.id != ?1 ORDER BY h.start, h.step, d.id`, f.ids[0])
	f.report(b, f.ids, series, lastDay, f.end)
	return f
}

// firmwareAt is the md5 the fleet runs at t: A, then B for the last 5
// days.
func (f *historyFleet) firmwareAt(t time.Time) string {
	return fmt.Sprintf("%032d", map[bool]int{true: 1, false: 2}[t.Before(f.end.AddDate(0, 0, -5))])
}

// report has the devices ids report their series (4 or 18) for every
// bucket in [from, to), a flush per bucket, and runs a retention pass
// each day; the store's clock is at to after.
func (f *historyFleet) report(b *testing.B, ids []int64, series int, from, to time.Time) {
	env, ctx := f.env, context.Background()
	samples := make([][]history.Sample, len(ids))
	for t := from; !t.After(to); t = t.Add(history.BucketSeconds * time.Second) {
		env.clock.set(t)
		var flush *history.Flush
		err := inTx(ctx, env.st, func(tx *sql.Tx) error {
			flush = history.Begin(tx, storeEngine(env.st))
			defer flush.Close()
			for i, id := range ids {
				if t.Equal(to) {
					break // only closes the last bucket
				}
				samples[i] = historySamples(samples[i][:0], t.Unix(), int(id), series)
				r := &history.Report{DeviceID: id, TeamID: f.team, Firmware: f.firmwareAt(t), Seen: t, Samples: samples[i]}
				if _, _, err := flush.Add(ctx, r); err != nil {
					return err
				}
			}
			_, _, err := flush.Finish(ctx, t)
			return err
		})
		flush.Done(err == nil)
		must(b, err)
		for range len(ids) / 2000 { // the closed buckets one flush left, as the next flushes write them
			err := inTx(ctx, env.st, func(tx *sql.Tx) error {
				flush = history.Begin(tx, storeEngine(env.st))
				defer flush.Close()
				_, _, err := flush.Finish(ctx, t)
				return err
			})
			flush.Done(err == nil)
			must(b, err)
		}
		if t.Unix()%3600 == 0 {
			must(b, env.st.Checkpoint(ctx)) // as server.run does every second
		}
		if t.Unix()%86400 == 0 {
			retentionPass(b, env.st) // the pruner's hourly passes, a day's at once
		}
	}
}

// retentionPass runs a whole retention pass, step by step, and returns
// its steps and the longest one.
func retentionPass(b *testing.B, st *store.Store) (steps int, longest time.Duration) {
	cutoff := st.Now().AddDate(0, 0, -historyBenchDays)
	for pass := (&history.Pass{}); ; steps++ {
		t0 := time.Now()
		done, err := st.RetentionStep(context.Background(), pass, cutoff)
		must(b, err)
		longest = max(longest, time.Since(t0))
		if done {
			return steps, longest
		}
	}
}

// historySamples appends the buckets device i reports for bucket t of
// series series (4: rssi, heap_free, temp_c, battery_v; 18: and 14
// metrics more): 30 readings each, 10 s apart, with the spread of a real
// device's (RSSI in whole dBm, heap in bytes, a temperature and a battery
// voltage with decimals).
func historySamples(h []history.Sample, t int64, i, series int) []history.Sample {
	k := float64((t/300 + int64(i)) % 17)
	for j, s := range []struct {
		name        history.SeriesName
		lo, hi, sum float64
		last        float64
	}{
		{"rssi", -70 - k, -58 + k, 30*-64 + k, -63 - k},
		{"heap_free", 180000 - 97*k, 182000 + 13*k, 5430000 + 1234*k, 181000 + 7*k},
		{"metrics.temp_c", 21.3 + k/10, 22.9 + k/10, 665.1 + k, 22.1 + k/10},
		{"metrics.battery_v", 3.71 - k/100, 3.74, 111.81 - k/100, 3.72},
	} {
		h = append(h, history.Sample{Series: s.name, Bucket: t, Min: s.lo, Max: s.hi, Sum: s.sum, Count: 30, Last: s.last})
		if j == 3 {
			for m := range series - 4 {
				v := float64(m) + k/7
				h = append(h, history.Sample{Series: history.MetricSeries(fmt.Sprintf("m%02d", m)), Bucket: t, Min: v - 1.5, Max: v + 2.25,
					Sum: 30*v + k, Count: 30, Last: v})
			}
		}
	}
	return h
}

// dbSize is the size of the store's database file with its WAL
// checkpointed into it.
func dbSize(b *testing.B, st *store.Store) int64 {
	b.Helper()
	_, err := storeWriter(st).Exec(`PRAGMA wal_checkpoint(TRUNCATE)`)
	must(b, err)
	fi, err := os.Stat(filepath.Join(filepath.Dir(firmwareDir(st)), "devicehub.db"))
	must(b, err)
	return fi.Size()
}

// historyBenchDevices is how many devices BenchmarkHistory30Days fills:
// DEVICEHUB_BENCH_HISTORY_DEVICES (a comma-separated list); 2 by default,
// so that CI's single run stays short. DEVICEHUB_BENCH_HISTORY_SERIES
// says how many series they report (4,18 by default).
func historyBenchDevices(b *testing.B) []int {
	return benchList(b, "DEVICEHUB_BENCH_HISTORY_DEVICES", "2")
}

// benchList reads the comma-separated numbers of the environment
// variable name, def when it is not set.
func benchList(b *testing.B, name, def string) []int {
	list := cmp.Or(os.Getenv(name), def)
	var ns []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(f)
		must(b, err)
		ns = append(ns, n)
	}
	return ns
}

// BenchmarkHistory30Days fills 30 days of history of 4 and of 18 series
// reported every 10 s for a fleet (newHistoryFleet; historyBenchDevices),
// then measures (issue 35's goals):
//   - disk: the database's growth per device (KiB-per-device) after a
//     checkpoint, its rows of history, and dbstat by table (logged);
//   - chart-30d: GET …/history of one series over 30 days, points=300,
//     the median of the runs (median-ms), devices in turn;
//   - firmware-health-7d, -30d: GET /v1/user/firmware-health?hours=168
//     and 720, the median (median-ms);
//   - prune: each run moves the clock on an hour and makes a retention
//     pass, step by step as the pruner does; the longest step
//     (max-step-ms) is the longest the write lock is held.
//
// Filling 1,000 devices takes about a minute: run it with -benchtime 5x
// or so.
func BenchmarkHistory30Days(b *testing.B) {
	for _, n := range historyBenchDevices(b) {
		for _, series := range benchList(b, "DEVICEHUB_BENCH_HISTORY_SERIES", "4,18") {
			b.Run(fmt.Sprintf("devices=%d/series=%d", n, series), func(b *testing.B) { benchHistory(b, n, series) })
		}
	}
}

func benchHistory(b *testing.B, n, series int) {
	begun := time.Now()
	f := newHistoryFleet(b, n, series)
	b.Logf("filled %d devices in %s", n, time.Since(begun).Round(time.Second))
	env := f.env
	b.Run("disk", func(b *testing.B) {
		var rows int64
		must(b, storeWriter(env.st).QueryRow(`SELECT count(*) FROM history_rows`).Scan(&rows))
		grown := dbSize(b, env.st) - f.dbBefore
		for range b.N {
		}
		b.ReportMetric(float64(grown)/float64(n)/1024, "KiB-per-device")
		b.ReportMetric(float64(rows)/float64(n), "rows-per-device")
		b.Logf("dbstat, KiB per device: %s", scalar(b, env.st, `SELECT group_concat(name || ' ' || printf('%.1f', kib / ?), ', ')
			FROM (SELECT name, sum(pgsize) / 1024.0 AS kib FROM dbstat GROUP BY name ORDER BY kib DESC LIMIT 8)`, n))
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
	for _, days := range []int{7, 30} {
		b.Run(fmt.Sprintf("firmware-health-%dd", days), func(b *testing.B) {
			medianOf(b, func(int) { get(b, fmt.Sprintf("/v1/user/firmware-health?hours=%d", 24*days)) })
		})
	}
	b.Run("prune", func(b *testing.B) {
		var longest time.Duration
		steps := 0
		for i := range b.N {
			env.clock.set(f.end.Add(time.Duration(i+1) * time.Hour))
			must(b, env.st.Checkpoint(context.Background())) // as server.run does every second
			n, step := retentionPass(b, env.st)
			steps, longest = steps+n, max(longest, step)
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

// BenchmarkIngest30Days is BenchmarkTelemetryHistory on full tables
// (issue 35: with 30 days of 10,000 devices, ingest with history at
// least 0.85 of -history-days 0). It fills 30 days of 4 series for a
// fleet (newHistoryFleet; DEVICEHUB_BENCH_INGEST_DEVICES, a list, 200
// by default), then has every device send fourSeriesReport through the
// offline link, a round of all devices then the clock 10 s on, with
// -history-days 0 and then 30, on that database. Each run starts at a
// bucket's start after a bucket's worth of untimed rounds, so that
// every 30 timed rounds close and write each device's bucket once, as
// a device reporting every 10 s does. It reports msgs/s of each, and
// with history the rate without (no-history-msgs/s) and the ratio of
// the two. No retention pass runs meanwhile. -benchtime must be 60
// rounds (devices × 60); at 10,000 devices the fill takes minutes:
//
//	DEVICEHUB_BENCH_INGEST_DEVICES=10000 go test -run '^$' -bench Ingest30Days -benchtime 600000x -timeout 60m .
func BenchmarkIngest30Days(b *testing.B) {
	for _, n := range benchList(b, "DEVICEHUB_BENCH_INGEST_DEVICES", "200") {
		b.Run(fmt.Sprintf("devices=%d", n), func(b *testing.B) {
			begun := time.Now()
			f := newHistoryFleet(b, n, 4)
			b.Logf("filled %d devices in %s", n, time.Since(begun).Round(time.Second))
			env, bucket := f.env, history.BucketSeconds*time.Second
			var without float64
			for _, days := range []int{0, historyBenchDays} {
				b.Run(fmt.Sprintf("history-days=%d", days), func(b *testing.B) {
					env.rebuild(withQuotas(store.Quotas{HistoryDays: days}))
					l := newOfflineLink(env.st, env.log)
					start := env.clock.now().Truncate(bucket).Add(2 * bucket)
					for t := start.Add(-bucket); t.Before(start); t = t.Add(10 * time.Second) {
						env.clock.set(t) // untimed; older closed buckets written meanwhile, 2,000 a flush
						for _, uid := range f.uids {
							l.Handle("devices/"+uid+"/telemetry", fourSeriesReport, false)
						}
						l.Flush()
					}
					env.clock.set(start)
					rate := applyTelemetry(b, l, f.uids, fourSeriesReport, func() { env.clock.advance(10 * time.Second) })
					if days == 0 {
						without = rate
						return
					}
					b.ReportMetric(without, "no-history-msgs/s")
					b.ReportMetric(rate/without, "ratio")
				})
			}
		})
	}
}
