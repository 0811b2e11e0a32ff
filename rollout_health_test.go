package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"devicehub/internal/mqttlink"
)

// healthRollout is a rollout env of 4 online devices whose OTA commands
// go to a recording link, and a link that applies what they say.
type healthRollout struct {
	*rolloutEnv
	link *mqttlink.Offline
}

func newHealthRollout(t *testing.T) *healthRollout {
	t.Helper()
	e := &rolloutEnv{testEnv: newTestEnv(t, &recordingLink{}), img: newOTAImage(11, rolloutImageSize), bobImg: newOTAImage(12, rolloutImageSize)}
	e.uids = append([]string{e.alice.device}, e.addDevices(e.alice, 3)...)
	e.uploadImage(e.alice, e.alice.device, e.img, "fw", "2.0")
	h := &healthRollout{e, newOfflineLink(e.st, e.log)}
	for _, uid := range e.uids {
		tell(e.testEnv, h.link, uid, "status", "online")
	}
	return h
}

// flash has the devices report the rollout's image after its reboot:
// their OTA commands succeed.
func (h *healthRollout) flash(uids ...string) {
	for _, uid := range uids {
		tell(h.testEnv, h.link, uid, "telemetry", `{"fw_md5":"`+h.img.md5+`","reset_reason":"sw","uptime_s":2}`)
	}
}

// states moves the rollout on once and returns it.
func (h *healthRollout) states(id int64) rollout {
	h.srv.rollouts.advance(context.Background())
	return h.rollout(h.alice, id)
}

// TestRolloutHaltsOnHealth: a rollout whose updated devices crash on the
// new firmware halts, with halt_reason kind health and its figures,
// before its next batch; crashes below min_crashes do not halt it, and a
// batch is watched before the next starts.
func TestRolloutHaltsOnHealth(t *testing.T) {
	t.Parallel()
	h := newHealthRollout(t)
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids, "batch_size": 2,
		"health": map[string]any{"max_crash_rate": 1, "min_crashes": 2, "watch_minutes": 30}})
	if r.Health == nil || *r.Health != (rolloutHealth{1, 2, 30}) || string(r.HaltReason) != "null" {
		t.Fatalf("created: health %+v, halt_reason %s", r.Health, r.HaltReason)
	}
	h.flash(h.uids[0], h.uids[1])
	if v := h.states(r.ID); fmt.Sprint(v.deviceStates()) != fmt.Sprint(map[string]string{
		h.uids[0]: "succeeded", h.uids[1]: "succeeded", h.uids[2]: "pending", h.uids[3]: "pending"}) {
		t.Fatalf("first batch flashed, watched: %v", v.deviceStates())
	}
	h.clock.advance(5 * time.Minute)
	tell(h.testEnv, h.link, h.uids[0], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
	if v := h.states(r.ID); v.State != "running" {
		t.Fatalf("after one crash (min_crashes 2): %s", v.State)
	}
	tell(h.testEnv, h.link, h.uids[1], "telemetry", `{"reset_reason":"task_wdt","uptime_s":1}`)
	v := h.states(r.ID)
	// 2 crashes in 2 devices × 5 minutes (0.006944 device-days): 288 a day.
	want := `{"kind":"health","crashes":2,"device_days":0.006944,"rate":288,"limit":1}`
	if v.State != "halted" || !jsonEqual(t, v.HaltReason, []byte(want)) {
		t.Errorf("after two crashes: state %s, halt_reason %s; want halted, %s", v.State, v.HaltReason, want)
	}
	if s := v.deviceStates(); s[h.uids[2]] != "pending" || s[h.uids[3]] != "pending" {
		t.Errorf("the second batch: %v, want never started", s)
	}
	h.clock.advance(time.Hour)
	if v := h.states(r.ID); v.State != "halted" || v.deviceStates()[h.uids[2]] != "pending" {
		t.Errorf("an hour later: %s %v", v.State, v.deviceStates())
	}
}

