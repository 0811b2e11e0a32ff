package main

// The store's fleet health (CONTRACT §14): history buckets, presence,
// boots and firmware runs, written with the device reports that carry
// them (store_devices.go), read by the history routes (history_routes.go),
// release health and the rollouts' health gate, and kept for
// -history-days.

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/wire"
)

const (
	// maxSeries bounds a device's series: rssi, heap_free and 16 metrics.
	// A sample of a new series past it is left out and counted.
	maxSeries = wire.MaxMetrics + 2
	// maxBoots bounds the boots kept per device, the newest.
	maxBoots = 1000
	// maxRuns bounds the firmware runs kept per device, the newest.
	maxRuns = 100
	// maxPresence bounds the presence intervals kept per device, the
	// newest, as of each retention pass.
	maxPresence = 2000
)

// healthStmts are the statements that write a report's health, prepared
// with the report's (reportStmts).
var healthStmts = []string{
	// series: a new series, while the device has fewer than maxSeries.
	`INSERT INTO series (device_id, name) SELECT ?1, ?2
		WHERE NOT EXISTS (SELECT 1 FROM series WHERE device_id = ?1 AND name = ?2)
		AND (SELECT count(*) FROM series WHERE device_id = ?1) < ?3`,
	// bucket: folds a sample into its bucket.
	`INSERT INTO buckets (series_id, t, min, max, sum, count, last)
		SELECT id, ?3, ?4, ?5, ?6, ?7, ?8 FROM series WHERE device_id = ?1 AND name = ?2
		ON CONFLICT (series_id, t) DO UPDATE SET min = min(min, excluded.min), max = max(max, excluded.max),
		sum = sum + excluded.sum, count = count + excluded.count, last = excluded.last`,
	// boot: a boot unless one with the same reason is within mqttlink.BootWindow;
	// without an md5 of its own it is charged to the one the device ran.
	// It is numbered after the device's newest: the number is its id in
	// the API, which tells nothing of other devices' boots.
	`INSERT INTO boots (device_id, number, at, reason, crash, fw_md5, fw_version)
		SELECT id, (SELECT coalesce(max(number), 0) + 1 FROM boots WHERE device_id = ?1), ?2, ?3, ?4,
			COALESCE(?5, current_md5), CASE WHEN ?5 IS NULL THEN current_version ELSE ?6 END
		FROM devices WHERE id = ?1 AND NOT EXISTS (SELECT 1 FROM boots b
			WHERE b.device_id = ?1 AND b.reason = ?3 AND b.at > ?7 AND b.at < ?8)
		RETURNING id`,
	// bootCap: keeps the newest maxBoots.
	`DELETE FROM boots WHERE device_id = ?1 AND id <= (SELECT id FROM boots WHERE device_id = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)`,
	// runEnd, runStart: the device reports another md5.
	`UPDATE firmware_runs SET to_at = ?2 WHERE device_id = ?1 AND to_at IS NULL`,
	`INSERT INTO firmware_runs (device_id, md5, version, from_at) VALUES (?1, ?2, ?3, ?4)`,
	// runCap: keeps the newest maxRuns.
	`DELETE FROM firmware_runs WHERE device_id = ?1 AND id <= (SELECT id FROM firmware_runs WHERE device_id = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)`,
}

const (
	stmtSeries = iota
	stmtBucket
	stmtBoot
	stmtBootCap
	stmtRunEnd
	stmtRunStart
	stmtRunCap
)

// bootEvent is a recorded boot as the device.boot event tells it.
type bootEvent struct {
	UID    string `json:"uid"`
	Reason string `json:"reason"`
	Crash  bool   `json:"crash"`
	At     string `json:"at"`
}

