package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// maxJSONBody caps JSON request bodies.
const maxJSONBody = 64 << 10

// maxUploadBody caps a firmware upload request: the file plus form fields.
const maxUploadBody = store.MaxFirmwareSize + 1<<20

// apiMethods are the methods the API's routes use.
var apiMethods = []string{"GET", "POST", "PATCH", "DELETE"}

// apiHandler is a handler that returns its failure instead of answering
// it; answer turns it into an http.HandlerFunc.
type apiHandler func(w http.ResponseWriter, r *http.Request) error

// route is a ServeMux pattern and its handler, with every wrapper that
// guards it in sight.
type route struct {
	pattern string
	handler apiHandler
}

// answer adapts h to net/http: an error h returns is answered through
// writeError, the one place that turns errors into responses.
func (s *server) answer(h apiHandler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			s.writeError(w, r, err)
		}
	}
}

// routes lists every route of the service. openapi.json documents each
// one; TestOpenAPIRouteParity holds the two to the same set.
func (s *server) routes() []route {
	return []route{
		{"/", s.handleNoRoute}, // anything no other route takes: JSON 404 or 405
		{"GET /healthz", s.handleHealth},
		{"GET /v1/openapi.json", s.handleOpenAPI},
		{"GET /{$}", s.handleDashboard},
		{"GET /ota/{uid}/{file}", s.handleOTADownload}, // devices; signed link, no token

		{"POST /v1/auth/login", s.handleLogin},
		{"POST /v1/auth/invite", s.handleInvite},
		{"POST /v1/auth/invite/info", s.handleInviteInfo},
		{"POST /v1/auth/reset", s.handleReset},
		{"POST /v1/auth/reset/info", s.handleResetInfo},
		{"GET /v1/auth/me", s.auth(s.handleMe)},
		{"POST /v1/auth/logout", s.auth(s.handleLogout)},

		{"GET /v1/user/events", s.auth(s.handleEvents)}, // a stream: gives back its -max-conns slot

		// Reads need a token (auth); every write also a role that allows
		// it (own: anyone's, to what is theirs; write: user or admin;
		// admin), and is recorded in the audit log.
		{"GET /v1/user/team", s.auth(s.handleTeamGet)},
		{"PATCH /v1/user/team", s.auth(s.admin("team.update", s.handleTeamUpdate))},
		{"POST /v1/user/team/members", s.auth(s.admin("member.invite", s.handleMemberInvite))},
		{"PATCH /v1/user/team/members/{id}", s.auth(s.admin("member.update", s.handleMemberUpdate))},
		{"DELETE /v1/user/team/members/{id}", s.auth(s.admin("member.delete", s.handleMemberDelete))},
		{"POST /v1/user/team/members/{id}/invite", s.auth(s.admin("member.invite", s.handleMemberReinvite))},
		{"POST /v1/user/team/members/{id}/reset", s.auth(s.admin("member.reset", s.handleMemberReset))},
		{"DELETE /v1/user/team/members/{id}/reset", s.auth(s.admin("member.reset_revoke", s.handleMemberResetRevoke))},
		{"GET /v1/user/team/audit", s.auth(s.handleAuditLog)},
		{"GET /v1/user/team/webhooks", s.auth(adminOnly(s.handleWebhookList))},
		{"POST /v1/user/team/webhooks", s.auth(s.admin("webhook.create", s.handleWebhookCreate))},
		{"PATCH /v1/user/team/webhooks/{id}", s.auth(s.admin("webhook.update", s.handleWebhookUpdate))},
		{"DELETE /v1/user/team/webhooks/{id}", s.auth(s.admin("webhook.delete", s.handleWebhookDelete))},
		{"POST /v1/user/team/webhooks/{id}/test", s.auth(adminOnly(s.handleWebhookTest))},
		{"GET /v1/user/team/webhooks/{id}/deliveries", s.auth(adminOnly(s.handleWebhookDeliveries))},

		{"GET /v1/user/tokens", s.auth(s.handleTokenList)},
		{"POST /v1/user/tokens", s.auth(s.own("token.create", s.handleTokenCreate))},
		{"DELETE /v1/user/tokens/{id}", s.auth(s.own("token.delete", s.handleTokenDelete))},

		{"GET /v1/user/devices", s.auth(s.handleDeviceList)},
		{"POST /v1/user/devices", s.auth(s.write("device.create", s.handleDeviceCreate))},
		{"GET /v1/user/devices/{uid}", s.auth(s.handleDeviceGet)},
		{"PATCH /v1/user/devices/{uid}", s.auth(s.write("device.update", s.withDevice(s.handleDeviceUpdate)))},
		{"DELETE /v1/user/devices/{uid}", s.auth(s.write("device.delete", s.withDevice(s.handleDeviceDelete)))},
		{"POST /v1/user/devices/{uid}/credentials", s.auth(s.write("device.credentials", s.withDevice(s.handleDeviceCredentials)))},

		{"POST /v1/user/devices/{uid}/reboot", s.auth(s.write("command.send", s.withDevice(s.handleDeviceReboot)))},
		{"POST /v1/user/devices/{uid}/wifi-reset", s.auth(s.write("command.send", s.withDevice(s.handleDeviceWifiReset)))},
		{"POST /v1/user/devices/{uid}/ota", s.auth(s.write("command.send", s.withDevice(s.handleDeviceOTA)))},
		{"POST /v1/user/devices/{uid}/commands", s.auth(s.write("command.send", s.withDevice(s.handleDeviceCommand)))},
		{"GET /v1/user/devices/{uid}/commands", s.auth(s.withDevice(s.handleCommandList))},
		{"GET /v1/user/devices/{uid}/commands/{id}", s.auth(s.withDevice(s.handleCommandGet))},

		{"GET /v1/user/devices/{uid}/series", s.auth(s.withDevice(s.handleSeriesList))},
		{"GET /v1/user/devices/{uid}/history", s.auth(s.withDevice(s.handleHistory))},
		{"GET /v1/user/devices/{uid}/presence", s.auth(s.withDevice(s.handlePresence))},
		{"GET /v1/user/devices/{uid}/boots", s.auth(s.withDevice(s.handleBoots))},

		{"GET /v1/user/devices/{uid}/command-buttons", s.auth(s.withDevice(s.handleButtonList))},
		{"POST /v1/user/devices/{uid}/command-buttons", s.auth(s.write("button.create", s.withDevice(s.handleButtonCreate)))},
		{"DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}", s.auth(s.write("button.delete", s.withDevice(s.handleButtonDelete)))},
		{"POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send", s.auth(s.write("command.send", s.withDevice(s.handleButtonSend)))},

		{"GET /v1/user/firmware-health", s.auth(s.handleFirmwareHealth)},

		{"GET /v1/user/rollouts", s.auth(s.handleRolloutList)},
		{"POST /v1/user/rollouts", s.auth(s.write("rollout.create", s.handleRolloutCreate))},
		{"GET /v1/user/rollouts/{id}", s.auth(s.handleRolloutGet)},
		{"POST /v1/user/rollouts/{id}/pause", s.auth(s.write("rollout.pause", s.handleRolloutMove("pause")))},
		{"POST /v1/user/rollouts/{id}/resume", s.auth(s.write("rollout.resume", s.handleRolloutMove("resume")))},
		{"POST /v1/user/rollouts/{id}/cancel", s.auth(s.write("rollout.cancel", s.handleRolloutMove("cancel")))},
		{"POST /v1/user/rollouts/{id}/revert", s.auth(s.write("rollout.revert", s.handleRolloutRevert))},

		{"GET /v1/user/firmwares", s.auth(s.handleLibraryList)},
		{"POST /v1/user/firmwares", s.auth(s.write("firmware.upload", s.handleLibraryUpload))},
		{"DELETE /v1/user/firmwares/{sha256}", s.auth(s.write("firmware.delete", s.handleLibraryDelete))},
		{"GET /v1/user/devices/{uid}/firmwares", s.auth(s.withDevice(s.handleFirmwareList))},
		{"POST /v1/user/devices/{uid}/firmwares", s.auth(s.write("firmware.upload", s.withDevice(s.handleFirmwareUpload)))},
		{"PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}", s.auth(s.write("firmware.update", s.withDevice(s.handleFirmwareUpdate)))},
		{"DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}", s.auth(s.write("firmware.delete", s.withDevice(s.handleFirmwareDelete)))},
		{"POST /v1/user/devices/{uid}/firmwares/set-target", s.auth(s.write("firmware.set_target", s.withDevice(s.handleFirmwareSetTarget)))},
	}
}

