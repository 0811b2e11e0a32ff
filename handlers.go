package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
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
	hashSem chan struct{} // bounds concurrent password hashing
	// iterations is the PBKDF2 count of the dummy hash that an unknown
	// email is checked against, so that it costs what a real check costs.
	iterations int
	dummyHash  func() string
	// checkPassword is checkPassword; a test may watch it.
	checkPassword func(hash, password string) bool
	// corsOrigins are the browser origins allowed to call the API; none
	// by default.
	corsOrigins map[string]bool
	mux         *http.ServeMux

	// dashboard serves the browser page at GET / (dashboard.go); off by
	// default, set with setDashboard.
	dashboard bool
}

// commandLink is the device link as the handlers see it (mqtt.go).
type commandLink interface {
	connected() bool
	publish(uid string, payload []byte) error
}

// maxJSONBody caps JSON request bodies.
const maxJSONBody = 64 << 10

// maxUploadBody caps a firmware upload request: the file plus form fields.
const maxUploadBody = maxFirmwareSize + 1<<20

func newServer(st *store, link commandLink, log *slog.Logger, otaKey []byte, publicURL string) *server {
	s := &server{
		store:         st,
		link:          link,
		log:           log,
		otaKey:        otaKey,
		public:        strings.TrimRight(publicURL, "/"),
		limiter:       newLoginLimiter(5, time.Minute),
		hashSem:       make(chan struct{}, 1),
		iterations:    passwordIterations,
		corsOrigins:   map[string]bool{},
		checkPassword: checkPassword,
	}
	s.dummyHash = sync.OnceValue(func() string {
		h, _ := hashPassword(randomString(20, alnum), s.iterations)
		return h
	})
	s.mux = http.NewServeMux()
	s.routes()
	return s
}

// routes lists every route of the service.
func (s *server) routes() {
	auth := s.requireAuth
	m := s.mux
	m.HandleFunc("/", s.handleNoRoute) // anything no other route takes: JSON 404 or 405
	m.HandleFunc("GET /healthz", s.handleHealth)
	m.HandleFunc("GET /ota/{uid}/{file}", s.handleOTADownload) // devices; signed link, no token
	if s.dashboard {
		m.Handle("GET /{$}", newDashboardPage(dashboardHTML)) // the browser page; CSP hashes computed here, once
	}

	m.HandleFunc("POST /v1/auth/login", s.handleLogin)
	m.Handle("GET /v1/auth/me", auth(s.handleMe))
	m.Handle("POST /v1/auth/logout", auth(s.handleLogout))

	m.Handle("GET /v1/user/devices", auth(s.handleDeviceList))
	m.Handle("GET /v1/user/devices/{uid}", auth(s.handleDeviceGet))
	m.Handle("PATCH /v1/user/devices/{uid}", auth(s.handleDeviceUpdate))

	m.Handle("POST /v1/user/devices/{uid}/reboot", auth(s.handleDeviceReboot))
	m.Handle("POST /v1/user/devices/{uid}/wifi-reset", auth(s.handleDeviceWifiReset))
	m.Handle("POST /v1/user/devices/{uid}/ota", auth(s.handleDeviceOTA))
	m.Handle("POST /v1/user/devices/{uid}/commands", auth(s.handleDeviceCommand))

	m.Handle("GET /v1/user/devices/{uid}/command-buttons", auth(s.handleButtonList))
	m.Handle("POST /v1/user/devices/{uid}/command-buttons", auth(s.handleButtonCreate))
	m.Handle("DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}", auth(s.handleButtonDelete))
	m.Handle("POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send", auth(s.handleButtonSend))

	m.Handle("GET /v1/user/devices/{uid}/firmwares", auth(s.handleFirmwareList))
	m.Handle("POST /v1/user/devices/{uid}/firmwares", auth(s.handleFirmwareUpload))
	m.Handle("PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}", auth(s.handleFirmwareUpdate))
	m.Handle("DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}", auth(s.handleFirmwareDelete))
	m.Handle("POST /v1/user/devices/{uid}/firmwares/set-target", auth(s.handleFirmwareSetTarget))
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
				h.Set("Access-Control-Allow-Methods", "GET, POST, PATCH, DELETE")
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
		writeMessage(w, http.StatusNotFound, "Not found.")
		return
	}
	s.mux.ServeHTTP(w, r)
}