// applyHealth writes what report r of device deviceID says of its
// health: its samples (with history kept), its boots, and a new firmware
// run when its md5 changed (c.firmwareChanged). It adds the boots it
// recorded to c, and returns how many samples were left out for want of
// room for another series.
func (st *reportStmts) applyHealth(ctx context.Context, deviceID int64, r *mqttlink.Report, c *deviceChange) (int, error) {
	h, seen := st.health, r.Seen.UTC().Format(timeFormat)
	if c.firmwareChanged && r.FWMD5 != nil {
		if _, err := h[stmtRunEnd].ExecContext(ctx, deviceID, seen); err != nil {
			return 0, err
		}
		if _, err := h[stmtRunStart].ExecContext(ctx, deviceID, *r.FWMD5, r.FWVersion, seen); err != nil {
			return 0, err
		}
		if _, err := h[stmtRunCap].ExecContext(ctx, deviceID, maxRuns); err != nil {
			return 0, err
		}
	}
	for _, b := range r.Boots {
		at := b.At.UTC()
		var id int64
		err := h[stmtBoot].QueryRowContext(ctx, deviceID, at.Format(timeFormat), b.Reason, b.Crash(), b.FWMD5, b.FWVersion,
			at.Add(-mqttlink.BootWindow).Format(timeFormat), at.Add(mqttlink.BootWindow).Format(timeFormat)).Scan(&id)
		if err == sql.ErrNoRows {
			continue // the same boot, told again
		}
		if err != nil {
			return 0, err
		}
		if _, err := h[stmtBootCap].ExecContext(ctx, deviceID, maxBoots); err != nil {
			return 0, err
		}
		c.boots = append(c.boots, bootEvent{c.UID, b.Reason, b.Crash(), at.Format(time.RFC3339)})
	}
	if !st.keepHistory {
		return 0, nil
	}
	left := 0
	for _, s := range r.History {
		if _, err := h[stmtSeries].ExecContext(ctx, deviceID, s.Series, maxSeries); err != nil {
			return 0, err
		}
		res, err := h[stmtBucket].ExecContext(ctx, deviceID, s.Series, s.Bucket, s.Min, s.Max, s.Sum, s.Count, s.Last)
		if err != nil {
			return 0, err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			left++
		}
	}
	return left, nil
}

// presenceChunk is how many devices one pair of presence statements takes.
const presenceChunk = 1000

// recordPresence ends the open interval of each changed device whose
// online-ness changed, and opens one for it, at now: a chunk of devices
// at a time, as applyStatuses does. Reconnecting counts as offline.
func recordPresence(ctx context.Context, tx *sql.Tx, now string, changes []deviceChange) error {
	var rows []any
	for _, c := range changes {
		if c.statusChanged && c.Status != statusPending {
			rows = append(rows, c.UID, c.Status == statusOnline)
		}
	}
	for len(rows) > 0 {
		chunk := rows[:min(len(rows), 2*presenceChunk)]
		rows = rows[len(chunk):]
		values := `WITH r(u, o) AS (VALUES (?, ?)` + strings.Repeat(`, (?, ?)`, len(chunk)/2-1) + `) `
		at := "?" + strconv.Itoa(len(chunk)+1) // now, after the VALUES' parameters
		args := append(chunk[:len(chunk):len(chunk)], now)
		_, err := tx.ExecContext(ctx, values+`UPDATE presence SET to_at = `+at+` FROM r, devices d
			WHERE d.uid = r.u AND presence.device_id = d.id AND presence.to_at IS NULL AND presence.online IS NOT r.o`,
			args...)
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, values+`INSERT INTO presence (device_id, online, from_at)
			SELECT d.id, r.o, `+at+` FROM r JOIN devices d ON d.uid = r.u
			WHERE NOT EXISTS (SELECT 1 FROM presence p WHERE p.device_id = d.id AND p.to_at IS NULL)`, args...)
		if err != nil {
			return err
		}
	}
	return nil
}

// errSeriesNotFound: the device has no series of that name.
var errSeriesNotFound = errors.New("series not found")

// seriesOf lists the device's series by name, each with the starts of
// its oldest and newest buckets.
func (s *store) seriesOf(ctx context.Context, deviceID int64) ([]seriesInfo, error) {
	return queryAll(ctx, s.reader, func(row scanner) (seriesInfo, error) {
		var si seriesInfo
		var first, last int64
		err := row.Scan(&si.Series, &first, &last)
		si.FirstAt, si.LastAt = unixTime(first), unixTime(last)
		return si, err
	}, `SELECT name, f, l FROM (SELECT s.name,
			(SELECT t FROM buckets WHERE series_id = s.id ORDER BY t LIMIT 1) AS f,
			(SELECT t FROM buckets WHERE series_id = s.id ORDER BY t DESC LIMIT 1) AS l
		FROM series s WHERE s.device_id = ?) WHERE f IS NOT NULL ORDER BY name`, deviceID)
}

// unixTime renders Unix seconds as every timestamp is (timeFormat).
func unixTime(t int64) string { return time.Unix(t, 0).UTC().Format(timeFormat) }

// bucketsOf returns the buckets of the device's series that start in
// [from, to), oldest first; errSeriesNotFound when it has no such series.
func (s *store) bucketsOf(ctx context.Context, deviceID int64, name string, from, to int64) ([]mqttlink.Sample, error) {
	var id int64
	err := s.reader.QueryRowContext(ctx, `SELECT id FROM series WHERE device_id = ? AND name = ?`, deviceID, name).Scan(&id)
	if err != nil {
		return nil, notFound(err, errSeriesNotFound)
	}
	return queryAll(ctx, s.reader, func(row scanner) (mqttlink.Sample, error) {
		b := mqttlink.Sample{Series: name}
		return b, row.Scan(&b.Bucket, &b.Min, &b.Max, &b.Sum, &b.Count, &b.Last)
	}, `SELECT t, min, max, sum, count, last FROM buckets WHERE series_id = ? AND t >= ? AND t < ? ORDER BY t`, id, from, to)
}

