package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/store"
)

// The webhook engine: the event hub's webhookTap, built with the hub,
// hears each team's events of the types its webhooks want; the engine,
// built on that hub, queues them for the team's webhooks in the store (so
// that a restart loses none, and a crash those of its last queueEvery),
// and delivers each webhook's queue in order, one event at a time, on a
// goroutine of its own: a slow or dead endpoint holds nothing but its own
// queue. A failed delivery is tried again after a growing wait, and the
// events behind it wait; past retryWindow of failures the webhook is
// disabled.

const (
	// defaultWebhookQueue and webhookQueueBytes bound each webhook's queue.
	defaultWebhookQueue = 10000
	webhookQueueBytes   = 4 << 20
	// webhookTimeout is how long one delivery may take.
	webhookTimeout = 10 * time.Second
	// webhookRetryWindow is how long a webhook may fail before it is disabled.
	webhookRetryWindow = 24 * time.Hour
	// webhookInbox bounds the events heard and not yet queued in the store.
	webhookInbox = 10000
	// offlineCheckEvery is how often devices gone offline are looked for.
	offlineCheckEvery = 30 * time.Second
	// queueEvery spaces the commits that queue what was heard: each
	// commit empties the read cache (internal/store/store_cache.go), as the device
	// link's flushes do, at the same pace.
	queueEvery = 100 * time.Millisecond
)

// webhookSettings are the webhook engine's tunables: the flags', and
// shorter waits in tests. The zero value of each is the service's default.
type webhookSettings struct {
	queueEvents  int  // -webhook-queue
	allowPrivate bool // -webhook-allow-private
	queueBytes   int  // webhookQueueBytes
	// timeout is how long a delivery may take (webhookTimeout);
	// retryWindow how long a webhook may fail (webhookRetryWindow).
	timeout, retryWindow time.Duration
	// backoff is the wait before attempt n+1 of an event (retryWait);
	// after waits (time.After).
	backoff func(attempt int) time.Duration
	after   func(time.Duration) <-chan time.Time
	// lookup resolves a URL's host (net.DefaultResolver's).
	lookup func(ctx context.Context, host string) ([]netip.Addr, error)
}

// retryWait is the wait after the attempt-th failure of an event: 10 s,
// doubled each time, at most an hour; about 30 attempts in 24 hours.
func retryWait(attempt int) time.Duration {
	return min(10*time.Second<<min(attempt-1, 10), time.Hour)
}

// heardEvent is an event heard for a team, not yet queued.
type heardEvent struct {
	teamID int64
	kind   string
	id     string
	body   []byte
}

// webhookTap is the event hub's side of the webhooks: each team's
// enabled webhooks, as the engine last loaded them, and the events heard
// of the types they want, not yet queued in the store.
type webhookTap struct {
	timestamp func() string // the store's
	dropped   atomic.Int64  // events dropped from full queues

	mu    sync.Mutex
	hooks map[int64][]*model.Webhook // each team's enabled webhooks
	inbox []heardEvent
	wake  chan struct{} // the queuer's
}

func newWebhookTap(timestamp func() string) *webhookTap {
	return &webhookTap{timestamp: timestamp, hooks: map[int64][]*model.Webhook{}, wake: make(chan struct{}, 1)}
}

type webhookEngine struct {
	store  *store.Store
	log    *slog.Logger
	events *eventHub // hears audit entries of disabled webhooks
	tap    *webhookTap
	webhookSettings
	client *http.Client

	mu      sync.Mutex
	running context.Context // run's; nil before run
	workers map[int64]*webhookWorker
	working sync.WaitGroup // the workers' goroutines
}

// webhookWorker delivers one webhook's queue: its settings as it started
// with them (a change restarts it), and its wake-up.
type webhookWorker struct {
	hook *model.Webhook
	wake chan struct{}
	stop context.CancelFunc
}

