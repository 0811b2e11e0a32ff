package history

// Release health reads hours, not buckets: a row of fleet_hours per team,
// firmware (md5) and hour keeps the offline intervals its devices began
// then, and a histogram of the means of their 5-minute buckets of rssi
// (1 dBm bins) and heap_free (1 % bins), written in the flush that writes
// the buckets. A median is then the median of those means, within a bin's
// width: each bin keeps the sum of its values too, and the median's bin
// answers their mean (exact when its values are one).

import (
	"context"
	"database/sql"
	"encoding/binary"
	"fmt"
	"maps"
	"math"
	"slices"
)

// histogram counts values by bin; each bin keeps their sum.
type histogram map[int64]*binSum

type binSum struct {
	count int64
	sum   float64
}

// binOf is the bin of a value of series: 1 dBm of rssi, 1 % of heap_free.
func binOf(series SeriesName, v float64) int64 {
	if series == SeriesRSSI {
		return int64(math.Round(v))
	}
	return int64(math.Round(math.Log(max(v, 1)) / math.Log(1.01)))
}

func (h histogram) add(bin int64, count int64, sum float64) {
	b := h[bin]
	if b == nil {
		b = &binSum{}
		h[bin] = b
	}
	b.count, b.sum = b.count+count, b.sum+sum
}

// encode packs h: per bin, in order, its number (zigzag), count and sum.
func (h histogram) encode() []byte {
	var out []byte
	for _, bin := range slices.Sorted(maps.Keys(h)) {
		out = binary.AppendVarint(out, bin)
		out = binary.AppendUvarint(out, uint64(h[bin].count))
		out = binary.LittleEndian.AppendUint64(out, math.Float64bits(h[bin].sum))
	}
	return out
}

// decodeInto adds the packed histogram b to h.
func (h histogram) decodeInto(b []byte) error {
	for len(b) > 0 {
		bin, k := binary.Varint(b)
		if k <= 0 {
			return errBadRow
		}
		count, j := binary.Uvarint(b[k:])
		if j <= 0 || len(b) < k+j+8 {
			return errBadRow
		}
		h.add(bin, int64(count), math.Float64frombits(binary.LittleEndian.Uint64(b[k+j:])))
		b = b[k+j+8:]
	}
	return nil
}

// median is the median of the values h counts, each read as the mean of
// its bin; nil when there are none.
func (h histogram) median() *float64 {
	var n int64
	for _, b := range h {
		n += b.count
	}
	if n == 0 {
		return nil
	}
	bins := slices.Sorted(maps.Keys(h))
	at := func(i int64) float64 { // the value at position i, in order
		for _, bin := range bins {
			if i < h[bin].count {
				return h[bin].sum / float64(h[bin].count)
			}
			i -= h[bin].count
		}
		return math.NaN()
	}
	m := at(n / 2)
	if n%2 == 0 {
		m = (at(n/2-1) + m) / 2
	}
	return &m
}

// hourKey is a row of fleet_hours.
type hourKey struct {
	team int64
	md5  string
	hour int64
}

// addMeans adds the means of the rssi and heap_free buckets of closed to
// the rows of fleet_hours of their team, firmware and hour, in tx, each
// row alone: one refused is undone and named in failed.
func addMeans(ctx context.Context, tx *sql.Tx, closed []closedBucket) (failed []error, err error) {
	sums := map[hourKey]map[SeriesName]histogram{}
	var keys []hourKey
	for _, c := range closed {
		for _, s := range c.samples {
			if s.Series != SeriesRSSI && s.Series != SeriesHeapFree {
				continue
			}
			k := hourKey{c.team, c.md5, s.Bucket - s.Bucket%hourSeconds}
			if sums[k] == nil {
				sums[k] = map[SeriesName]histogram{SeriesRSSI: {}, SeriesHeapFree: {}}
				keys = append(keys, k)
			}
			mean := s.Sum / float64(s.Count)
			sums[k][s.Series].add(binOf(s.Series, mean), 1, mean)
		}
	}
	for _, k := range keys {
		refused, err := alone(ctx, tx, func() error { return addHourMeans(ctx, tx, k, sums[k][SeriesRSSI], sums[k][SeriesHeapFree]) })
		if err != nil {
			return nil, err
		}
		if refused != nil {
			failed = append(failed, fmt.Errorf("fleet hours of team %d, firmware %q: %w", k.team, k.md5, refused))
		}
	}
	return failed, nil
}

