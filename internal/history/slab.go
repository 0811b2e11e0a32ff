package history

// A row of history packs the slots of all of a device's series for an
// hour (twelve 5-minute slots) or, after detailDays, a day (24 hourly
// slots). Each series is a name, a mask of the slots it has, and per
// slot its count and its min, max, mean and last as float32 (docs/api.md,
// "Fleet health"): about 17 bytes a slot, where a row per series and
// bucket cost 55.

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"strconv"
)

const (
	// hourSeconds and daySeconds are the spans of the two kinds of row.
	hourSeconds, daySeconds = 3600, 86400
	// detailDays is how long 5-minute slots are kept; older hours are
	// merged into one row per device and day of hourly slots.
	detailDays = 7
)

// errBadRow: a row's bytes do not decode.
var errBadRow = errors.New("history: bad row")

// rowOf is the start and the slot width of the row that keeps a slot
// of width step that starts at t.
func rowOf(t, step int64) int64 {
	if step == BucketSeconds {
		return t - t%hourSeconds
	}
	return t - t%daySeconds
}

// toFloat32 narrows v to a float32 that stays finite.
func toFloat32(v float64) float32 {
	return float32(max(-math.MaxFloat32, min(math.MaxFloat32, v)))
}

// widen is the float64 that a float32 reads as in decimal: 21.3, not
// 21.299999237060547.
func widen(f float32) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(float64(f), 'g', -1, 32), 64)
	return v
}

// encodeRow packs samples (each a slot of width step in the row that
// starts at start; one per series and slot) into a row's bytes, series
// by name, slots in order.
func encodeRow(samples []Sample, start, step int64) []byte {
	samples = slices.Clone(samples)
	slices.SortFunc(samples, func(a, b Sample) int {
		if a.Series != b.Series {
			if a.Series < b.Series {
				return -1
			}
			return 1
		}
		return int(a.Bucket - b.Bucket)
	})
	var out []byte
	for i := 0; i < len(samples); {
		j := i
		var mask uint64
		for ; j < len(samples) && samples[j].Series == samples[i].Series; j++ {
			mask |= 1 << uint((samples[j].Bucket-start)/step)
		}
		out = append(out, byte(len(samples[i].Series)))
		out = append(out, samples[i].Series...)
		out = binary.AppendUvarint(out, mask)
		for _, s := range samples[i:j] {
			out = binary.AppendUvarint(out, uint64(s.Count))
			for _, v := range []float64{s.Min, s.Max, s.Sum / float64(s.Count), s.Last} {
				out = binary.LittleEndian.AppendUint32(out, math.Float32bits(toFloat32(v)))
			}
		}
		i = j
	}
	return out
}

// decodeRow unpacks a row's bytes into its samples, series by name,
// slots in order.
func decodeRow(b []byte, start, step int64) ([]Sample, error) {
	return decodeSeries(b, start, step, "")
}

// decodeSeries is decodeRow of one series only ("": all of them).
func decodeSeries(b []byte, start, step int64, only SeriesName) ([]Sample, error) {
	var list []Sample
	for len(b) > 0 {
		n := int(b[0])
		if len(b) < 1+n {
			return nil, errBadRow
		}
		name := SeriesName(b[1 : 1+n])
		b = b[1+n:]
		skip := only != "" && name != only
		mask, k := binary.Uvarint(b)
		if k <= 0 {
			return nil, errBadRow
		}
		b = b[k:]
		for slot := int64(0); mask != 0; slot, mask = slot+1, mask>>1 {
			if mask&1 == 0 {
				continue
			}
			count, k := binary.Uvarint(b)
			if k <= 0 || len(b) < k+16 || count == 0 {
				return nil, errBadRow
			}
			if skip {
				b = b[k+16:]
				continue
			}
			var v [4]float64
			for i := range v {
				v[i] = widen(math.Float32frombits(binary.LittleEndian.Uint32(b[k+4*i:])))
			}
			b = b[k+16:]
			list = append(list, Sample{name, start + slot*step, v[0], v[1], v[2] * float64(count), int64(count), v[3]})
		}
	}
	return list, nil
}

// mergeInto folds the samples n into row, those of a series and slot
// already there merged; a series past MaxSeries is left out, and counted.
func mergeInto(row, n []Sample) ([]Sample, int) {
	left := 0
	for _, s := range n {
		if i := slices.IndexFunc(row, func(o Sample) bool { return o.Series == s.Series && o.Bucket == s.Bucket }); i >= 0 {
			row[i].merge(s)
			continue
		}
		if !slices.ContainsFunc(row, func(o Sample) bool { return o.Series == s.Series }) && seriesIn(row) >= MaxSeries {
			left++
			continue
		}
		row = append(row, s)
	}
	return row, left
}

// seriesIn counts the series of samples.
func seriesIn(samples []Sample) int {
	var names []SeriesName
	for _, s := range samples {
		if !slices.Contains(names, s.Series) {
			names = append(names, s.Series)
		}
	}
	return len(names)
}

// toHours merges 5-minute samples into hourly ones.
func toHours(samples []Sample) []Sample {
	var hours []Sample
	for _, s := range samples {
		s.Bucket -= s.Bucket % hourSeconds
		hours, _ = mergeInto(hours, []Sample{s})
	}
	return hours
}
