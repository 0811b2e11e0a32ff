package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf16"
	"unicode/utf8"
)

// server is the HTTP API. Everything it uses is passed in; nothing is global.
type server struct {
	store   *store
	link    commandLink // nil: no broker configured; commands answer 503
	log     *slog.Logger
	otaKey  []byte // signs OTA download links
	public  string // base URL devices use to reach this server
	limiter *loginLimiter
	hashes  *hashPool // runs password checks on a few workers
	// iterations is the PBKDF2 count of the dummy hash that an unknown
	// email is checked against; it matches what 'user add' uses, so that
	// an unknown email costs what a real check costs.
	iterations int
	dummyHash  func() string
	// corsOrigins are the browser origins allowed to call the API; none
	// by default.
	corsOrigins map[string]bool
	// trustedProxies are the peers whose X-Forwarded-For is believed
	// (clientIP); none by default.
	trustedProxies []netip.Prefix
	// commandTimeout and otaTimeout are how long a command may take to end.
	commandTimeout, otaTimeout time.Duration
	rolloutMu                  sync.Mutex // one rollout engine at a time
	// dashboard is the browser page at GET / (dashboard.go); nil when
	// -dashboard=false.
	dashboard http.Handler
	mux       *http.ServeMux
}

// commandLink is the device link as the handlers see it (mqtt.go).
type commandLink interface {
	connected() bool
	publish(uid, commandID string, payload []byte) error
}

// maxJSONBody caps JSON request bodies.
const maxJSONBody = 64 << 10

// maxUploadBody caps a firmware upload request: the file plus form fields.
const maxUploadBody = maxFirmwareSize + 1<<20

// apiMethods are the methods the API's routes use.
var apiMethods = []string{"GET", "POST", "PATCH", "DELETE"}

func newServer(st *store, link commandLink, log *slog.Logger, otaKey []byte, publicURL string) *server {
	s := &server{
		store:          st,
		link:           link,
		log:            log,
		otaKey:         otaKey,
		public:         strings.TrimRight(publicURL, "/"),
		limiter:        newLoginLimiter(),
		hashes:         newHashPool(hashWorkers(), hashQueue),
		iterations:     passwordIterations,
		corsOrigins:    map[string]bool{},
		dashboard:      newDashboardPage(dashboardHTML),
		commandTimeout: defaultCommandTimeout,
		otaTimeout:     defaultOTATimeout,
		mux:            http.NewServeMux(),
	}
	s.dummyHash = sync.OnceValue(func() string {
		h, _ := hashPassword(randomString(20, alnum), s.iterations)
		return h
	})
	for _, rt := range s.routes() {
		s.mux.HandleFunc(rt.pattern, rt.handler)
	}
	return s
}

// route is a ServeMux pattern and its handler.
type route struct {
	pattern string
	handler http.HandlerFunc
}