// addHourMeans adds the histograms of means rssi and heap to the row of
// fleet_hours k.
func addHourMeans(ctx context.Context, tx *sql.Tx, k hourKey, rssi, heap histogram) error {
	var rssiRow, heapRow []byte
	err := tx.QueryRowContext(ctx, `SELECT rssi, heap FROM fleet_hours WHERE team_id = ? AND md5 = ? AND hour = ?`,
		k.team, k.md5, k.hour).Scan(&rssiRow, &heapRow)
	if err != nil && err != sql.ErrNoRows {
		return err
	}
	if err := rssi.decodeInto(rssiRow); err != nil {
		return err
	}
	if err := heap.decodeInto(heapRow); err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO fleet_hours (team_id, md5, hour, rssi, heap) SELECT ?1, ?2, ?3, ?4, ?5
		WHERE EXISTS (SELECT 1 FROM teams WHERE id = ?1)
		ON CONFLICT (team_id, md5, hour) DO UPDATE SET rssi = excluded.rssi, heap = excluded.heap`,
		k.team, k.md5, k.hour, rssi.encode(), heap.encode())
	return err
}

// hourFigures are what fleet_hours says of a firmware of a team over a
// window: offline intervals begun, and the medians.
type hourFigures struct {
	boots, crashes, offline int
	rssi, heap              histogram
}

// hoursOf reads the rows of fleet_hours of the team in the hours that
// begin in [from, to], by md5.
func hoursOf(ctx context.Context, q Queryer, teamID, from, to int64) (map[string]*hourFigures, error) {
	rows, err := q.QueryContext(ctx, `SELECT md5, boots, crashes, offline, rssi, heap FROM fleet_hours
		WHERE team_id = ? AND hour >= ? AND hour <= ?`,
		teamID, from-from%hourSeconds, to)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	byMD5 := map[string]*hourFigures{}
	for rows.Next() {
		var md5 string
		var boots, crashes, offline int
		var rssi, heap []byte
		if err := rows.Scan(&md5, &boots, &crashes, &offline, &rssi, &heap); err != nil {
			return nil, err
		}
		f := byMD5[md5]
		if f == nil {
			f = &hourFigures{rssi: histogram{}, heap: histogram{}}
			byMD5[md5] = f
		}
		f.boots, f.crashes, f.offline = f.boots+boots, f.crashes+crashes, f.offline+offline
		if err := f.rssi.decodeInto(rssi); err != nil {
			return nil, err
		}
		if err := f.heap.decodeInto(heap); err != nil {
			return nil, err
		}
	}
	return byMD5, rows.Err()
}

// addUnwritten adds to hours the means of the rssi and heap_free buckets
// of the team that memory holds and that begin in [from, to].
func (e *Engine) addUnwritten(hours map[string]*hourFigures, teamID, from, to int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	add := func(c closedBucket) {
		if c.team != teamID {
			return
		}
		for _, s := range c.samples {
			if (s.Series != SeriesRSSI && s.Series != SeriesHeapFree) || s.Bucket < from-from%hourSeconds || s.Bucket > to {
				continue
			}
			f := hours[c.md5]
			if f == nil {
				f = &hourFigures{rssi: histogram{}, heap: histogram{}}
				hours[c.md5] = f
			}
			h, mean := f.rssi, s.Sum/float64(s.Count)
			if s.Series == SeriesHeapFree {
				h = f.heap
			}
			h.add(binOf(s.Series, mean), 1, mean)
		}
	}
	for _, c := range e.open {
		add(c)
	}
	for _, c := range e.closed {
		add(c)
	}
}
