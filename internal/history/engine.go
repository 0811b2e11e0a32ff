package history

// The open 5-minute bucket of each device is kept in memory and written
// once, when it closes, into the row of its hour: a chart shows it from
// memory meanwhile, and a crash loses at most that bucket.

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"time"
)

// closePerFlush bounds the closed buckets one flush writes, so that the
// flush after a bucket's end, when every device's bucket closes at once,
// does not hold the writer long: the rest wait for the next flushes.
const closePerFlush = 2000

// Engine holds the buckets not yet written. One Engine serves a store;
// flushes run one at a time (the store has one writer).
type Engine struct {
	mu     sync.Mutex
	open   map[int64]closedBucket // by device: its open bucket
	closed []closedBucket         // closed, to be written, oldest first
	swept  int64                  // the bucket before which every open one was closed
}

// closedBucket is a device's bucket, open or closed: its samples, and
// the team and firmware (md5, "" for none) they are charged to.
type closedBucket struct {
	device, team int64
	md5          string
	samples      []Sample
}

// NewEngine returns an engine with nothing in memory.
func NewEngine() *Engine { return &Engine{open: map[int64]closedBucket{}} }

// fold adds the samples of report r to its device's open bucket; a
// bucket before it closes, and a series past MaxSeries in the bucket is
// left out. It returns how many samples were left out.
func (e *Engine) fold(r *Report) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	left := 0
	for _, s := range r.Samples {
		open := e.open[r.DeviceID]
		switch {
		case len(open.samples) > 0 && s.Bucket > open.samples[0].Bucket:
			e.closed = append(e.closed, open)
			open.samples = nil
		case len(open.samples) > 0 && s.Bucket < open.samples[0].Bucket: // a late one: written as it is
			e.closed = append(e.closed, closedBucket{r.DeviceID, r.TeamID, r.Firmware, []Sample{s}})
			continue
		}
		var n int
		open.samples, n = mergeInto(open.samples, []Sample{s})
		open.device, open.team, open.md5 = r.DeviceID, r.TeamID, r.Firmware
		e.open[r.DeviceID], left = open, left+n
	}
	return left
}

// sweep closes every open bucket that ended before now.
func (e *Engine) sweep(now time.Time) {
	current := bucketOf(now.Unix())
	if current == e.swept {
		return
	}
	for device, open := range e.open {
		if open.samples[0].Bucket < current {
			e.closed = append(e.closed, open)
			delete(e.open, device)
		}
	}
	e.swept = current
}

// unwritten is what memory holds of the device: its open bucket and
// those closed but not yet written.
func (e *Engine) unwritten(device int64) []Sample {
	e.mu.Lock()
	defer e.mu.Unlock()
	list := slices.Clone(e.open[device].samples)
	for _, c := range e.closed {
		if c.device == device {
			list = append(list, c.samples...)
		}
	}
	return list
}

// rowStmts read and write a row of history.
// A device deleted since its bucket was taken gets no row.
var rowStmts = []string{
	`SELECT slots FROM history_rows WHERE device_id = ? AND step = ? AND start = ?`,
	`INSERT INTO history_rows (device_id, step, start, slots) SELECT ?1, ?2, ?3, ?4
		WHERE EXISTS (SELECT 1 FROM devices WHERE id = ?1)
		ON CONFLICT (device_id, step, start) DO UPDATE SET slots = excluded.slots`,
}

// writeClosed writes up to closePerFlush closed buckets into the rows of
// their devices and their means into fleet_hours, in tx. Each device's row,
// and each hour of fleet_hours, is written alone: one the database
// refuses, or whose row does not decode, is undone and named in failed,
// and the others are written; the buckets taken leave memory with the
// commit all the same (Flush.Done), so that a bucket that cannot be
// written is not tried again at every flush. It returns how many buckets
// it took, and the samples left out for want of room in their rows.
func (e *Engine) writeClosed(ctx context.Context, tx *sql.Tx, now time.Time) (taken, left int, failed []error, err error) {
	e.mu.Lock()
	e.sweep(now)
	batch := slices.Clone(e.closed[:min(len(e.closed), closePerFlush)])
	e.mu.Unlock()
	if len(batch) == 0 {
		return 0, 0, nil, nil
	}
	writer, err := newRowWriter(ctx, tx)
	if err != nil {
		return 0, 0, nil, err
	}
	defer writer.Close()
	written := batch[:0:0]
	for _, c := range batch {
		var n int
		refused, err := alone(ctx, tx, func() (err error) {
			n, err = writer.merge(ctx, c.device, BucketSeconds, rowOf(c.samples[0].Bucket, BucketSeconds), c.samples)
			return err
		})
		if err != nil {
			return 0, 0, nil, err
		}
		if refused != nil {
			failed = append(failed, fmt.Errorf("history of device %d: %w", c.device, refused))
			continue
		}
		left += n
		written = append(written, c)
	}
	refused, err := addMeans(ctx, tx, written)
	return len(batch), left, append(failed, refused...), err
}

// alone runs write in a savepoint of tx: when write fails, what it wrote
// is undone, the transaction goes on, and write's error is returned as
// failed. err is the transaction's own error, after which it cannot go on.
func alone(ctx context.Context, tx *sql.Tx, write func() error) (failed, err error) {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT history`); err != nil {
		return nil, err
	}
	if failed = write(); failed != nil {
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO history`); err != nil {
			return nil, fmt.Errorf("%w (and then: %w)", failed, err)
		}
	}
	_, err = tx.ExecContext(ctx, `RELEASE history`)
	return failed, err
}

// rowWriter merges samples into rows of history, with a transaction's
// statements (rowStmts).
type rowWriter struct{ read, write *sql.Stmt }

func newRowWriter(ctx context.Context, tx *sql.Tx) (*rowWriter, error) {
	read, err := tx.PrepareContext(ctx, rowStmts[0])
	if err != nil {
		return nil, err
	}
	write, err := tx.PrepareContext(ctx, rowStmts[1])
	if err != nil {
		read.Close()
		return nil, err
	}
	return &rowWriter{read, write}, nil
}

func (w *rowWriter) Close() {
	w.read.Close()
	w.write.Close()
}

// merge folds samples (slots of width step in the row that starts at
// start) into the device's row, made when it has none, and returns the
// samples left out for want of room for another series.
func (w *rowWriter) merge(ctx context.Context, device, step, start int64, samples []Sample) (int, error) {
	var b []byte
	err := w.read.QueryRowContext(ctx, device, step, start).Scan(&b)
	if err != nil && err != sql.ErrNoRows {
		return 0, err
	}
	row, err := decodeRow(b, start, step)
	if err != nil {
		return 0, err
	}
	row, left := mergeInto(row, samples)
	_, err = w.write.ExecContext(ctx, device, step, start, encodeRow(row, start, step))
	return left, err
}

// writtenOut drops the first n closed buckets, written by a flush that
// committed.
func (e *Engine) writtenOut(n int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = slices.Delete(e.closed, 0, n)
}

// WriteAll writes every bucket memory holds, open or closed, in tx, and
// forgets them: at shutdown, the last write.
func (e *Engine) WriteAll(ctx context.Context, tx *sql.Tx) (int, error) {
	e.mu.Lock()
	for device, open := range e.open {
		e.closed = append(e.closed, open)
		delete(e.open, device)
	}
	n := len(e.closed)
	e.mu.Unlock()
	total := 0
	for total < n {
		taken, _, _, err := e.writeClosed(ctx, tx, time.Unix(e.swept, 0))
		if err != nil || taken == 0 {
			return total, err
		}
		total += taken
		e.writtenOut(taken)
	}
	return total, nil
}
