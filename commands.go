package main

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"devicehub/sim"
)

// Command records (README: Commands that report back): every accepted command gets an id, is
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

// commandAnswer is a command endpoint's 200 answer; Command only with ?wait=.
type commandAnswer struct {
	Message   string   `json:"message"`
	DeviceUID string   `json:"device_uid"`
	CommandID string   `json:"command_id"`
	Command   *command `json:"command,omitempty"`
}

// commandRequest is what every command endpoint reads first: the device
// (404 when not the user's) and ?wait= (a 422 field error when bad).
func (s *server) commandRequest(w http.ResponseWriter, r *http.Request) (d *deviceRef, wait *time.Duration, ok bool) {
	d, ok = s.deviceFor(w, r)
	if !ok {
		return nil, nil, false
	}
	if !r.URL.Query().Has("wait") {
		return d, nil, true
	}
	n, err := strconv.Atoi(r.URL.Query().Get("wait"))
	if err != nil || n < 0 || time.Duration(n)*time.Second > maxWait {
		s.writeError(w, r, fieldError("wait", "must be an integer between 0 and %d.", int(maxWait.Seconds())))
		return nil, nil, false
	}
	wd := time.Duration(n) * time.Second
	return d, &wd, true
}

// sendCommand issues a command and answers with msg and its id; with
// wait, once the command has ended or wait has passed.
func (s *server) sendCommand(w http.ResponseWriter, r *http.Request, d *deviceRef, wait *time.Duration, c *command, msg string) {
	if err := s.issueCommand(r.Context(), d, c); err != nil {
		s.writeError(w, r, err)
		return
	}
	answer := commandAnswer{Message: msg, DeviceUID: d.uid, CommandID: c.ID}
	if wait != nil {
		var err error
		if answer.Command, err = s.awaitCommand(r.Context(), d.id, c.ID, *wait); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, answer)
}

// issueCommand records c (Kind and Payload set; ID too, or a new one is
// drawn) for the device, then publishes it on P/{uid}/cmd/{id}. A device
// that is not online, or no broker, is refused and leaves no record. The
// record is committed before the publish, so a device's answer always
// finds it, and it is removed only when the client library refused the
// publish outright: a publish whose acknowledgement is late, or whose
// connection dropped, may still reach the device (the library sends it
// again after a reconnect), so its record stays, sent, until the device
// answers or it times out.
func (s *server) issueCommand(ctx context.Context, d *deviceRef, c *command) error {
	switch {
	case d.status == "reconnecting":
		return errDeviceReconnecting
	case d.status != "online":
		return errDeviceOffline
	case s.link == nil || !s.link.connected():
		return errLinkDown
	}
	now := s.store.now()
	timeout := s.commandTimeout
	if c.Kind == "ota" {
		timeout = s.otaTimeout
	}
	if c.ID == "" {
		c.ID = randomString(20, alnum)
	}
	c.deviceID = d.id
	c.State = "sent"
	c.CreatedAt = now.UTC().Format(timeFormat)
	c.UpdatedAt = c.CreatedAt
	c.deadline = now.Add(timeout).UTC().Format(timeFormat)
	if err := s.store.insertCommand(c); err != nil {
		return err
	}
	err := s.link.publish(d.uid, c.ID, c.Payload)
	switch {
	case errors.Is(err, errNotPublished):
		if err := s.store.deleteCommand(ctx, c.ID); err != nil {
			s.log.Error("delete unpublished command", "id", c.ID, "err", err)
		}
		return errLinkDown
	case err != nil:
		s.log.Warn("command published without the broker's acknowledgement; it may still arrive",
			"uid", d.uid, "command", c.ID, "err", err)
	}
	return nil
}

// awaitCommand returns the command once it has ended, or as it stands when
// wait has passed or the client has gone.
func (s *server) awaitCommand(ctx context.Context, deviceID int64, id string, wait time.Duration) (*command, error) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		changed := s.store.commandsChanged.wait() // before the read: no change is missed
		c, err := s.store.commandOf(ctx, deviceID, id)
		if err != nil || c.FinishedAt != nil {
			return c, err
		}
		select {
		case <-changed:
		case <-timer.C:
			return s.store.commandOf(ctx, deviceID, id) // as it stands now
		case <-ctx.Done():
			return c, nil
		}
	}
}

