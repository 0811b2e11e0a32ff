package history

// Retention: what -history-days no longer keeps is deleted, and hours
// older than detailDays are merged into days, a step at a time: each
// step a small transaction of its own that touches at most pruneRows
// rows of history (or the presence of pruneDevices devices that have
// some), so that no step holds the writer long.

import (
	"context"
	"database/sql"
	"time"
)

const (
	// pruneRows bounds the rows one step deletes.
	pruneRows = 250
	// rollupRows bounds the hour rows one step merges into days.
	rollupRows = 16
	// pruneDevices bounds the devices whose presence one step trims to
	// MaxPresence.
	pruneDevices = 50
)

// Pass is a retention pass under way: the stage it is at, and for the
// last stage the last device it trimmed.
type Pass struct {
	stage int
	after int64
}

// deleteStages delete what is older than the cutoff (?1, Unix seconds),
// pruneRows rows at most each; the boots and runs (the last two) only
// with history kept: with none kept they are bounded by their count
// alone, for the health gate needs them.
var deleteStages = []string{
	`DELETE FROM history_rows WHERE id IN (SELECT id FROM history_rows
		WHERE step = 3600 AND start <= ?1 - 86400 ORDER BY step, start LIMIT ?2)`,
	`DELETE FROM history_rows WHERE id IN (SELECT id FROM history_rows
		WHERE step = 300 AND start <= ?1 - 3600 ORDER BY step, start LIMIT ?2)`,
	`DELETE FROM presence WHERE id IN (SELECT id FROM presence WHERE to_at < ?1 LIMIT ?2)`,
	`DELETE FROM fleet_hours WHERE id IN (SELECT id FROM fleet_hours WHERE hour <= ?1 - 3600 LIMIT ?2)`,
	`DELETE FROM boots WHERE id IN (SELECT id FROM boots WHERE at < ?1 LIMIT ?2)`,
	`DELETE FROM firmware_runs WHERE id IN (SELECT id FROM firmware_runs WHERE to_at < ?1 LIMIT ?2)`,
}

// Step does the next step of pass p in tx, at now, deleting what is
// older than cutoff; keep says whether history is kept. A pass's stages:
// the deletes, converting the buckets of before version 16, the roll-up
// of hours into days, the presence trim. It returns true when the pass
// is done.
func Step(ctx context.Context, tx *sql.Tx, p *Pass, now, cutoff time.Time, keep bool) (bool, error) {
	stages := deleteStages
	if !keep {
		stages = stages[:4]
	}
	for p.stage < len(stages) {
		res, err := tx.ExecContext(ctx, stages[p.stage], cutoff.Unix(), pruneRows)
		if err != nil {
			return false, err
		}
		if n, _ := res.RowsAffected(); n > 0 {
			return false, nil
		}
		p.stage++
	}
	if p.stage == len(stages) {
		more, err := convertLegacy(ctx, tx, now.Unix()-detailDays*daySeconds)
		if err != nil || more {
			return false, err
		}
		p.stage++
	}
	if p.stage == len(stages)+1 {
		more, err := rollup(ctx, tx, now.Unix()-detailDays*daySeconds)
		if err != nil || more {
			return false, err
		}
		p.stage++
	}
	last, err := trimPresence(ctx, tx, p.after)
	p.after = last
	return last == 0, err
}