// ServeHTTP sets the headers every response carries, answers CORS
// preflights and routes the request.
func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	if len(s.corsOrigins) > 0 {
		h.Add("Vary", "Origin")
		if origin := r.Header.Get("Origin"); s.corsOrigins[origin] {
			h.Set("Access-Control-Allow-Origin", origin)
			if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
				// A preflight: answer it here, before routing.
				h.Set("Access-Control-Allow-Methods", strings.Join(apiMethods, ", "))
				h.Set("Access-Control-Allow-Headers", "Authorization, Content-Type, Accept")
				h.Set("Access-Control-Max-Age", "600")
				h.Del("Content-Type")
				w.WriteHeader(http.StatusNoContent)
				return
			}
		}
	}
	// The mux would redirect a path like /v1//auth/me to its clean form;
	// an API client (or an ESP updater, which follows no redirects) is
	// better served by a plain 404.
	if p := r.URL.Path; p != "/" && path.Clean(p) != p {
		s.writeError(w, r, errNoRoute)
		return
	}
	s.mux.ServeHTTP(w, r)
}

// handleNoRoute answers requests that no route takes: 405 with Allow when
// the path exists for other methods, 404 otherwise.
func (s *server) handleNoRoute(w http.ResponseWriter, r *http.Request) error {
	var allow []string
	for _, m := range apiMethods {
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pattern := s.mux.Handler(r2); pattern != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) == 0 {
		return errNoRoute
	}
	w.Header().Set("Allow", strings.Join(allow, ", "))
	return errMethodNotAllowed
}