func newWebhookEngine(st *store.Store, log *slog.Logger, events *eventHub, ws webhookSettings) *webhookEngine {
	ws.queueBytes = cmp.Or(ws.queueBytes, webhookQueueBytes)
	ws.timeout = cmp.Or(ws.timeout, webhookTimeout)
	ws.retryWindow = cmp.Or(ws.retryWindow, webhookRetryWindow)
	if ws.backoff == nil {
		ws.backoff = retryWait
	}
	if ws.after == nil {
		ws.after = time.After
	}
	if ws.lookup == nil {
		ws.lookup = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	e := &webhookEngine{store: st, log: log, events: events, tap: events.webhooks, webhookSettings: ws,
		workers: map[int64]*webhookWorker{}}
	dialer := &net.Dialer{Timeout: ws.timeout, Control: e.checkDial}
	e.client = &http.Client{
		// No proxy from the environment: it would connect where checkDial
		// cannot see.
		Transport: &http.Transport{DialContext: dialer.DialContext, TLSHandshakeTimeout: ws.timeout,
			MaxIdleConnsPerHost: 1, IdleConnTimeout: time.Minute},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Timeout:       ws.timeout,
	}
	return e
}

var errPrivateAddress = errors.New("refused: a loopback, private, link-local or unspecified address")

// privateAddr reports whether ip is one a team's webhook must not reach
// without -webhook-allow-private.
func privateAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	return ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsUnspecified()
}

// checkDial refuses a connection to a private address, checked on the
// address resolved for this very connection: a name that resolved to a
// public address when the webhook was made may resolve to another now.
func (e *webhookEngine) checkDial(_, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || !e.allowPrivate && privateAddr(ip) {
		return errPrivateAddress
	}
	return nil
}

// hooked reports whether the team has an enabled webhook; the event hub
// then reads what it would otherwise skip.
func (w *webhookTap) hooked(teamID int64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.hooks[teamID]) > 0
}

// hookedAny reports whether any team has an enabled webhook.
func (w *webhookTap) hookedAny() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.hooks) > 0
}

// heard takes an event of the team's, when one of its webhooks wants that
// type; it never waits. Past webhookInbox events not yet queued (the store
// is slow), the oldest is dropped and counted.
func (w *webhookTap) heard(teamID int64, kind string, data []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !slices.ContainsFunc(w.hooks[teamID], func(h *model.Webhook) bool { return slices.Contains(h.Events, kind) }) {
		return
	}
	id := store.RandomString(24, store.Alnum)
	body, _ := json.Marshal(webhookBody{id, kind, w.timestamp(), data})
	if len(w.inbox) >= webhookInbox {
		w.inbox = w.inbox[1:]
		w.dropped.Add(1)
	}
	w.inbox = append(w.inbox, heardEvent{teamID, kind, id, body})
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// take empties the inbox: each event heard for each webhook that wants it.
func (w *webhookTap) take() []store.QueuedEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	var queued []store.QueuedEvent
	for _, h := range w.inbox {
		for _, hook := range w.hooks[h.teamID] {
			if slices.Contains(hook.Events, h.kind) {
				queued = append(queued, store.QueuedEvent{WebhookID: hook.ID, EventID: h.id, Kind: h.kind, Body: h.body})
			}
		}
	}
	w.inbox = nil
	return queued
}

// wanting lists the webhooks that want events of kind.
func (w *webhookTap) wanting(kind string) []*model.Webhook {
	w.mu.Lock()
	defer w.mu.Unlock()
	var hooks []*model.Webhook
	for _, list := range w.hooks {
		for _, h := range list {
			if slices.Contains(h.Events, kind) {
				hooks = append(hooks, h)
			}
		}
	}
	return hooks
}

// webhookBody is what a delivery posts.
type webhookBody struct {
	ID   string          `json:"id"`
	Type string          `json:"type"`
	At   string          `json:"at"`
	Data json.RawMessage `json:"data"`
}

// run queues what is heard, delivers every enabled webhook's queue and
// looks for devices gone offline, until ctx is done.
func (e *webhookEngine) run(ctx context.Context) {
	e.mu.Lock()
	e.running = ctx
	e.mu.Unlock()
	if err := e.reload(ctx); err != nil {
		e.log.Error("load webhooks", "err", err)
	}
	offline := time.NewTicker(offlineCheckEvery)
	defer offline.Stop()
	for {
		select {
		case <-e.tap.wake:
			e.queueHeard(ctx)
			select {
			case <-time.After(queueEvery): // what comes meanwhile is queued in one commit
			case <-ctx.Done():
			}
		case <-offline.C:
			e.checkOffline(ctx)
		case <-ctx.Done():
			e.queueHeard(context.WithoutCancel(ctx)) // the store closes after the engines
			e.working.Wait()                         // each stops with ctx
			return
		}
	}
}

