package main

// The store's webhooks (webhooks.go): the endpoints, each one's queue of
// events not yet delivered, and its last deliveries.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
)

// keepDeliveries is how many of an endpoint's newest deliveries are kept.
const keepDeliveries = 100

var errWebhookNotFound = errors.New("webhook not found")

const webhookColumns = `id, team_id, url, events, offline_minutes, secret, enabled, disabled_reason,
	created_at, last_delivery_at, offline_checked_at`

func scanWebhook(row scanner) (*webhook, error) {
	w := &webhook{}
	var events string
	err := row.Scan(&w.ID, &w.teamID, &w.URL, &events, &w.OfflineMinutes, &w.secret, &w.Enabled, &w.DisabledReason,
		&w.CreatedAt, &w.LastDeliveryAt, &w.offlineCheckedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errWebhookNotFound
	}
	if err != nil {
		return nil, err
	}
	return w, json.Unmarshal([]byte(events), &w.Events)
}

// webhooks lists the team's webhooks, oldest first.
func (s *store) webhooks(ctx context.Context, teamID int64) ([]*webhook, error) {
	return queryAll(ctx, s.reader, scanWebhook, `SELECT `+webhookColumns+` FROM webhooks WHERE team_id = ? ORDER BY id`, teamID)
}

// enabledWebhooks lists every team's enabled webhooks, for the engine.
func (s *store) enabledWebhooks(ctx context.Context) ([]*webhook, error) {
	return queryAll(ctx, s.reader, scanWebhook, `SELECT `+webhookColumns+` FROM webhooks WHERE enabled ORDER BY id`)
}

func (s *store) webhook(ctx context.Context, teamID, id int64) (*webhook, error) {
	return scanWebhook(s.reader.QueryRowContext(ctx, `SELECT `+webhookColumns+` FROM webhooks WHERE team_id = ? AND id = ?`, teamID, id))
}

// createWebhook adds w to its team, with its secret; a quotaError when
// the team has -max-webhooks already.
func (s *store) createWebhook(ctx context.Context, w *webhook) error {
	events, _ := json.Marshal(w.Events)
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.webhooks; max > 0 {
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM webhooks WHERE team_id = ?`, w.teamID).Scan(&n); err != nil {
				return err
			}
			if n >= max {
				return &quotaError{quota: quotaWebhooks, limit: max}
			}
		}
		now := s.timestamp()
		return tx.QueryRowContext(ctx, `INSERT INTO webhooks (team_id, url, events, offline_minutes, secret, created_at, offline_checked_at)
			VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id, created_at, enabled`,
			w.teamID, w.URL, string(events), w.OfflineMinutes, w.secret, now, now).Scan(&w.ID, &w.CreatedAt, &w.Enabled)
	})
}

// updateWebhook changes the team's webhook id as change says, and returns it.
func (s *store) updateWebhook(ctx context.Context, teamID, id int64, change func(*webhook)) (*webhook, error) {
	var w *webhook
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
		return err
	})
	return w, err
}

// deleteWebhook deletes the team's webhook id, its queue and deliveries.
func (s *store) deleteWebhook(ctx context.Context, teamID, id int64) (*webhook, error) {
	var w *webhook
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		w, err = scanWebhook(tx.QueryRowContext(ctx, `DELETE FROM webhooks WHERE team_id = ? AND id = ? RETURNING `+webhookColumns, teamID, id))
		return err
	})
	return w, err
}

// queuedEvent is an event in a webhook's queue: the body a delivery posts.
type queuedEvent struct {
	seq       int64 // its place in the queue
	webhookID int64
	eventID   string
	kind      string
	body      []byte
}

// enqueueWebhookEvents adds the events to their webhooks' queues in one
// transaction, then drops each queue's oldest events while it holds more
// than maxEvents or maxBytes (0: no bound), recording a delivery with an
// error for each; it returns how many it dropped.
func (s *store) enqueueWebhookEvents(ctx context.Context, events []queuedEvent, maxEvents, maxBytes int) (dropped int, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		dropped = 0
		touched := map[int64]bool{}
		for _, e := range events {
			res, err := tx.ExecContext(ctx, `INSERT INTO webhook_queue (webhook_id, event_id, type, body)
				SELECT id, ?, ?, ? FROM webhooks WHERE id = ?`, e.eventID, e.kind, e.body, e.webhookID)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				continue // deleted meanwhile
			}
			if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued + 1, queued_bytes = queued_bytes + ? WHERE id = ?`,
				len(e.body), e.webhookID); err != nil {
				return err
			}
			touched[e.webhookID] = true
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
func (s *store) trimWebhookQueue(ctx context.Context, tx *sql.Tx, id int64, maxEvents, maxBytes int) (int, error) {
	dropped := 0
	for {
		var queued, bytes int
		if err := tx.QueryRowContext(ctx, `SELECT queued, queued_bytes FROM webhooks WHERE id = ?`, id).Scan(&queued, &bytes); err != nil {
			return dropped, err
		}
		if queued <= 1 || (maxEvents == 0 || queued <= maxEvents) && (maxBytes == 0 || bytes <= maxBytes) {
			return dropped, nil
		}
		var e queuedEvent
		err := tx.QueryRowContext(ctx, `DELETE FROM webhook_queue WHERE seq = (SELECT min(seq) FROM webhook_queue WHERE webhook_id = ?)
			RETURNING seq, event_id, type, body`, id).Scan(&e.seq, &e.eventID, &e.kind, &e.body)
		if err != nil {
			return dropped, err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued - 1, queued_bytes = queued_bytes - ? WHERE id = ?`,
			len(e.body), id); err != nil {
			return dropped, err
		}
		msg := "dropped: the webhook's queue was full"
		d := &webhookDelivery{ID: randomString(20, alnum), EventID: e.eventID, Type: e.kind, At: s.timestamp(), Error: &msg}
		if err := s.recordDelivery(ctx, tx, id, d); err != nil {
			return dropped, err
		}
		dropped++
	}
}

// nextQueued is the oldest event in the webhook's queue; nil when none.
func (s *store) nextQueued(ctx context.Context, webhookID int64) (*queuedEvent, error) {
	e := &queuedEvent{webhookID: webhookID}
	err := s.reader.QueryRowContext(ctx, `SELECT seq, event_id, type, body FROM webhook_queue WHERE webhook_id = ? ORDER BY seq LIMIT 1`,
		webhookID).Scan(&e.seq, &e.eventID, &e.kind, &e.body)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	return e, err
}

// finishDelivery records a delivery of e, and when it was delivered takes
// e from the queue (unless it was dropped meanwhile).
func (s *store) finishDelivery(ctx context.Context, e *queuedEvent, d *webhookDelivery, delivered bool) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if delivered {
			var n int
			err := tx.QueryRowContext(ctx, `DELETE FROM webhook_queue WHERE seq = ? RETURNING length(body)`, e.seq).Scan(&n)
			if err == nil {
				_, err = tx.ExecContext(ctx, `UPDATE webhooks SET queued = queued - 1, queued_bytes = queued_bytes - ? WHERE id = ?`, n, e.webhookID)
			}
			if err != nil && !errors.Is(err, sql.ErrNoRows) {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE webhooks SET last_delivery_at = ? WHERE id = ?`, d.At, e.webhookID); err != nil {
			return err
		}
		return s.recordDelivery(ctx, tx, e.webhookID, d)
	})
}