// presenceOf returns the device's presence intervals that overlap
// [from, to], oldest first: one that begins at to (now, by default) is
// the current one.
func (s *store) presenceOf(ctx context.Context, deviceID int64, from, to string) ([]presenceInterval, error) {
	return queryAll(ctx, s.reader, func(row scanner) (presenceInterval, error) {
		var p presenceInterval
		var online bool
		err := row.Scan(&online, &p.From, &p.To)
		p.Status = map[bool]deviceStatus{true: statusOnline, false: statusOffline}[online]
		return p, err
	}, `SELECT online, from_at, to_at FROM presence WHERE device_id = ? AND from_at <= ? AND (to_at IS NULL OR to_at > ?)
		ORDER BY from_at, id`, deviceID, to, from)
}

// bootsOf returns up to limit of the device's boots, newest first,
// those numbered below before when it is not 0.
func (s *store) bootsOf(ctx context.Context, deviceID, before int64, limit int) ([]bootEntry, error) {
	if before == 0 {
		before = math.MaxInt64
	}
	return queryAll(ctx, s.reader, func(row scanner) (bootEntry, error) {
		var b bootEntry
		var md5, version *string
		err := row.Scan(&b.ID, &b.At, &b.Reason, &b.Crash, &md5, &version)
		if md5 != nil {
			b.Firmware = &bootFirmware{*md5, version}
		}
		return b, err
	}, `SELECT number, at, reason, crash, fw_md5, fw_version FROM boots WHERE device_id = ? AND number < ?
		ORDER BY number DESC LIMIT ?`, deviceID, before, limit)
}

// pruneDevices is how many devices' history one retention step deletes
// from, in one transaction: a pass each pruneEvery leaves an hour's
// buckets of each series to delete, so a step holds the write lock for a
// few milliseconds.
const pruneDevices = 50

// pruneStep deletes what -history-days no longer keeps of the devices
// with the next pruneDevices ids after after: buckets before cutoff (and
// series left empty), presence intervals that ended before it and those
// past the newest maxPresence; with history kept, boots and firmware
// runs that ended before it too (with none kept, boots and runs are
// bounded by their count alone: the health gate needs them). It returns
// the last id it took, 0 when there was none.
func (s *store) pruneStep(ctx context.Context, after int64, cutoff time.Time) (int64, error) {
	var first, last sql.NullInt64
	err := s.reader.QueryRowContext(ctx, `SELECT min(id), max(id) FROM (SELECT id FROM devices WHERE id > ? ORDER BY id LIMIT ?)`,
		after, pruneDevices).Scan(&first, &last)
	if err != nil || !last.Valid {
		return 0, err
	}
	at := cutoff.UTC().Format(timeFormat)
	statements := []string{
		`DELETE FROM buckets WHERE series_id IN (SELECT id FROM series WHERE device_id BETWEEN ?1 AND ?2) AND t < ?3`,
		`DELETE FROM series WHERE device_id BETWEEN ?1 AND ?2 AND NOT EXISTS (SELECT 1 FROM buckets WHERE series_id = series.id)`,
		`DELETE FROM presence WHERE device_id BETWEEN ?1 AND ?2 AND to_at < ?4`,
		`DELETE FROM presence WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY device_id ORDER BY id DESC) AS n
			FROM presence WHERE device_id BETWEEN ?1 AND ?2) WHERE n > ?5)`,
	}
	if s.limits.historyDays > 0 {
		statements = append(statements,
			`DELETE FROM boots WHERE device_id BETWEEN ?1 AND ?2 AND at < ?4`,
			`DELETE FROM firmware_runs WHERE device_id BETWEEN ?1 AND ?2 AND to_at < ?4`)
	}
	return last.Int64, s.inTx(ctx, func(tx *sql.Tx) error {
		for _, q := range statements {
			if _, err := tx.ExecContext(ctx, q, first.Int64, last.Int64, cutoff.Unix(), at, maxPresence); err != nil {
				return err
			}
		}
		return nil
	})
}

