package main

// The store's side of fleet health (internal/history holds its rules,
// tables and statements): the reads the routes make, and a retention
// step. The writes are made with the device reports that carry them
// (store_reports.go).

import (
	"context"
	"database/sql"
	"time"

	"devicehub/internal/history"
)

// bootEvent is a recorded boot as the device.boot event tells it.
type bootEvent struct {
	UID    string `json:"uid"`
	Reason string `json:"reason"`
	Crash  bool   `json:"crash"`
	At     string `json:"at"`
}

// historyChanges are the presence changes of the devices a flush
// changed: reconnecting counts as offline.
func historyChanges(changes []deviceChange) []history.Change {
	var list []history.Change
	for _, c := range changes {
		if c.statusChanged && c.Status != statusPending {
			list = append(list, history.Change{UID: c.UID, Online: c.Status == statusOnline})
		}
	}
	return list
}

// keptHistory is the engine that keeps samples, nil with -history-days 0.
func (s *store) keptHistory() *history.Engine {
	if s.limits.historyDays == 0 {
		return nil
	}
	return s.history
}

// seriesOf lists the device's series by name.
func (s *store) seriesOf(ctx context.Context, deviceID int64) ([]seriesInfo, error) {
	return history.SeriesOf(ctx, s.reader, s.history, deviceID)
}

// bucketsOf returns the buckets of the device's series that start in
// [from, to); history.ErrSeriesNotFound when it has no such series.
func (s *store) bucketsOf(ctx context.Context, deviceID int64, name string, from, to int64) ([]history.Sample, error) {
	return history.Buckets(ctx, s.reader, s.history, deviceID, name, from, to)
}

// presenceOf returns a page of the device's presence (history.Presence).
func (s *store) presenceOf(ctx context.Context, deviceID int64, from, to time.Time, limit int) ([]presenceInterval, error) {
	return history.Presence(ctx, s.reader, deviceID, from, to, limit)
}

// bootsOf returns a page of the device's boots (history.Boots).
func (s *store) bootsOf(ctx context.Context, deviceID, before int64, limit int) ([]bootEntry, error) {
	return history.Boots(ctx, s.reader, deviceID, before, limit)
}

// firmwareHealth compares the firmwares the team's devices ran in
// [from, to] (history.Compare).
func (s *store) firmwareHealth(ctx context.Context, teamID int64, from, to time.Time) ([]*firmwareHealth, error) {
	return history.Compare(ctx, s.reader, s.history, teamID, from, to)
}

// retentionStep does the next step of a history retention pass
// (history.Step), in a transaction of its own; true when the pass is done.
func (s *store) retentionStep(ctx context.Context, p *history.Pass, cutoff time.Time) (done bool, err error) {
	return done, s.inTx(ctx, func(tx *sql.Tx) error {
		done, err = history.Step(ctx, tx, p, s.now(), cutoff, s.limits.historyDays > 0)
		return err
	})
}
