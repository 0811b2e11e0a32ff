package store

// The store's webhooks (webhooks.go): the endpoints, each one's queue of
// events not yet delivered, and its last deliveries.

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"encoding/json"
	"errors"
)

// KeepDeliveries is how many of an endpoint's newest deliveries are kept.
const KeepDeliveries = 100

var ErrWebhookNotFound = errors.New("webhook not found")

const webhookColumns = `id, team_id, url, events, offline_minutes, secret, enabled, disabled_reason,
	created_at, last_delivery_at, offline_checked_at`

func scanWebhook(row scanner) (*model.Webhook, error) {
	w := &model.Webhook{}
	var events string
	err := row.Scan(&w.ID, &w.TeamID, &w.URL, &events, &w.OfflineMinutes, &w.Secret, &w.Enabled, &w.DisabledReason,
		&w.CreatedAt, &w.LastDeliveryAt, &w.OfflineCheckedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, ErrWebhookNotFound
	}
	if err != nil {
		return nil, err
	}
	return w, json.Unmarshal([]byte(events), &w.Events)
}

// Webhooks lists the team's webhooks, oldest first.
func (s *Store) Webhooks(ctx context.Context, teamID int64) ([]*model.Webhook, error) {
	return queryAll(ctx, s.reader, scanWebhook, `SELECT `+webhookColumns+` FROM webhooks WHERE team_id = ? ORDER BY id`, teamID)
}

// EnabledWebhooks lists every team's enabled webhooks, for the engine.
func (s *Store) EnabledWebhooks(ctx context.Context) ([]*model.Webhook, error) {
	return queryAll(ctx, s.reader, scanWebhook, `SELECT `+webhookColumns+` FROM webhooks WHERE enabled ORDER BY id`)
}

func (s *Store) Webhook(ctx context.Context, teamID, id int64) (*model.Webhook, error) {
	return scanWebhook(s.reader.QueryRowContext(ctx, `SELECT `+webhookColumns+` FROM webhooks WHERE team_id = ? AND id = ?`, teamID, id))
}

// CreateWebhook adds w to its team, with its secret; a QuotaError when
// the team has -max-webhooks already. audit is made of w as stored.
func (s *Store) CreateWebhook(ctx context.Context, w *model.Webhook, audit Audit[*model.Webhook]) error {
	events, _ := json.Marshal(w.Events)
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.Webhooks; max > 0 {
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM webhooks WHERE team_id = ?`, w.TeamID).Scan(&n); err != nil {
				return err
			}
			if n >= max {
				return &QuotaError{Quota: QuotaWebhooks, Limit: max}
			}
		}
		now := s.Timestamp()
		err := tx.QueryRowContext(ctx, `INSERT INTO webhooks (team_id, url, events, offline_minutes, secret, created_at, offline_checked_at)
			VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id, created_at, enabled`,
			w.TeamID, w.URL, string(events), w.OfflineMinutes, w.Secret, now, now).Scan(&w.ID, &w.CreatedAt, &w.Enabled)
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, w)
	})
}

// UpdateWebhook changes the team's webhook id as change says, and returns
// it; audit is made of it as changed.
func (s *Store) UpdateWebhook(ctx context.Context, teamID, id int64, change func(*model.Webhook), audit Audit[*model.Webhook]) (*model.Webhook, error) {
	var w *model.Webhook
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		w, err = scanWebhook(tx.QueryRowContext(ctx, `SELECT `+webhookColumns+` FROM webhooks WHERE team_id = ? AND id = ?`, teamID, id))
		if err != nil {
			return err
		}
		change(w)
		events, _ := json.Marshal(w.Events)
		_, err = tx.ExecContext(ctx, `UPDATE webhooks SET url = ?, events = ?, offline_minutes = ?, enabled = ?, disabled_reason = ?
			WHERE id = ?`, w.URL, string(events), w.OfflineMinutes, w.Enabled, w.DisabledReason, id)
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, w)
	})
	return w, err
}

// DeleteWebhook deletes the team's webhook id, its queue and deliveries;
// audit is made of it as it was.
func (s *Store) DeleteWebhook(ctx context.Context, teamID, id int64, audit Audit[*model.Webhook]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		w, err := scanWebhook(tx.QueryRowContext(ctx, `DELETE FROM webhooks WHERE team_id = ? AND id = ? RETURNING `+webhookColumns, teamID, id))
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, w)
	})
}

// QueuedEvent is an event in a webhook's queue: the body a delivery posts.
type QueuedEvent struct {
	Seq       int64 // its place in the queue
	WebhookID int64
	EventID   string
	Kind      string
	Body      []byte
}

// EnqueueWebhookEvents adds the events to their webhooks' queues in one
// transaction, then drops each queue's oldest events while it holds more
// than maxEvents or maxBytes (0: no bound), recording a delivery with an
// error for each; it returns how many it dropped.
func (s *Store) EnqueueWebhookEvents(ctx context.Context, events []QueuedEvent, maxEvents, maxBytes int) (dropped int, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		dropped = 0
		touched := map[int64]bool{}
		for _, e := range events {
			res, err := tx.ExecContext(ctx, `INSERT INTO webhook_queue (webhook_id, event_id, type, body)
				SELECT id, ?, ?, ? FROM webhooks WHERE id = ?`, e.EventID, e.Kind, e.Body, e.WebhookID)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				continue // deleted meanwhile
			}
			if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued + 1, queued_bytes = queued_bytes + ? WHERE id = ?`,
				len(e.Body), e.WebhookID); err != nil {
				return err
			}
			touched[e.WebhookID] = true
		}
		for id := range touched {
			n, err := s.trimWebhookQueue(ctx, tx, id, maxEvents, maxBytes)
			if err != nil {
				return err
			}
			dropped += n
		}
		return nil
	})
	return dropped, err
}