// handleDeviceReboot serves POST /v1/user/devices/{uid}/reboot.
func (s *server) handleDeviceReboot(w http.ResponseWriter, r *http.Request) {
	if d, wait, ok := s.commandRequest(w, r); ok {
		c := &command{Kind: "reboot", Payload: []byte(`{"cmd":"reboot"}`)}
		s.sendCommand(w, r, d, wait, c, "Reboot command sent.")
	}
}

// handleDeviceWifiReset serves POST /v1/user/devices/{uid}/wifi-reset.
func (s *server) handleDeviceWifiReset(w http.ResponseWriter, r *http.Request) {
	if d, wait, ok := s.commandRequest(w, r); ok {
		c := &command{Kind: "wifi_reset", Payload: []byte(`{"cmd":"wifi_reset"}`)}
		s.sendCommand(w, r, d, wait, c, "Wi-Fi reset command sent.")
	}
}

// otaPayload is the payload of an ota command (README: Devices and MQTT).
type otaPayload struct {
	Cmd     string  `json:"cmd"`
	URL     string  `json:"url"`
	MD5     string  `json:"md5"`
	SHA256  string  `json:"sha256"`
	Size    int64   `json:"size"`
	Version *string `json:"version"`
}

// otaCommand is an ota command for the device to flash firmware f, an
// uploaded firmware of that device.
func (s *server) otaCommand(uid string, f *firmware) (*command, error) {
	payload, err := sim.EncodeJSON(otaPayload{Cmd: "ota", URL: s.otaURL(uid, f.MD5), MD5: f.MD5,
		SHA256: *f.SHA256, Size: *f.Size, Version: f.Version})
	return &command{Kind: "ota", Payload: payload}, err
}

// handleDeviceOTA serves POST /v1/user/devices/{uid}/ota: it sends the
// device a signed link to its target firmware.
func (s *server) handleDeviceOTA(w http.ResponseWriter, r *http.Request) {
	d, wait, ok := s.commandRequest(w, r)
	if !ok {
		return
	}
	tf, err := s.store.targetFirmware(r.Context(), d)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	c, err := s.otaCommand(d.uid, tf)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, wait, c, "OTA check triggered.")
}

// handleDeviceCommand serves POST /v1/user/devices/{uid}/commands: the
// payload object is published verbatim.
func (s *server) handleDeviceCommand(w http.ResponseWriter, r *http.Request) {
	d, wait, ok := s.commandRequest(w, r)
	if !ok {
		return
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var e fieldErrors
	payload := body.object(&e, "payload")
	if err := e.err(); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, wait, &command{Kind: "custom", Payload: payload}, "Command sent.")
}

// handleButtonSend serves POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send.
func (s *server) handleButtonSend(w http.ResponseWriter, r *http.Request) {
	d, wait, ok := s.commandRequest(w, r)
	if !ok {
		return
	}
	b, err := s.store.button(r.Context(), d.id, r.PathValue("buttonId"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, wait, &command{Kind: "button", ButtonID: &b.ID, Payload: b.Payload}, "Command sent.")
}

// handleCommandList serves GET /v1/user/devices/{uid}/commands: newest
// first, ?limit= 1–100 (25), ?before=<id> for the page after that command.
func (s *server) handleCommandList(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	limit := 25
	if q.Has("limit") {
		n, err := strconv.Atoi(q.Get("limit"))
		if err != nil || n < 1 || n > 100 {
			s.writeError(w, r, fieldError("limit", "must be an integer between 1 and 100."))
			return
		}
		limit = n
	}
	list, err := s.store.commandsOf(r.Context(), d.id, limit, q.Get("before"))
	if errors.Is(err, errCommandNotFound) {
		err = fieldError("before", "must be the id of one of this device's commands.")
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{list})
}

// handleCommandGet serves GET /v1/user/devices/{uid}/commands/{id}.
func (s *server) handleCommandGet(w http.ResponseWriter, r *http.Request) {
	d, ok := s.deviceFor(w, r)
	if !ok {
		return
	}
	c, err := s.store.commandOf(r.Context(), d.id, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, dataBody{c})
}
