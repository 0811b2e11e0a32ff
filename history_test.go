package main

// Tests of the history's layout and release health's hours
// (internal/history): the upgrade from the buckets of before, the
// comparison against a brute-force count, the bucket under way at a
// clean stop.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// TestStoreMigrateHistory: version 16 on a database of the release before
// with 30 days of two series of a device keeps them: the retention steps
// convert the old buckets into rows (5-minute slots for the last 7 days,
// hourly ones before) and drop the old tables; every count, min and max
// is kept, each sum to float32's precision; boots and presence keep
// their times.
func TestStoreMigrateHistory(t *testing.T) {
	// Not parallel: it swaps the package's migrations (oldReleaseDB).
	ctx := context.Background()
	_, v5 := oldReleaseDB(t, 5)
	dir := t.TempDir()
	must(t, v5.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))
	old := storeAtVersion(t, dir, 15) // versions 1-15: the database before version 16
	end := time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)
	start := end.AddDate(0, 0, -30)
	mustExec(t, old, `INSERT INTO series (id, device_id, name) VALUES (1, 1, 'rssi'), (2, 1, 'metrics.temp_c')`)
	mustExec(t, old, `WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 30 * 288 - 1)
		INSERT INTO buckets (series_id, t, min, max, sum, count, last)
		SELECT 1, ?1 + i * 300, -70 - i % 7, -50 + i % 5, (-60 - i % 3) * 10, 10, -61 FROM n
		UNION ALL SELECT 2, ?1 + i * 300, 21.5 + (i % 10) / 10.0, 24.25, 225.5 + i % 4, 10, 22.1 FROM n`, start.Unix())
	mustExec(t, old, `INSERT INTO boots (device_id, at, reason, crash, fw_md5) VALUES (1, '2026-11-01T00:00:00.000000Z', 'panic', 1, 'md5a')`)
	mustExec(t, old, `INSERT INTO presence (device_id, online, from_at, to_at) VALUES (1, 0, '2026-11-01T00:00:00.000000Z', '2026-11-02T00:00:00.000000Z')`)
	totals := `SELECT group_concat(v, ' ') FROM (SELECT s.name || ':' || sum(b.count) || ',' || printf('%g', min(b.min)) || ',' || printf('%g', max(b.max)) AS v
		FROM buckets b JOIN series s ON s.id = b.series_id GROUP BY s.name ORDER BY s.name)`
	want := scalar(t, old, totals)
	wantSums := map[string]float64{}
	for _, name := range []string{"rssi", "metrics.temp_c"} {
		var sum float64
		must(t, storeWriter(old).QueryRow(`SELECT sum(b.sum) FROM buckets b JOIN series s ON s.id = b.series_id WHERE s.name = ?`, name).Scan(&sum))
		wantSums[name] = sum
	}
	dir = t.TempDir()
	must(t, old.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))
	st, err := store.Open(ctx, dir, func() time.Time { return end }, store.Quotas{HistoryDays: 30})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	log, _ := captureLogs(t)
	p := &historyPruner{store: st, log: log}
	for range 100 {
		if p.run(ctx); scalar(t, st, `SELECT count(*) FROM sqlite_master WHERE name LIKE 'legacy_%'`) == "0" {
			break
		}
	}
	wantDB(t, st, "0", `SELECT count(*) FROM sqlite_master WHERE name LIKE 'legacy_%'`)
	var got []string
	for _, name := range []string{"metrics.temp_c", "rssi"} {
		list, err := st.BucketsOf(ctx, deviceRefByID(t, st, 1), history.SeriesName(name), start.Unix(), end.Unix())
		must(t, err)
		var count, detail int64
		lo, hi, sum := math.Inf(1), math.Inf(-1), 0.0
		for _, b := range list {
			count, lo, hi, sum = count+b.Count, min(lo, b.Min), max(hi, b.Max), sum+b.Sum
			if b.Bucket >= end.AddDate(0, 0, -7).Unix() {
				detail++
			}
		}
		got = append(got, fmt.Sprintf("%s:%d,%s,%s", name, count, strconv.FormatFloat(lo, 'g', -1, 64), strconv.FormatFloat(hi, 'g', -1, 64)))
		if math.Abs(sum-wantSums[name]) > 1e-6*math.Abs(wantSums[name]) {
			t.Errorf("%s: sum %v, want %v", name, sum, wantSums[name])
		}
		if hours := int64(len(list)) - detail; detail != 7*288 || hours != 23*24 {
			t.Errorf("%s: %d 5-minute slots and %d hourly ones, want %d and %d", name, detail, hours, 7*288, 23*24)
		}
	}
	if g := strings.Join(got, " "); g != want {
		t.Errorf("count, min, max: got %s, want %s", g, want)
	}
	boots, err := st.BootsOf(ctx, deviceRefByID(t, st, 1), 0, 10)
	must(t, err)
	presence, err := st.PresenceOf(ctx, deviceRefByID(t, st, 1), start, end, 10)
	must(t, err)
	if len(boots) != 1 || boots[0].At != "2026-11-01T00:00:00.000000Z" || len(presence) != 1 || *presence[0].To != "2026-11-02T00:00:00.000000Z" {
		t.Errorf("boots %+v, presence %+v", boots, presence)
	}
}

