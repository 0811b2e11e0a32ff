package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Rollouts send one firmware to many devices in batches cut from
// device_uids in the order given. The rollout engine moves every running
// rollout on: it records how its devices' OTA commands ended, halts it past
// max_failures, and starts the current batch's devices that are online.
// All of a rollout's state is in the database, so it goes on after a
// restart where it stood.

const (
	maxRolloutDevices = 10_000
	// maxRolloutBody caps a rollout request: 10,000 uids do not fit in
	// maxJSONBody, and the list must be refused with a field error, not
	// cut off with a 413.
	maxRolloutBody = 1 << 20
	// rolloutTick is how often rollouts move on without a command result.
	rolloutTick = time.Second
	// rolloutSenders is how many OTA commands of a batch are sent at once.
	rolloutSenders = 16
)

// handleRolloutCreate serves POST /v1/user/rollouts.
func (s *server) handleRolloutCreate(w http.ResponseWriter, r *http.Request) error {
	teamID := authFrom(r.Context()).user.TeamID
	body, err := decodeJSONUpTo(w, r, maxRolloutBody)
	if err != nil {
		return err
	}
	nr, err := s.readRollout(r.Context(), teamID, body)
	if err != nil {
		return err
	}
	nr.CreatedBy = authFrom(r.Context()).user.ID
	id, err := s.store.CreateRollout(r.Context(), teamID, nr, auditOf(r.Context(), rolloutAuditDetail))
	switch {
	case errors.Is(err, store.ErrMD5OfTwoFiles):
		err = fieldError("md5", "names two different files among your firmwares (an md5 collision); delete one of them first.")
	case errors.Is(err, store.ErrPlatformMismatch):
		err = fieldError("md5", "names firmware for another platform than some of the devices.")
	case errors.Is(err, store.ErrNoDeviceMatches):
		err = fieldError("select", "matches none of your devices.")
	}
	if err != nil {
		return err
	}
	// Start the first batch now, not at the next tick; a client that goes
	// away must not stop the engine half-way through a batch.
	s.rollouts.start(context.WithoutCancel(r.Context()), teamID, id)
	return s.answerRollout(w, r, http.StatusCreated, id)
}

// readRollout validates a rollout request against the user's firmwares
// and devices.
func (s *server) readRollout(ctx context.Context, teamID int64, body jsonBody) (store.NewRollout, error) {
	var e fieldErrors
	nr := store.NewRollout{
		Name:        body.str(&e, "name", false, 255),
		BatchSize:   body.integer(&e, "batch_size", 10, 1, 1000),
		MaxFailures: body.integer(&e, "max_failures", 0, 0, math.MaxInt32), // a select may match a million
		Health:      body.readHealth(&e),
		OnHalt:      model.OnHaltStop,
	}
	if v := body.str(&e, "on_halt", false, 16); v != nil && !slices.Contains(onHalts, *v) {
		e.add("on_halt", "must be one of: %s.", strings.Join(onHalts, ", "))
	} else if v != nil {
		nr.OnHalt = *v
	}
	if sum := body.str(&e, "md5", true, 255); sum != nil {
		nr.MD5 = strings.ToLower(strings.TrimSpace(*sum))
		// Two files under the md5 is createRollout's to say, in its transaction.
		_, err := s.store.RolloutFirmware(ctx, teamID, nr.MD5)
		switch {
		case errors.Is(err, store.ErrFirmwareNotFound):
			e.add("md5", "must be the md5 of one of your firmwares.")
		case err != nil && !errors.Is(err, store.ErrMD5OfTwoFiles):
			return nr, err
		}
	}
	if body.has("select") {
		if body.has("device_uids") {
			e.add("select", "must not be given with device_uids.")
		}
		nr.Selection = body.selection(&e)
		return nr, e.err()
	}
	if err := s.readRolloutUIDs(ctx, teamID, body, &nr, &e); err != nil {
		return nr, err
	}
	return nr, e.err()
}

// selection reads a rollout's "select": an object of filterFields, each
// a string as the device list's parameter of that name takes it.
func (b jsonBody) selection(e *fieldErrors) *store.DeviceFilter {
	raw := b["select"]
	var fields map[string]json.RawMessage
	if isNull(raw) || raw[0] != '{' || json.Unmarshal(raw, &fields) != nil {
		e.add("select", "must be an object of %s.", strings.Join(filterFields, ", "))
		return nil
	}
	if hasDuplicateKey(raw, false) {
		e.add("select", "must not contain duplicate keys.")
		return nil
	}
	values := map[string]string{}
	for _, field := range slices.Sorted(maps.Keys(fields)) {
		var v string
		switch {
		case !slices.Contains(filterFields, field):
			e.add("select", "may only have the fields %s.", strings.Join(filterFields, ", "))
		case json.Unmarshal(fields[field], &v) != nil:
			e.add("select."+field, "must be a string.")
		case v == "":
			e.add("select."+field, "must not be empty.")
		default:
			values[field] = v
		}
	}
	f := readFilter(e, "select.", values)
	return &f
}

