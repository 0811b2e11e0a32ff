package main

// A device's health and readings as the link gathers them between two
// flushes: samples folded into 5-minute buckets, and the boots its
// reset reasons tell of (CONTRACT §14). store_history.go writes them.

import (
	"slices"
	"time"

	"devicehub/internal/wire"
)

const (
	// bucketSeconds is a history bucket's width.
	bucketSeconds = 300
	// bootWindow: two boots with the same reason whose boot times are
	// this close are one (a resent message, or a clock's jitter).
	bootWindow = 60 * time.Second
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

// sample is one series' bucket of values, as folded so far.
type sample struct {
	series        string // rssi, heap_free or metrics.<key>
	bucket        int64  // the bucket's start, Unix seconds
	min, max, sum float64
	count         int64
	last          float64
}

// history is the samples of one device's report, in no order.
type history []sample

// add folds value, read at t, into its series' bucket.
func (h history) add(series string, t time.Time, value float64) history {
	b := t.Unix() - t.Unix()%bucketSeconds
	for i := range h {
		if s := &h[i]; s.series == series && s.bucket == b {
			s.min, s.max, s.sum, s.count, s.last = min(s.min, value), max(s.max, value), s.sum+value, s.count+1, value
			return h
		}
	}
	if len(h) == maxReportSamples {
		return h
	}
	return append(h, sample{series, b, value, value, value, 1, value})
}

// merge folds the newer samples n into h.
func (h history) merge(n history) history {
	for _, s := range n {
		i := slices.IndexFunc(h, func(o sample) bool { return o.series == s.series && o.bucket == s.bucket })
		switch {
		case i >= 0:
			o := &h[i]
			o.min, o.max, o.sum, o.count, o.last = min(o.min, s.min), max(o.max, s.max), o.sum+s.sum, o.count+s.count, s.last
		case len(h) < maxReportSamples:
			h = append(h, s)
		}
	}
	return h
}

// boot is a boot a device told of: its reason, when it booted, and the
// firmware it reported with it (nil: the one it ran before).
type boot struct {
	reason           string
	at               time.Time
	fwMD5, fwVersion *string
}

// crash reports whether the boot is a crash.
func (b boot) crash() bool { return slices.Contains(crashReasons, b.reason) }

// same reports whether two boots are one: the same reason, boot times
// within bootWindow.
func (b boot) same(o boot) bool {
	d := b.at.Sub(o.at)
	return b.reason == o.reason && d < bootWindow && d > -bootWindow
}

// mergeBoots adds the boots of n that are not already in p.
func mergeBoots(p, n []boot) []boot {
	for _, b := range n {
		if !slices.ContainsFunc(p, b.same) && len(p) < maxReportBoots {
			p = append(p, b)
		}
	}
	return p
}

// addHealth puts what telemetry t, read at now, says of the device's
// health and readings into the report.
func (r *deviceReport) addHealth(t *wire.Telemetry, now time.Time) {
	if t.RSSI != nil {
		r.history = r.history.add("rssi", now, *t.RSSI)
	}
	if t.HeapFree != nil {
		r.history = r.history.add("heap_free", now, *t.HeapFree)
	}
	for _, m := range t.Metrics {
		r.history = r.history.add("metrics."+m.Key, now, m.Value)
	}
	if t.ResetReason != nil {
		at := now
		if t.UptimeS != nil {
			at = now.Add(-time.Duration(*t.UptimeS * float64(time.Second)))
		}
		r.boots = mergeBoots(r.boots, []boot{{*t.ResetReason, at, t.FWMD5, t.FWVersion}})
	}
}
