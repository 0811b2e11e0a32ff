// Package history is devicehub's fleet health (docs/api.md, "Fleet
// health"): the rules that turn what devices report into history (5-minute
// buckets of readings, boots, crashes, presence, firmware runs), the
// tables that keep it and the statements that write, read and prune them.
// The MQTT link folds what one device says between two flushes with the
// rules of this file; the store hands a flush to Add, inside its own
// transaction.
package history

import (
	"slices"
	"time"

	"devicehub/internal/wire"
)

const (
	// BucketSeconds is a history bucket's width.
	BucketSeconds = 300
	// ResendWindow: a message with reset_reason that comes again this
	// soon, the same in every field that tells boots apart, is the same
	// boot told again (a QoS 1 resend).
	ResendWindow = 60 * time.Second
	// MaxSeries bounds a device's series: rssi, heap_free and 16 metrics.
	// A sample of a new series past it is left out and counted.
	MaxSeries = wire.MaxMetrics + 2
	// maxReportSamples bounds the buckets one device's report holds
	// between two flushes: every series twice over (a flush that spans a
	// bucket's end); more are left out.
	maxReportSamples = 2 * MaxSeries
	// maxReportBoots bounds the boots one device's report holds between
	// two flushes (100 ms); more are left out.
	maxReportBoots = 8
)

// CrashReason is a reset reason that makes a boot a crash. A device may
// report any reason; the others are boots that are not crashes.
type CrashReason string

const (
	CrashPanic    CrashReason = "panic"
	CrashIntWDT   CrashReason = "int_wdt"
	CrashTaskWDT  CrashReason = "task_wdt"
	CrashWDT      CrashReason = "wdt"
	CrashBrownout CrashReason = "brownout"
)

// crashReasons are the reset reasons that make a boot a crash.
var crashReasons = []CrashReason{CrashPanic, CrashIntWDT, CrashTaskWDT, CrashWDT, CrashBrownout}

// IsCrash reports whether a boot for reason is a crash.
func IsCrash(reason string) bool { return slices.Contains(crashReasons, CrashReason(reason)) }

// SeriesName names one of a device's series: rssi, heap_free, or a
// metric's (MetricSeries).
type SeriesName string

const (
	SeriesRSSI     SeriesName = "rssi"
	SeriesHeapFree SeriesName = "heap_free"
)

// MetricSeries is the series of the metric with that key: metrics.<key>.
func MetricSeries(key string) SeriesName { return SeriesName("metrics." + key) }

// Sample is one series' bucket of values, as folded so far.
type Sample struct {
	Series        SeriesName
	Bucket        int64 // the bucket's start, Unix seconds
	Min, Max, Sum float64
	Count         int64
	Last          float64
}

// bucketOf is the start of the bucket that holds t, Unix seconds.
func bucketOf(t int64) int64 { return t - t%BucketSeconds }

// merge folds the newer sample n of the same series into s.
func (s *Sample) merge(n Sample) {
	s.Min, s.Max, s.Sum, s.Count, s.Last = min(s.Min, n.Min), max(s.Max, n.Max), s.Sum+n.Sum, s.Count+n.Count, n.Last
}

// MergeSamples folds the newer samples n into h, the samples of one
// device's report, in no order; at most maxReportSamples are kept. Each
// of n is of a series and bucket of its own (Fold's, or a merged
// report's): into an empty h, n is h.
func MergeSamples(h, n []Sample) []Sample {
	if len(h) == 0 && len(n) <= maxReportSamples {
		return n
	}
	for _, s := range n {
		i := slices.IndexFunc(h, func(o Sample) bool { return o.Series == s.Series && o.Bucket == s.Bucket })
		switch {
		case i >= 0:
			h[i].merge(s)
		case len(h) < maxReportSamples:
			h = append(h, s)
		}
	}
	return h
}

// Boot is a message with reset_reason as a device sent it: the reason,
// when it came, the uptime_s and boot_count it carried (nil: none), and
// the firmware it reported with it (nil: the one it ran before).
type Boot struct {
	Reason           string
	Arrived          time.Time
	UptimeS          *float64
	BootCount        *int64
	FWMD5, FWVersion *string
}

// At is when the device booted: its arrival less uptime_s.
func (b Boot) At() time.Time {
	if b.UptimeS == nil {
		return b.Arrived
	}
	return b.Arrived.Add(-time.Duration(*b.UptimeS * float64(time.Second)))
}

// Crash reports whether the boot is a crash.
func (b Boot) Crash() bool { return IsCrash(b.Reason) }

// Resends reports whether b is o sent again: the same reason, uptime_s
// and boot_count (or neither), arrived within ResendWindow. Any other
// two messages are two boots, however close.
func (b Boot) Resends(o Boot) bool {
	d := b.Arrived.Sub(o.Arrived)
	return b.Reason == o.Reason && same(b.UptimeS, o.UptimeS) && same(b.BootCount, o.BootCount) &&
		d < ResendWindow && d > -ResendWindow
}

// same reports whether two optional values are both absent or equal.
func same[T comparable](a, b *T) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// MergeBoots adds the boots of n that do not resend one already in p;
// at most maxReportBoots are kept.
func MergeBoots(p, n []Boot) []Boot {
	for _, b := range n {
		if !slices.ContainsFunc(p, b.Resends) && len(p) < maxReportBoots {
			p = append(p, b)
		}
	}
	return p
}

// Fold puts what telemetry t, taken at now, says of the device's health
// and readings into its report's samples and boots.
func Fold(samples []Sample, boots []Boot, t *wire.Telemetry, now time.Time) ([]Sample, []Boot) {
	bucket, folded := bucketOf(now.Unix()), make([]Sample, 0, 2+len(t.Metrics))
	add := func(series SeriesName, v float64) {
		folded = append(folded, Sample{series, bucket, v, v, v, 1, v})
	}
	if t.RSSI != nil {
		add(SeriesRSSI, *t.RSSI)
	}
	if t.HeapFree != nil {
		add(SeriesHeapFree, *t.HeapFree)
	}
	for _, m := range t.Metrics {
		add(MetricSeries(m.Key), m.Value) // keys of their own (wire.ParseTelemetry)
	}
	samples = MergeSamples(samples, folded)
	if t.ResetReason != nil {
		boots = MergeBoots(boots, []Boot{{*t.ResetReason, now, t.UptimeS, t.BootCount, t.FWMD5, t.FWVersion}})
	}
	return samples, boots
}