// trimWebhookQueue drops the webhook's oldest queued events while its
// queue is past a bound, always keeping the newest one.
func (s *Store) trimWebhookQueue(ctx context.Context, tx *sql.Tx, id int64, maxEvents, maxBytes int) (int, error) {
	dropped := 0
	for {
		var queued, bytes int
		if err := tx.QueryRowContext(ctx, `SELECT queued, queued_bytes FROM webhooks WHERE id = ?`, id).Scan(&queued, &bytes); err != nil {
			return dropped, err
		}
		if queued <= 1 || (maxEvents == 0 || queued <= maxEvents) && (maxBytes == 0 || bytes <= maxBytes) {
			return dropped, nil
		}
		var e QueuedEvent
		err := tx.QueryRowContext(ctx, `DELETE FROM webhook_queue WHERE seq = (SELECT min(seq) FROM webhook_queue WHERE webhook_id = ?)
			RETURNING seq, event_id, type, body`, id).Scan(&e.Seq, &e.EventID, &e.Kind, &e.Body)
		if err != nil {
			return dropped, err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued - 1, queued_bytes = queued_bytes - ? WHERE id = ?`,
			len(e.Body), id); err != nil {
			return dropped, err
		}
		msg := "dropped: the webhook's queue was full"
		d := &model.WebhookDelivery{ID: RandomString(20, Alnum), EventID: e.EventID, Type: e.Kind, At: s.Timestamp(), Error: &msg}
		if err := s.recordDelivery(ctx, tx, id, d); err != nil {
			return dropped, err
		}
		dropped++
	}
}

// NextQueued is the oldest event in the queue of the team's webhook; nil
// when none.
func (s *Store) NextQueued(ctx context.Context, teamID, id int64) (*QueuedEvent, error) {
	e := &QueuedEvent{WebhookID: id}
	err := s.reader.QueryRowContext(ctx, `SELECT q.seq, q.event_id, q.type, q.body FROM webhook_queue q
		JOIN webhooks w ON w.id = q.webhook_id WHERE q.webhook_id = ? AND w.team_id = ? ORDER BY q.seq LIMIT 1`,
		id, teamID).Scan(&e.Seq, &e.EventID, &e.Kind, &e.Body)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	return e, err
}

// FinishDelivery records a delivery of e, and when it was delivered takes
// e from the queue (unless it was dropped meanwhile).
func (s *Store) FinishDelivery(ctx context.Context, e *QueuedEvent, d *model.WebhookDelivery, delivered bool) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if delivered {
			var n int
			err := tx.QueryRowContext(ctx, `DELETE FROM webhook_queue WHERE seq = ? RETURNING length(body)`, e.Seq).Scan(&n)
			if err == nil {
				_, err = tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued - 1, queued_bytes = queued_bytes - ? WHERE id = ?`, n, e.WebhookID)
			}
			if err != nil && !errors.Is(err, sql.ErrNoRows) {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET last_delivery_at = ? WHERE id = ?`, d.At, e.WebhookID); err != nil {
			return err
		}
		return s.recordDelivery(ctx, tx, e.WebhookID, d)
	})
}

// recordDelivery adds a delivery to the webhook's log and keeps its
// newest KeepDeliveries.
func (s *Store) recordDelivery(ctx context.Context, tx *sql.Tx, webhookID int64, d *model.WebhookDelivery) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO webhook_deliveries (id, webhook_id, event_id, type, at, status, error, duration_ms, attempt)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`, d.ID, webhookID, d.EventID, d.Type, d.At, d.Status, d.Error, d.DurationMS, d.Attempt)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `DELETE FROM webhook_deliveries WHERE webhook_id = ?1 AND seq <=
		(SELECT seq FROM webhook_deliveries WHERE webhook_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2)`, webhookID, KeepDeliveries)
	return err
}

