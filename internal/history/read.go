package history

// Reading history: a device's series and their buckets, its presence
// and boots, and the figures of release health (one definition of
// crashes per device-day, for the firmware comparison and a rollout's
// health gate alike).

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"devicehub/internal/wire"
)

// TimeFormat is how every time the API shows is written.
const TimeFormat = "2006-01-02T15:04:05.000000Z"

// unixTime renders Unix seconds as TimeFormat.
func unixTime(t int64) string { return time.Unix(t, 0).UTC().Format(TimeFormat) }

// ErrSeriesNotFound: the device has no series of that name.
var ErrSeriesNotFound = errors.New("series not found")

// queryAll runs query on q and returns what scan makes of each row, in
// order; never nil.
func queryAll[T any](ctx context.Context, q Queryer, scan func(*sql.Rows) (T, error), query string, args ...any) ([]T, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []T{}
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		list = append(list, v)
	}
	return list, rows.Err()
}

// SeriesInfo is one of a device's series, with the starts of its oldest
// and newest buckets.
type SeriesInfo struct {
	Series  SeriesName `json:"series"`
	FirstAt string     `json:"first_at"`
	LastAt  string     `json:"last_at"`
}

// rowSpan is SQL for the span of a row of history h: an hour of
// 5-minute slots or a day of hourly ones.
const rowSpan = `CASE h.step WHEN ` + "300" + ` THEN 3600 ELSE 86400 END`