// writeJSON writes v as the response body with the given status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"message":"Server Error."}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

// writeData writes {"data": raw} without re-encoding raw, a page rendered
// and kept in the read cache.
func writeData(w http.ResponseWriter, status int, raw json.RawMessage) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(raw)+len(`{"data":}`)+1))
	w.WriteHeader(status)
	w.Write(slices.Concat([]byte(`{"data":`), raw, []byte("}\n")))
}

func writeMessage(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, messageBody{msg})
}

// Errors the handlers themselves decide on; the store's are in internal/store/store.go,
// the commander's in commands.go and the request reader's in request.go.
var (
	errNoRoute          = errors.New("no such route")
	errMethodNotAllowed = errors.New("method not allowed")
	errUnauthenticated  = errors.New("no valid token")
	errBadLink          = errors.New("invalid or expired download link")
)

// refusal is a request refused with a 422 and a message of its own.
type refusal string

func (r refusal) Error() string { return string(r) }

// tooManyAttempts is a request refused for now: 429 with Retry-After, in whole
// seconds and at least one.
type tooManyAttempts time.Duration

func (r tooManyAttempts) Error() string { return "too many attempts" }

// quotaMessages say, for each quota the store may refuse a write for,
// which limit it would pass (quotaMessage).
var quotaMessages = map[store.Quota]string{
	store.QuotaButtons:      "This device has reached its limit of %d command buttons.",
	store.QuotaFirmwares:    "This device has reached its limit of %d firmwares.",
	store.QuotaFirmwareMiB:  "This upload would pass your team's firmware storage limit of %d MiB.",
	store.QuotaTokens:       "You have reached the limit of %d tokens. Delete a token first.",
	store.QuotaMembers:      "Your team has reached its limit of %d members, invites included.",
	store.QuotaDevices:      "Your team has reached its limit of %d devices.",
	store.QuotaTeamData:     "This button would pass your team's limit of %d MiB of buttons and command history.",
	store.QuotaLibraryFiles: "Your team's firmware library has reached its limit of %d files. Delete a file first.",
	store.QuotaWebhooks:     "Your team has reached its limit of %d webhooks.",
}

// rolloutQuotaMessages are quotaMessages for a rollout, which may pass a
// limit at any of its devices: they name the first.
var rolloutQuotaMessages = map[store.Quota]string{
	store.QuotaFirmwares:   "This rollout would give device %[2]q more than its limit of %[1]d firmwares.",
	store.QuotaFirmwareMiB: "This rollout would pass your team's firmware storage limit of %[1]d MiB at device %[2]q.",
}

// quotaMessage is what a user reads of a write refused over a quota.
func quotaMessage(e *store.QuotaError) string {
	if e.Device != "" {
		return fmt.Sprintf(rolloutQuotaMessages[e.Quota], e.Limit, e.Device)
	}
	return fmt.Sprintf(quotaMessages[e.Quota], e.Limit)
}

