package main

import (
	"context"
	"encoding/json"
	"net/http"
)

// deviceHandler serves a route of one of the user's devices, the {uid} of
// its path.
type deviceHandler func(w http.ResponseWriter, r *http.Request, d *deviceRef) error

// withDevice loads the {uid} device of the authenticated user's team for
// h, or answers errDeviceNotFound (the same for missing and foreign
// devices). A write's audit entry names the device.
func (s *server) withDevice(h deviceHandler) apiHandler {
	return func(w http.ResponseWriter, r *http.Request) error {
		d, err := s.store.deviceRefOf(r.Context(), authFrom(r.Context()).user.teamID, r.PathValue("uid"))
		if err != nil {
			return err
		}
		noteAudit(r.Context(), d.uid, nil)
		return h(w, r, d)
	}
}

// devicePage is the user's device as Device detail JSON, rendered once and
// kept in the read cache until the next commit.
func (s *server) devicePage(ctx context.Context, userID int64, uid string) ([]byte, error) {
	return s.store.cachedPage(ctx, pageKey{userID, uid}, func() ([]byte, error) {
		return marshal(s.store.device(ctx, userID, uid))
	})
}

// marshal encodes what a store read returned, or passes on its error.
func marshal[T any](v T, err error) ([]byte, error) {
	if err != nil {
		return nil, err
	}
	return json.Marshal(v)
}

// handleDeviceGet serves GET /v1/user/devices/{uid}.
func (s *server) handleDeviceGet(w http.ResponseWriter, r *http.Request) error {
	page, err := s.devicePage(r.Context(), authFrom(r.Context()).user.teamID, r.PathValue("uid"))
	if err != nil {
		return err
	}
	writeData(w, http.StatusOK, page)
	return nil
}

// handleDeviceUpdate serves PATCH /v1/user/devices/{uid}: name and
// description; description null clears it.
func (s *server) handleDeviceUpdate(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	var u deviceUpdate
	if body.has("name") {
		u.name = body.str(&e, "name", true, 255)
	}
	u.description = body.str(&e, "description", false, 2000)
	u.clearDescription = body.has("description") && isNull(body["description"])
	if err := e.err(); err != nil {
		return err
	}
	updated, err := s.store.updateDevice(r.Context(), d.owner, d.uid, u)
	if err != nil {
		return err
	}
	s.events.deviceUpdated(r.Context(), d.owner, d.uid, "name", "description")
	noteAudit(r.Context(), "", map[string]any{"name": updated.Name, "description": updated.Description})
	writeJSON(w, http.StatusOK, dataBody{updated})
	return nil
}

// handleButtonList serves GET /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonList(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	list, err := s.store.buttonsOf(r.Context(), d.id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleButtonCreate serves POST /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonCreate(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
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
		return err
	}
	b := commandButton{ID: *id, Label: *label, Payload: payload, Confirm: confirm}
	if err := s.store.createButton(r.Context(), d.id, b); err != nil {
		return err
	}
	noteAudit(r.Context(), "", map[string]any{"button_id": b.ID, "label": b.Label})
	writeJSON(w, http.StatusCreated, struct {
		Message   string        `json:"message"`
		DeviceUID string        `json:"device_uid"`
		Data      commandButton `json:"data"`
	}{"Command button created.", d.uid, b})
	return nil
}

// handleButtonDelete serves DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}.
func (s *server) handleButtonDelete(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	if err := s.store.deleteButton(r.Context(), d.id, r.PathValue("buttonId")); err != nil {
		return err
	}
	noteAudit(r.Context(), "", map[string]any{"button_id": r.PathValue("buttonId")})
	writeJSON(w, http.StatusOK, deviceMessage{"Command button deleted.", d.uid})
	return nil
}

// handleDeviceCreate serves POST /v1/user/devices: a pending device of the
// team and, with -mqtt-dynsec, its broker login, made first so that a
// broker that does not answer leaves nothing behind.
func (s *server) handleDeviceCreate(w http.ResponseWriter, r *http.Request) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	nd := newDevice{mqttPort: s.devicePort}
	for field, v := range map[string]*string{"platform": &nd.platform, "board": &nd.board} {
		if key := body.str(&e, field, true, 64); key != nil && !validID(*key) {
			e.add(field, "may only contain letters, digits, dots, underscores and dashes.")
		} else if key != nil {
			*v = *key
		}
	}
	name := body.str(&e, "name", false, 255)
	description := body.str(&e, "description", false, 2000)
	if err := e.err(); err != nil {
		return err
	}
	nd.uid, nd.name, nd.description = newDeviceUID(nd.platform), orEmpty(name), orEmpty(description)
	ctx := r.Context()
	var creds *credentials
	if s.logins != nil {
		if creds, err = s.issueLogin(ctx, nd.uid, s.logins.create); err != nil {
			return err
		}
	}
	teamID := authFrom(ctx).user.teamID
	if _, err := s.store.createDevice(ctx, teamID, nd); err != nil {
		if creds != nil {
			if err := s.logins.remove(context.WithoutCancel(ctx), nd.uid); err != nil {
				s.log.Error("remove the broker login of a device not created", "uid", nd.uid, "err", err)
			}
		}
		return err
	}
	d, err := s.store.device(ctx, teamID, nd.uid)
	if err != nil {
		return err
	}
	noteAudit(ctx, nd.uid, map[string]any{"platform": nd.platform, "board": nd.board, "name": d.Name})
	writeJSON(w, http.StatusCreated, struct {
		Data        *device      `json:"data"`
		Credentials *credentials `json:"credentials"`
	}{d, creds})
	return nil
}

// handleDeviceDelete serves DELETE /v1/user/devices/{uid}: its broker
// login first, then the device with its firmwares, buttons, commands and
// places in rollouts, and the firmware files no other device needs.
func (s *server) handleDeviceDelete(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	if s.logins != nil {
		if err := s.logins.remove(r.Context(), d.uid); err != nil {
			return err
		}
	}
	if _, err := s.store.deleteDevice(r.Context(), d.uid); err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Device deleted.")
	return nil
}

// issueLogin runs issue, the broker's create or rotate, for the device
// uid, and returns its new credentials.
func (s *server) issueLogin(ctx context.Context, uid string, issue func(context.Context, string) (string, error)) (*credentials, error) {
	password, err := issue(ctx, uid)
	if err != nil {
		return nil, err
	}
	creds := s.logins.credentials(uid, password)
	return &creds, nil
}

// handleDeviceCredentials serves POST /v1/user/devices/{uid}/credentials:
// a new broker password; the old one is refused from the next connect.
func (s *server) handleDeviceCredentials(w http.ResponseWriter, r *http.Request, d *deviceRef) error {
	if s.logins == nil {
		return refusal("Broker logins are not managed by devicehub.")
	}
	creds, err := s.issueLogin(r.Context(), d.uid, s.logins.rotate)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{creds})
	return nil
}
