package main

import (
	"context"
	"log/slog"
	"time"
)

// Retention of device history (-history-days): a pass over every device
// each historyPruneEvery, a few small steps at a time (store.pruneStep), so that
// no step holds the write lock for long and device reports keep flowing.

const (
	// historyPruneEvery is how often a history retention pass starts.
	historyPruneEvery = time.Hour
	// pruneBudget is how long one run of the pruner may go on deleting.
	pruneBudget = 50 * time.Millisecond
	// historyPruneTick is how often the pruner runs (server.run).
	historyPruneTick = time.Second
)

// historyPruner deletes history older than -history-days, a pass at a
// time; run goes on where the previous run stopped.
type historyPruner struct {
	store historyStore
	log   *slog.Logger
	next  int64     // the last device id done in the pass under way; 0: none under way
	begun time.Time // when the latest pass began, on the store's clock
}

// historyStore is what the history pruner uses of the store.
type historyStore interface {
	now() time.Time
	kept() (auditDays, historyDays int)
	pruneStep(ctx context.Context, after int64, cutoff time.Time) (int64, error)
}

func newHistoryPruner(st historyStore, log *slog.Logger) *historyPruner {
	return &historyPruner{store: st, log: log}
}

// run goes on with the pass under way, or begins one when historyPruneEvery has
// passed, for at most pruneBudget.
func (p *historyPruner) run(ctx context.Context) {
	now := p.store.now()
	if p.next == 0 {
		if !p.begun.IsZero() && now.Sub(p.begun) < historyPruneEvery {
			return
		}
		p.begun = now
	}
	_, days := p.store.kept()
	cutoff := now.AddDate(0, 0, -days)
	for start := time.Now(); time.Since(start) < pruneBudget; {
		next, err := p.store.pruneStep(ctx, p.next, cutoff)
		if err != nil {
			p.log.Error("prune device history", "err", err)
			return
		}
		if p.next = next; next == 0 {
			return
		}
	}
}
