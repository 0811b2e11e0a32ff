package main

// The server's side of the MQTT link (internal/mqttlink): deviceSink, where
// the link hands what devices report, and presence, which sets devices
// offline that have said nothing for -offline-after.

import (
	"context"
	"log/slog"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// deviceLink is the MQTT link as the server uses it: the commander sends
// on it, presence reads it.
type deviceLink interface {
	commandLink
	presenceLink
}

// deviceSink takes what the link applies (mqttlink.Sink): the store writes
// it, then the event stream hears what changed.
type deviceSink struct {
	store  sinkStore
	events *eventHub
}

// sinkStore is what deviceSink uses of the store.
type sinkStore interface {
	ApplyDeviceMessages(ctx context.Context, reports map[string]*mqttlink.Report, results []mqttlink.Result) (store.Applied, error)
}

// Apply writes one batch of reports and results (ApplyDeviceMessages),
// each report and result alone: one the database refuses is left out
// (Applied.Failed), the rest written.
func (s deviceSink) Apply(ctx context.Context, reports map[string]*mqttlink.Report, results []mqttlink.Result) (mqttlink.Applied, error) {
	a, err := s.store.ApplyDeviceMessages(ctx, reports, results)
	if err != nil {
		return mqttlink.Applied{}, err
	}
	s.events.devicesChanged(ctx, a.Devices)
	s.events.CommandsChanged(ctx, a.Commands)
	done := mqttlink.Applied{Unknown: a.Unknown, Rejected: a.Rejected, Devices: len(a.Devices), Results: a.Results,
		Unkept: a.Unkept, Failed: a.Failed, Resend: a.Resend}
	for _, c := range a.Devices {
		for _, b := range c.Boots {
			done.Boots++
			if b.Crash {
				done.Crashes++
			}
		}
	}
	return done, nil
}

// presenceEvery is how often presence looks for silent devices.
const presenceEvery = time.Second

// presenceLink is the device link as presence sees it.
type presenceLink interface {
	ConnectedSince() time.Time
	AwaitApplied(ctx context.Context, t time.Time) error
}

// presence is the backstop for devices that go away without a word (no
// Last Will reached the broker): one that has said nothing for
// offlineAfter is set offline.
type presence struct {
	store        presenceStore
	link         presenceLink // nil: no broker, nobody is heard, nobody set offline
	events       *eventHub
	log          *slog.Logger
	offlineAfter time.Duration // 0: never
}

// presenceStore is what presence uses of the store.
type presenceStore interface {
	Now() time.Time
	MarkSilentOffline(ctx context.Context, cutoff time.Time) ([]store.DeviceChange, error)
}

// run sweeps every presenceEvery until ctx is done.
func (p *presence) run(ctx context.Context) {
	if p.link != nil && p.offlineAfter > 0 {
		every(ctx, presenceEvery, p.sweep)
	}
}

// sweep sets devices offline that have said nothing for offlineAfter, once
// what the link took before now is written, counted from no earlier than
// the link's latest connection to the broker: while the link is down, or
// just back, silence proves nothing.
func (p *presence) sweep(ctx context.Context) {
	now := p.store.Now()
	if p.link.AwaitApplied(ctx, now) != nil {
		return
	}
	since, cutoff := p.link.ConnectedSince(), now.Add(-p.offlineAfter)
	if since.IsZero() || since.After(cutoff) {
		return
	}
	if changed, err := p.store.MarkSilentOffline(ctx, cutoff); err != nil {
		p.log.Error("mark silent devices offline", "err", err)
	} else if len(changed) > 0 {
		p.log.Info("devices silent for too long set offline", "devices", len(changed), "after", p.offlineAfter)
		p.events.devicesChanged(ctx, changed)
	}
}
