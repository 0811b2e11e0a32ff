package main

// Webhooks: a team's admins add endpoints that devicehub POSTs the team's
// events to, signed with the endpoint's secret; webhook_engine.go delivers
// them, internal/store/store_webhooks.go keeps them.

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// webhookEventTypes are the types a webhook may ask for: the event
// stream's, and device.offline.
var webhookEventTypes = []string{"device.status", "device.boot", "device.updated", "command.state",
	"rollout.progress", "audit.entry", "device.offline"}

// webhookQueuedTypes are the types of what a webhook's queue holds and its
// deliveries record: the events it may ask for, and a ping (a test).
// schema.sql's CHECK constraints hold the same list (TestStatesMatchSchema).
var webhookQueuedTypes = append(slices.Clip(webhookEventTypes), "ping")

// maxWebhookURL caps a webhook's URL.
const maxWebhookURL = 2048

// adminOnly lets only admins through to h, which changes nothing the
// audit log records: a read, or a ping.
func adminOnly(h apiHandler) apiHandler {
	return func(w http.ResponseWriter, r *http.Request) error {
		if !authFrom(r.Context()).user.Role.May(model.RoleAdmin) {
			return errForbidden
		}
		return h(w, r)
	}
}

// handleWebhookList serves GET /v1/user/team/webhooks.
func (s *server) handleWebhookList(w http.ResponseWriter, r *http.Request) error {
	list, err := s.store.Webhooks(r.Context(), authFrom(r.Context()).user.TeamID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleWebhookCreate serves POST /v1/user/team/webhooks: the webhook and
// its secret, which is shown this once.
func (s *server) handleWebhookCreate(w http.ResponseWriter, r *http.Request) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	hook := &model.Webhook{TeamID: authFrom(r.Context()).user.TeamID, Secret: store.RandomString(40, store.Alnum)}
	if u := body.str(&e, "url", true, maxWebhookURL); u != nil {
		hook.URL = *u
		s.checkWebhookURL(r.Context(), &e, *u)
	}
	hook.Events = readWebhookEvents(&e, body)
	hook.OfflineMinutes = body.integer(&e, "offline_minutes", 10, 1, 1440)
	if err := e.err(); err != nil {
		return err
	}
	err = s.store.CreateWebhook(r.Context(), hook, auditOf(r.Context(), func(hook *model.Webhook) map[string]any {
		return map[string]any{"webhook_id": hook.ID, "host": urlHost(hook.URL), "events": hook.Events}
	}))
	if err != nil {
		return err
	}
	s.reloadWebhooks(r.Context())
	writeJSON(w, http.StatusCreated, struct {
		Data   *model.Webhook `json:"data"`
		Secret string         `json:"secret"`
	}{hook, hook.Secret})
	return nil
}

// handleWebhookUpdate serves PATCH /v1/user/team/webhooks/{id}: url,
// events, offline_minutes, enabled; enabling clears disabled_reason.
func (s *server) handleWebhookUpdate(w http.ResponseWriter, r *http.Request) error {
	id, err := webhookID(r)
	if err != nil {
		return err
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	detail := map[string]any{"webhook_id": id}
	var newURL *string
	if body.has("url") {
		if newURL = body.str(&e, "url", true, maxWebhookURL); newURL != nil {
			s.checkWebhookURL(r.Context(), &e, *newURL)
			detail["host"] = urlHost(*newURL)
		}
	}
	var events []string
	if body.has("events") {
		events = readWebhookEvents(&e, body)
		detail["events"] = events
	}
	minutes := body.integer(&e, "offline_minutes", 0, 1, 1440)
	if minutes != 0 {
		detail["offline_minutes"] = minutes
	}
	enabled := body.boolean(&e, "enabled")
	if body.has("enabled") {
		detail["enabled"] = enabled
	}
	if err := e.err(); err != nil {
		return err
	}
	hook, err := s.store.UpdateWebhook(r.Context(), authFrom(r.Context()).user.TeamID, id, func(h *model.Webhook) {
		if newURL != nil {
			h.URL = *newURL
		}
		if events != nil {
			h.Events = events
		}
		if minutes != 0 {
			h.OfflineMinutes = minutes
		}
		if body.has("enabled") {
			h.Enabled, h.DisabledReason = enabled, nil
		}
	}, auditOf(r.Context(), func(*model.Webhook) map[string]any { return detail }))
	if err != nil {
		return err
	}
	s.reloadWebhooks(r.Context())
	writeJSON(w, http.StatusOK, dataBody{hook})
	return nil
}

// handleWebhookDelete serves DELETE /v1/user/team/webhooks/{id}: the
// webhook goes with its queue and deliveries.
func (s *server) handleWebhookDelete(w http.ResponseWriter, r *http.Request) error {
	id, err := webhookID(r)
	if err != nil {
		return err
	}
	err = s.store.DeleteWebhook(r.Context(), authFrom(r.Context()).user.TeamID, id,
		auditOf(r.Context(), func(hook *model.Webhook) map[string]any {
			return map[string]any{"webhook_id": hook.ID, "host": urlHost(hook.URL)}
		}))
	if err != nil {
		return err
	}
	s.reloadWebhooks(r.Context())
	writeMessage(w, http.StatusOK, "Webhook deleted.")
	return nil
}

// handleWebhookTest serves POST /v1/user/team/webhooks/{id}/test: a ping
// queued behind the webhook's other events.
func (s *server) handleWebhookTest(w http.ResponseWriter, r *http.Request) error {
	hook, err := s.webhookOf(r)
	if err != nil {
		return err
	}
	if !hook.Enabled {
		return refusal("This webhook is disabled: enable it first.")
	}
	if err := s.webhooks.ping(r.Context(), hook); err != nil {
		return err
	}
	writeMessage(w, http.StatusAccepted, "Ping queued.")
	return nil
}

// handleWebhookDeliveries serves GET /v1/user/team/webhooks/{id}/deliveries:
// the newest store.KeepDeliveries, newest first.
func (s *server) handleWebhookDeliveries(w http.ResponseWriter, r *http.Request) error {
	hook, err := s.webhookOf(r)
	if err != nil {
		return err
	}
	list, err := s.store.WebhookDeliveries(r.Context(), authFrom(r.Context()).user.TeamID, hook.ID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// webhookOf is the caller's team's webhook that the route's {id} names.
func (s *server) webhookOf(r *http.Request) (*model.Webhook, error) {
	id, err := webhookID(r)
	if err != nil {
		return nil, err
	}
	return s.store.Webhook(r.Context(), authFrom(r.Context()).user.TeamID, id)
}

// webhookID reads the {id} of a webhook route.
func webhookID(r *http.Request) (int64, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		return 0, store.ErrWebhookNotFound
	}
	return id, nil
}

// reloadWebhooks tells the engine of a change; a failure is logged (the
// engine reads them all again at the next change or start).
func (s *server) reloadWebhooks(ctx context.Context) {
	if err := s.webhooks.reload(ctx); err != nil {
		s.log.Error("load webhooks", "err", err)
	}
}

// readWebhookEvents reads a required, non-empty list of event types
// (stringList refuses an empty one).
func readWebhookEvents(e *fieldErrors, body jsonBody) []string {
	events := body.stringList(e, "events", len(webhookEventTypes))
	if events == nil {
		return nil
	}
	for _, ev := range events {
		if !slices.Contains(webhookEventTypes, ev) {
			e.add("events", "must each be one of: %s.", strings.Join(webhookEventTypes, ", "))
			break
		}
	}
	slices.Sort(events)
	return slices.Compact(events)
}

// checkWebhookURL notes a field error on url unless it is an http or
// https URL with a host that is not, and does not resolve to, a private
// address (unless -webhook-allow-private).
func (s *server) checkWebhookURL(ctx context.Context, e *fieldErrors, raw string) {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "http" && u.Scheme != "https" || u.Hostname() == "" {
		e.add("url", "must be an http or https URL with a host.")
		return
	}
	if s.webhooks.allowPrivate {
		return
	}
	addrs, err := []netip.Addr{}, error(nil)
	if ip, perr := netip.ParseAddr(u.Hostname()); perr == nil {
		addrs = append(addrs, ip)
	} else {
		addrs, err = s.webhooks.lookup(ctx, u.Hostname())
	}
	if err != nil || len(addrs) == 0 {
		e.add("url", "must have a host that resolves.")
		return
	}
	if slices.ContainsFunc(addrs, privateAddr) {
		e.add("url", "must not point to a loopback, private, link-local or unspecified address.")
	}
}

// urlHost is a URL's host, which the audit log records: the whole URL
// may hold a secret of the endpoint's, and every member reads the log.
func urlHost(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return ""
	}
	return u.Host
}