// rollup merges up to rollupRows hour rows that ended before cutoff into
// the rows of their days, hourly slots, and deletes them. It returns
// whether there may be more.
func rollup(ctx context.Context, tx *sql.Tx, cutoff int64) (bool, error) {
	type hourRow struct {
		id, device, start int64
		slots             []byte
	}
	rows, err := tx.QueryContext(ctx, `SELECT id, device_id, start, slots FROM history_rows
		WHERE step = 300 AND start <= ? - 3600 ORDER BY step, start LIMIT ?`, cutoff, rollupRows)
	if err != nil {
		return false, err
	}
	var hours []hourRow
	for rows.Next() {
		var h hourRow
		if err := rows.Scan(&h.id, &h.device, &h.start, &h.slots); err != nil {
			rows.Close()
			return false, err
		}
		hours = append(hours, h)
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(hours) == 0 {
		return false, err
	}
	writer, err := newRowWriter(ctx, tx)
	if err != nil {
		return false, err
	}
	defer writer.Close()
	for _, h := range hours {
		samples, err := decodeRow(h.slots, h.start, BucketSeconds)
		if err != nil {
			return false, err
		}
		if _, err := writer.merge(ctx, h.device, hourSeconds, rowOf(h.start, hourSeconds), toHours(samples)); err != nil {
			return false, err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM history_rows WHERE id = ?`, h.id); err != nil {
			return false, err
		}
	}
	return len(hours) == rollupRows, nil
}

// trimPresence deletes the presence intervals past the newest
// MaxPresence of the next pruneDevices devices after after that have
// any, and returns the last of them, 0 when there was none.
func trimPresence(ctx context.Context, tx *sql.Tx, after int64) (int64, error) {
	var last sql.NullInt64
	err := tx.QueryRowContext(ctx, `SELECT max(device_id) FROM (SELECT DISTINCT device_id FROM presence
		WHERE device_id > ? ORDER BY device_id LIMIT ?)`, after, pruneDevices).Scan(&last)
	if err != nil || !last.Valid {
		return 0, err
	}
	_, err = tx.ExecContext(ctx, `DELETE FROM presence WHERE id IN (SELECT id FROM (SELECT id,
		row_number() OVER (PARTITION BY device_id ORDER BY id DESC) AS n
		FROM presence WHERE device_id > ?1 AND device_id <= ?2) WHERE n > ?3)`, after, last.Int64, MaxPresence)
	return last.Int64, err
}

// convertRows bounds the legacy buckets one step converts.
const convertRows = 2000

// convertLegacy moves up to convertRows buckets of the layout before
// version 16 (a row per series and bucket, legacy_buckets) into rows of
// history: 5-minute slots, hourly ones when they began before cutoff.
// Once none is left it drops the legacy tables. It returns whether
// there may be more.
func convertLegacy(ctx context.Context, tx *sql.Tx, cutoff int64) (bool, error) {
	var exists bool
	err := tx.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE name = 'legacy_buckets'`).Scan(&exists)
	if err != nil || !exists {
		return false, err
	}
	type legacy struct {
		device int64
		series int64
		s      Sample
	}
	list, err := queryAll(ctx, tx, func(row *sql.Rows) (legacy, error) {
		var l legacy
		return l, row.Scan(&l.series, &l.device, &l.s.Series, &l.s.Bucket, &l.s.Min, &l.s.Max, &l.s.Sum, &l.s.Count, &l.s.Last)
	}, `SELECT b.series_id, s.device_id, s.name, b.t, b.min, b.max, b.sum, b.count, b.last
		FROM legacy_buckets b JOIN legacy_series s ON s.id = b.series_id ORDER BY b.series_id, b.t LIMIT ?`, convertRows)
	if err != nil {
		return false, err
	}
	if len(list) == 0 {
		_, err := tx.ExecContext(ctx, `DROP TABLE legacy_buckets; DROP TABLE legacy_series`)
		return false, err
	}
	writer, err := newRowWriter(ctx, tx)
	if err != nil {
		return false, err
	}
	defer writer.Close()
	type rowKey struct{ device, step, start int64 }
	rows := map[rowKey][]Sample{}
	var keys []rowKey
	for _, l := range list {
		step := int64(BucketSeconds)
		if l.s.Bucket < cutoff {
			step, l.s.Bucket = hourSeconds, l.s.Bucket-l.s.Bucket%hourSeconds
		}
		k := rowKey{l.device, step, rowOf(l.s.Bucket, step)}
		if rows[k] == nil {
			keys = append(keys, k)
		}
		rows[k], _ = mergeInto(rows[k], []Sample{l.s})
	}
	for _, k := range keys {
		if _, err := writer.merge(ctx, k.device, k.step, k.start, rows[k]); err != nil {
			return false, err
		}
	}
	last := list[len(list)-1]
	_, err = tx.ExecContext(ctx, `DELETE FROM legacy_buckets WHERE series_id < ?1 OR (series_id = ?1 AND t <= ?2)`, last.series, last.s.Bucket)
	return true, err
}