// TestFirmwareHealthRollup: the comparison, read from the hours of
// fleet_hours, and the rollout gate's count of crashes, against a
// brute-force count of what 100 devices did over
// a day through the write path: two firmwares, each device switching at
// its own time, boots and crashes, offline intervals, and readings of
// random spread. Counts and device-days match exactly; the medians of
// the devices' 5-minute means within 1 dBm and 1 % of heap.
func TestFirmwareHealthRollup(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	ctx := context.Background()
	teamID := env.teamOf(env.alice)
	addFleet(t, env.st, teamID, 100)
	var ids []int64
	uids := map[int64]string{}
	rows, err := storeReader(env.st).QueryContext(ctx, `SELECT id, uid FROM devices WHERE uid LIKE '%fleet%' ORDER BY id`)
	must(t, err)
	for rows.Next() {
		var id int64
		var uid string
		must(t, rows.Scan(&id, &uid))
		uids[id] = uid
		ids = append(ids, id)
	}
	must(t, errors.Join(rows.Err(), rows.Close()))
	const fwA, fwB = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	start := env.clock.now().Truncate(24 * time.Hour)
	end := start.Add(24 * time.Hour)
	rnd := rand.New(rand.NewPCG(1, 2))
	switchAt := map[int64]time.Time{}
	mustExec(t, env.st, `DELETE FROM firmware_runs`)
	for _, id := range ids {
		switchAt[id] = start.Add(time.Duration(rnd.IntN(24*12)) * 5 * time.Minute)
		mustExec(t, env.st, `UPDATE devices SET current_md5 = ? WHERE id = ?`, fwA, id)
		mustExec(t, env.st, `INSERT INTO firmware_runs (device_id, md5, from_at, to_at) VALUES (?1, ?2, ?3, ?4), (?1, ?5, ?4, NULL)`,
			id, fwA, start.Unix(), switchAt[id].Unix(), fwB)
	}
	type want struct {
		boots, crashes, offline int
		rssi, heap              []float64
	}
	wants := map[string]*want{fwA: {}, fwB: {}}
	md5At := func(id int64, t time.Time) string {
		return map[bool]string{true: fwA, false: fwB}[t.Before(switchAt[id])]
	}
	for at := start; at.Before(end); at = at.Add(5 * time.Minute) {
		env.clock.set(at)
		var changes []history.Change
		var flush *history.Flush
		err := inTx(ctx, env.st, func(tx *sql.Tx) error {
			flush = history.Begin(tx, storeEngine(env.st))
			defer flush.Close()
			for _, id := range ids {
				md5 := md5At(id, at)
				if at.Equal(switchAt[id]) {
					if _, err := tx.ExecContext(ctx, `UPDATE devices SET current_md5 = ? WHERE id = ?`, md5, id); err != nil {
						return err
					}
				}
				r := &history.Report{DeviceID: id, TeamID: teamID, Firmware: md5, Seen: at}
				n := 1 + rnd.IntN(30)
				for _, s := range []struct {
					name     history.SeriesName
					lo, span float64
				}{{"rssi", -90, 50}, {"heap_free", 50_000, 150_000}} {
					mean := s.lo + s.span*rnd.Float64()
					r.Samples = append(r.Samples, history.Sample{Series: s.name, Bucket: at.Unix(), Min: mean - 1, Max: mean + 1,
						Sum: mean * float64(n), Count: int64(n), Last: mean})
					w := wants[md5]
					if s.name == "rssi" {
						w.rssi = append(w.rssi, mean)
					} else {
						w.heap = append(w.heap, mean)
					}
				}
				if rnd.IntN(50) == 0 {
					reason := []string{"panic", "poweron", "task_wdt"}[rnd.IntN(3)]
					r.Boots = []history.Boot{{Reason: reason, Arrived: at}}
					wants[md5].boots++
					if history.IsCrash(reason) {
						wants[md5].crashes++
					}
				}
				if rnd.IntN(40) == 0 {
					changes = append(changes, history.Change{DeviceID: id, Online: false})
					wants[md5].offline++
				}
				if _, _, err := flush.Add(ctx, r); err != nil {
					return err
				}
			}
			if _, _, err := flush.Finish(ctx, at); err != nil {
				return err
			}
			return history.RecordPresence(ctx, tx, at, changes)
		})
		flush.Done(err == nil)
		must(t, err)
		// Back online a minute later: the next offline change opens an interval.
		for i := range changes {
			changes[i].Online = true
		}
		env.clock.set(at.Add(time.Minute))
		must(t, inTx(ctx, env.st, func(tx *sql.Tx) error { return history.RecordPresence(ctx, tx, at.Add(time.Minute), changes) }))
	}
	got, err := env.st.FirmwareHealth(ctx, teamID, start, end)
	must(t, err)
	if len(got) != 2 {
		t.Fatalf("firmwares: got %d, want 2", len(got))
	}
	// The rollout gate's count (FiguresOf, from the boots) agrees.
	figures, err := history.FiguresOf(ctx, storeReader(env.st), history.Devices{SQL: `SELECT id FROM devices WHERE team_id = ?`, Args: []any{teamID}}, start, end)
	must(t, err)
	for _, h := range got {
		if f := figures[h.MD5]; f == nil || f.Crashes != h.Crashes || f.CrashRate() != h.CrashesPerDeviceDay {
			t.Errorf("%s: the gate counts %+v, the comparison %d crashes, %v a device-day", h.MD5[:4], f, h.Crashes, h.CrashesPerDeviceDay)
		}
	}
	for _, h := range got {
		w := wants[h.MD5]
		var days float64
		for _, id := range ids {
			if h.MD5 == fwA {
				days += switchAt[id].Sub(start).Hours() / 24
			} else {
				days += end.Sub(switchAt[id]).Hours() / 24
			}
		}
		if h.Boots != w.boots || h.Crashes != w.crashes || math.Abs(h.OfflinePerDeviceDay*h.DeviceDays-float64(w.offline)) > 1e-6 ||
			math.Abs(h.DeviceDays-days) > 1e-6 {
			t.Errorf("%s: got boots %d, crashes %d, offline %.3f, device-days %v; want %d, %d, %d, %v",
				h.MD5[:4], h.Boots, h.Crashes, h.OfflinePerDeviceDay*h.DeviceDays, h.DeviceDays, w.boots, w.crashes, w.offline, days)
		}
		rssi, heap := *median(w.rssi), *median(w.heap)
		if math.Abs(*h.RSSIMedian-rssi) > 1 || math.Abs(*h.HeapFreeMedian-heap) > heap/100 {
			t.Errorf("%s: medians %v dBm, %v B; brute force %v, %v", h.MD5[:4], *h.RSSIMedian, *h.HeapFreeMedian, rssi, heap)
		}
	}
}