// readRolloutUIDs reads a rollout's device_uids into nr: every one a
// device of the team, none twice.
func (s *server) readRolloutUIDs(ctx context.Context, teamID int64, body jsonBody, nr *store.NewRollout, e *fieldErrors) error {
	uids := body.stringList(e, "device_uids", maxRolloutDevices)
	refs, err := s.store.DeviceRefsOf(ctx, teamID, uids)
	if err != nil {
		return err
	}
	seen := map[string]int{}
	var unknown, twice []string
	for _, uid := range uids {
		seen[uid]++
		_, known := refs[uid]
		switch {
		case seen[uid] == 2:
			twice = append(twice, uid)
		case seen[uid] == 1 && !known:
			unknown = append(unknown, uid)
		}
		nr.Devices = append(nr.Devices, refs[uid])
	}
	if len(unknown) > 0 {
		e.add("device_uids", "contains devices you do not have: %s.", quoteList(unknown))
	}
	if len(twice) > 0 {
		e.add("device_uids", "contains devices more than once: %s.", quoteList(twice))
	}
	return nil
}

// quoteList quotes up to five items, and says how many more there are.
func quoteList(items []string) string {
	var q []string
	for _, it := range items[:min(5, len(items))] {
		q = append(q, strconv.Quote(it))
	}
	if len(items) > 5 {
		q = append(q, fmt.Sprintf("and %d more", len(items)-5))
	}
	return strings.Join(q, ", ")
}

// handleRolloutList serves GET /v1/user/rollouts.
func (s *server) handleRolloutList(w http.ResponseWriter, r *http.Request) error {
	list, err := s.store.RolloutsOf(r.Context(), authFrom(r.Context()).user.TeamID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleRolloutGet serves GET /v1/user/rollouts/{id}.
func (s *server) handleRolloutGet(w http.ResponseWriter, r *http.Request) error {
	id, ok := rolloutID(r)
	if !ok {
		return store.ErrRolloutNotFound
	}
	return s.answerRollout(w, r, http.StatusOK, id)
}

// answerRollout answers with the user's rollout in detail; its devices
// are encoded as they are read (dataWriter), so that the answer costs no
// more memory for a hundred thousand devices than for ten.
func (s *server) answerRollout(w http.ResponseWriter, r *http.Request, status int, id int64) error {
	auditCommitted(r.Context()) // after a write, which has committed
	teamID := authFrom(r.Context()).user.TeamID
	dw := newDataWriter(w, status)
	err := s.store.RolloutDetail(r.Context(), teamID, id, func(ro *model.Rollout) error {
		// Created or moved: the write is done; tell the streams before
		// the answer starts.
		if r.Method == http.MethodPost {
			s.events.publish(teamID, "rollout.progress", progressOf(ro))
		}
		head, err := json.Marshal(ro) // without devices: {…}
		dw.wrap(string(head[:len(head)-1])+`,"devices":`, "}")
		return err
	}, func(d model.RolloutDevice) error { return dw.add(d) })
	var data []byte
	if err == nil {
		data, err = dw.end()
	}
	if written, err := s.finish(dw, err); written || err != nil {
		return err
	}
	writeData(w, status, data)
	return nil
}

func rolloutID(r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	return id, err == nil && id > 0
}

// rolloutMoves are the transitions a user may ask for: from which states,
// and what a refusal says.
var rolloutMoves = map[string]struct {
	from    []model.RolloutState
	to      model.RolloutState
	refusal string
}{
	"pause":  {[]model.RolloutState{model.RolloutRunning}, model.RolloutPaused, "Only a running rollout can be paused."},
	"resume": {[]model.RolloutState{model.RolloutPaused, model.RolloutHalted}, model.RolloutRunning, "Only a paused or halted rollout can be resumed."},
	"cancel": {[]model.RolloutState{model.RolloutRunning, model.RolloutPaused, model.RolloutHalted}, model.RolloutCancelled,
		"Only a running, paused or halted rollout can be cancelled."},
}

// handleRolloutMove serves POST /v1/user/rollouts/{id}/pause, …/resume
// and …/cancel.
func (s *server) handleRolloutMove(move string) apiHandler {
	m := rolloutMoves[move]
	return func(w http.ResponseWriter, r *http.Request) error {
		id, ok := rolloutID(r)
		if !ok {
			return store.ErrRolloutNotFound
		}
		// Under the rollout's lock: once a pause or cancel is answered, the
		// engine starts no device for that rollout.
		teamID := authFrom(r.Context()).user.TeamID
		moved, err := s.rollouts.move(r.Context(), teamID, id, m.from, m.to, auditOf(r.Context(), rolloutAuditDetail))
		if err != nil {
			return err
		}
		if !moved {
			return refusal(m.refusal)
		}
		if m.to == model.RolloutRunning {
			s.rollouts.start(context.WithoutCancel(r.Context()), teamID, id)
		}
		return s.answerRollout(w, r, http.StatusOK, id)
	}
}