// routes lists every route of the service. openapi.json documents each
// one; TestOpenAPIRouteParity holds the two to the same set.
func (s *server) routes() []route {
	auth := s.requireAuth
	return []route{
		{"/", s.handleNoRoute}, // anything no other route takes: JSON 404 or 405
		{"GET /healthz", s.handleHealth},
		{"GET /v1/openapi.json", s.handleOpenAPI},
		{"GET /{$}", s.handleDashboard},
		{"GET /ota/{uid}/{file}", s.handleOTADownload}, // devices; signed link, no token

		{"POST /v1/auth/login", s.handleLogin},
		{"GET /v1/auth/me", auth(s.handleMe)},
		{"POST /v1/auth/logout", auth(s.handleLogout)},

		{"GET /v1/user/tokens", auth(s.handleTokenList)},
		{"POST /v1/user/tokens", auth(s.handleTokenCreate)},
		{"DELETE /v1/user/tokens/{id}", auth(s.handleTokenDelete)},

		{"GET /v1/user/devices", auth(s.handleDeviceList)},
		{"GET /v1/user/devices/{uid}", auth(s.handleDeviceGet)},
		{"PATCH /v1/user/devices/{uid}", auth(s.handleDeviceUpdate)},

		{"POST /v1/user/devices/{uid}/reboot", auth(s.handleDeviceReboot)},
		{"POST /v1/user/devices/{uid}/wifi-reset", auth(s.handleDeviceWifiReset)},
		{"POST /v1/user/devices/{uid}/ota", auth(s.handleDeviceOTA)},
		{"POST /v1/user/devices/{uid}/commands", auth(s.handleDeviceCommand)},
		{"GET /v1/user/devices/{uid}/commands", auth(s.handleCommandList)},
		{"GET /v1/user/devices/{uid}/commands/{id}", auth(s.handleCommandGet)},

		{"GET /v1/user/devices/{uid}/command-buttons", auth(s.handleButtonList)},
		{"POST /v1/user/devices/{uid}/command-buttons", auth(s.handleButtonCreate)},
		{"DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}", auth(s.handleButtonDelete)},
		{"POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send", auth(s.handleButtonSend)},

		{"GET /v1/user/rollouts", auth(s.handleRolloutList)},
		{"POST /v1/user/rollouts", auth(s.handleRolloutCreate)},
		{"GET /v1/user/rollouts/{id}", auth(s.handleRolloutGet)},
		{"POST /v1/user/rollouts/{id}/pause", auth(s.handleRolloutMove("pause"))},
		{"POST /v1/user/rollouts/{id}/resume", auth(s.handleRolloutMove("resume"))},
		{"POST /v1/user/rollouts/{id}/cancel", auth(s.handleRolloutMove("cancel"))},

		{"GET /v1/user/devices/{uid}/firmwares", auth(s.handleFirmwareList)},
		{"POST /v1/user/devices/{uid}/firmwares", auth(s.handleFirmwareUpload)},
		{"PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}", auth(s.handleFirmwareUpdate)},
		{"DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}", auth(s.handleFirmwareDelete)},
		{"POST /v1/user/devices/{uid}/firmwares/set-target", auth(s.handleFirmwareSetTarget)},
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
func (s *server) handleNoRoute(w http.ResponseWriter, r *http.Request) {
	var allow []string
	for _, m := range apiMethods {
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pattern := s.mux.Handler(r2); pattern != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) == 0 {
		s.writeError(w, r, errNoRoute)
		return
	}
	w.Header().Set("Allow", strings.Join(allow, ", "))
	writeMessage(w, http.StatusMethodNotAllowed, "Method not allowed.")
}

// ---- responses ----

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

type messageBody struct {
	Message string `json:"message"`
}

type deviceMessage struct {
	Message   string `json:"message"`
	DeviceUID string `json:"device_uid"`
}

type dataBody struct {
	Data any `json:"data"`
}

// writeData writes {"data": raw} without re-encoding raw, JSON the store
// rendered and cached.
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

// Errors the handlers themselves decide on; the store's are in store.go.
var (
	errBodyTooLarge       = errors.New("request body too large")
	errBodyUnreadable     = errors.New("request body could not be read")
	errDeviceOffline      = errors.New("device is offline")
	errDeviceReconnecting = errors.New("device is reconnecting")
	errLinkDown           = errors.New("device link unavailable")
	errNoRoute            = errors.New("no such route")
	errBadLink            = errors.New("invalid or expired download link")
)

// errorAnswers maps each sentinel error to its status and message, the
// contract's where it names one.
var errorAnswers = []struct {
	err     error
	status  int
	message string
}{
	{errTokenNotFound, http.StatusUnauthorized, "Unauthenticated."},
	{errNoRoute, http.StatusNotFound, "Not found."},
	{errBadLink, http.StatusForbidden, "Invalid or expired link."},
	{errDeviceNotFound, http.StatusNotFound, "Device not found."},
	{errButtonNotFound, http.StatusNotFound, "Command button not found."},
	{errFirmwareNotFound, http.StatusNotFound, "Firmware not found."},
	{errNoSuchToken, http.StatusNotFound, "Token not found."},
	{errCommandNotFound, http.StatusNotFound, "Command not found."},
	{errRolloutNotFound, http.StatusNotFound, "Rollout not found."},
	{errButtonExists, http.StatusUnprocessableEntity, "A command button with this id already exists."},
	{errFirmwareExists, http.StatusUnprocessableEntity, "This firmware file is already uploaded."},
	{errFirmwareAssigned, http.StatusUnprocessableEntity, "Cannot delete firmware while it is assigned to any device."},
	{errTargetNotFound, http.StatusUnprocessableEntity, "Firmware with the provided md5 was not found for this device."},
	{errNoTarget, http.StatusUnprocessableEntity, "Assign firmware first to trigger OTA."},
	{errDeviceOffline, http.StatusUnprocessableEntity, "Device is offline."},
	{errDeviceReconnecting, http.StatusUnprocessableEntity, "Device is reconnecting."},
	{errLinkDown, http.StatusServiceUnavailable, "The device link is unavailable. Try again later."},
	{errBodyTooLarge, http.StatusRequestEntityTooLarge, "The request body is too large."},
	{errBodyUnreadable, http.StatusBadRequest, "The request body could not be read."},
	{errDiskFull, http.StatusInsufficientStorage, "The server's disk is full: nothing was saved. Try again later."},
}

// writeError answers err: field errors as a Laravel 422, a quota as a 422
// that names it, a sentinel with its status and message, a body past its
// size cap as 413, a full disk as 507 (logged), and anything else as a 500
// that is logged and never explained to the client.
func (s *server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var fe *fieldErrors
	if errors.As(err, &fe) {
		fe.write(w)
		return
	}
	var qe *quotaError
	if errors.As(err, &qe) {
		writeMessage(w, http.StatusUnprocessableEntity, qe.msg)
		return
	}
	if isTooBig(err) {
		err = errBodyTooLarge
	}
	if isDiskFull(err) {
		s.log.Error("disk full", "method", r.Method, "path", r.URL.Path, "err", err)
		err = errDiskFull
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

// fieldErrors collects validation problems per field, in order. As an
// error it is answered as a 422 in Laravel's shape.
type fieldErrors struct {
	fields []string
	msgs   map[string][]string
}

func (e *fieldErrors) add(field, format string, args ...any) {
	if e.msgs == nil {
		e.msgs = map[string][]string{}
	}
	if _, ok := e.msgs[field]; !ok {
		e.fields = append(e.fields, field)
	}
	label := strings.ReplaceAll(field, "_", " ")
	e.msgs[field] = append(e.msgs[field], "The "+label+" field "+fmt.Sprintf(format, args...))
}

func (e *fieldErrors) Error() string { return "invalid fields: " + strings.Join(e.fields, ", ") }

// err returns e as an error, or nil when no field is wrong.
func (e *fieldErrors) err() error {
	if len(e.fields) == 0 {
		return nil
	}
	return e
}

// fieldError is a single field's problem as an error.
func fieldError(field, format string, args ...any) error {
	var e fieldErrors
	e.add(field, format, args...)
	return &e
}

// write answers 422 in Laravel's shape: the first message (and how many
// more there are) plus every message per field.
func (e *fieldErrors) write(w http.ResponseWriter) {
	n := 0
	for _, f := range e.fields {
		n += len(e.msgs[f])
	}
	msg := e.msgs[e.fields[0]][0]
	if n > 1 {
		plural := "s"
		if n == 2 {
			plural = ""
		}
		msg += fmt.Sprintf(" (and %d more error%s)", n-1, plural)
	}
	writeJSON(w, http.StatusUnprocessableEntity, struct {
		Message string              `json:"message"`
		Errors  map[string][]string `json:"errors"`
	}{msg, e.msgs})
}

// ---- request bodies ----

// jsonBody is a decoded JSON object, its fields still raw.
type jsonBody map[string]json.RawMessage

// decodeJSON reads a JSON object body of at most maxJSONBody bytes. An
// empty body is an empty object.
func decodeJSON(w http.ResponseWriter, r *http.Request) (jsonBody, error) {
	return decodeJSONUpTo(w, r, maxJSONBody)
}

// decodeJSONUpTo is decodeJSON for a route whose bodies may be larger.
func decodeJSONUpTo(w http.ResponseWriter, r *http.Request, limit int64) (jsonBody, error) {
	if r.ContentLength > limit {
		return nil, errBodyTooLarge
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if isTooBig(err) {
		return nil, errBodyTooLarge
	}
	if err != nil {
		return nil, errBodyUnreadable
	}
	body := jsonBody{}
	if len(bytes.Trim(data, " \t\r\n")) == 0 { // JSON's white space only
		return body, nil
	}
	if err := json.Unmarshal(data, &body); err != nil || body == nil {
		return nil, fieldError("body", "must be a valid JSON object.")
	}
	if hasDuplicateKey(data, false) {
		// Unmarshal kept the last; another parser may keep the first.
		return nil, fieldError("body", "must not contain duplicate keys.")
	}
	return body, nil
}

// hasDuplicateKey reports whether an object of the JSON text raw has a key
// twice (as unescaped), at its top level or, with deep, at any depth. Two
// parsers may disagree on which one counts. raw must be valid JSON.
func hasDuplicateKey(raw []byte, deep bool) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dup, err := scanDuplicates(dec, deep, true)
	return dup && err == nil
}

// scanDuplicates reads the next value from dec and reports whether an
// object in it has a key twice; only the top level's when deep is false.
func scanDuplicates(dec *json.Decoder, deep, top bool) (bool, error) {
	tok, err := dec.Token()
	if err != nil {
		return false, err
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			key, err := dec.Token()
			if err != nil {
				return false, err
			}
			if seen[key.(string)] && (deep || top) {
				return true, nil
			}
			seen[key.(string)] = true
			if dup, err := scanDuplicates(dec, deep, false); dup || err != nil {
				return dup, err
			}
		}
	case json.Delim('['):
		for dec.More() {
			if dup, err := scanDuplicates(dec, deep, false); dup || err != nil {
				return dup, err
			}
		}
	default:
		return false, nil
	}
	_, err = dec.Token() // the closing delimiter
	return false, err
}

// validText reports whether the JSON text raw is text every parser reads
// the same: UTF-8, and no escaped UTF-16 surrogate without its pair
// (encoding/json would silently read either as U+FFFD; a device's parser
// may fail, or keep the bytes). raw must be valid JSON.
func validText(raw []byte) bool {
	if !utf8.Valid(raw) {
		return false
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		i++ // the escaped character: a backslash here is not a new escape
		if i+4 >= len(raw) || raw[i] != 'u' {
			continue
		}
		r := escapedRune(raw[i+1:])
		i += 4
		switch {
		case !utf16.IsSurrogate(r):
		case r < 0xDC00 && bytes.HasPrefix(raw[i+1:], []byte(`\u`)) && isLowSurrogate(escapedRune(raw[i+3:])):
			i += 6 // a high surrogate and its low one
		default:
			return false
		}
	}
	return true
}

// escapedRune is the code unit of the four hex digits b starts with.
func escapedRune(b []byte) rune {
	n, err := strconv.ParseUint(string(b[:min(4, len(b))]), 16, 16)
	if err != nil {
		return utf8.RuneError
	}
	return rune(n)
}

func isLowSurrogate(r rune) bool { return 0xDC00 <= r && r <= 0xDFFF }

func isNull(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

// has reports whether the body names field at all (null included).
func (b jsonBody) has(field string) bool {
	_, ok := b[field]
	return ok
}

// str reads an optional string field (absent or null: nil) of at most max
// characters; required makes absence, null and blank an error.
func (b jsonBody) str(e *fieldErrors, field string, required bool, max int) *string {
	raw := b[field]
	if isNull(raw) {
		if required {
			e.add(field, "is required.")
		}
		return nil
	}
	var v string
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be a string.")
		return nil
	}
	if !validText(raw) {
		e.add(field, "must be valid UTF-8.")
		return nil
	}
	return e.text(field, &v, required, max)
}

// text checks a string field's value: v nil is absent; required makes
// absence and blank an error. It returns v, or nil when v is wrong.
func (e *fieldErrors) text(field string, v *string, required bool, max int) *string {
	if v != nil && !utf8.ValidString(*v) { // a form field: JSON's were checked as text
		e.add(field, "must be valid UTF-8.")
		return nil
	}
	if required && (v == nil || strings.TrimSpace(*v) == "") {
		e.add(field, "is required.")
		return nil
	}
	if v != nil && utf8.RuneCountInString(*v) > max {
		e.add(field, "must not be greater than %d characters.", max)
		return nil
	}
	return v
}

// clearable reads an optional string field that null clears: absent is
// nil (unchanged), null and "" are a pointer to "" (cleared).
func (b jsonBody) clearable(e *fieldErrors, field string, max int) *string {
	if !b.has(field) {
		return nil
	}
	if isNull(b[field]) {
		return new(string)
	}
	return b.str(e, field, false, max)
}

// object reads a field that must be a JSON object and returns it compacted
// (key order and values as sent). It refuses what parsers on a device could
// read differently: a key twice in an object, at any depth, and text that
// is not valid UTF-8.
func (b jsonBody) object(e *fieldErrors, field string) json.RawMessage {
	raw := b[field]
	if isNull(raw) {
		e.add(field, "is required.")
		return nil
	}
	var buf bytes.Buffer
	switch {
	case raw[0] != '{' || json.Compact(&buf, raw) != nil:
		e.add(field, "must be a JSON object.")
	case !validText(raw):
		e.add(field, "must be valid UTF-8.")
	case hasDuplicateKey(raw, true):
		e.add(field, "must not contain duplicate keys.")
	default:
		return buf.Bytes()
	}
	return nil
}

// boolean reads an optional boolean field (absent or null: false).
func (b jsonBody) boolean(e *fieldErrors, field string) bool {
	raw := b[field]
	if isNull(raw) {
		return false
	}
	var v bool
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be true or false.")
	}
	return v
}

// integer reads an optional whole-number field between min and max (absent
// or null: def).
func (b jsonBody) integer(e *fieldErrors, field string, def, min, max int) int {
	raw := b[field]
	if isNull(raw) {
		return def
	}
	var v int
	if err := json.Unmarshal(raw, &v); err != nil || v < min || v > max {
		e.add(field, "must be an integer between %d and %d.", min, max)
		return def
	}
	return v
}

// stringList reads a required field that must be an array of at most max
// strings.
func (b jsonBody) stringList(e *fieldErrors, field string, max int) []string {
	raw := b[field]
	if isNull(raw) {
		e.add(field, "is required.")
		return nil
	}
	var v []string
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be an array of strings.")
		return nil
	}
	switch {
	case len(v) == 0:
		e.add(field, "must not be empty.")
	case len(v) > max:
		e.add(field, "must not have more than %d items.", max)
		return nil
	}
	return v
}

// ---- health ----

// handleHealth serves GET /healthz.
func (s *server) handleHealth(w http.ResponseWriter, r *http.Request) {
	state := "disconnected"
	if s.link != nil && s.link.connected() {
		state = "connected"
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok", "mqtt": state})
}

// ---- auth ----

// handleMe serves GET /v1/auth/me.
func (s *server) handleMe(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, dataBody{authFrom(r.Context()).user})
}

// handleLogout serves POST /v1/auth/logout: it deletes the presented token only.
func (s *server) handleLogout(w http.ResponseWriter, r *http.Request) {
	if err := s.store.deleteToken(r.Context(), authFrom(r.Context()).tokenID); err != nil {
		s.writeError(w, r, err)
		return
	}
	writeMessage(w, http.StatusOK, "Logged out.")
}

// ---- devices ----

// deviceFor loads the {uid} device of the authenticated user, answering
// 404 (the same for missing and foreign devices) when there is none.
func (s *server) deviceFor(w http.ResponseWriter, r *http.Request) (*deviceRef, bool) {
	d, err := s.store.deviceRefOf(r.Context(), authFrom(r.Context()).user.ID, r.PathValue("uid"))
	if err != nil {
		s.writeError(w, r, err)
		return nil, false
	}
	return d, true
}

// handleDeviceList serves GET /v1/user/devices.
func (s *server) handleDeviceList(w http.ResponseWriter, r *http.Request) {
	list, err := s.store.deviceListPage(r.Context(), authFrom(r.Context()).user.ID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeData(w, http.StatusOK, list)
}

// handleDeviceGet serves GET /v1/user/devices/{uid}.
func (s *server) handleDeviceGet(w http.ResponseWriter, r *http.Request) {
	page, err := s.store.devicePage(r.Context(), authFrom(r.Context()).user.ID, r.PathValue("uid"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeData(w, http.StatusOK, page)
}

// handleDeviceUpdate serves PATCH /v1/user/devices/{uid}: name and
// description; description null clears it.
func (s *server) handleDeviceUpdate(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var e fieldErrors
	var u deviceUpdate
	if body.has("name") {
		u.name = body.str(&e, "name", true, 255)
	}
	u.description = body.str(&e, "description", false, 2000)
	u.clearDescription = body.has("description") && isNull(body["description"])
	if err := e.err(); err != nil {
		s.writeError(w, r, err)
		return
	}
	updated, err := s.store.updateDevice(r.Context(), authFrom(r.Context()).user.ID, d.uid, u)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{updated})
}

// ---- command buttons ----

// idPattern is what a button id, a platform key and a board key may be:
// safe in a topic and a URL path segment.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// validID reports whether s matches idPattern and is not "." or "..",
// which would be cleaned out of a URL.
func validID(s string) bool { return idPattern.MatchString(s) && s != "." && s != ".." }

// handleButtonList serves GET /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonList(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	list, err := s.store.buttonsOf(r.Context(), d.id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{list})
}

// handleButtonCreate serves POST /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonCreate(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var e fieldErrors
	id := body.str(&e, "id", true, 64)
	if id != nil && !validID(*id) {
		e.add("id", "may only contain letters, digits, dots, underscores and dashes.")
	}
	label := body.str(&e, "label", true, 255)
	payload := body.object(&e, "payload")
	confirm := body.boolean(&e, "confirm")
	if err := e.err(); err != nil {
		s.writeError(w, r, err)
		return
	}
	b := commandButton{ID: *id, Label: *label, Payload: payload, Confirm: confirm}
	if err := s.store.createButton(r.Context(), d.id, b); err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, struct {
		Message   string        `json:"message"`
		DeviceUID string        `json:"device_uid"`
		Data      commandButton `json:"data"`
	}{"Command button created.", d.uid, b})
}