// samplesOf returns the device's samples of series only ("": all) of
// the slots that start in [from, to), written or in memory (e), in no
// order.
func samplesOf(ctx context.Context, q Queryer, e *Engine, device int64, only SeriesName, from, to int64) ([]Sample, error) {
	rows, err := q.QueryContext(ctx, `SELECT step, start, slots FROM history_rows h
		WHERE device_id = ? AND start < ? AND start > ? - `+rowSpan, device, to, from)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var list []Sample
	for rows.Next() {
		var step, start int64
		var b []byte
		if err := rows.Scan(&step, &start, &b); err != nil {
			return nil, err
		}
		row, err := decodeSeries(b, start, step, only)
		if err != nil {
			return nil, err
		}
		list = append(list, row...)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if e != nil {
		list = append(list, e.unwritten(device)...)
	}
	return slices.DeleteFunc(list, func(s Sample) bool {
		return s.Bucket < from || s.Bucket >= to || only != "" && s.Series != only
	}), nil
}

// SeriesOf lists the device's series by name, each with the starts of
// its oldest and newest slots.
func SeriesOf(ctx context.Context, q Queryer, e *Engine, deviceID int64) ([]SeriesInfo, error) {
	all, err := samplesOf(ctx, q, e, deviceID, "", 0, math.MaxInt64)
	if err != nil {
		return nil, err
	}
	spans := map[SeriesName][2]int64{}
	for _, s := range all {
		sp, ok := spans[s.Series]
		if !ok {
			sp = [2]int64{s.Bucket, s.Bucket}
		}
		spans[s.Series] = [2]int64{min(sp[0], s.Bucket), max(sp[1], s.Bucket)}
	}
	list := []SeriesInfo{}
	for _, name := range slices.Sorted(maps.Keys(spans)) {
		list = append(list, SeriesInfo{name, unixTime(spans[name][0]), unixTime(spans[name][1])})
	}
	return list, nil
}

// Buckets returns the slots of the device's series name that start in
// [from, to) (Unix seconds), oldest first: 5-minute buckets, hours after
// detailDays; ErrSeriesNotFound when it has no such series.
func Buckets(ctx context.Context, q Queryer, e *Engine, deviceID int64, name SeriesName, from, to int64) ([]Sample, error) {
	list, err := samplesOf(ctx, q, e, deviceID, name, from, to)
	if err != nil {
		return nil, err
	}
	slices.SortStableFunc(list, func(a, b Sample) int { return int(a.Bucket - b.Bucket) })
	if len(list) > 0 {
		return list, nil
	}
	series, err := SeriesOf(ctx, q, e, deviceID)
	if err == nil && !slices.ContainsFunc(series, func(s SeriesInfo) bool { return s.Series == name }) {
		err = ErrSeriesNotFound
	}
	return []Sample{}, err
}

// Point is buckets merged into one point of a chart.
type Point struct {
	T     string  `json:"t"`
	Min   float64 `json:"min"`
	Max   float64 `json:"max"`
	Mean  float64 `json:"mean"`
	Last  float64 `json:"last"`
	Count int64   `json:"count"`
}

// Chart is a series' points.
type Chart struct {
	Series SeriesName `json:"series"`
	StepS  int64      `json:"step_s"`
	Points []Point    `json:"points"`
}

// Merge merges buckets (oldest first, each in [start, end)) into points
// of a step that is a whole number of buckets, the fewest that make at
// most points of the span; a step with no bucket has no point.
func Merge(name SeriesName, buckets []Sample, start, end int64, points int) Chart {
	span := (end - start + BucketSeconds - 1) / BucketSeconds // buckets in the span
	step := max(1, (span+int64(points)-1)/int64(points)) * BucketSeconds
	h := Chart{Series: name, StepS: step, Points: []Point{}}
	var cur *Sample
	flush := func() {
		if cur != nil {
			h.Points = append(h.Points, Point{unixTime(cur.Bucket), cur.Min, cur.Max, cur.Sum / float64(cur.Count), cur.Last, cur.Count})
		}
	}
	for _, b := range buckets {
		t := start + (b.Bucket-start)/step*step
		if cur != nil && cur.Bucket == t {
			cur.merge(b)
			continue
		}
		flush()
		b.Bucket = t
		cur = &b
	}
	flush()
	return h
}

// BucketStart is the start of the bucket that holds t.
func BucketStart(t time.Time) int64 { return bucketOf(t.Unix()) }

// Interval is a span of a device's presence; To nil for the current one.
type Interval struct {
	Status string  `json:"status"` // wire.Online or wire.Offline
	From   string  `json:"from"`
	To     *string `json:"to"`
}

// Presence returns up to limit of the device's presence intervals that
// overlap [from, to], oldest first: one that begins at to (now, by
// default) is the current one. The next page begins at the last one's end.
func Presence(ctx context.Context, q Queryer, deviceID int64, from, to time.Time, limit int) ([]Interval, error) {
	return queryAll(ctx, q, func(row *sql.Rows) (Interval, error) {
		var p Interval
		var online bool
		var f int64
		var t *int64
		err := row.Scan(&online, &f, &t)
		p.Status, p.From = map[bool]string{true: wire.Online, false: wire.Offline}[online], unixTime(f)
		if t != nil {
			s := unixTime(*t)
			p.To = &s
		}
		return p, err
	}, `SELECT online, from_at, to_at FROM presence WHERE device_id = ? AND from_at <= ? AND (to_at IS NULL OR to_at > ?)
		ORDER BY from_at, id LIMIT ?`, deviceID, to.Unix(), from.Unix(), limit)
}

// BootEntry is one of a device's boots.
type BootEntry struct {
	ID       int64         `json:"id"`
	At       string        `json:"at"`
	Reason   string        `json:"reason"`
	Crash    bool          `json:"crash"`
	Firmware *BootFirmware `json:"firmware"`
}

// BootFirmware is the firmware a boot is charged to.
type BootFirmware struct {
	MD5     string  `json:"md5"`
	Version *string `json:"version"`
}

// Boots returns up to limit of the device's boots, newest first, those
// numbered below before when it is not 0. A boot's id in the API is its
// number among its device's boots, which tells nothing of other devices'.
func Boots(ctx context.Context, q Queryer, deviceID, before int64, limit int) ([]BootEntry, error) {
	if before == 0 {
		before = math.MaxInt64
	}
	return queryAll(ctx, q, func(row *sql.Rows) (BootEntry, error) {
		var b BootEntry
		var at int64
		var md5, version *string
		err := row.Scan(&b.ID, &at, &b.Reason, &b.Crash, &md5, &version)
		b.At = unixTime(at)
		if md5 != nil {
			b.Firmware = &BootFirmware{*md5, version}
		}
		return b, err
	}, `SELECT number, at, reason, crash, fw_md5, fw_version FROM boots WHERE device_id = ? AND number < ?
		ORDER BY number DESC LIMIT ?`, deviceID, before, limit)
}

// Devices is a set of devices whose health is counted: SQL that selects
// their ids (as "id") and its parameters.
type Devices struct {
	SQL  string
	Args []any
}

// Figures are what a set of devices did on one firmware in a window.
type Figures struct {
	Devices     int
	DeviceDays  float64   // the time they ran it in the window
	Boots       int       // their boots charged to it in the window
	Crashes     int       // of which crashes
	LatestStart time.Time // when the latest of them began to run it
}

// FiguresOf returns, by md5, the figures of the devices ds on each
// firmware they ran in [from, to]: a device-day is a day of one device
// running it (its firmware runs, cut to the window, runFigures), and a
// crash counts when its boot is charged to it and falls in the window.
// A rollout's health gate counts with it; the firmware comparison counts
// the same boots by the hour (fleet_hours), which the flush that records
// a boot counts in.
func FiguresOf(ctx context.Context, q Queryer, ds Devices, from, to time.Time) (map[string]*Figures, error) {
	byMD5, err := runFigures(ctx, q, ds, from, to)
	if err != nil {
		return nil, err
	}
	args := append(slices.Clone(ds.Args), sql.Named("from", from.Unix()), sql.Named("to", to.Unix()))
	_, err = queryAll(ctx, q, func(row *sql.Rows) (struct{}, error) {
		var md5 string
		var boots, crashes int
		err := row.Scan(&md5, &boots, &crashes)
		if fig := byMD5[md5]; fig != nil {
			fig.Boots, fig.Crashes = boots, crashes
		}
		return struct{}{}, err
	}, `WITH ds(id) AS (`+ds.SQL+`) SELECT b.fw_md5, count(*), sum(b.crash) FROM boots b JOIN ds ON ds.id = b.device_id
		WHERE b.at >= :from AND b.at <= :to AND b.fw_md5 IS NOT NULL GROUP BY b.fw_md5`, args...)
	return byMD5, err
}

// runFigures returns, by md5, the devices of ds that ran it in [from,
// to], their device-days on it there and when the latest began to run
// it; no boots.
func runFigures(ctx context.Context, q Queryer, ds Devices, from, to time.Time) (map[string]*Figures, error) {
	args := append(slices.Clone(ds.Args), sql.Named("from", from.Unix()), sql.Named("to", to.Unix()))
	byMD5 := map[string]*Figures{}
	_, err := queryAll(ctx, q, func(row *sql.Rows) (struct{}, error) {
		var md5 string
		var seconds, latest int64
		fig := &Figures{}
		err := row.Scan(&md5, &fig.Devices, &seconds, &latest)
		fig.DeviceDays, fig.LatestStart = float64(seconds)/86400, time.Unix(latest, 0).UTC()
		byMD5[md5] = fig
		return struct{}{}, err
	}, `WITH ds(id) AS (`+ds.SQL+`) SELECT r.md5, count(DISTINCT r.device_id),
			sum(min(COALESCE(r.to_at, :to), :to) - max(r.from_at, :from)), max(r.from_at)
		FROM firmware_runs r JOIN ds ON ds.id = r.device_id
		WHERE r.from_at <= :to AND (r.to_at IS NULL OR r.to_at > :from) GROUP BY r.md5`, args...)
	return byMD5, err
}

// CrashRate is crashes per device-day.
func (f *Figures) CrashRate() float64 {
	if f.DeviceDays <= 0 {
		return 0
	}
	return float64(f.Crashes) / f.DeviceDays
}

// FirmwareHealth is one firmware's figures in the comparison.
type FirmwareHealth struct {
	MD5                 string   `json:"md5"`
	Version             *string  `json:"version"`
	Name                *string  `json:"name"`
	Devices             int      `json:"devices"`
	DeviceDays          float64  `json:"device_days"`
	Boots               int      `json:"boots"`
	Crashes             int      `json:"crashes"`
	CrashesPerDeviceDay float64  `json:"crashes_per_device_day"`
	OfflinePerDeviceDay float64  `json:"offline_per_device_day"`
	RSSIMedian          *float64 `json:"rssi_median"`
	HeapFreeMedian      *float64 `json:"heap_free_median"`
}

// Compare compares the firmwares the team's devices ran in [from, to]:
// their devices and device-days (runFigures), and from the hours of
// fleet_hours that begin in the window their boots and crashes charged
// to it (so crashes per device-day as FiguresOf counts them, by the
// hour), the offline intervals its devices began while they ran it and
// the medians of the means of their 5-minute buckets of
// rssi and heap_free (rollup.go), with those memory holds (e), the
// open buckets included. Worst first (worstFirst).
func Compare(ctx context.Context, q Queryer, e *Engine, teamID int64, from, to time.Time) ([]*FirmwareHealth, error) {
	figures, err := runFigures(ctx, q, Devices{`SELECT id FROM devices WHERE team_id = ?`, []any{teamID}}, from, to)
	if err != nil || len(figures) == 0 {
		return []*FirmwareHealth{}, err
	}
	f, t := from.Unix(), to.Unix()
	names, err := queryAll(ctx, q, func(row *sql.Rows) (FirmwareHealth, error) {
		var h FirmwareHealth
		return h, row.Scan(&h.MD5, &h.Version, &h.Name)
	}, `SELECT r.md5, COALESCE((SELECT f.version FROM firmwares f WHERE f.device_id = r.device_id AND f.md5 = r.md5), max(r.version)),
			(SELECT f.name FROM firmwares f JOIN devices fd ON fd.id = f.device_id WHERE fd.team_id = ?1 AND f.md5 = r.md5 ORDER BY f.id DESC LIMIT 1)
		FROM firmware_runs r JOIN devices d ON d.id = r.device_id
		WHERE d.team_id = ?1 AND r.from_at < ?3 AND (r.to_at IS NULL OR r.to_at > ?2) GROUP BY r.md5`, teamID, f, t)
	if err != nil {
		return nil, err
	}
	hours, err := hoursOf(ctx, q, teamID, f, t)
	if err != nil {
		return nil, err
	}
	e.addUnwritten(hours, teamID, f, t)
	list := make([]*FirmwareHealth, 0, len(names))
	for _, h := range names {
		fig := figures[h.MD5]
		if fig == nil {
			continue
		}
		if hf := hours[h.MD5]; hf != nil {
			fig.Boots, fig.Crashes = hf.boots, hf.crashes
			if fig.DeviceDays > 0 {
				h.OfflinePerDeviceDay = float64(hf.offline) / fig.DeviceDays
			}
			h.RSSIMedian, h.HeapFreeMedian = hf.rssi.median(), hf.heap.median()
		}
		h.Devices, h.Boots, h.Crashes = fig.Devices, fig.Boots, fig.Crashes
		h.DeviceDays = math.Round(fig.DeviceDays*1e6) / 1e6
		h.CrashesPerDeviceDay = fig.CrashRate()
		list = append(list, &h)
	}
	slices.SortFunc(list, worstFirst)
	return list, nil
}

// worstFirst orders the comparison: the most crashes per device-day
// first; of equal rates, the firmware on more devices first, then by
// version (none last), and by md5 only when all of these are equal.
func worstFirst(a, b *FirmwareHealth) int {
	return cmp.Or(cmp.Compare(b.CrashesPerDeviceDay, a.CrashesPerDeviceDay), cmp.Compare(b.Devices, a.Devices),
		compareVersions(a.Version, b.Version), strings.Compare(a.MD5, b.MD5))
}

// compareVersions orders versions as text, none after any.
func compareVersions(a, b *string) int {
	if a != nil && b != nil {
		return strings.Compare(*a, *b)
	}
	none := func(v *string) int {
		if v == nil {
			return 1
		}
		return 0
	}
	return cmp.Compare(none(a), none(b))
}