// handleNoRoute answers requests that no route takes: 405 with Allow when
// the path exists for other methods, 404 otherwise.
func (s *server) handleNoRoute(w http.ResponseWriter, r *http.Request) {
	var allow []string
	for _, m := range []string{"GET", "POST", "PATCH", "DELETE"} {
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pattern := s.mux.Handler(r2); pattern != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) == 0 {
		writeMessage(w, http.StatusNotFound, "Not found.")
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
// built.
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

// The answers several handlers give, each written in one place.

func bodyTooLarge(w http.ResponseWriter) {
	writeMessage(w, http.StatusRequestEntityTooLarge, "The request body is too large.")
}

func deviceNotFound(w http.ResponseWriter) {
	writeMessage(w, http.StatusNotFound, "Device not found.")
}

func buttonNotFound(w http.ResponseWriter) {
	writeMessage(w, http.StatusNotFound, "Command button not found.")
}

func firmwareNotFound(w http.ResponseWriter) {
	writeMessage(w, http.StatusNotFound, "Firmware not found.")
}

// isTooBig reports whether err comes from a body past its MaxBytesReader cap.
func isTooBig(err error) bool {
	var tooBig *http.MaxBytesError
	return errors.As(err, &tooBig)
}

// serverError logs err and answers 500 without telling the client why.
func (s *server) serverError(w http.ResponseWriter, r *http.Request, err error) {
	s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	writeMessage(w, http.StatusInternalServerError, "Server Error.")
}

// fieldErrors collects validation problems per field, in order.
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

func (e *fieldErrors) ok() bool { return len(e.fields) == 0 }

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

// decodeJSON reads a JSON object body of at most maxJSONBody bytes. It
// answers 413 or 422 itself and returns false when the body is unusable.
// An empty body is an empty object.
func decodeJSON(w http.ResponseWriter, r *http.Request) (jsonBody, bool) {
	if r.ContentLength > maxJSONBody {
		bodyTooLarge(w)
		return nil, false
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxJSONBody))
	if isTooBig(err) {
		bodyTooLarge(w)
		return nil, false
	}
	if err != nil {
		writeMessage(w, http.StatusBadRequest, "The request body could not be read.")
		return nil, false
	}
	body := jsonBody{}
	if len(bytes.Trim(data, " \t\r\n")) == 0 { // JSON's white space only
		return body, true
	}
	if err := json.Unmarshal(data, &body); err != nil || body == nil {
		var e fieldErrors
		e.add("body", "must be a valid JSON object.")
		e.write(w)
		return nil, false
	}
	return body, true
}

func isNull(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

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
	if required && strings.TrimSpace(v) == "" {
		e.add(field, "is required.")
		return nil
	}
	if utf8.RuneCountInString(v) > max {
		e.add(field, "must not be greater than %d characters.", max)
		return nil
	}
	return &v
}

// object reads a field that must be a JSON object and returns it compacted
// (key order and values as sent).
func (b jsonBody) object(e *fieldErrors, field string) json.RawMessage {
	raw := b[field]
	if isNull(raw) {
		e.add(field, "is required.")
		return nil
	}
	if raw[0] != '{' {
		e.add(field, "must be a JSON object.")
		return nil
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		e.add(field, "must be a JSON object.")
		return nil
	}
	return buf.Bytes()
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

type userSummary struct {
	ID    int64  `json:"id"`
	Name  string `json:"name"`
	Email string `json:"email"`
	Role  string `json:"role"`
}

// handleLogin serves POST /v1/auth/login: email, password and token_name
// in, a new personal access token out.
func (s *server) handleLogin(w http.ResponseWriter, r *http.Request) {
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	email := body.str(&e, "email", true, 255)
	password := body.str(&e, "password", true, 1024)
	tokenName := body.str(&e, "token_name", true, 255)
	if !e.ok() {
		e.write(w)
		return
	}
	ctx := r.Context()
	key := normalizeEmail(*email) + "|" + clientIP(r)
	if wait, blocked := s.limiter.blocked(key, s.store.now()); blocked {
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(wait.Seconds()))))
		writeMessage(w, http.StatusTooManyRequests, "Too Many Attempts.")
		return
	}
	u, err := s.store.userByEmail(ctx, *email)
	if err != nil && !errors.Is(err, errNotFound) {
		s.serverError(w, r, err)
		return
	}
	var hash string
	if u != nil {
		hash = u.passwordHash
	} else {
		hash = s.dummyHash() // the same work as a real check: no user enumeration by timing
	}
	// Hash with bounded concurrency, so that a burst of logins cannot take
	// every core from the rest of the API.
	select {
	case s.hashSem <- struct{}{}:
	case <-ctx.Done():
		return
	}
	match := s.checkPassword(hash, *password)
	<-s.hashSem
	if u == nil || !match {
		s.limiter.fail(key, s.store.now())
		const msg = "The provided credentials are incorrect."
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{
			"message": msg, "errors": map[string][]string{"email": {msg}}})
		return
	}
	s.limiter.succeed(key)
	tok, err := s.store.issueToken(ctx, u.ID, *tokenName, true)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		TokenType string      `json:"token_type"`
		Token     string      `json:"token"`
		User      userSummary `json:"user"`
	}{"Bearer", tok, userSummary{u.ID, u.Name, u.Email, u.Role}})
}