// TestRolloutHealthyCompletes: with a health gate and healthy devices
// (a crash of a device not updated by it does not count), each batch is
// watched for watch_minutes, then the next starts, and the rollout
// completes after its last batch's watch.
func TestRolloutHealthyCompletes(t *testing.T) {
	t.Parallel()
	h := newHealthRollout(t)
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids[:3], "batch_size": 2,
		"health": map[string]any{"max_crash_rate": 1}})
	if *r.Health != (rolloutHealth{1, 2, 60}) {
		t.Errorf("defaults: %+v, want min_crashes 2, watch_minutes 60", *r.Health)
	}
	for range 3 { // not in the rollout
		tell(h.testEnv, h.link, h.uids[3], "telemetry", `{"fw_md5":"`+h.img.md5+`","reset_reason":"panic"}`)
		h.clock.advance(2 * time.Minute)
	}
	h.flash(h.uids[0], h.uids[1])
	h.clock.advance(59 * time.Minute)
	if v := h.states(r.ID); v.deviceStates()[h.uids[2]] != "pending" {
		t.Fatalf("59 minutes into the watch: %v", v.deviceStates())
	}
	h.clock.advance(time.Minute)
	if v := h.states(r.ID); v.deviceStates()[h.uids[2]] != "running" {
		t.Fatalf("after the watch: %v, want the second batch running", v.deviceStates())
	}
	h.flash(h.uids[2])
	if v := h.states(r.ID); v.State != "running" {
		t.Fatalf("the last batch flashed: %s, want running while it is watched", v.State)
	}
	h.clock.advance(time.Hour)
	if v := h.states(r.ID); v.State != "completed" || string(v.HaltReason) != "null" {
		t.Errorf("after the last watch: %s %s, want completed without a halt_reason", v.State, v.HaltReason)
	}
}

// TestRolloutWatchedBatchReachesStreams: a device of a batch that the
// health gate watches, once updated, reaches the streams as
// rollout.progress, although no next batch starts to tell them.
func TestRolloutWatchedBatchReachesStreams(t *testing.T) {
	t.Parallel()
	h := newHealthRollout(t)
	s := openStream(t, serveEnv(t, h.testEnv, requestReadTimeout, 0), h.alice.token, "")
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids[:2], "batch_size": 1,
		"health": map[string]any{"max_crash_rate": 1}})
	h.flash(h.uids[0])
	if v := h.states(r.ID); v.Counts["succeeded"] != 1 || v.Counts["pending"] != 1 {
		t.Fatalf("counts %v, want the first device succeeded and the second pending", v.Counts)
	}
	h.srv.events.publish(h.alice.id, "test", "after the engine's pass")
	var seen []any
	for ev := s.next(t); ev.kind != "test"; ev = s.next(t) {
		if ev.kind == "rollout.progress" {
			seen = append(seen, ev.data["counts"].(map[string]any)["succeeded"])
		}
	}
	if len(seen) == 0 || seen[len(seen)-1] != 1.0 {
		t.Errorf("rollout.progress succeeded counts %v, want the last 1", seen)
	}
}

// TestRolloutHealthRejected: the health gate's fields are checked.
func TestRolloutHealthRejected(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 1)
	for _, tt := range []struct {
		health any
		field  string
	}{
		{"strict", "health"},
		{map[string]any{}, "health.max_crash_rate"},
		{map[string]any{"max_crash_rate": 0}, "health.max_crash_rate"},
		{map[string]any{"max_crash_rate": "1"}, "health.max_crash_rate"},
		{map[string]any{"max_crash_rate": 1, "min_crashes": 0}, "health.min_crashes"},
		{map[string]any{"max_crash_rate": 1, "watch_minutes": 1441}, "health.watch_minutes"},
		{map[string]any{"max_crash_rate": 1, "watch_minutes": -1}, "health.watch_minutes"},
		{map[string]any{"max_crash_rate": 1, "extra": 1}, "health"},
	} {
		w := e.request("POST", "/v1/user/rollouts", e.alice.token, map[string]any{"md5": e.img.md5, "device_uids": e.uids, "health": tt.health})
		var body struct{ Errors map[string][]string }
		json.Unmarshal(w.Body.Bytes(), &body)
		if w.Code != http.StatusUnprocessableEntity || body.Errors[tt.field] == nil {
			t.Errorf("health %v: got %d %s, want a 422 on %s", tt.health, w.Code, w.Body, tt.field)
		}
	}
	wantDB(t, e.st, "0", `SELECT count(*) FROM rollouts`)
}