// handleButtonDelete serves DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}.
func (s *server) handleButtonDelete(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	if err := s.store.deleteButton(r.Context(), d.id, r.PathValue("buttonId")); err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, deviceMessage{"Command button deleted.", d.uid})
}

// ---- access log ----

// accessLog wraps h to log one info line per request: method, route
// pattern, status, duration and bytes written. It logs the pattern the
// mux matched, never the URL (an OTA link carries its signature in the
// query) nor any header (the token).
func accessLog(h http.Handler, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &recordingWriter{ResponseWriter: w}
		h.ServeHTTP(rec, r)
		route := r.Pattern // set on r by the mux while routing
		if route == "" {
			route = "(none)"
		}
		log.Info("request", "method", r.Method, "route", route, "status", rec.statusOr200(),
			"duration", time.Since(start), "bytes", rec.bytes)
	})
}

// recordingWriter notes the status and body size of a response. Unwrap
// lets http.ResponseController reach the connection's deadlines and
// flushing through it.
type recordingWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (w *recordingWriter) WriteHeader(status int) {
	if w.status == 0 && status >= 200 { // 1xx are interim answers
		w.status = status
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *recordingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.bytes += int64(n)
	return n, err
}

// ReadFrom keeps the connection's sendfile path for firmware downloads.
func (w *recordingWriter) ReadFrom(r io.Reader) (int64, error) {
	n, err := io.Copy(w.ResponseWriter, r)
	w.bytes += n
	return n, err
}

func (w *recordingWriter) Flush() { http.NewResponseController(w.ResponseWriter).Flush() }

func (w *recordingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *recordingWriter) statusOr200() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}