// clientIP is the request's peer address. Forwarding headers are not
// trusted: behind a proxy, every client shares the proxy's address.
func clientIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// handleMe serves GET /v1/auth/me.
func (s *server) handleMe(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, dataBody{authFrom(r.Context()).user})
}

// handleLogout serves POST /v1/auth/logout: it deletes the presented token only.
func (s *server) handleLogout(w http.ResponseWriter, r *http.Request) {
	if err := s.store.deleteToken(r.Context(), authFrom(r.Context()).tokenID); err != nil {
		s.serverError(w, r, err)
		return
	}
	writeMessage(w, http.StatusOK, "Logged out.")
}

// ---- devices ----

// deviceFor loads the {uid} device of the authenticated user, answering
// 404 (the same for missing and foreign devices) when there is none.
func (s *server) deviceFor(w http.ResponseWriter, r *http.Request) (*device, bool) {
	d, err := s.store.deviceOf(r.Context(), authFrom(r.Context()).user.ID, r.PathValue("uid"))
	if errors.Is(err, errNotFound) {
		deviceNotFound(w)
		return nil, false
	}
	if err != nil {
		s.serverError(w, r, err)
		return nil, false
	}
	return d, true
}

// handleDeviceList serves GET /v1/user/devices.
func (s *server) handleDeviceList(w http.ResponseWriter, r *http.Request) {
	list, err := s.store.devicesJSON(r.Context(), authFrom(r.Context()).user.ID)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeData(w, http.StatusOK, list)
}

