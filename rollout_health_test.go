package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// healthRollout is a rollout env of 4 online devices whose OTA commands
// go to a recording link, and a link that applies what they say.
type healthRollout struct {
	*rolloutEnv
	link *mqttlink.Offline
	sent *recordingLink // the OTA commands sent
}

func newHealthRollout(t *testing.T) *healthRollout {
	t.Helper()
	sent := &recordingLink{}
	e := &rolloutEnv{testEnv: newTestEnv(t, sent), img: newOTAImage(11, rolloutImageSize), bobImg: newOTAImage(12, rolloutImageSize)}
	e.uids = append([]string{e.alice.device}, e.addDevices(e.alice, 3)...)
	e.uploadImage(e.alice, e.alice.device, e.img, "fw", "2.0")
	h := &healthRollout{e, newOfflineLink(e.st, e.log), sent}
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
func (h *healthRollout) states(id int64) model.Rollout {
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
	if r.Health == nil || *r.Health != (model.RolloutHealth{MaxCrashRate: 1, MinCrashes: 2, WatchMinutes: 30}) || string(r.HaltReason) != "null" {
		t.Fatalf("created: health %+v, halt_reason %s", r.Health, r.HaltReason)
	}
	h.flash(h.uids[0], h.uids[1])
	if v := h.states(r.ID); fmt.Sprint(stateOfDevice(v)) != fmt.Sprint(map[string]string{
		h.uids[0]: "succeeded", h.uids[1]: "succeeded", h.uids[2]: "pending", h.uids[3]: "pending"}) {
		t.Fatalf("first batch flashed, watched: %v", stateOfDevice(v))
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
	if s := stateOfDevice(v); s[h.uids[2]] != "pending" || s[h.uids[3]] != "pending" {
		t.Errorf("the second batch: %v, want never started", s)
	}
	h.clock.advance(time.Hour)
	if v := h.states(r.ID); v.State != "halted" || stateOfDevice(v)[h.uids[2]] != "pending" {
		t.Errorf("an hour later: %s %v", v.State, stateOfDevice(v))
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
	if *r.Health != (model.RolloutHealth{MaxCrashRate: 1, MinCrashes: 2, WatchMinutes: 60}) {
		t.Errorf("defaults: %+v, want min_crashes 2, watch_minutes 60", *r.Health)
	}
	for range 3 { // not in the rollout
		tell(h.testEnv, h.link, h.uids[3], "telemetry", `{"fw_md5":"`+h.img.md5+`","reset_reason":"panic"}`)
		h.clock.advance(2 * time.Minute)
	}
	h.flash(h.uids[0], h.uids[1])
	h.clock.advance(59 * time.Minute)
	if v := h.states(r.ID); stateOfDevice(v)[h.uids[2]] != "pending" {
		t.Fatalf("59 minutes into the watch: %v", stateOfDevice(v))
	}
	h.clock.advance(time.Minute)
	if v := h.states(r.ID); stateOfDevice(v)[h.uids[2]] != "running" {
		t.Fatalf("after the watch: %v, want the second batch running", stateOfDevice(v))
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

// haltForHealth has the rollout of h's four devices (batch_size 2, a
// health gate watching 30 minutes) halt for health after its first
// batch, each device having targeted old before; it returns the rollout.
func (h *healthRollout) haltForHealth(old otaImage) model.Rollout {
	h.t.Helper()
	for _, uid := range h.uids {
		h.uploadImage(h.alice, uid, old, "fw", "1.0")
		h.setTarget(testUser{id: h.alice.id, device: uid, token: h.alice.token}, old.md5)
	}
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids, "batch_size": 2,
		"health": map[string]any{"max_crash_rate": 1, "min_crashes": 2, "watch_minutes": 30}})
	h.flash(h.uids[0], h.uids[1])
	h.clock.advance(5 * time.Minute)
	tell(h.testEnv, h.link, h.uids[0], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
	tell(h.testEnv, h.link, h.uids[1], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
	if v := h.states(r.ID); v.State != "halted" {
		h.t.Fatalf("after two crashes: %s, want halted", v.State)
	}
	return r
}

// targets lists the md5 each of h's devices targets, in order.
func (h *healthRollout) targets() string {
	h.t.Helper()
	var got []string
	for _, uid := range h.uids {
		got = append(got, scalar(h.t, h.st, `SELECT f.md5 FROM devices d JOIN firmwares f ON f.id = d.target_firmware_id WHERE d.uid = ?`, uid))
	}
	return strings.Join(got, " ")
}

// TestRolloutHaltedResumeOrCancel: a rollout makes its firmware a
// device's target only when it sends that device the OTA, so the devices
// a rollout halted for health never reached keep their earlier target;
// the halted rollout can be cancelled (200: those devices skipped, their
// targets kept) or resumed (200: its health gate counts from the resume,
// so the crashes it halted on do not halt it again, and its next batch
// goes out after the watch, taking the firmware as target).
func TestRolloutHaltedResumeOrCancel(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		move        string
		state       model.RolloutState
		devices     string // the devices' states once moved, and after the watch
		later       string
		targetLater string // whose target is the new firmware after the watch: n new, o old
	}{
		{"cancel", "cancelled", "succeeded succeeded skipped skipped", "succeeded succeeded skipped skipped", "n n o o"},
		{"resume", "running", "succeeded succeeded pending pending", "succeeded succeeded running running", "n n n n"},
	} {
		t.Run(tt.move, func(t *testing.T) {
			t.Parallel()
			h := newHealthRollout(t)
			old := newOTAImage(13, rolloutImageSize)
			r := h.haltForHealth(old)
			want := func(when, targets string) {
				t.Helper()
				targets = strings.NewReplacer("n", h.img.md5, "o", old.md5).Replace(targets)
				if got := h.targets(); got != targets {
					t.Errorf("%s: targets %s, want %s", when, got, targets)
				}
			}
			want("halted", "n n o o")
			sent := len(h.sent.take())

			h.clock.advance(time.Minute)
			resumedAt := h.st.Timestamp()
			w := h.want(t, http.StatusOK, "POST", fmt.Sprintf("/v1/user/rollouts/%d/%s", r.ID, tt.move), h.alice.token, nil)
			v := decodeRollout(t, w.Body.Bytes())
			if v.State != tt.state || string(v.HaltReason) != "null" || ordered(h.uids, stateOfDevice(v)) != tt.devices {
				t.Errorf("%s: state %s, halt_reason %s, devices %s; want %s, null, %s", tt.move, v.State, v.HaltReason,
					ordered(h.uids, stateOfDevice(v)), tt.state, tt.devices)
			}
			wantDB(t, h.st, string(tt.state)+" "+map[bool]string{true: resumedAt, false: "NULL"}[tt.move == "resume"],
				`SELECT state || ' ' || COALESCE(gate_from, 'NULL') FROM rollouts WHERE id = ?`, r.ID)
			wantDB(t, h.st, tt.devices, `SELECT group_concat(state, ' ' ORDER BY position) FROM rollout_devices WHERE rollout_id = ?`, r.ID)
			want(tt.move, "n n o o")

			h.clock.advance(30 * time.Minute) // the first batch's watch ends
			v = h.states(r.ID)
			if v.State != tt.state || ordered(h.uids, stateOfDevice(v)) != tt.later {
				t.Errorf("after the watch: %s %s, want %s %s", v.State, ordered(h.uids, stateOfDevice(v)), tt.state, tt.later)
			}
			want("after the watch", tt.targetLater)
			if got := len(h.sent.take()); got != strings.Count(tt.targetLater, "n")-2 {
				t.Errorf("after the watch: %d more OTA commands sent (%d before)", got, sent)
			}
		})
	}
}

// ordered lists the states of uids, in order.
func ordered(uids []string, states map[string]model.RolloutDeviceState) string {
	var s []string
	for _, uid := range uids {
		s = append(s, string(states[uid]))
	}
	return strings.Join(s, " ")
}

// TestRolloutResumedAfterFailures: a rollout halted past max_failures,
// resumed, counts its failures from the resume: the failure it halted on
// does not halt it again, the next one does.
func TestRolloutResumedAfterFailures(t *testing.T) {
	t.Parallel()
	h := newHealthRollout(t)
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids[:2], "batch_size": 2})
	fail := func(uid string) {
		t.Helper()
		mustExec(t, h.st, `UPDATE commands SET state = 'failed', finished_at = updated_at
			WHERE id = (SELECT rd.command_id FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id WHERE d.uid = ?)`, uid)
	}
	fail(h.uids[0])
	if v := h.states(r.ID); v.State != "halted" || !jsonEqual(t, v.HaltReason, []byte(`{"kind":"failures","failed":1,"limit":0}`)) {
		t.Fatalf("after a failure: %s %s, want halted for failures", v.State, v.HaltReason)
	}
	h.MoveRollout(h.alice, r.ID, "resume", "running")
	wantDB(t, h.st, "running 1", `SELECT state || ' ' || failures_before FROM rollouts WHERE id = ?`, r.ID)
	if v := h.states(r.ID); v.State != "running" || stateOfDevice(v)[h.uids[1]] != "running" {
		t.Fatalf("resumed: %s %v, want running on", v.State, stateOfDevice(v))
	}
	fail(h.uids[1])
	if v := h.states(r.ID); v.State != "halted" || !jsonEqual(t, v.HaltReason, []byte(`{"kind":"failures","failed":1,"limit":0}`)) {
		t.Errorf("a failure after the resume: %s %s, want halted again", v.State, v.HaltReason)
	}
}

// TestRolloutHealthStatus: a rollout's detail says where its health gate
// stands: the crashes it counts, and the batch it watches while the
// next waits for the watch, until when; none once the next batch runs.
func TestRolloutHealthStatus(t *testing.T) {
	t.Parallel()
	h := newHealthRollout(t)
	r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids, "batch_size": 2,
		"health": map[string]any{"max_crash_rate": 100, "min_crashes": 2, "watch_minutes": 30}})
	status := func(when string, want string) {
		t.Helper()
		w := h.want(t, http.StatusOK, "GET", fmt.Sprintf("/v1/user/rollouts/%d", r.ID), h.alice.token, nil)
		var v struct{ Data map[string]json.RawMessage }
		must(t, json.Unmarshal(w.Body.Bytes(), &v))
		if !jsonEqual(t, v.Data["health_status"], []byte(want)) {
			t.Errorf("%s: health_status %s, want %s", when, v.Data["health_status"], want)
		}
	}
	status("created", `{"since":"`+r.CreatedAt+`","crashes":0,"device_days":0.000012,"rate":0,"watching":null}`)
	h.flash(h.uids[0], h.uids[1])
	until := h.clock.now().Add(30 * time.Minute).UTC().Format(store.TimeFormat)
	h.states(r.ID)
	h.clock.advance(6 * time.Minute)
	tell(h.testEnv, h.link, h.uids[0], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
	// 1 crash in 2 devices × 6 minutes.
	status("the first batch watched", `{"since":"`+r.CreatedAt+`","crashes":1,"device_days":0.008333,"rate":120,
		"watching":{"batch":1,"until":"`+until+`"}}`)
	h.clock.advance(24 * time.Minute)
	if v := h.states(r.ID); stateOfDevice(v)[h.uids[2]] != "running" {
		t.Fatalf("after the watch: %v, want the second batch running", stateOfDevice(v))
	}
	status("the second batch running", `{"since":"`+r.CreatedAt+`","crashes":1,"device_days":0.041667,"rate":24,"watching":null}`)
}