// firmwareHealth compares the firmwares the team's devices ran in
// [from, to]: device-days from their firmware runs, boots and crashes
// charged to each, offline transitions while a device ran it, and the
// medians over its devices of each one's mean rssi and heap_free while
// it ran it. Worst crashes per device-day first.
func (s *store) firmwareHealth(ctx context.Context, teamID int64, from, to time.Time) ([]*firmwareHealth, error) {
	f, t := from.UTC().Format(timeFormat), to.UTC().Format(timeFormat)
	byMD5 := map[string]*firmwareHealth{}
	list, err := queryAll(ctx, s.reader, func(row scanner) (*firmwareHealth, error) {
		h := &firmwareHealth{}
		err := row.Scan(&h.MD5, &h.Version, &h.Name, &h.Devices, &h.DeviceDays)
		byMD5[h.MD5] = h
		return h, err
	}, `SELECT r.md5, COALESCE((SELECT f.version FROM firmwares f WHERE f.device_id = r.device_id AND f.md5 = r.md5), max(r.version)),
			(SELECT f.name FROM firmwares f JOIN devices fd ON fd.id = f.device_id WHERE fd.team_id = ?1 AND f.md5 = r.md5 ORDER BY f.id DESC LIMIT 1),
			count(DISTINCT r.device_id),
			sum(julianday(min(COALESCE(r.to_at, ?3), ?3)) - julianday(max(r.from_at, ?2)))
		FROM firmware_runs r JOIN devices d ON d.id = r.device_id
		WHERE d.team_id = ?1 AND r.from_at < ?3 AND (r.to_at IS NULL OR r.to_at > ?2)
		GROUP BY r.md5`, teamID, f, t)
	if err != nil || len(list) == 0 {
		return list, err
	}
	each := func(query string, fill func(h *firmwareHealth, row scanner) error) error {
		_, err := queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
			h := &firmwareHealth{}
			if err := fill(h, row); err != nil {
				return struct{}{}, err
			}
			if into := byMD5[h.MD5]; into != nil {
				into.Boots += h.Boots
				into.Crashes += h.Crashes
				into.offline += h.offline
			}
			return struct{}{}, nil
		}, query, teamID, f, t)
		return err
	}
	err = each(`SELECT b.fw_md5, count(*), sum(b.crash) FROM boots b JOIN devices d ON d.id = b.device_id
		WHERE d.team_id = ?1 AND b.at >= ?2 AND b.at <= ?3 AND b.fw_md5 IS NOT NULL GROUP BY b.fw_md5`,
		func(h *firmwareHealth, row scanner) error { return row.Scan(&h.MD5, &h.Boots, &h.Crashes) })
	if err != nil {
		return nil, err
	}
	err = each(`SELECT r.md5, count(*) FROM presence p JOIN devices d ON d.id = p.device_id
		JOIN firmware_runs r ON r.device_id = p.device_id AND p.from_at >= r.from_at AND (r.to_at IS NULL OR p.from_at < r.to_at)
		WHERE d.team_id = ?1 AND p.online = 0 AND p.from_at >= ?2 AND p.from_at <= ?3 GROUP BY r.md5`,
		func(h *firmwareHealth, row scanner) error { return row.Scan(&h.MD5, &h.offline) })
	if err != nil {
		return nil, err
	}
	means := map[string]map[string][]float64{} // md5 → series → a mean per device run
	_, err = queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
		var md5, name string
		var mean float64
		err := row.Scan(&md5, &name, &mean)
		if means[md5] == nil {
			means[md5] = map[string][]float64{}
		}
		means[md5][name] = append(means[md5][name], mean)
		return struct{}{}, err
	}, `SELECT r.md5, s.name, sum(b.sum) / sum(b.count) FROM firmware_runs r JOIN devices d ON d.id = r.device_id
		JOIN series s ON s.device_id = r.device_id AND s.name IN ('rssi', 'heap_free')
		JOIN buckets b ON b.series_id = s.id AND b.t >= max(unixepoch(r.from_at), ?4) AND b.t <= COALESCE(unixepoch(r.to_at), ?5)
		WHERE d.team_id = ?1 AND r.from_at < ?3 AND (r.to_at IS NULL OR r.to_at > ?2)
		GROUP BY r.id, s.name`, teamID, f, t, from.Unix()-from.Unix()%mqttlink.BucketSeconds, to.Unix())
	if err != nil {
		return nil, err
	}
	for _, h := range list {
		h.RSSIMedian, h.HeapFreeMedian = median(means[h.MD5]["rssi"]), median(means[h.MD5]["heap_free"])
		h.DeviceDays = math.Round(h.DeviceDays*1e6) / 1e6 // julianday's float noise
		if h.DeviceDays > 0 {
			h.CrashesPerDeviceDay = float64(h.Crashes) / h.DeviceDays
			h.OfflinePerDeviceDay = float64(h.offline) / h.DeviceDays
		}
	}
	slices.SortFunc(list, func(a, b *firmwareHealth) int {
		return cmp.Or(cmp.Compare(b.CrashesPerDeviceDay, a.CrashesPerDeviceDay), strings.Compare(a.MD5, b.MD5))
	})
	return list, nil
}

// median is the median of values, nil when there are none.
func median(values []float64) *float64 {
	if len(values) == 0 {
		return nil
	}
	slices.Sort(values)
	m := values[len(values)/2]
	if len(values)%2 == 0 {
		m = (values[len(values)/2-1] + m) / 2
	}
	return &m
}