// handleDeviceGet serves GET /v1/user/devices/{uid}.
func (s *server) handleDeviceGet(w http.ResponseWriter, r *http.Request) {
	d, err := s.store.deviceJSON(r.Context(), authFrom(r.Context()).user.ID, r.PathValue("uid"))
	if errors.Is(err, errNotFound) {
		deviceNotFound(w)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeData(w, http.StatusOK, d)
}

// handleDeviceUpdate serves PATCH /v1/user/devices/{uid}: name and
// description; description null clears it.
func (s *server) handleDeviceUpdate(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	var name *string
	if _, present := body["name"]; present {
		name = body.str(&e, "name", true, 255)
	}
	desc := body.str(&e, "description", false, 2000)
	raw, present := body["description"]
	clearDesc := present && isNull(raw)
	if !e.ok() {
		e.write(w)
		return
	}
	j, err := s.store.updateDevice(r.Context(), authFrom(r.Context()).user.ID, d.UID, name, desc, clearDesc)
	if errors.Is(err, errNotFound) {
		deviceNotFound(w)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeData(w, http.StatusOK, j)
}

// ---- commands ----

// sendCommand publishes payload to the device if it can take commands now,
// and answers with msg. Order: offline (422), no broker (503), publish.
func (s *server) sendCommand(w http.ResponseWriter, r *http.Request, d *device, payload []byte, msg string) {
	switch d.Status {
	case "online":
	case "reconnecting":
		writeMessage(w, http.StatusUnprocessableEntity, "Device is reconnecting.")
		return
	default:
		writeMessage(w, http.StatusUnprocessableEntity, "Device is offline.")
		return
	}
	if s.link == nil || !s.link.connected() {
		writeMessage(w, http.StatusServiceUnavailable, "The device link is unavailable. Try again later.")
		return
	}
	if err := s.link.publish(d.UID, payload); err != nil {
		s.log.Warn("publish command", "uid", d.UID, "err", err)
		writeMessage(w, http.StatusServiceUnavailable, "The device link is unavailable. Try again later.")
		return
	}
	writeJSON(w, http.StatusOK, deviceMessage{msg, d.UID})
}

// handleDeviceReboot serves POST /v1/user/devices/{uid}/reboot.
func (s *server) handleDeviceReboot(w http.ResponseWriter, r *http.Request) {
	if d, ok := s.deviceFor(w, r); ok {
		s.sendCommand(w, r, d, []byte(`{"cmd":"reboot"}`), "Reboot command sent.")
	}
}

// handleDeviceWifiReset serves POST /v1/user/devices/{uid}/wifi-reset.
func (s *server) handleDeviceWifiReset(w http.ResponseWriter, r *http.Request) {
	if d, ok := s.deviceFor(w, r); ok {
		s.sendCommand(w, r, d, []byte(`{"cmd":"wifi_reset"}`), "Wi-Fi reset command sent.")
	}
}

// handleDeviceOTA serves POST /v1/user/devices/{uid}/ota: it sends the
// device a signed link to its target firmware.
func (s *server) handleDeviceOTA(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	tf := d.TargetFirmware
	if tf == nil {
		writeMessage(w, http.StatusUnprocessableEntity, "Assign firmware first to trigger OTA.")
		return
	}
	version := ""
	if tf.Version != nil {
		version = *tf.Version
	}
	cmd, err := json.Marshal(struct {
		Cmd     string `json:"cmd"`
		URL     string `json:"url"`
		MD5     string `json:"md5"`
		Size    int64  `json:"size"`
		Version string `json:"version"`
	}{"ota", s.otaURL(d.UID, tf.MD5), tf.MD5, *tf.Size, version})
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, cmd, "OTA check triggered.")
}

// handleDeviceCommand serves POST /v1/user/devices/{uid}/commands: the
// payload object is published verbatim.
func (s *server) handleDeviceCommand(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	payload := body.object(&e, "payload")
	if !e.ok() {
		e.write(w)
		return
	}
	s.sendCommand(w, r, d, payload, "Command sent.")
}

// ---- command buttons ----

var buttonIDPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// handleButtonList serves GET /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonList(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	list, err := s.store.buttonsOf(r.Context(), d.id)
	if err != nil {
		s.serverError(w, r, err)
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
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	id := body.str(&e, "id", true, 64)
	// "." and ".." would be cleaned out of the button's URLs.
	if id != nil && (!buttonIDPattern.MatchString(*id) || *id == "." || *id == "..") {
		e.add("id", "may only contain letters, digits, dots, underscores and dashes.")
	}
	label := body.str(&e, "label", true, 255)
	payload := body.object(&e, "payload")
	confirm := body.boolean(&e, "confirm")
	if !e.ok() {
		e.write(w)
		return
	}
	b := commandButton{ID: *id, Label: *label, Payload: payload, Confirm: confirm}
	err := s.store.createButton(r.Context(), d.id, b)
	if errors.Is(err, errConflict) {
		writeMessage(w, http.StatusUnprocessableEntity, "A command button with this id already exists.")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, struct {
		Message   string        `json:"message"`
		DeviceUID string        `json:"device_uid"`
		Data      commandButton `json:"data"`
	}{"Command button created.", d.UID, b})
}

// handleButtonDelete serves DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}.
func (s *server) handleButtonDelete(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	err := s.store.deleteButton(r.Context(), d.id, r.PathValue("buttonId"))
	if errors.Is(err, errNotFound) {
		buttonNotFound(w)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, deviceMessage{"Command button deleted.", d.UID})
}

// handleButtonSend serves POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send.
func (s *server) handleButtonSend(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	b, err := s.store.button(r.Context(), d.id, r.PathValue("buttonId"))
	if errors.Is(err, errNotFound) {
		buttonNotFound(w)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, b.Payload, "Command sent.")
}

// ---- firmwares ----

// handleFirmwareList serves GET /v1/user/devices/{uid}/firmwares.
func (s *server) handleFirmwareList(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	list, err := s.store.firmwaresOf(r.Context(), d.id)
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{list})
}

