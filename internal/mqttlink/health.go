package mqttlink

// A device's health and readings as the link gathers them between two
// flushes: samples folded into 5-minute buckets, and the boots its
// reset reasons tell of (CONTRACT §14). The server's store writes them.

import (
	"slices"
	"time"

	"devicehub/internal/wire"
)

const (
	// BucketSeconds is a history bucket's width.
	BucketSeconds = 300
	// BootWindow: two boots with the same reason whose boot times are
	// this close are one (a resent message, or a clock's jitter).
	BootWindow = 60 * time.Second
	// maxReportSamples bounds the buckets one device's report holds
	// between two flushes: every series twice over (a flush that spans a
	// bucket's end); more are left out.
	maxReportSamples = 2 * (wire.MaxMetrics + 2)
	// maxReportBoots bounds the boots one device's report holds between
	// two flushes; a device cannot boot more often than that in 100 ms.
	maxReportBoots = 4
)

// crashReasons are the reset reasons that make a boot a crash.
var crashReasons = []string{"panic", "int_wdt", "task_wdt", "wdt", "brownout"}

// Sample is one series' bucket of values, as folded so far.
type Sample struct {
	Series        string // rssi, heap_free or metrics.<key>
	Bucket        int64  // the bucket's start, Unix seconds
	Min, Max, Sum float64
	Count         int64
	Last          float64
}

// addSample folds value, read at t, into its series' bucket in h, the
// samples of one device's report, in no order.
func addSample(h []Sample, series string, t time.Time, value float64) []Sample {
	b := t.Unix() - t.Unix()%BucketSeconds
	return mergeSamples(h, []Sample{{series, b, value, value, value, 1, value}})
}

// mergeSamples folds the newer samples n into h.
func mergeSamples(h, n []Sample) []Sample {
	for _, s := range n {
		i := slices.IndexFunc(h, func(o Sample) bool { return o.Series == s.Series && o.Bucket == s.Bucket })
		switch {
		case i >= 0:
			o := &h[i]
			o.Min, o.Max, o.Sum, o.Count, o.Last = min(o.Min, s.Min), max(o.Max, s.Max), o.Sum+s.Sum, o.Count+s.Count, s.Last
		case len(h) < maxReportSamples:
			h = append(h, s)
		}
	}
	return h
}

// Boot is a boot a device told of: its reason, when it booted, and the
// firmware it reported with it (nil: the one it ran before).
type Boot struct {
	Reason           string
	At               time.Time
	FWMD5, FWVersion *string
}

// Crash reports whether the boot is a crash.
func (b Boot) Crash() bool { return slices.Contains(crashReasons, b.Reason) }

// same reports whether two boots are one: the same reason, boot times
// within BootWindow.
func (b Boot) same(o Boot) bool {
	d := b.At.Sub(o.At)
	return b.Reason == o.Reason && d < BootWindow && d > -BootWindow
}

// mergeBoots adds the boots of n that are not already in p.
func mergeBoots(p, n []Boot) []Boot {
	for _, b := range n {
		if !slices.ContainsFunc(p, b.same) && len(p) < maxReportBoots {
			p = append(p, b)
		}
	}
	return p
}

// addHealth puts what telemetry t, read at now, says of the device's
// health and readings into the report.
func (r *Report) addHealth(t *wire.Telemetry, now time.Time) {
	if t.RSSI != nil {
		r.History = addSample(r.History, "rssi", now, *t.RSSI)
	}
	if t.HeapFree != nil {
		r.History = addSample(r.History, "heap_free", now, *t.HeapFree)
	}
	for _, m := range t.Metrics {
		r.History = addSample(r.History, "metrics."+m.Key, now, m.Value)
	}
	if t.ResetReason != nil {
		at := now
		if t.UptimeS != nil {
			at = now.Add(-time.Duration(*t.UptimeS * float64(time.Second)))
		}
		r.Boots = mergeBoots(r.Boots, []Boot{{*t.ResetReason, at, t.FWMD5, t.FWVersion}})
	}
}
