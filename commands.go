package main

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"
)

// Command records (CONTRACT §6): every accepted command gets an id, is
// published on P/{uid}/cmd/{id}, and moves from sent to running to an end
// as the device answers on P/{uid}/result/{id} (mqtt.go), or times out.

// maxWait is the longest ?wait= a command request may ask for.
const maxWait = 30 * time.Second

// commandAnswer is a command endpoint's 200 answer; Command only with ?wait=.
type commandAnswer struct {
	Message   string   `json:"message"`
	DeviceUID string   `json:"device_uid"`
	CommandID string   `json:"command_id"`
	Command   *command `json:"command,omitempty"`
}

// commandRequest is what every command endpoint reads first: the device
// (404 when not the user's) and ?wait= (a 422 field error when bad).
func (s *server) commandRequest(w http.ResponseWriter, r *http.Request) (d *device, wait *time.Duration, ok bool) {
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

// sendCommand records a command of that kind for the device, publishes it
// and answers with msg and its id; with wait, once it has ended or wait
// has passed. A command the device cannot take now leaves no record:
// a device that is not online is a 422, no broker a 503.
func (s *server) sendCommand(w http.ResponseWriter, r *http.Request, d *device, wait *time.Duration, c *command, msg string) {
	switch {
	case d.Status == "reconnecting":
		s.writeError(w, r, errDeviceReconnecting)
		return
	case d.Status != "online":
		s.writeError(w, r, errDeviceOffline)
		return
	case s.link == nil || !s.link.connected():
		s.writeError(w, r, errLinkDown)
		return
	}
	now := s.store.now()
	timeout := s.commandTimeout
	if c.Kind == "ota" {
		timeout = s.otaTimeout
	}
	c.ID = randomString(20, alnum)
	c.deviceID = d.id
	c.State = "sent"
	c.CreatedAt = now.UTC().Format(timeFormat)
	c.UpdatedAt = c.CreatedAt
	c.deadline = now.Add(timeout).UTC().Format(timeFormat)
	if err := s.store.insertCommand(c); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.link.publish(d.UID, c.ID, c.Payload); err != nil {
		s.log.Warn("publish command", "uid", d.UID, "err", err)
		if err := s.store.deleteCommand(r.Context(), c.ID); err != nil {
			s.log.Error("delete unpublished command", "id", c.ID, "err", err)
		}
		s.writeError(w, r, errLinkDown)
		return
	}
	answer := commandAnswer{Message: msg, DeviceUID: d.UID, CommandID: c.ID}
	if wait != nil {
		var err error
		if answer.Command, err = s.awaitCommand(r.Context(), d.id, c.ID, *wait); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, answer)
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
			return c, nil
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

// otaCommand is the payload of an ota command (CONTRACT §4).
type otaCommand struct {
	Cmd     string  `json:"cmd"`
	URL     string  `json:"url"`
	MD5     string  `json:"md5"`
	Size    int64   `json:"size"`
	Version *string `json:"version"`
}

// handleDeviceOTA serves POST /v1/user/devices/{uid}/ota: it sends the
// device a signed link to its target firmware.
func (s *server) handleDeviceOTA(w http.ResponseWriter, r *http.Request) {
	d, wait, ok := s.commandRequest(w, r)
	if !ok {
		return
	}
	tf := d.TargetFirmware
	if tf == nil {
		s.writeError(w, r, errNoTarget)
		return
	}
	payload, err := deviceJSON(otaCommand{Cmd: "ota", URL: s.otaURL(d.UID, tf.MD5), MD5: tf.MD5, Size: *tf.Size, Version: tf.Version})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.sendCommand(w, r, d, wait, &command{Kind: "ota", Payload: payload}, "OTA check triggered.")
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
