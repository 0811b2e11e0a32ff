package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
)

// deviceHandler serves a route of one of the user's devices, the {uid} of
// its path.
type deviceHandler func(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error

// withDevice loads the {uid} device of the authenticated user's team for
// h, or answers store.ErrDeviceNotFound (the same for missing and foreign
// devices). A write's audit entry names the device.
func (s *server) withDevice(h deviceHandler) apiHandler {
	return func(w http.ResponseWriter, r *http.Request) error {
		d, err := s.store.DeviceRefOf(r.Context(), authFrom(r.Context()).user.TeamID, r.PathValue("uid"))
		if err != nil {
			return err
		}
		noteAuditDevice(r.Context(), d.UID())
		return h(w, r, d)
	}
}

// devicePage is the team's device as Device detail JSON, rendered once and
// kept in the read cache until the next commit.
func (s *server) devicePage(ctx context.Context, teamID int64, uid string) ([]byte, error) {
	return s.store.CachedPage(ctx, store.PageKey{TeamID: teamID, UID: uid}, func() ([]byte, error) {
		return marshal(s.store.Device(ctx, teamID, uid))
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
	page, err := s.devicePage(r.Context(), authFrom(r.Context()).user.TeamID, r.PathValue("uid"))
	if err != nil {
		return err
	}
	writeData(w, http.StatusOK, page)
	return nil
}

// handleDeviceUpdate serves PATCH /v1/user/devices/{uid}: name and
// description; description null clears it.
func (s *server) handleDeviceUpdate(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	var u store.DeviceUpdate
	if body.has("name") {
		u.Name = body.str(&e, "name", true, 255)
	}
	u.Description = body.str(&e, "description", false, 2000)
	u.ClearDescription = body.has("description") && isNull(body["description"])
	if err := e.err(); err != nil {
		return err
	}
	updated, err := s.store.UpdateDevice(r.Context(), d.TeamID(), d.UID(), u, auditOf(r.Context(), func(e store.DeviceEdit) map[string]any {
		detail := map[string]any{"name": e.Device.Name, "description": e.Device.Description}
		if e.PreviousName != e.Device.Name { // the entry says what the name was
			detail["previous_name"] = e.PreviousName
		}
		return detail
	}))
	if err != nil {
		return err
	}
	s.events.deviceUpdated(r.Context(), d.TeamID(), d.UID(), "name", "description")
	writeJSON(w, http.StatusOK, dataBody{updated})
	return nil
}

// handleButtonList serves GET /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonList(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	list, err := s.store.ButtonsOf(r.Context(), d)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleButtonCreate serves POST /v1/user/devices/{uid}/command-buttons.
func (s *server) handleButtonCreate(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
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
	b := model.CommandButton{ID: *id, Label: *label, Payload: payload, Confirm: confirm}
	err = s.store.CreateButton(r.Context(), d, b, auditOf(r.Context(), func(b model.CommandButton) map[string]any {
		return map[string]any{"button_id": b.ID, "label": b.Label}
	}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, struct {
		Message   string              `json:"message"`
		DeviceUID string              `json:"device_uid"`
		Data      model.CommandButton `json:"data"`
	}{"Command button created.", d.UID(), b})
	return nil
}

// handleButtonDelete serves DELETE /v1/user/devices/{uid}/command-buttons/{buttonId}.
func (s *server) handleButtonDelete(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	err := s.store.DeleteButton(r.Context(), d, r.PathValue("buttonId"), auditOf(r.Context(), func(id string) map[string]any {
		return map[string]any{"button_id": id}
	}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, deviceMessage{"Command button deleted.", d.UID()})
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
	nd := store.NewDevice{MQTTPort: s.devicePort, Capped: true}
	// In this order, so that the answer's first message is always the same.
	for _, f := range []struct {
		name string
		key  *string
	}{{"platform", &nd.Platform}, {"board", &nd.Board}} {
		if key := body.str(&e, f.name, true, 64); key != nil && !validID(*key) {
			e.add(f.name, "may only contain letters, digits, dots, underscores and dashes.")
		} else if key != nil {
			*f.key = *key
		}
	}
	name := body.str(&e, "name", false, 255)
	description := body.str(&e, "description", false, 2000)
	if err := e.err(); err != nil {
		return err
	}
	nd.UID, nd.Name, nd.Description = store.NewDeviceUID(nd.Platform), orEmpty(name), orEmpty(description)
	ctx := r.Context()
	teamID := authFrom(ctx).user.TeamID
	noteAuditDevice(ctx, nd.UID)
	audit := auditOf(ctx, func(d *model.Device) map[string]any {
		return map[string]any{"platform": nd.Platform, "board": nd.Board, "name": d.Name}
	})
	unlock := s.loginLocks.lock(nd.UID)
	password, err := createDeviceWithLogin(ctx, s.store, s.logins, teamID, nd, audit)
	unlock()
	if err != nil {
		return err
	}
	auditCommitted(ctx)
	var creds *model.Credentials
	if s.logins != nil {
		c := model.Credentials(s.logins.Credentials(nd.UID, password))
		creds = &c
	}
	d, err := s.store.Device(ctx, teamID, nd.UID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, struct {
		Data        *model.Device      `json:"data"`
		Credentials *model.Credentials `json:"credentials"`
		Broker      model.BrokerInfo   `json:"broker"`
	}{d, creds, s.broker.of(nd.UID)})
	return nil
}

// deviceBroker is the broker as devices are told of it: its public URL
// ("" when unknown) and the topic prefix.
type deviceBroker struct{ url, prefix string }

// of is what a device uid is told of the broker.
func (b deviceBroker) of(uid string) model.BrokerInfo {
	info := model.BrokerInfo{TopicPrefix: wire.DeviceTopic(b.prefix, uid)}
	if b.url != "" {
		info.MQTTURL = &b.url
	}
	return info
}

// handleDeviceDelete serves DELETE /v1/user/devices/{uid}: the device
// with its broker login (deleteDeviceWithLogin).
func (s *server) handleDeviceDelete(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	unlock := s.loginLocks.lock(d.UID())
	_, err := deleteDeviceWithLogin(r.Context(), s.store, s.logins, d.TeamID(), d.UID(), auditOf[string](r.Context(), nil))
	unlock()
	if err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Device deleted.")
	return nil
}

// createDeviceWithLogin creates nd in the team and, when logins is not nil, its
// broker login, which it makes first, so that a broker that does not
// answer leaves nothing behind; a device that cannot be created takes
// its login with it. It returns the login's password ("" without logins).
// audit (nil: none) is made of the device as created.
func createDeviceWithLogin(ctx context.Context, st *store.Store, logins *mqttlink.Logins, teamID int64, nd store.NewDevice,
	audit store.Audit[*model.Device]) (string, error) {
	var password string
	if logins != nil {
		var err error
		if password, err = logins.Create(ctx, nd.UID); err != nil {
			return "", err
		}
	}
	if _, err := st.CreateDevice(ctx, teamID, nd, audit); err != nil {
		if logins != nil {
			err = errors.Join(err, logins.Remove(context.WithoutCancel(ctx), nd.UID))
		}
		return "", err
	}
	return password, nil
}

// deleteDeviceWithLogin deletes the team's device uid (store.ErrDeviceNotFound
// when there is none: then no broker login is touched) with its firmwares,
// buttons, commands and places in rollouts, and the firmware files no
// other device needs. Its broker login goes first, so that a broker that
// does not answer leaves the device as it was. It returns how many files
// went. audit (nil: none) is made of the uid.
func deleteDeviceWithLogin(ctx context.Context, st *store.Store, logins *mqttlink.Logins, teamID int64, uid string, audit store.Audit[string]) (files int, err error) {
	d, err := st.DeviceRefOf(ctx, teamID, uid)
	if err != nil {
		return 0, err
	}
	if logins != nil {
		if err := logins.Remove(ctx, uid); err != nil {
			return 0, err
		}
	}
	return st.DeleteDevice(ctx, d, audit)
}

// handleDeviceCredentials serves POST /v1/user/devices/{uid}/credentials:
// a new broker password; the old one is refused from the next connect.
func (s *server) handleDeviceCredentials(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	if s.logins == nil {
		return refusal("Broker logins are not managed by devicehub.")
	}
	ctx := r.Context()
	defer s.loginLocks.lock(d.UID())()
	// A delete may have gone first, while this request waited: rotate
	// would make the login it finds missing again.
	if _, err := s.store.DeviceRefOf(ctx, d.TeamID(), d.UID()); err != nil {
		return err
	}
	password, err := s.logins.Rotate(ctx, d.UID())
	if errors.Is(err, mqttlink.ErrBrokerUnavailable) || ctx.Err() != nil {
		// The request may have reached the broker, and its new password
		// may take effect later: say so, where the team can see it.
		commitAudit(ctx, map[string]any{"outcome": "unknown"})
		return errRotateUnknown
	}
	if err != nil {
		return err
	}
	commitAudit(ctx, nil)
	writeJSON(w, http.StatusOK, dataBody{model.Credentials(s.logins.Credentials(d.UID(), password))})
	return nil
}

// errRotateUnknown: a rotate the broker did not answer in time, whose new
// password may still take effect.
var errRotateUnknown = errors.New("rotate: the broker did not answer")
