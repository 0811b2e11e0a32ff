package history

// Retention: what -history-days no longer keeps is deleted a step at a
// time, each step a small transaction of its own.

import (
	"context"
	"database/sql"
	"time"
)

// pruneDevices is how many devices' history one retention step deletes
// from, in one transaction.
const pruneDevices = 50

// PruneStep deletes, in tx, what is no longer kept of the devices with
// the next pruneDevices ids after after that have history: buckets
// before cutoff (and series left empty), presence intervals that ended
// before it and those past the newest MaxPresence; with history kept
// (keep), boots and firmware runs that ended before it too (with none
// kept, boots and runs are bounded by their count alone: the health
// gate needs them). It returns the last id it took, 0 when there was none.
func PruneStep(ctx context.Context, tx *sql.Tx, after int64, cutoff time.Time, keep bool) (int64, error) {
	var first, last sql.NullInt64
	err := tx.QueryRowContext(ctx, `SELECT min(id), max(id) FROM (SELECT id FROM devices WHERE id > ? ORDER BY id LIMIT ?)`,
		after, pruneDevices).Scan(&first, &last)
	if err != nil || !last.Valid {
		return 0, err
	}
	statements := []string{
		`DELETE FROM buckets WHERE series_id IN (SELECT id FROM series WHERE device_id BETWEEN ?1 AND ?2) AND t < ?3`,
		`DELETE FROM series WHERE device_id BETWEEN ?1 AND ?2 AND NOT EXISTS (SELECT 1 FROM buckets WHERE series_id = series.id)`,
		`DELETE FROM presence WHERE device_id BETWEEN ?1 AND ?2 AND to_at < ?3`,
		`DELETE FROM presence WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY device_id ORDER BY id DESC) AS n
			FROM presence WHERE device_id BETWEEN ?1 AND ?2) WHERE n > ?4)`,
	}
	if keep {
		statements = append(statements,
			`DELETE FROM boots WHERE device_id BETWEEN ?1 AND ?2 AND at < ?3`,
			`DELETE FROM firmware_runs WHERE device_id BETWEEN ?1 AND ?2 AND to_at < ?3`)
	}
	for _, q := range statements {
		if _, err := tx.ExecContext(ctx, q, first.Int64, last.Int64, cutoff.Unix(), MaxPresence); err != nil {
			return 0, err
		}
	}
	return last.Int64, nil
}
