package main

// A rollout's health gate (docs/api.md, "History and release health"):
// each batch's devices that report the new firmware are watched for
// watch_minutes before the next batch starts, and the rollout halts once
// the devices it updated have crashed at least min_crashes times on the
// new firmware at more than max_crash_rate crashes per device-day. A
// halt says why (haltReason).

import (
	"context"
	"encoding/json"
	"math"
	"time"
)

// rolloutHealth is a rollout's health gate, as asked for and shown.
type rolloutHealth struct {
	MaxCrashRate float64 `json:"max_crash_rate"`
	MinCrashes   int     `json:"min_crashes"`
	WatchMinutes int     `json:"watch_minutes"`
}

// haltReason is why a rollout halted: kind failures (failed, limit) or
// health (crashes, device_days, rate, limit).
type haltReason struct {
	Kind       string   `json:"kind"`
	Failed     *int     `json:"failed,omitempty"`
	Crashes    *int     `json:"crashes,omitempty"`
	DeviceDays *float64 `json:"device_days,omitempty"`
	Rate       *float64 `json:"rate,omitempty"`
	Limit      float64  `json:"limit"`
}

// readHealth reads a rollout's "health": an object of max_crash_rate
// (required, > 0), min_crashes (≥ 1, default 2) and watch_minutes (0 to
// 1440, default 60), nothing else.
func (b jsonBody) readHealth(e *fieldErrors) *rolloutHealth {
	raw := b["health"]
	if isNull(raw) {
		return nil
	}
	var fields jsonBody
	if raw[0] != '{' || json.Unmarshal(raw, &fields) != nil || hasDuplicateKey(raw, false) {
		e.add("health", "must be an object of max_crash_rate, min_crashes and watch_minutes.")
		return nil
	}
	inner := jsonBody{}
	for k, v := range fields {
		switch k {
		case "max_crash_rate", "min_crashes", "watch_minutes":
			inner["health."+k] = v
		default:
			e.add("health", "may only have the fields max_crash_rate, min_crashes and watch_minutes.")
		}
	}
	h := &rolloutHealth{
		MinCrashes:   inner.integer(e, "health.min_crashes", 2, 1, math.MaxInt32),
		WatchMinutes: inner.integer(e, "health.watch_minutes", 60, 0, 1440),
	}
	rate, present := inner["health.max_crash_rate"]
	if err := json.Unmarshal(rate, &h.MaxCrashRate); !present || isNull(rate) || err != nil || !(h.MaxCrashRate > 0) {
		e.add("health.max_crash_rate", "must be a number above 0 (crashes per device-day).")
	}
	return h
}

// checkHealth halts the rollout when its health gate is crossed, and
// otherwise returns until when its latest updated device is watched.
func (e *rolloutEngine) checkHealth(ctx context.Context, ro *rollout, teamID int64) (halted bool, watchUntil time.Time, err error) {
	h := ro.Health
	if h == nil {
		return false, time.Time{}, nil
	}
	crashes, days, latest, err := e.store.rolloutHealthFigures(ctx, ro)
	if err != nil {
		return false, time.Time{}, err
	}
	if days, rate := crashRate(crashes, days); crashes >= h.MinCrashes && rate > h.MaxCrashRate {
		return true, time.Time{}, e.end(ctx, ro, teamID, rolloutHalted,
			&haltReason{Kind: "health", Crashes: &crashes, DeviceDays: &days, Rate: &rate, Limit: h.MaxCrashRate})
	}
	return false, watchEnd(h, latest), nil
}

// crashRate returns device-days (a second at least: a rate is finite)
// and the crashes per device-day, rounded as a halt_reason shows them.
func crashRate(crashes int, days float64) (float64, float64) {
	days = math.Max(days, 1.0/86400)
	rate := float64(crashes) / days
	return math.Round(days*1e6) / 1e6, math.Round(rate*1e4) / 1e4
}

// watchEnd is when the watch of the device updated latest ends; zero
// when none has been updated.
func watchEnd(h *rolloutHealth, latest time.Time) time.Time {
	if latest.IsZero() {
		return time.Time{}
	}
	return latest.Add(time.Duration(h.WatchMinutes) * time.Minute)
}

// healthStatus is where a rollout's health gate stands (the detail's
// health_status): the figures it halts on, counted since since, and the
// batch it watches while a running rollout waits for the watch to end.
type healthStatus struct {
	Since      string      `json:"since"`
	Crashes    int         `json:"crashes"`
	DeviceDays float64     `json:"device_days"`
	Rate       float64     `json:"rate"`
	Watching   *batchWatch `json:"watching"`
}

// batchWatch is the batch (numbered from 1) whose devices a health gate
// watches, and when the watch ends.
type batchWatch struct {
	Batch int    `json:"batch"`
	Until string `json:"until"`
}

// healthStatusOf reads where the rollout's health gate stands at now;
// nil when it has none. A running rollout is watching when the watch of
// its latest updated device has not ended and it has started none of
// its current batch (or has none left): the engine then waits
// (advanceOne).
func healthStatusOf(ctx context.Context, q queryer, ro *rollout, now time.Time) (*healthStatus, error) {
	if ro.Health == nil {
		return nil, nil
	}
	crashes, days, latest, err := healthFiguresOf(ctx, q, ro, now)
	if err != nil {
		return nil, err
	}
	st := &healthStatus{Since: ro.gateFrom, Crashes: crashes}
	st.DeviceDays, st.Rate = crashRate(crashes, days)
	until := watchEnd(ro.Health, latest)
	if ro.State != rolloutRunning || !now.Before(until) {
		return st, nil
	}
	position, waits, err := watchedPosition(ctx, q, ro, latest)
	if err != nil || !waits {
		return st, err
	}
	st.Watching = &batchWatch{Batch: int(position)/ro.BatchSize + 1, Until: until.UTC().Format(timeFormat)}
	return st, nil
}
