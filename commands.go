package main

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"devicehub/sim"
)

// Command records: every accepted command gets an id, is
// published on P/{uid}/cmd/{id}, and moves from sent to running to an end
// as the device answers on P/{uid}/result/{id} (mqtt.go), or times out.

// maxWait is the longest ?wait= a command request may ask for.
const maxWait = 30 * time.Second

// How long a command may take to end before it is timed_out, unless
// -command-timeout and -ota-timeout say otherwise.
const (
	defaultCommandTimeout = 30 * time.Second
	defaultOTATimeout     = 15 * time.Minute
)

// The reasons the commander refuses a command.
var (
	errDeviceOffline      = errors.New("device is offline")
	errDeviceReconnecting = errors.New("device is reconnecting")
	errLinkDown           = errors.New("device link unavailable")
)

// commander issues commands to devices, waits for their ends and times
// out the ones past their deadlines. The handlers and the rollout engine
// send through it.
type commander struct {
	store *store
	link  commandLink // nil: no broker configured; commands answer 503
	ota   *otaLinks
	log   *slog.Logger
	// timeout and otaTimeout are how long a command may take to end.
	timeout, otaTimeout time.Duration
	// events hears every command it records and ends (nil: nobody).
	events *eventHub
}

// issue records c (Kind and Payload set; ID too, or a new one is drawn)
// for the device, with its audit entry, then publishes it on
// P/{uid}/cmd/{id}. A device that is not online, or no broker, is refused
// and leaves no record. The record is
// committed before the publish, so a device's answer always finds it, and
// it is removed, with its audit entry, only when the client library
// refused the publish outright: a publish whose acknowledgement is late, or whose connection
// dropped, may still reach the device (the library sends it again after a
// reconnect), so its record stays, sent, until the device answers or it
// times out.
func (cm *commander) issue(ctx context.Context, d *deviceRef, c *command) error {
	switch {
	case d.status == "reconnecting":
		return errDeviceReconnecting
	case d.status != "online":
		return errDeviceOffline
	case !cm.linkUp():
		return errLinkDown
	}
	now := cm.store.now()
	timeout := cm.timeout
	if c.Kind == "ota" {
		timeout = cm.otaTimeout
	}
	if c.ID == "" {
		c.ID = newCommandID()
	}
	c.deviceID = d.id
	c.State = "sent"
	c.CreatedAt = now.UTC().Format(timeFormat)
	c.UpdatedAt = c.CreatedAt
	c.deadline = now.Add(timeout).UTC().Format(timeFormat)
	if err := cm.store.insertCommand(c); err != nil {
		return err
	}
	// Told before the publish, so that no result can overtake it (a
	// record the client library refuses outright is deleted below, unsaid).
	cm.events.command(d.owner, d.uid, c)
	err := cm.link.publish(d.uid, c.ID, c.Payload)
	switch {
	case errors.Is(err, errNotPublished):
		if err := cm.store.deleteCommand(ctx, c); err != nil {
			cm.log.Error("delete unpublished command", "id", c.ID, "err", err)
		}
		return errLinkDown
	case err != nil:
		cm.log.Warn("command published without the broker's acknowledgement; it may still arrive",
			"uid", d.uid, "command", c.ID, "err", err)
	}
	return nil
}

// newCommandID draws a command id.
func newCommandID() string { return randomString(20, alnum) }

// await returns the command once it has ended, or as it stands when wait
// has passed or the client has gone.
func (cm *commander) await(ctx context.Context, deviceID int64, id string, wait time.Duration) (*command, error) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		changed := cm.store.commandsChanged.wait() // before the read: no change is missed
		c, err := cm.store.commandOf(ctx, deviceID, id)
		if err != nil || c.FinishedAt != nil {
			return c, err
		}
		select {
		case <-changed:
		case <-timer.C:
			return cm.store.commandOf(ctx, deviceID, id) // as it stands now
		case <-ctx.Done():
			return c, nil
		}
	}
}

// linkUp reports whether commands can be sent: a broker is configured
// and the link to it is up.
func (cm *commander) linkUp() bool { return cm.link != nil && cm.link.connected() }

// expire ends the commands past their deadline as timed_out. The link
// runs it in each sweep, after writing the results received before it
// (onSweep), so that a result that came in time is never beaten by the
// timeout.
func (cm *commander) expire(ctx context.Context) {
	ids, err := cm.store.expireCommands(ctx)
	if err != nil {
		cm.log.Error("expire commands", "err", err)
	}
	cm.events.commandsChanged(ctx, ids)
}

// otaCommand is an ota command for the device to flash firmware f, an
// uploaded firmware of that device.
func (cm *commander) otaCommand(uid string, f *firmware) (*command, error) {
	payload, err := sim.EncodeJSON(otaPayload{Cmd: "ota", URL: cm.ota.url(uid, f.MD5), MD5: f.MD5,
		SHA256: *f.SHA256, Size: *f.Size, Version: f.Version})
	return &command{Kind: "ota", Payload: payload}, err
}