// queueHeard moves the events heard into their webhooks' queues, in one
// transaction, and wakes the webhooks' workers.
func (e *webhookEngine) queueHeard(ctx context.Context) {
	e.enqueue(ctx, e.tap.take())
}

// enqueue adds events to their webhooks' queues and wakes their workers.
func (e *webhookEngine) enqueue(ctx context.Context, queued []store.QueuedEvent) error {
	if len(queued) == 0 {
		return nil
	}
	dropped, err := e.store.EnqueueWebhookEvents(ctx, queued, e.queueEvents, e.queueBytes)
	if err != nil {
		e.log.Error("queue webhook events", "events", len(queued), "err", err)
		e.tap.dropped.Add(int64(len(queued)))
		return err
	}
	e.tap.dropped.Add(int64(dropped))
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, q := range queued {
		if w := e.workers[q.WebhookID]; w != nil {
			select {
			case w.wake <- struct{}{}:
			default:
			}
		}
	}
	return nil
}

// ping queues a ping event for the webhook alone.
func (e *webhookEngine) ping(ctx context.Context, w *model.Webhook) error {
	id := store.RandomString(24, store.Alnum)
	body, _ := json.Marshal(webhookBody{id, "ping", e.store.Timestamp(), json.RawMessage(fmt.Sprintf(`{"webhook_id":%d}`, w.ID))})
	return e.enqueue(ctx, []store.QueuedEvent{{WebhookID: w.ID, EventID: id, Kind: "ping", Body: body}})
}

