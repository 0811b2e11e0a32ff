package main

import (
	"context"
	"log/slog"
	"time"

	"devicehub/internal/history"
)

// Retention: one pruner deletes what is no longer kept, a pass each
// retentionEvery: audit entries older than -audit-days and expired
// invites and password resets first, then device history older than
// -history-days in small steps (history.Step: each a transaction that
// touches a bounded number of rows, hours rolled up into days on the
// way), so that no step holds the write lock for long and device
// reports keep flowing.

const (
	// retentionEvery is how often a retention pass starts.
	retentionEvery = time.Hour
	// pruneBudget is how long one run of the pruner may go on deleting.
	pruneBudget = 50 * time.Millisecond
	// historyPruneTick is how often the pruner runs (server.run).
	historyPruneTick = time.Second
	// historyStepsAfter is how long after a start the first pass's
	// history steps wait (its audit entries and invites go at once), so
	// that a restart's replay of retained statuses (a million take a
	// minute) has the writer to itself.
	historyStepsAfter = 5 * time.Minute
)

// historyPruner runs the retention passes; run goes on where the
// previous run stopped.
type historyPruner struct {
	store historyStore
	log   *slog.Logger
	pass  *history.Pass // the pass under way; nil: none
	begun time.Time     // when the latest pass began, on the store's clock
	// stepsFrom: no history step runs before it (historyStepsAfter).
	stepsFrom time.Time
}

// historyStore is what the pruner uses of the store.
type historyStore interface {
	Now() time.Time
	Kept() (auditDays, historyDays int)
	PruneAudit(ctx context.Context, cutoff time.Time) (int64, error)
	PruneInvites(ctx context.Context) error
	RetentionStep(ctx context.Context, p *history.Pass, cutoff time.Time) (bool, error)
}

func newHistoryPruner(st historyStore, log *slog.Logger) *historyPruner {
	return &historyPruner{store: st, log: log, stepsFrom: st.Now().Add(historyStepsAfter)}
}

// run goes on with the pass under way, or begins one when retentionEvery
// has passed, for at most pruneBudget.
func (p *historyPruner) run(ctx context.Context) {
	now := p.store.Now()
	auditDays, historyDays := p.store.Kept()
	if p.pass == nil {
		if !p.begun.IsZero() && now.Sub(p.begun) < retentionEvery {
			return
		}
		p.begun, p.pass = now, &history.Pass{}
		if auditDays > 0 {
			if _, err := p.store.PruneAudit(ctx, now.AddDate(0, 0, -auditDays)); err != nil && ctx.Err() == nil {
				p.log.Error("prune the audit log", "err", err)
			}
		}
		if err := p.store.PruneInvites(ctx); err != nil && ctx.Err() == nil {
			p.log.Error("prune expired invites", "err", err)
		}
	}
	if now.Before(p.stepsFrom) {
		return
	}
	cutoff := now.AddDate(0, 0, -historyDays)
	for start := time.Now(); time.Since(start) < pruneBudget; {
		done, err := p.store.RetentionStep(ctx, p.pass, cutoff)
		if err != nil {
			p.log.Error("prune device history", "err", err)
			return
		}
		if done {
			p.pass = nil
			return
		}
	}
}