// recordDelivery adds a delivery to the webhook's log and keeps its
// newest keepDeliveries.
func (s *store) recordDelivery(ctx context.Context, tx *sql.Tx, webhookID int64, d *webhookDelivery) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO webhook_deliveries (id, webhook_id, event_id, type, at, status, error, duration_ms, attempt)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`, d.ID, webhookID, d.EventID, d.Type, d.At, d.Status, d.Error, d.DurationMS, d.Attempt)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `DELETE FROM webhook_deliveries WHERE webhook_id = ?1 AND seq <=
		(SELECT seq FROM webhook_deliveries WHERE webhook_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2)`, webhookID, keepDeliveries)
	return err
}

// webhookDeliveries are the webhook's newest deliveries, newest first.
func (s *store) webhookDeliveries(ctx context.Context, webhookID int64) ([]*webhookDelivery, error) {
	return queryAll(ctx, s.reader, func(row scanner) (*webhookDelivery, error) {
		d := &webhookDelivery{}
		return d, row.Scan(&d.ID, &d.EventID, &d.Type, &d.At, &d.Status, &d.Error, &d.DurationMS, &d.Attempt)
	}, `SELECT id, event_id, type, at, status, error, duration_ms, attempt FROM webhook_deliveries
		WHERE webhook_id = ? ORDER BY seq DESC LIMIT ?`, webhookID, keepDeliveries)
}

// disableWebhook turns the webhook off, and records entry in the audit
// log in the same transaction, unless it was deleted or turned off
// meanwhile: false then.
func (s *store) disableWebhook(ctx context.Context, id int64, reason string, entry *auditEntry) (bool, error) {
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
		res, err = tx.ExecContext(ctx, auditInsertSQL, entry.teamID, entry.At, nil, nil, entry.Action, nil, string(entry.Detail))
		if err != nil {
			return err
		}
		entry.ID, err = res.LastInsertId()
		return err
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

// devicesGoneOffline are the team's devices that are offline and were
// last seen in (after, until]: those whose offline spell passed the
// webhook's offline_minutes since its last check.
func (s *store) devicesGoneOffline(ctx context.Context, teamID int64, after, until string) ([]offlineDevice, error) {
	return queryAll(ctx, s.reader, func(row scanner) (offlineDevice, error) {
		var d offlineDevice
		return d, row.Scan(&d.UID, &d.Name, &d.LastSeenAt)
	}, `SELECT uid, name, last_seen_at FROM devices WHERE team_id = ? AND status = 'offline'
		AND last_seen_at > ? AND last_seen_at <= ? ORDER BY last_seen_at`, teamID, after, until)
}

// setOfflineChecked records how far the webhook's device.offline check has looked.
func (s *store) setOfflineChecked(ctx context.Context, id int64, at string) error {
	_, err := s.writer.ExecContext(ctx, `UPDATE webhooks SET offline_checked_at = ? WHERE id = ?`, at, id)
	return err
}
