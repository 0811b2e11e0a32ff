package store

// Where a rollout's health gate stands (rollout_health.go): the crashes
// and device-days of the devices it updated, and the watch of the one
// updated last.

import (
	"context"
	"database/sql"
	"math"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
)

// RolloutHealthFigures returns what the team's rollout's health gate watches
// (history.FiguresOf): the crashes of the devices this rollout updated,
// each on the firmware it is sent, and their device-days on it, since its gate began to
// count (GateFrom: its creation, or its resume from a halt), up to now;
// and when the latest of them began to run it (zero when none has yet).
// A device that already ran the firmware (skipped) is not counted.
func (s *Store) RolloutHealthFigures(ctx context.Context, teamID int64, ro *model.Rollout) (crashes int, deviceDays float64, latest time.Time, err error) {
	if err := teamRollout(ctx, s.reader, teamID, ro.ID); err != nil {
		return 0, 0, time.Time{}, err
	}
	return healthFiguresOf(ctx, s.reader, ro, s.Now())
}

func healthFiguresOf(ctx context.Context, q queryer, ro *model.Rollout, now time.Time) (crashes int, deviceDays float64, latest time.Time, err error) {
	since, err := time.Parse(TimeFormat, ro.GateFrom)
	if err != nil {
		return 0, 0, time.Time{}, err
	}
	// Each device is counted on the firmware it is sent: the rollout's,
	// or for a revert its own (rollout_devices.md5).
	md5s, err := queryAll(ctx, q, scanString, `SELECT DISTINCT COALESCE(md5, ?2) FROM rollout_devices
		WHERE rollout_id = ?1 AND state != `+sqlString(model.RdSkipped)+` AND COALESCE(md5, ?2) IS NOT NULL`, ro.ID, ro.MD5)
	if err != nil {
		return 0, 0, time.Time{}, err
	}
	for _, md5 := range md5s {
		updated := history.Devices{SQL: `SELECT device_id FROM rollout_devices WHERE rollout_id = ? AND state != ` + sqlString(model.RdSkipped) +
			` AND COALESCE(md5, ?) = ?`, Args: []any{ro.ID, ro.MD5, md5}}
		figures, err := history.FiguresOf(ctx, q, updated, since, now)
		if err != nil {
			return 0, 0, time.Time{}, err
		}
		if f := figures[md5]; f != nil {
			crashes, deviceDays = crashes+f.Crashes, deviceDays+f.DeviceDays
			if f.LatestStart.After(latest) {
				latest = f.LatestStart
			}
		}
	}
	return crashes, deviceDays, latest, err
}

// watchedPosition returns the position of the rollout's device that
// began to run its firmware at latest (the one updated last), and whether
// the rollout waits on its watch: it has started none of its current
// batch, or has none left.
func watchedPosition(ctx context.Context, q queryer, ro *model.Rollout, latest time.Time) (position int64, waits bool, err error) {
	var pos sql.NullInt64
	var begun bool
	err = q.QueryRowContext(ctx, `SELECT
		(SELECT rd.position FROM firmware_runs fr JOIN rollout_devices rd ON rd.device_id = fr.device_id
			WHERE rd.rollout_id = ?1 AND fr.md5 = COALESCE(rd.md5, ?2) AND fr.from_at = ?3 ORDER BY rd.position DESC LIMIT 1),
		EXISTS (SELECT 1 FROM rollout_devices WHERE rollout_id = ?1 AND state != `+sqlString(model.RdPending)+`
			AND position / ?4 = (`+rolloutBatchStart+`) / ?4)`,
		ro.ID, ro.MD5, latest.Unix(), ro.BatchSize).Scan(&pos, &begun)
	return pos.Int64, err == nil && pos.Valid && !begun, err
}

// healthStatusOf reads where the rollout's health gate stands at now;
// nil when it has none. A running rollout is watching when the watch of
// its latest updated device has not ended and it has started none of
// its current batch (or has none left): the engine then waits
// (advanceOne).
func healthStatusOf(ctx context.Context, q queryer, ro *model.Rollout, now time.Time) (*model.HealthStatus, error) {
	if ro.Health == nil {
		return nil, nil
	}
	crashes, days, latest, err := healthFiguresOf(ctx, q, ro, now)
	if err != nil {
		return nil, err
	}
	st := &model.HealthStatus{Since: ro.GateFrom, Crashes: crashes}
	st.DeviceDays, st.Rate = CrashRate(crashes, days)
	until := WatchEnd(ro.Health, latest)
	if ro.State != model.RolloutRunning || !now.Before(until) {
		return st, nil
	}
	position, waits, err := watchedPosition(ctx, q, ro, latest)
	if err != nil || !waits {
		return st, err
	}
	st.Watching = &model.BatchWatch{Batch: int(position)/ro.BatchSize + 1, Until: until.UTC().Format(TimeFormat)}
	return st, nil
}

// CrashRate returns device-days (a second at least: a rate is finite)
// and the crashes per device-day, rounded as a halt_reason shows them.
func CrashRate(crashes int, days float64) (float64, float64) {
	days = math.Max(days, 1.0/86400)
	rate := float64(crashes) / days
	return math.Round(days*1e6) / 1e6, math.Round(rate*1e4) / 1e4
}

// WatchEnd is when the watch of the device updated latest ends; zero
// when none has been updated.
func WatchEnd(h *model.RolloutHealth, latest time.Time) time.Time {
	if latest.IsZero() {
		return time.Time{}
	}
	return latest.Add(time.Duration(h.WatchMinutes) * time.Minute)
}
