package main

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"errors"
	"net/http"
	"time"
)

// Command records: every accepted command gets an id, is
// published on P/{uid}/cmd/{id}, and moves from sent to running to an end
// as the device answers on P/{uid}/result/{id} (internal/mqttlink), or times out.

// maxWait is the longest ?wait= a command request may ask for.
const maxWait = 30 * time.Second

// waitFor reads ?wait=, how long a command request may wait for the
// command's end: nil when absent, a 422 field error when bad.
func waitFor(r *http.Request) (*time.Duration, error) {
	if !r.URL.Query().Has("wait") {
		return nil, nil
	}
	var e fieldErrors
	n := intField(&e, "wait", r.URL.Query().Get("wait"), 0, int(maxWait/time.Second))
	if err := e.err(); err != nil {
		return nil, err
	}
	wait := time.Duration(n) * time.Second
	return &wait, nil
}

// sendCommand issues a command and answers with msg and its id; with
// wait, once the command has ended or wait has passed.
func (s *server) sendCommand(w http.ResponseWriter, r *http.Request, d *store.DeviceRef, wait *time.Duration, c *model.Command, msg string) error {
	u := authFrom(r.Context()).user
	c.SentBy = &model.ActorRef{ID: u.ID, Name: u.Name}
	c.ID = newCommandID()
	audit := takeAudit(r.Context(), map[string]any{"kind": c.Kind, "command_id": c.ID})
	if err := s.commands.issue(r.Context(), d, c, audit); err != nil {
		return err
	}
	auditCommitted(r.Context())
	answer := model.CommandAnswer{Message: msg, DeviceUID: d.UID(), CommandID: c.ID}
	if wait != nil {
		var err error
		if answer.Command, err = s.commands.await(r.Context(), d, c.ID, *wait); err != nil {
			return err
		}
	}
	writeJSON(w, http.StatusOK, answer)
	return nil
}

// handleDeviceReboot serves POST /v1/user/devices/{uid}/reboot.
func (s *server) handleDeviceReboot(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	c := &model.Command{Kind: model.KindReboot, Payload: []byte(`{"cmd":"reboot"}`)}
	return s.sendCommand(w, r, d, wait, c, "Reboot command sent.")
}

// handleDeviceWifiReset serves POST /v1/user/devices/{uid}/wifi-reset.
func (s *server) handleDeviceWifiReset(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	c := &model.Command{Kind: model.KindWifiReset, Payload: []byte(`{"cmd":"wifi_reset"}`)}
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
func (s *server) handleDeviceOTA(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	tf, err := s.store.TargetFirmware(r.Context(), d)
	if err != nil {
		return err
	}
	c, err := s.commands.otaCommand(d.UID(), tf)
	if err != nil {
		return err
	}
	return s.sendCommand(w, r, d, wait, c, "OTA check triggered.")
}

// handleDeviceCommand serves POST /v1/user/devices/{uid}/commands: the
// payload object is published verbatim.
func (s *server) handleDeviceCommand(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
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
	return s.sendCommand(w, r, d, wait, &model.Command{Kind: model.KindCustom, Payload: payload}, "Command sent.")
}

// handleButtonSend serves POST /v1/user/devices/{uid}/command-buttons/{buttonId}/send.
func (s *server) handleButtonSend(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	wait, err := waitFor(r)
	if err != nil {
		return err
	}
	b, err := s.store.Button(r.Context(), d, r.PathValue("buttonId"))
	if err != nil {
		return err
	}
	return s.sendCommand(w, r, d, wait, &model.Command{Kind: model.KindButton, ButtonID: &b.ID, Payload: b.Payload}, "Command sent.")
}

// handleCommandList serves GET /v1/user/devices/{uid}/commands: newest
// first, ?limit= 1–100 (25), ?before=<id> for the page after that command.
func (s *server) handleCommandList(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	q := r.URL.Query()
	var e fieldErrors
	limit := historyLimit(&e, q)
	if err := e.err(); err != nil {
		return err
	}
	list, err := s.store.CommandsOf(r.Context(), d, limit, q.Get("before"))
	if errors.Is(err, store.ErrCommandNotFound) {
		err = fieldError("before", "must be the id of one of this device's commands.")
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleCommandGet serves GET /v1/user/devices/{uid}/commands/{id}.
func (s *server) handleCommandGet(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	c, err := s.store.CommandOf(r.Context(), d, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{c})
	return nil
}
