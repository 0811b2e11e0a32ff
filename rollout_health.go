package main

// A rollout's health gate (docs/api.md, "History and release health"):
// each batch's devices that report the new firmware are watched for
// watch_minutes before the next batch starts, and the rollout halts once
// the devices it updated have crashed at least min_crashes times on the
// new firmware at more than max_crash_rate crashes per device-day. A
// halt says why (haltReason).

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"math"
	"time"
)

// haltKind is why a rollout halted: too many of its devices failed, or
// its health gate closed.
type haltKind string

const (
	haltFailures haltKind = "failures"
	haltHealth   haltKind = "health"
)

// haltReason is why a rollout halted: kind failures (failed, limit) or
// health (crashes, device_days, rate, limit).
type haltReason struct {
	Kind       haltKind `json:"kind"`
	Failed     *int     `json:"failed,omitempty"`
	Crashes    *int     `json:"crashes,omitempty"`
	DeviceDays *float64 `json:"device_days,omitempty"`
	Rate       *float64 `json:"rate,omitempty"`
	Limit      float64  `json:"limit"`
}

// readHealth reads a rollout's "health": an object of max_crash_rate
// (required, > 0), min_crashes (≥ 1, default 2) and watch_minutes (0 to
// 1440, default 60), nothing else.
func (b jsonBody) readHealth(e *fieldErrors) *model.RolloutHealth {
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
	h := &model.RolloutHealth{
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
func (e *rolloutEngine) checkHealth(ctx context.Context, ro *model.Rollout, teamID int64) (halted bool, watchUntil time.Time, err error) {
	h := ro.Health
	if h == nil {
		return false, time.Time{}, nil
	}
	crashes, days, latest, err := e.store.RolloutHealthFigures(ctx, teamID, ro)
	if err != nil {
		return false, time.Time{}, err
	}
	if days, rate := store.CrashRate(crashes, days); crashes >= h.MinCrashes && rate > h.MaxCrashRate {
		return true, time.Time{}, e.end(ctx, ro, teamID, model.RolloutHalted,
			&haltReason{Kind: haltHealth, Crashes: &crashes, DeviceDays: &days, Rate: &rate, Limit: h.MaxCrashRate})
	}
	return false, store.WatchEnd(h, latest), nil
}