// handleFirmwareUpload serves POST /v1/user/devices/{uid}/firmwares, a
// multipart form with name, version, notes and file. The file is streamed
// to disk while it is hashed; it is never held in memory whole.
func (s *server) handleFirmwareUpload(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	if r.ContentLength > maxUploadBody {
		bodyTooLarge(w)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxUploadBody)
	var e fieldErrors
	mr, err := r.MultipartReader()
	if err != nil {
		e.add("file", "is required.")
		e.write(w)
		return
	}
	fields := map[string]string{}
	var md5sum string
	var size int64
	var tmpPath string
	gotFile := false
	defer func() {
		if tmpPath != "" {
			os.Remove(tmpPath)
		}
	}()
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			s.uploadReadError(w, r, err)
			return
		}
		switch name := part.FormName(); {
		case name == "file" && !gotFile:
			gotFile = true
			tmp, err := s.store.newFirmwareTemp()
			if err != nil {
				s.serverError(w, r, err)
				return
			}
			tmpPath = tmp.Name()
			var tooBig bool
			md5sum, size, tooBig, err = hashToTemp(tmp, part, maxFirmwareSize)
			tmp.Close()
			if err != nil {
				s.uploadReadError(w, r, err)
				return
			}
			if tooBig {
				// A file just over the limit is a field error; a body past
				// the request cap (read at most that far) is a 413.
				if _, err := io.Copy(io.Discard, r.Body); err != nil {
					s.uploadReadError(w, r, err)
					return
				}
				e.add("file", "must not be greater than %d kilobytes.", maxFirmwareSize>>10)
				e.write(w)
				return
			}
		case name == "name" || name == "version" || name == "notes":
			v, err := io.ReadAll(io.LimitReader(part, maxJSONBody+1))
			if err != nil {
				s.uploadReadError(w, r, err)
				return
			}
			if len(v) > maxJSONBody {
				bodyTooLarge(w)
				return
			}
			fields[name] = string(v)
		default:
			if _, err := io.Copy(io.Discard, part); err != nil {
				s.uploadReadError(w, r, err)
				return
			}
		}
	}
	form := jsonBody{}
	for k, v := range fields {
		form[k], _ = json.Marshal(v)
	}
	name := form.str(&e, "name", true, 255)
	version := form.str(&e, "version", false, 255)
	notes := form.str(&e, "notes", false, 2000)
	if !gotFile {
		e.add("file", "is required.")
	} else if size == 0 {
		e.add("file", "must not be empty.")
	}
	if !e.ok() {
		e.write(w)
		return
	}
	f, err := s.store.createFirmware(r.Context(), d.id, *name, emptyToNil(version), emptyToNil(notes), md5sum, size, tmpPath)
	if errors.Is(err, errFirmwareExists) {
		writeMessage(w, http.StatusUnprocessableEntity, "This firmware file is already uploaded.")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	tmpPath = ""
	writeJSON(w, http.StatusCreated, dataBody{f})
}

