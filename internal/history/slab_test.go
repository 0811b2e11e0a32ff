package history

import (
	"math"
	"slices"
	"testing"
	"time"
)

// TestRowRoundTrip: a row packs each series' slots as float32 and reads
// back the values a float32 holds, written as their shortest decimal;
// what a float32 cannot hold stays finite.
func TestRowRoundTrip(t *testing.T) {
	const start = 1_800_000_000 - 1_800_000_000%hourSeconds
	in := []Sample{
		{"rssi", start, -70, -58, -64 * 10, 10, -63},
		{"rssi", start + 11*BucketSeconds, -61, -61, -61, 1, -61},
		{"metrics.temp_c", start + 5*BucketSeconds, 21.3, 22.9, 221.7, 10, 22.1},
		{"heap_free", start, 180000, 182345, 1812345 * 10, 10, 181000},
		{"metrics.huge", start, -1e308, 1e308, 0, 2, 1e300},
	}
	b := encodeRow(in, start, BucketSeconds)
	out, err := decodeRow(b, start, BucketSeconds)
	if err != nil {
		t.Fatal(err)
	}
	want := []Sample{
		{"heap_free", start, 180000, 182345, 1812345 * 10, 10, 181000},
		{"metrics.huge", start, -math.MaxFloat32, math.MaxFloat32, 0, 2, math.MaxFloat32},
		{"metrics.temp_c", start + 5*BucketSeconds, 21.3, 22.9, 221.7, 10, 22.1},
		{"rssi", start, -70, -58, -64 * 10, 10, -63},
		{"rssi", start + 11*BucketSeconds, -61, -61, -61, 1, -61},
	}
	for i := range want {
		want[i].Min, want[i].Max, want[i].Last = widen(toFloat32(want[i].Min)), widen(toFloat32(want[i].Max)), widen(toFloat32(want[i].Last))
	}
	if len(out) != len(want) {
		t.Fatalf("got %d samples, want %d: %+v", len(out), len(want), out)
	}
	for i := range want {
		g, w := out[i], want[i]
		if g.Series != w.Series || g.Bucket != w.Bucket || g.Min != w.Min || g.Max != w.Max || g.Count != w.Count || g.Last != w.Last ||
			math.Abs(g.Sum/float64(g.Count)-w.Sum/float64(w.Count)) > 1e-6*math.Abs(w.Sum/float64(w.Count))+1e-9 {
			t.Errorf("sample %d: got %+v, want %+v", i, g, w)
		}
	}
	if out[2].Min != 21.3 || out[2].Last != 22.1 {
		t.Errorf("float32 values read as %v and %v, want 21.3 and 22.1", out[2].Min, out[2].Last)
	}
	// 5 slots of 4 values and a count, and 4 names with their masks.
	if len(b) > 5*17+4*(2+15)+8 {
		t.Errorf("row of 5 slots is %d bytes", len(b))
	}
	if _, err := decodeRow(b[:len(b)-1], start, BucketSeconds); err == nil {
		t.Error("a cut row decoded")
	}
}

// TestToHours: an hour's 5-minute slots merge into one hourly slot per
// series: min of mins, max of maxes, counts and sums added, the last of
// the latest.
func TestToHours(t *testing.T) {
	const start = 1_800_000_000 - 1_800_000_000%daySeconds
	in := []Sample{
		{"rssi", start, -70, -60, -650, 10, -61},
		{"rssi", start + 5*BucketSeconds, -80, -50, -320, 5, -55},
		{"rssi", start + hourSeconds, -40, -40, -40, 1, -40},
	}
	got := toHours(in)
	want := []Sample{
		{"rssi", start, -80, -50, -970, 15, -55},
		{"rssi", start + hourSeconds, -40, -40, -40, 1, -40},
	}
	if !slices.Equal(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
}

// TestEngineFold: a device's open bucket takes its samples until one of
// a later bucket closes it; a sweep closes the buckets that have ended;
// a series past MaxSeries in a bucket is left out and counted.
func TestEngineFold(t *testing.T) {
	e := NewEngine()
	t0 := time.Unix(1_800_000_000-1_800_000_000%BucketSeconds, 0)
	s := func(series SeriesName, at time.Time, v float64) Sample {
		return Sample{series, bucketOf(at.Unix()), v, v, v, 1, v}
	}
	fold := func(device int64, samples ...Sample) int {
		return e.fold(&Report{DeviceID: device, Samples: samples})
	}
	fold(1, s("rssi", t0, -60))
	fold(1, s("rssi", t0.Add(time.Minute), -70))
	fold(2, s("rssi", t0, -50))
	if len(e.closed) != 0 || e.open[1].samples[0].Count != 2 {
		t.Fatalf("one bucket: closed %v, open %v", e.closed, e.open)
	}
	fold(1, s("rssi", t0.Add(5*time.Minute), -80))
	if len(e.closed) != 1 || e.closed[0].samples[0].Sum != -130 {
		t.Fatalf("the next bucket closes the first: closed %+v", e.closed)
	}
	e.sweep(t0.Add(10 * time.Minute))
	if len(e.closed) != 3 || len(e.open) != 0 {
		t.Errorf("a sweep closes what ended: closed %d, open %d", len(e.closed), len(e.open))
	}
	var many []Sample
	for i := range MaxSeries + 2 {
		many = append(many, s(SeriesName(rune('a'+i)), t0.Add(10*time.Minute), 1))
	}
	if left := fold(3, many...); left != 2 {
		t.Errorf("left out past MaxSeries: got %d, want 2", left)
	}
}