// reload reads the enabled webhooks again, after a change: a worker for
// each (once run has begun), restarted when its webhook changed.
func (e *webhookEngine) reload(ctx context.Context) error {
	list, err := e.store.EnabledWebhooks(ctx)
	if err != nil {
		return err
	}
	hooks := map[int64][]*model.Webhook{}
	byID := map[int64]*model.Webhook{}
	for _, w := range list {
		hooks[w.TeamID] = append(hooks[w.TeamID], w)
		byID[w.ID] = w
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.tap.mu.Lock()
	e.tap.hooks = hooks
	e.tap.mu.Unlock()
	if e.running == nil {
		return nil
	}
	for id, wk := range e.workers {
		if w := byID[id]; w == nil || w.URL != wk.hook.URL || w.Secret != wk.hook.Secret {
			wk.stop()
			delete(e.workers, id)
		}
	}
	for id, w := range byID {
		if e.workers[id] == nil && e.running.Err() == nil {
			ctx, stop := context.WithCancel(e.running)
			wk := &webhookWorker{hook: w, wake: make(chan struct{}, 1), stop: stop}
			e.workers[id] = wk
			e.working.Go(func() { e.deliverQueue(ctx, wk) })
		}
	}
	return nil
}

// deliverQueue delivers the worker's webhook's queue, oldest first, until
// ctx is done or the webhook has failed for retryWindow.
func (e *webhookEngine) deliverQueue(ctx context.Context, wk *webhookWorker) {
	var failingSince time.Time
	var head int64 // the event being tried
	attempt := 0
	for ctx.Err() == nil {
		q, err := e.store.NextQueued(ctx, wk.hook.TeamID, wk.hook.ID)
		if err != nil {
			if ctx.Err() == nil {
				e.log.Error("read webhook queue", "webhook_id", wk.hook.ID, "err", err)
			}
			select {
			case <-e.after(time.Minute): // tried again
			case <-ctx.Done():
			}
			continue
		}
		if q == nil {
			select {
			case <-wk.wake:
			case <-ctx.Done():
			}
			continue
		}
		if q.Seq != head {
			head, attempt = q.Seq, 0
		}
		attempt++
		d := e.post(ctx, wk.hook, q, attempt)
		if ctx.Err() != nil {
			return // stopped: the event stays queued
		}
		delivered := d.Error == nil
		if err := e.store.FinishDelivery(ctx, q, d, delivered); err != nil {
			e.log.Error("record webhook delivery", "webhook_id", wk.hook.ID, "err", err)
		}
		if delivered {
			failingSince = time.Time{}
			continue
		}
		if failingSince.IsZero() {
			failingSince = e.store.Now()
		}
		if e.store.Now().Sub(failingSince) >= e.retryWindow {
			e.disable(ctx, wk.hook, fmt.Sprintf("Every delivery failed for %s; the last: %s", e.retryWindow, *d.Error))
			return
		}
		select {
		case <-e.after(e.backoff(attempt)):
		case <-ctx.Done():
		}
	}
}

// post delivers q once: delivered when the endpoint answers 2xx in time.
func (e *webhookEngine) post(ctx context.Context, w *model.Webhook, q *store.QueuedEvent, attempt int) *model.WebhookDelivery {
	d := &model.WebhookDelivery{ID: store.RandomString(20, store.Alnum), EventID: q.EventID, Type: q.Kind, At: e.store.Timestamp(), Attempt: attempt}
	mac := hmac.New(sha256.New, []byte(w.Secret))
	mac.Write(q.Body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL, bytes.NewReader(q.Body))
	if err == nil {
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("User-Agent", "devicehub-webhook")
		req.Header.Set("X-Devicehub-Event", q.Kind)
		req.Header.Set("X-Devicehub-Delivery", d.ID)
		req.Header.Set("X-Devicehub-Signature-256", "sha256="+hex.EncodeToString(mac.Sum(nil)))
		start := time.Now()
		var resp *http.Response
		resp, err = e.client.Do(req)
		d.DurationMS = time.Since(start).Milliseconds()
		if err == nil {
			resp.Body.Close() // unread: what the endpoint answers is not kept
			d.Status = &resp.StatusCode
			if resp.StatusCode < 200 || resp.StatusCode > 299 {
				err = fmt.Errorf("answered %s", resp.Status)
			}
		}
	}
	if err != nil {
		msg := err.Error()
		d.Error = &msg
	}
	return d
}

// disable turns the webhook off, and records it in the team's audit log
// with devicehub as the actor.
func (e *webhookEngine) disable(ctx context.Context, w *model.Webhook, reason string) {
	detail, _ := json.Marshal(map[string]any{"webhook_id": w.ID, "host": urlHost(w.URL), "enabled": false, "disabled_reason": reason})
	entry := &model.AuditEntry{At: e.store.Timestamp(), Action: "webhook.update", Detail: detail, TeamID: w.TeamID}
	changed, err := e.store.DisableWebhook(ctx, w.ID, reason, entry)
	if err != nil {
		e.log.Error("disable webhook", "webhook_id", w.ID, "err", err)
		return
	}
	if changed {
		e.events.audited(entry)
	}
	if err := e.reload(context.WithoutCancel(ctx)); err != nil { // which stops this worker
		e.log.Error("load webhooks", "err", err)
	}
}

// checkOffline queues device.offline for each device whose offline
// spell has passed a webhook's offline_minutes since that webhook's last
// check: once per spell, as a spell's last_seen_at does not move.
func (e *webhookEngine) checkOffline(ctx context.Context) {
	now := e.store.Now()
	for _, w := range e.tap.wanting("device.offline") {
		checked, err := time.Parse(store.TimeFormat, w.OfflineCheckedAt)
		if err != nil {
			checked = now
		}
		spell := time.Duration(w.OfflineMinutes) * time.Minute
		list, err := e.store.DevicesGoneOffline(ctx, w.TeamID, checked.Add(-spell).UTC().Format(store.TimeFormat), now.Add(-spell).UTC().Format(store.TimeFormat))
		if err != nil {
			e.log.Error("find devices gone offline", "webhook_id", w.ID, "err", err)
			continue
		}
		var queued []store.QueuedEvent
		for _, d := range list {
			d.OfflineMinutes = w.OfflineMinutes
			data, _ := json.Marshal(d)
			id := store.RandomString(24, store.Alnum)
			body, _ := json.Marshal(webhookBody{id, "device.offline", e.store.Timestamp(), data})
			queued = append(queued, store.QueuedEvent{WebhookID: w.ID, EventID: id, Kind: "device.offline", Body: body})
		}
		if e.enqueue(ctx, queued) != nil {
			continue // looked at again next time
		}
		w.OfflineCheckedAt = now.UTC().Format(store.TimeFormat)
		if err := e.store.SetOfflineChecked(ctx, w.ID, w.OfflineCheckedAt); err != nil {
			e.log.Error("record offline check", "webhook_id", w.ID, "err", err)
		}
	}
}