// errorAnswers maps each sentinel error to its status and message, the
// contract's where it names one.
var errorAnswers = []struct {
	err     error
	status  int
	message string
}{
	{errUnauthenticated, http.StatusUnauthorized, "Unauthenticated."},
	{errNoRoute, http.StatusNotFound, "Not found."},
	{errMethodNotAllowed, http.StatusMethodNotAllowed, "Method not allowed."},
	{errBadLink, http.StatusForbidden, "Invalid or expired link."},
	{store.ErrDeviceNotFound, http.StatusNotFound, "Device not found."},
	{store.ErrButtonNotFound, http.StatusNotFound, "Command button not found."},
	{store.ErrFirmwareNotFound, http.StatusNotFound, "Firmware not found."},
	{store.ErrTokenNotFound, http.StatusNotFound, "Token not found."},
	{store.ErrCommandNotFound, http.StatusNotFound, "Command not found."},
	{store.ErrRolloutNotFound, http.StatusNotFound, "Rollout not found."},
	{store.ErrMemberNotFound, http.StatusNotFound, "Member not found."},
	{store.ErrWebhookNotFound, http.StatusNotFound, "Webhook not found."},
	{errForbidden, http.StatusForbidden, "This action is unauthorized."},
	{store.ErrNeedsAdmin, http.StatusUnprocessableEntity, "The team needs at least one admin."},
	{store.ErrInviteInvalid, http.StatusUnprocessableEntity, "This invitation is invalid or has expired."},
	{store.ErrResetInvalid, http.StatusUnprocessableEntity, "This password reset link is invalid or has expired."},
	{store.ErrResetNotFound, http.StatusNotFound, "The member has no pending password reset link."},
	{store.ErrMemberJoined, http.StatusUnprocessableEntity, "The member has joined already; make a password reset link instead."},
	{store.ErrButtonExists, http.StatusUnprocessableEntity, "A command button with this id already exists."},
	{store.ErrFirmwareExists, http.StatusUnprocessableEntity, "This firmware file is already uploaded."},
	{store.ErrFirmwareAssigned, http.StatusUnprocessableEntity, "Cannot delete firmware while it is assigned to any device."},
	{store.ErrFirmwareInUse, http.StatusUnprocessableEntity, "Cannot delete firmware while a device has it; delete it from the device first."},
	{store.ErrTargetNotFound, http.StatusUnprocessableEntity, "Firmware with the provided md5 was not found for this device."},
	{store.ErrNoTarget, http.StatusUnprocessableEntity, "Assign firmware first to trigger OTA."},
	{errDeviceOffline, http.StatusUnprocessableEntity, "Device is offline."},
	{errDeviceReconnecting, http.StatusUnprocessableEntity, "Device is reconnecting."},
	{errLinkDown, http.StatusServiceUnavailable, "The device link is unavailable. Try again later."},
	{mqttlink.ErrBrokerUnavailable, http.StatusServiceUnavailable, "The broker did not answer. Try again later."},
	{errRotateUnknown, http.StatusServiceUnavailable, "The broker did not answer: the new password may or may not be in effect. Rotate the credentials again."},
	{errBodyTooLarge, http.StatusRequestEntityTooLarge, "The request body is too large."},
	{errBodyUnreadable, http.StatusBadRequest, "The request body could not be read."},
	{store.ErrDiskFull, http.StatusInsufficientStorage, "The server's disk is full: nothing was saved. Try again later."},
}

// writeError answers err: field errors as a Laravel 422, a quota or a
// refusal as a 422 that says why, too many attempts as a 429, a sentinel
// with its status and message, a body past its size cap as 413, a full
// disk as 507 (logged), and anything else as a 500 that is logged and
// never explained to the client.
func (s *server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var fe *fieldErrors
	if errors.As(err, &fe) {
		fe.write(w)
		return
	}
	var qe *store.QuotaError
	if errors.As(err, &qe) {
		writeMessage(w, http.StatusUnprocessableEntity, quotaMessage(qe))
		return
	}
	var ref refusal
	if errors.As(err, &ref) {
		writeMessage(w, http.StatusUnprocessableEntity, string(ref))
		return
	}
	var busy tooManyAttempts
	if errors.As(err, &busy) {
		w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(time.Duration(busy).Seconds())))))
		writeMessage(w, http.StatusTooManyRequests, "Too Many Attempts.")
		return
	}
	if isTooBig(err) {
		err = errBodyTooLarge
	}
	if store.IsDiskFull(err) {
		s.log.Error("disk full", "method", r.Method, "path", r.URL.Path, "err", err)
		err = store.ErrDiskFull
	}
	for _, a := range errorAnswers {
		if errors.Is(err, a.err) {
			writeMessage(w, a.status, a.message)
			return
		}
	}
	s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	writeMessage(w, http.StatusInternalServerError, "Server Error.")
}

// isTooBig reports whether err comes from a body past its MaxBytesReader cap.
func isTooBig(err error) bool {
	var tooBig *http.MaxBytesError
	return errors.As(err, &tooBig)
}

// handleHealth serves GET /healthz.
func (s *server) handleHealth(w http.ResponseWriter, r *http.Request) error {
	state := "disconnected"
	if s.commands.linkUp() {
		state = "connected"
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok", "mqtt": state})
	return nil
}