// median is the median of values.
func median(values []float64) *float64 {
	values = slices.Sorted(slices.Values(values))
	m := values[len(values)/2]
	if len(values)%2 == 0 {
		m = (values[len(values)/2-1] + m) / 2
	}
	return &m
}

// TestHistoryWrittenAtClose: the bucket under way, held in memory, is
// written when the store closes (a clean stop), and read back after.
func TestHistoryWrittenAtClose(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st, err := store.Open(context.Background(), dir, time.Now, store.Quotas{HistoryDays: 30}) // closed below
	must(t, err)
	_, deviceID, uid := storeUser(t, st, "close@example.com")
	now := st.Now()
	rssi := -61.0
	rep := &mqttlink.Report{Seen: now, Live: true, History: []history.Sample{{Series: "rssi", Bucket: history.BucketStart(now),
		Min: rssi, Max: rssi, Sum: rssi, Count: 1, Last: rssi}}}
	rep.RSSI = &rssi
	_, err = st.ApplyDeviceMessages(context.Background(), map[string]*mqttlink.Report{uid: rep}, nil)
	must(t, err)
	wantDB(t, st, "0", `SELECT count(*) FROM history_rows`)
	must(t, st.Close())
	st = storeAt(t, dir)
	wantDB(t, st, "1", `SELECT count(*) FROM history_rows`)
	list, err := st.BucketsOf(context.Background(), deviceRefByID(t, st, deviceID), "rssi", 0, math.MaxInt64)
	must(t, err)
	if len(list) != 1 || list[0].Last != -61 {
		t.Errorf("after a clean stop: %+v, want the bucket of -61", list)
	}
}

