package store

// The store's side of fleet health (internal/history holds its rules,
// tables and statements): the reads the routes make, and a retention
// step. The writes are made with the device reports that carry them
// (store_reports.go).

import (
	"context"
	"database/sql"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
)

// BootEvent is a recorded boot as the device.boot event tells it.
type BootEvent struct {
	UID    string `json:"uid"`
	Reason string `json:"reason"`
	Crash  bool   `json:"crash"`
	At     string `json:"at"`
}

// historyChanges are the presence changes of the devices a flush
// changed: reconnecting counts as offline.
func historyChanges(changes []DeviceChange) []history.Change {
	var list []history.Change
	for _, c := range changes {
		if c.StatusChanged && c.Status != model.StatusPending {
			list = append(list, history.Change{DeviceID: c.DeviceID, Online: c.Status == model.StatusOnline, First: c.FirstStatus})
		}
	}
	return list
}

// keptHistory is the engine that keeps samples, nil with -history-days 0.
func (s *Store) keptHistory() *history.Engine {
	if s.limits.HistoryDays == 0 {
		return nil
	}
	return s.engine
}

// SeriesOf lists the device's series by name.
func (s *Store) SeriesOf(ctx context.Context, d *DeviceRef) ([]model.SeriesInfo, error) {
	return history.SeriesOf(ctx, s.reader, s.engine, d.id)
}

// BucketsOf returns the buckets of the device's series that start in
// [from, to); history.ErrSeriesNotFound when it has no such series.
func (s *Store) BucketsOf(ctx context.Context, d *DeviceRef, name history.SeriesName, from, to int64) ([]history.Sample, error) {
	return history.Buckets(ctx, s.reader, s.engine, d.id, name, from, to)
}

// PresenceOf returns a page of the device's presence (history.Presence).
func (s *Store) PresenceOf(ctx context.Context, d *DeviceRef, from, to time.Time, limit int) ([]model.PresenceInterval, error) {
	return history.Presence(ctx, s.reader, d.id, from, to, limit)
}

// BootsOf returns a page of the device's boots (history.Boots).
func (s *Store) BootsOf(ctx context.Context, d *DeviceRef, before int64, limit int) ([]model.BootEntry, error) {
	return history.Boots(ctx, s.reader, d.id, before, limit)
}

// FirmwareHealth compares the firmwares the team's devices ran in
// [from, to] (history.Compare).
func (s *Store) FirmwareHealth(ctx context.Context, teamID int64, from, to time.Time) ([]*model.FirmwareHealth, error) {
	return history.Compare(ctx, s.reader, s.engine, teamID, from, to)
}

// RetentionStep does the next step of a history retention pass
// (history.Step), in a transaction of its own; true when the pass is done.
func (s *Store) RetentionStep(ctx context.Context, p *history.Pass, cutoff time.Time) (done bool, err error) {
	return done, s.inTx(ctx, func(tx *sql.Tx) error {
		done, err = history.Step(ctx, tx, p, s.Now(), cutoff, s.limits.HistoryDays > 0)
		return err
	})
}