// WebhookDeliveries are the newest deliveries of the team's webhook,
// newest first.
func (s *Store) WebhookDeliveries(ctx context.Context, teamID, id int64) ([]*model.WebhookDelivery, error) {
	return queryAll(ctx, s.reader, func(row scanner) (*model.WebhookDelivery, error) {
		d := &model.WebhookDelivery{}
		return d, row.Scan(&d.ID, &d.EventID, &d.Type, &d.At, &d.Status, &d.Error, &d.DurationMS, &d.Attempt)
	}, `SELECT d.id, d.event_id, d.type, d.at, d.status, d.error, d.duration_ms, d.attempt FROM webhook_deliveries d
		JOIN webhooks w ON w.id = d.webhook_id WHERE d.webhook_id = ? AND w.team_id = ? ORDER BY d.seq DESC LIMIT ?`,
		id, teamID, KeepDeliveries)
}

// DisableWebhook turns the webhook off, and records entry in the audit
// log in the same transaction, unless it was deleted or turned off
// meanwhile: false then.
func (s *Store) DisableWebhook(ctx context.Context, id int64, reason string, entry *model.AuditEntry) (bool, error) {
	changed := false
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE webhooks SET enabled = 0, disabled_reason = ? WHERE id = ? AND enabled`, reason, id)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return nil
		}
		changed = true
		return insertEntry(ctx, tx, entry)
	})
	return changed && err == nil, err
}

// offlineDevice is a device.offline event's data.
type offlineDevice struct {
	UID            string `json:"uid"`
	Name           string `json:"name"`
	LastSeenAt     string `json:"last_seen_at"`
	OfflineMinutes int    `json:"offline_minutes"`
}

// DevicesGoneOffline are the team's devices that are offline and were
// last seen in (after, until]: those whose offline spell passed the
// webhook's offline_minutes since its last check.
func (s *Store) DevicesGoneOffline(ctx context.Context, teamID int64, after, until string) ([]offlineDevice, error) {
	return queryAll(ctx, s.reader, func(row scanner) (offlineDevice, error) {
		var d offlineDevice
		return d, row.Scan(&d.UID, &d.Name, &d.LastSeenAt)
	}, `SELECT uid, name, last_seen_at FROM devices WHERE team_id = ? AND status = 'offline'
		AND last_seen_at > ? AND last_seen_at <= ? ORDER BY last_seen_at`, teamID, after, until)
}

// SetOfflineChecked records how far the webhook's device.offline check has looked.
func (s *Store) SetOfflineChecked(ctx context.Context, id int64, at string) error {
	_, err := s.writer.ExecContext(ctx, `UPDATE webhooks SET offline_checked_at = ? WHERE id = ?`, at, id)
	return err
}