// uploadReadError answers a failure to read the upload: 413 past the
// size cap, 422 for a malformed form.
func (s *server) uploadReadError(w http.ResponseWriter, r *http.Request, err error) {
	// The multipart reader may not wrap the cap's error; the body, read
	// once more, says whether it was the cause.
	_, again := r.Body.Read(make([]byte, 1))
	if isTooBig(err) || isTooBig(again) {
		bodyTooLarge(w)
		return
	}
	s.log.Debug("bad upload", "err", err)
	var e fieldErrors
	e.add("file", "could not be read as multipart form data.")
	e.write(w)
}

func emptyToNil(s *string) *string {
	if s == nil || *s == "" {
		return nil
	}
	return s
}

// handleFirmwareUpdate serves PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}:
// name, version and notes; null or "" clears version and notes.
func (s *server) handleFirmwareUpdate(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	var u firmwareUpdate
	if _, present := body["name"]; present {
		u.name = body.str(&e, "name", true, 255)
	}
	clear := ""
	if raw, present := body["version"]; present {
		if u.version = body.str(&e, "version", false, 255); isNull(raw) {
			u.version = &clear
		}
	}
	if raw, present := body["notes"]; present {
		if u.notes = body.str(&e, "notes", false, 2000); isNull(raw) {
			u.notes = &clear
		}
	}
	if !e.ok() {
		e.write(w)
		return
	}
	f, err := s.store.updateFirmware(r.Context(), d.id, r.PathValue("firmware_id"), u)
	if errors.Is(err, errNotFound) {
		firmwareNotFound(w)
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{f})
}

// handleFirmwareDelete serves DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}.
func (s *server) handleFirmwareDelete(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	err := s.store.deleteFirmware(r.Context(), d.id, r.PathValue("firmware_id"))
	switch {
	case errors.Is(err, errNotFound):
		firmwareNotFound(w)
	case errors.Is(err, errFirmwareAssigned):
		writeMessage(w, http.StatusUnprocessableEntity, "Cannot delete firmware while it is assigned to any device.")
	case err != nil:
		s.serverError(w, r, err)
	default:
		writeMessage(w, http.StatusOK, "Firmware deleted.")
	}
}

// handleFirmwareSetTarget serves POST /v1/user/devices/{uid}/firmwares/set-target.
func (s *server) handleFirmwareSetTarget(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	body, ok := decodeJSON(w, r)
	if !ok {
		return
	}
	var e fieldErrors
	sum := body.str(&e, "md5", true, 255)
	if !e.ok() {
		e.write(w)
		return
	}
	md5sum := strings.ToLower(strings.TrimSpace(*sum))
	err := errNotFound
	if isMD5(md5sum) {
		err = s.store.setTarget(r.Context(), d.id, md5sum)
	}
	if errors.Is(err, errNotFound) {
		writeMessage(w, http.StatusUnprocessableEntity, "Firmware with the provided md5 was not found for this device.")
		return
	}
	if err != nil {
		s.serverError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Message   string `json:"message"`
		DeviceUID string `json:"device_uid"`
		MD5       string `json:"md5"`
	}{"Firmware assigned to device.", d.UID, md5sum})
}