// TestHistoryOfDeletedDevice: a device deleted while its bucket is in
// memory: the bucket is dropped when it closes, and the flushes of the
// other devices go on.
func TestHistoryOfDeletedDevice(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	tell(env, l, env.alice.device, "telemetry", `{"rssi":-60}`)
	mustExec(t, env.st, `DELETE FROM devices WHERE uid = ?`, env.alice.device)
	env.clock.advance(5 * time.Minute)
	tell(env, l, env.bob.device, "telemetry", `{"rssi":-70}`)
	env.clock.advance(5 * time.Minute)
	tell(env, l, env.bob.device, "telemetry", `{"rssi":-71}`)
	wantDB(t, env.st, "-71", `SELECT last_rssi FROM devices WHERE uid = ?`, env.bob.device)
	wantDB(t, env.st, "1", `SELECT count(*) FROM history_rows`) // bob's, with his first bucket
	if n := dropTotal(l); n != 0 {
		t.Errorf("messages dropped: %d, want none", n)
	}
}

// TestFirmwareHealthRightAfterReports: a minute after the devices first
// report, their buckets are still open, in memory, and the medians count
// them; equal crash rates are ordered by devices, most first, then by
// version, not by md5.
func TestFirmwareHealthRightAfterReports(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	const fwA, fwB, fwC = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "cccccccccccccccccccccccccccccccc"
	for i, fw := range []string{fwA + `","fw_version":"3.0","rssi":-50`, fwB + `","fw_version":"1.0","rssi":-60`,
		fwB + `","fw_version":"1.0","rssi":-70`, fwC + `","fw_version":"2.0","rssi":-80`} {
		uid := env.alice.device
		if i > 0 {
			uid = addDevice(t, env, env.alice, "esp32").device
		}
		tell(env, l, uid, "telemetry", `{"fw_md5":"`+fw+`,"heap_free":1000,"reset_reason":"poweron"}`)
	}
	env.clock.advance(time.Minute)
	wantDB(t, env.st, "0", `SELECT count(*) FROM fleet_hours WHERE rssi != x''`)
	row := func(md5, version string, devices int, rssi string) string {
		return `{"md5":"` + md5 + `","version":"` + version + `","name":null,"devices":` + strconv.Itoa(devices) +
			`,"device_days":` + map[int]string{1: "0.000694", 2: "0.001389"}[devices] + `,"boots":` + strconv.Itoa(devices) +
			`,"crashes":0,"crashes_per_device_day":0,"offline_per_device_day":0,"rssi_median":` + rssi + `,"heap_free_median":1000}`
	}
	checkAnswer(t, env.request("GET", "/v1/user/firmware-health", env.alice.token, nil), 200, `{"data":[`+
		row(fwB, "1.0", 2, "-65")+","+row(fwC, "2.0", 1, "-80")+","+row(fwA, "3.0", 1, "-50")+`]}`)
}