// waitFor reads ?wait=, how long a command request may wait for the
// command's end: nil when absent, a 422 field error when bad.
func waitFor(r *http.Request) (*time.Duration, error) {
	if !r.URL.Query().Has("wait") {
		return nil, nil
	}
	n, err := strconv.Atoi(r.URL.Query().Get("wait"))
	if err != nil || n < 0 || time.Duration(n)*time.Second > maxWait {
		return nil, fieldError("wait", "must be an integer between 0 and %d.", int(maxWait.Seconds()))
	}
	wait := time.Duration(n) * time.Second
	return &wait, nil
}

// sendCommand issues a command and answers with msg and its id; with
// wait, once the command has ended or wait has passed.
func (s *server) sendCommand(w http.ResponseWriter, r *http.Request, d *deviceRef, wait *time.Duration, c *command, msg string) error {
	u := authFrom(r.Context()).user
	c.SentBy = &actorRef{ID: u.ID, Name: u.Name}
	c.ID = newCommandID()
	c.audit = takeAudit(r.Context(), map[string]any{"kind": c.Kind, "command_id": c.ID})
	if err := s.commands.issue(r.Context(), d, c); err != nil {
		return err
	}
	answer := commandAnswer{Message: msg, DeviceUID: d.uid, CommandID: c.ID}
	if wait != nil {
		var err error
		if answer.Command, err = s.commands.await(r.Context(), d.id, c.ID, *wait); err != nil {
			return err
		}
	}
	writeJSON(w, http.StatusOK, answer)
	return nil
}

// handleDeviceReboot serves POST /v1/user/devices/{uid}/reboot.
func (s *server) handleDeviceReboot(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	c := &command{Kind: "reboot", Payload: []byte(`{"cmd":"reboot"}`)}
	return s.sendCommand(w, r, d, wait, c, "Reboot command sent.")
}

// handleDeviceWifiReset serves POST /v1/user/devices/{uid}/wifi-reset.
func (s *server) handleDeviceWifiReset(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	c := &command{Kind: "wifi_reset", Payload: []byte(`{"cmd":"wifi_reset"}`)}
	return s.sendCommand(w, r, d, wait, c, "Wi-Fi reset command sent.")
}

// otaPayload is the payload of an ota command.
type otaPayload struct {
	Cmd     string  `json:"cmd"`
	URL     string  `json:"url"`
	MD5     string  `json:"md5"`
	SHA256  string  `json:"sha256"`
	Size    int64   `json:"size"`
	Version *string `json:"version"`
}

// handleDeviceOTA serves POST /v1/user/devices/{uid}/ota: it sends the
// device a signed link to its target firmware.
func (s *server) handleDeviceOTA(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	tf, err := s.store.targetFirmware(r.Context(), d)
	if err != nil {
		return err
	}
	c, err := s.commands.otaCommand(d.uid, tf)
	if err != nil {
		return err
	}
	return s.sendCommand(w, r, d, wait, c, "OTA check triggered.")
}

// handleDeviceCommand serves POST /v1/user/devices/{uid}/commands: the
// payload object is published verbatim.
func (s *server) handleDeviceCommand(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	payload := body.object(&e, "payload")
	if err := e.err(); err != nil {
		return err
	}
	return s.sendCommand(w, r, d, wait, &command{Kind: "custom", Payload: payload}, "Command sent.")
}

// handleButtonSend serves POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send.
func (s *server) handleButtonSend(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	b, err := s.store.button(r.Context(), d.id, r.PathValue("buttonId"))
	if err != nil {
		return err
	}
	return s.sendCommand(w, r, d, wait, &command{Kind: "button", ButtonID: &b.ID, Payload: b.Payload}, "Command sent.")
}

// handleCommandList serves GET /v1/user/devices/{uid}/commands: newest
// first, ?limit= 1–100 (25), ?before=<id> for the page after that command.
func (s *server) handleCommandList(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	q := r.URL.Query()
	limit := 25
	if q.Has("limit") {
		n, err := strconv.Atoi(q.Get("limit"))
		if err != nil || n < 1 || n > 100 {
			return fieldError("limit", "must be an integer between 1 and 100.")
		}
		limit = n
	}
	list, err := s.store.commandsOf(r.Context(), d.id, limit, q.Get("before"))
	if errors.Is(err, errCommandNotFound) {
		err = fieldError("before", "must be the id of one of this device's commands.")
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleCommandGet serves GET /v1/user/devices/{uid}/commands/{id}.
func (s *server) handleCommandGet(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	c, err := s.store.commandOf(r.Context(), d.id, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{c})
	return nil
}

// commandLink is the device link as the command engine sees it (mqtt.go).
type commandLink interface {
	connected() bool
	publish(uid, commandID string, payload []byte) error
}
