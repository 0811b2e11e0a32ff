package main

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Rollouts. The HTTP tables here run without a broker: every device is
// offline, so the first batch waits. The fleet tests further on run real
// simulated devices against a real Mosquitto.

// stateOfDevice maps each device's uid to its state in the rollout.
func stateOfDevice(v model.Rollout) map[string]model.RolloutDeviceState {
	m := map[string]model.RolloutDeviceState{}
	for _, d := range v.Devices {
		m[d.UID] = d.State
	}
	return m
}

// rolloutEnv is a testEnv in which alice has n esp32 devices (alice.device
// first) and has uploaded img to alice.device; bob has uploaded bobImg to
// his one device.
type rolloutEnv struct {
	*testEnv
	uids   []string
	img    otaImage
	bobImg otaImage
}

const rolloutImageSize = 20 << 10

func newRolloutEnv(t *testing.T, n int) *rolloutEnv {
	t.Helper()
	e := &rolloutEnv{testEnv: newTestEnv(t, nil), img: newOTAImage(11, rolloutImageSize), bobImg: newOTAImage(12, rolloutImageSize)}
	e.uids = append([]string{e.alice.device}, e.addDevices(e.alice, n-1)...)
	e.uploadImage(e.alice, e.alice.device, e.img, "fw", "2.0")
	e.uploadImage(e.bob, e.bob.device, e.bobImg, "bob-fw", "9.9")
	return e
}

// addDevices creates n more esp32 devices for u and returns their uids.
func (e *testEnv) addDevices(u testUser, n int) []string {
	var uids []string
	for range n {
		uids = append(uids, addDevice(e.t, e, u, "esp32").device)
	}
	return uids
}

// uploadImage uploads img to u's device uid.
func (e *testEnv) uploadImage(u testUser, uid string, img otaImage, name, version string) {
	e.t.Helper()
	e.uploadOK(testUser{device: uid, token: u.token}, map[string]string{"name": name, "version": version, "notes": "notes of " + name}, img.bytes)
}

// report sets the md5 a device reports, as its telemetry would.
func (e *testEnv) report(uid, md5sum string) {
	e.t.Helper()
	mustExec(e.t, e.st, `UPDATE devices SET current_md5 = ? WHERE uid = ?`, md5sum, uid)
}

// createRollout posts body as u and wants 201; it returns the rollout.
func (e *testEnv) createRollout(u testUser, body any) model.Rollout {
	e.t.Helper()
	return decodeRollout(e.t, e.want(e.t, http.StatusCreated, "POST", "/v1/user/rollouts", u.token, body).Body.Bytes())
}

// rollout GETs u's rollout id and wants 200.
func (e *testEnv) rollout(u testUser, id int64) model.Rollout {
	e.t.Helper()
	return decodeRollout(e.t, e.want(e.t, http.StatusOK, "GET", fmt.Sprintf("/v1/user/rollouts/%d", id), u.token, nil).Body.Bytes())
}

// moveRollout posts …/{id}/{move} as u and wants 200 and state want.
func (e *testEnv) MoveRollout(u testUser, id int64, move string, want model.RolloutState) model.Rollout {
	e.t.Helper()
	v := decodeRollout(e.t, e.want(e.t, http.StatusOK, "POST", fmt.Sprintf("/v1/user/rollouts/%d/%s", id, move), u.token, nil).Body.Bytes())
	if v.State != want {
		e.t.Fatalf("%s rollout %d: state %q, want %q", move, id, v.State, want)
	}
	return v
}

func decodeRollout(tb testing.TB, body []byte) model.Rollout {
	tb.Helper()
	var v struct{ Data model.Rollout }
	if err := json.Unmarshal(body, &v); err != nil {
		tb.Fatalf("rollout answer: %v: %s", err, body)
	}
	return v.Data
}

func TestRolloutCreate(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 5)
	e.report(e.uids[3], e.img.md5) // already runs the image: skipped
	before := dbState(t, e.st)

	w := e.request("POST", "/v1/user/rollouts", e.alice.token, map[string]any{
		"md5": strings.ToUpper(e.img.md5), "device_uids": e.uids, "batch_size": 2, "max_failures": 1, "name": "spring"})
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	var raw struct{ Data map[string]json.RawMessage }
	must(t, json.Unmarshal(w.Body.Bytes(), &raw))
	wantKeys := []string{"batch_size", "counts", "created_at", "devices", "finished_at", "firmware", "halt_reason", "health", "id", "max_failures", "md5", "name", "on_halt", "reverted_by", "reverts", "sha256", "state", "updated_at"}
	if got := slices.Sorted(maps.Keys(raw.Data)); !slices.Equal(got, wantKeys) {
		t.Errorf("Rollout keys: got %v, want %v", got, wantKeys)
	}
	var counts map[string]json.RawMessage
	json.Unmarshal(raw.Data["counts"], &counts)
	wantCounts := []string{"failed", "pending", "running", "skipped", "succeeded", "timed_out", "waiting"}
	if got := slices.Sorted(maps.Keys(counts)); !slices.Equal(got, wantCounts) {
		t.Errorf("counts keys: got %v, want %v", got, wantCounts)
	}

	v := decodeRollout(t, w.Body.Bytes())
	if v.Name == nil || *v.Name != "spring" || v.MD5 == nil || *v.MD5 != e.img.md5 || v.SHA256 == nil || *v.SHA256 != e.img.sha256 || v.OnHalt != "stop" || v.State != "running" ||
		v.BatchSize != 2 || v.MaxFailures != 1 || v.FinishedAt != nil || v.CreatedAt == "" || v.UpdatedAt == "" ||
		v.Firmware == nil || v.Firmware.Name != "fw" || v.Firmware.Version == nil || *v.Firmware.Version != "2.0" {
		t.Errorf("rollout: %s", w.Body)
	}
	// No broker: the first batch's devices wait; the rest is pending.
	wantStates := []model.RolloutDeviceState{"waiting", "waiting", "pending", "skipped", "pending"}
	for i, d := range v.Devices {
		if d.UID != e.uids[i] || d.Name != scalar(t, e.st, `SELECT name FROM devices WHERE uid = ?`, d.UID) || d.State != wantStates[i] || d.CommandID != nil || d.Error != nil || d.Progress != nil {
			t.Errorf("device %d: got %+v, want uid %s state %s", i, d, e.uids[i], wantStates[i])
		}
	}
	want := map[model.RolloutDeviceState]int{"pending": 2, "waiting": 2, "running": 0, "succeeded": 0, "failed": 0, "timed_out": 0, "skipped": 1}
	if !maps.Equal(v.Counts, want) {
		t.Errorf("counts: got %v, want %v", v.Counts, want)
	}

	// Each device has one firmware row for the file, copied; not its
	// target: no broker, so the rollout has sent no device the OTA.
	for _, uid := range e.uids {
		wantDB(t, e.st, fmt.Sprintf("%s %s fw 2.0 notes of fw %d", e.img.md5, e.img.sha256, rolloutImageSize),
			`SELECT group_concat(f.md5 || ' ' || f.sha256 || ' ' || f.name || ' ' || f.version || ' ' || f.notes || ' ' || f.size ||
			iif(f.id = d.target_firmware_id, ' target', '')) FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, uid)
	}
	// They share the one stored file.
	wantFirmwareFiles(t, e.testEnv, map[string][]byte{e.img.sha256: e.img.bytes, e.bobImg.sha256: e.bobImg.bytes})
	// Bob's rows are untouched and he sees no rollout.
	sameState(t, "alice's rollout", before, dbState(t, e.st), e.bob.id)
	if got := e.request("GET", "/v1/user/rollouts", e.bob.token, nil).Body.String(); strings.TrimSpace(got) != `{"data":[]}` {
		t.Errorf("bob's rollouts: %s", got)
	}
}

func TestRolloutDefaultsAndList(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 3)
	first := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids[:1]})
	if first.Name != nil || first.BatchSize != 10 || first.MaxFailures != 0 {
		t.Errorf("defaults: name %v, batch_size %d, max_failures %d; want null, 10, 0", first.Name, first.BatchSize, first.MaxFailures)
	}
	second := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids[1:], "name": "second"})

	w := e.want(t, http.StatusOK, "GET", "/v1/user/rollouts", e.alice.token, nil)
	var list struct{ Data []map[string]json.RawMessage }
	var views struct{ Data []model.Rollout }
	if err := errors.Join(json.Unmarshal(w.Body.Bytes(), &list), json.Unmarshal(w.Body.Bytes(), &views)); err != nil || len(list.Data) != 2 {
		t.Fatalf("list: %s (%v)", w.Body, err)
	}
	for i, want := range []model.Rollout{second, first} {
		if _, ok := list.Data[i]["devices"]; ok {
			t.Errorf("list item %d has devices: %s", i, w.Body)
		}
		got := views.Data[i]
		if got.ID != want.ID || !maps.Equal(got.Counts, want.Counts) || got.State != want.State {
			t.Errorf("list item %d: got %+v, want id %d counts %v", i, got, want.ID, want.Counts)
		}
	}
	detail := e.rollout(e.alice, second.ID)
	if len(detail.Devices) != 2 || detail.Devices[0].UID != e.uids[1] || detail.Devices[1].UID != e.uids[2] {
		t.Errorf("detail devices: %+v", detail.Devices)
	}
}

func TestRolloutCreateRejected(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 3)
	other := e.addDevices(e.bob, 1)[0]
	// Two different files under one md5, as an md5 collision pair is
	// stored: a rollout of it could not say which bytes to send.
	twin, twin2 := newOTAImage(13, rolloutImageSize), newOTAImage(14, rolloutImageSize)
	e.uploadImage(e.alice, e.uids[1], twin, "twin", "1")
	e.uploadImage(e.alice, e.uids[2], twin2, "twin", "2")
	mustExec(t, e.st, `UPDATE firmwares SET md5 = ? WHERE sha256 = ?`, twin.md5, twin2.sha256)
	tooMany := make([]string, maxRolloutDevices+1)
	for i := range tooMany {
		tooMany[i] = fmt.Sprintf("esp32_%012d", i)
	}
	body := func(change map[string]any) map[string]any {
		b := map[string]any{"md5": e.img.md5, "device_uids": e.uids, "batch_size": 10, "max_failures": 0}
		for k, v := range change {
			if v == nil {
				delete(b, k)
			} else {
				b[k] = v
			}
		}
		return b
	}
	tests := []struct {
		name, field, says string
		body              map[string]any
	}{
		{"md5 of another user's firmware", "md5", "must be the md5 of one of your firmwares", body(map[string]any{"md5": e.bobImg.md5})},
		{"md5 of no firmware", "md5", "must be the md5 of one of your firmwares", body(map[string]any{"md5": strings.Repeat("0", 32)})},
		{"md5 missing", "md5", "is required", body(map[string]any{"md5": nil})},
		{"md5 not a string", "md5", "must be a string", body(map[string]any{"md5": 5})},
		{"md5 of two different files", "md5", "names two different files", body(map[string]any{"md5": twin.md5})},
		{"another user's uid", "device_uids", e.bob.device, body(map[string]any{"device_uids": []string{e.uids[0], e.bob.device}})},
		{"another user's second uid", "device_uids", other, body(map[string]any{"device_uids": []string{other}})},
		{"unknown uid", "device_uids", "esp32_nosuchdevice", body(map[string]any{"device_uids": []string{"esp32_nosuchdevice"}})},
		{"duplicate uid", "device_uids", "more than once: \"" + e.uids[1], body(map[string]any{"device_uids": []string{e.uids[0], e.uids[1], e.uids[1]}})},
		{"uids missing", "device_uids", "is required", body(map[string]any{"device_uids": nil})},
		{"uids empty", "device_uids", "must not be empty", body(map[string]any{"device_uids": []string{}})},
		{"uids not a list", "device_uids", "must be an array of strings", body(map[string]any{"device_uids": e.uids[0]})},
		{"more than 10,000 devices", "device_uids", "more than 10000", body(map[string]any{"device_uids": tooMany})},
		{"batch_size 0", "batch_size", "between 1 and 1000", body(map[string]any{"batch_size": 0})},
		{"batch_size 1001", "batch_size", "between 1 and 1000", body(map[string]any{"batch_size": 1001})},
		{"batch_size x", "batch_size", "between 1 and 1000", body(map[string]any{"batch_size": "x"})},
		{"batch_size 1.5", "batch_size", "between 1 and 1000", body(map[string]any{"batch_size": 1.5})},
		{"max_failures -1", "max_failures", "between 0 and", body(map[string]any{"max_failures": -1})},
		{"max_failures 2^31", "max_failures", "between 0 and 2147483647", body(map[string]any{"max_failures": 1 << 31})},
		{"name too long", "name", "255", body(map[string]any{"name": strings.Repeat("n", 256)})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := dbState(t, e.st)
			w := e.want(t, http.StatusUnprocessableEntity, "POST", "/v1/user/rollouts", e.alice.token, tt.body)
			var got struct {
				Message string
				Errors  map[string][]string
			}
			must(t, json.Unmarshal(w.Body.Bytes(), &got))
			if fields := slices.Collect(maps.Keys(got.Errors)); !slices.Equal(fields, []string{tt.field}) {
				t.Errorf("error fields %v, want [%s]: %s", fields, tt.field, w.Body)
			}
			if len(got.Errors[tt.field]) == 0 || !strings.Contains(got.Errors[tt.field][0], tt.says) || got.Message != got.Errors[tt.field][0] {
				t.Errorf("errors: want %s to say %q: %s", tt.field, tt.says, w.Body)
			}
			sameState(t, "a refused rollout", before, dbState(t, e.st))
		})
	}
}

// TestRolloutQuotas: a rollout counts against -max-firmwares and
// -max-firmware-mib as uploads do, one row per device that gets one (a
// device that has the md5 already gets none). Over a limit it is refused
// whole, naming the limit and the first device over it.
func TestRolloutQuotas(t *testing.T) {
	t.Parallel()
	img := newOTAImage(21, 512<<10)
	tests := []struct {
		name   string
		limits store.Quotas
		second bool  // the third device has another firmware already
		to     []int // the devices rolled out to: 0 has img, 1 and 2 have not
		over   int   // the device named in the 422; 0 for a 201
		says   string
	}{
		{"each device under its firmware limit", store.Quotas{Firmwares: 1}, false, []int{0, 1, 2}, 0, ""},
		{"a device at its firmware limit", store.Quotas{Firmwares: 1}, true, []int{0, 1, 2}, 2,
			"This rollout would give device %q more than its limit of 1 firmwares."},
		{"filling the storage limit exactly", store.Quotas{FirmwareMiB: 1}, false, []int{0, 1}, 0, ""},
		{"past the storage limit", store.Quotas{FirmwareMiB: 1}, false, []int{0, 1, 2}, 2,
			"This rollout would pass your team's firmware storage limit of 1 MiB at device %q."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTestEnv(t, nil)
			uids := append([]string{e.alice.device}, e.addDevices(e.alice, 2)...)
			e.uploadImage(e.alice, uids[0], img, "fw", "1")
			if tt.second {
				e.uploadImage(e.alice, uids[2], newOTAImage(22, 1<<10), "other", "1")
			}
			e.rebuild(withQuotas(tt.limits))
			var to []string
			for _, i := range tt.to {
				to = append(to, uids[i])
			}
			before := dbState(t, e.st)
			w := e.request("POST", "/v1/user/rollouts", e.alice.token, map[string]any{"md5": img.md5, "device_uids": to})
			if tt.over == 0 {
				checkAnswer(t, w, http.StatusCreated, "")
				wantDB(t, e.st, fmt.Sprint(len(to)), `SELECT count(*) FROM firmwares WHERE md5 = ?`, img.md5)
				return
			}
			checkAnswer(t, w, http.StatusUnprocessableEntity, apiJSON(map[string]string{"message": fmt.Sprintf(tt.says, uids[tt.over])}))
			sameState(t, "a rollout over a quota", before, dbState(t, e.st))
		})
	}
}

func TestRolloutTransitions(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 3)
	path := func(id int64, move string) string { return fmt.Sprintf("/v1/user/rollouts/%d/%s", id, move) }
	refused := func(id int64, move, message string, state model.RolloutState) {
		t.Helper()
		before := dbState(t, e.st)
		w := e.request("POST", path(id, move), e.alice.token, nil)
		if w.Code != http.StatusUnprocessableEntity || strings.TrimSpace(w.Body.String()) != `{"message":"`+message+`"}` {
			t.Errorf("%s in state %s: got %d %s, want 422 %q", move, state, w.Code, w.Body, message)
		}
		sameState(t, "a refused move", before, dbState(t, e.st))
		if got := e.rollout(e.alice, id).State; got != state {
			t.Errorf("after a refused %s: state %q, want %q", move, got, state)
		}
	}
	const (
		noPause  = "Only a running rollout can be paused."
		noResume = "Only a paused or halted rollout can be resumed."
		noCancel = "Only a running, paused or halted rollout can be cancelled."
	)

	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids, "batch_size": 1})
	refused(r.ID, "resume", noResume, "running")
	e.MoveRollout(e.alice, r.ID, "pause", "paused")
	refused(r.ID, "pause", noPause, "paused")
	e.MoveRollout(e.alice, r.ID, "resume", "running")
	e.MoveRollout(e.alice, r.ID, "pause", "paused")
	c := e.MoveRollout(e.alice, r.ID, "cancel", "cancelled")
	if c.FinishedAt == nil {
		t.Errorf("a cancelled rollout has no finished_at")
	}
	for _, move := range []string{"pause", "resume", "cancel"} {
		refused(r.ID, move, map[string]string{"pause": noPause, "resume": noResume, "cancel": noCancel}[move], "cancelled")
	}

	// Every device already runs the image: completed at once.
	for _, uid := range e.uids {
		e.report(uid, e.img.md5)
	}
	done := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids})
	if done.State != "completed" || done.FinishedAt == nil || done.Counts["skipped"] != len(e.uids) {
		t.Fatalf("rollout of devices that run the image: %+v", done)
	}
	refused(done.ID, "pause", noPause, "completed")
	refused(done.ID, "resume", noResume, "completed")
	refused(done.ID, "cancel", noCancel, "completed")
}

// TestRolloutRequestStartsOnlyItsRollout: a request that creates or
// resumes a rollout moves that rollout on before it answers, and no
// other: bob's running rollout, whose waiting device has come online, is
// left to the engine's next pass; nor does the request wait while the
// engine is sending bob's batch. A rollout paused since the engine
// listed it is not moved on.
func TestRolloutRequestStartsOnlyItsRollout(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 3)
	link := &gatedLink{recordingLink: &recordingLink{}}
	e.rebuild(withLink(link))
	ctx := context.Background()
	bobs := e.createRollout(e.bob, map[string]any{"md5": e.bobImg.md5, "device_uids": []string{e.bob.device}})
	e.setStatus(e.bob.device, "online") // the engine's next pass would send it
	bobWaits := func(when string) {
		t.Helper()
		if got := e.rollout(e.bob, bobs.ID).Devices[0].State; got != model.RdWaiting {
			t.Fatalf("%s: bob's device is %s, want it still waiting", when, got)
		}
		for _, p := range link.take() {
			if p.uid == e.bob.device {
				t.Errorf("%s: bob's device was sent %s", when, p.payload)
			}
		}
	}

	// Create: the first batch is sent before the answer, as ever.
	e.setStatus(e.uids[0], "online")
	created := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids[:2], "batch_size": 1})
	if d := created.Devices; d[0].State != model.RdRunning || d[0].CommandID == nil || d[1].State != model.RdPending {
		t.Errorf("created: devices %+v, want the first running with its command, the second pending", d)
	}
	bobWaits("after alice's create")

	// Resume: the waiting device that came online is sent before the answer.
	paused := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids[2:]})
	e.MoveRollout(e.alice, paused.ID, "pause", model.RolloutPaused)
	e.setStatus(e.uids[2], "online")
	aliceTeam, err := strconv.ParseInt(teamOf(t, e.testEnv, e.alice), 10, 64)
	must(t, err)
	e.srv.rollouts.start(ctx, aliceTeam, paused.ID) // a pass that listed it before the pause
	if got := e.rollout(e.alice, paused.ID).Devices[0].State; got != model.RdWaiting {
		t.Errorf("a pass over the paused rollout: its device is %s, want it still waiting", got)
	}
	if d := e.MoveRollout(e.alice, paused.ID, "resume", model.RolloutRunning).Devices[0]; d.State != model.RdRunning || d.CommandID == nil {
		t.Errorf("resumed: device %+v, want it running with its command", d)
	}
	bobWaits("after alice's resume")

	// The engine's pass sends bob's device; alice's create does not wait
	// for it, while bob's command is held at the link.
	link.hold(e.bob.device)
	passed := make(chan struct{})
	go func() {
		e.srv.rollouts.advance(ctx)
		close(passed)
	}()
	select {
	case <-link.held:
	case <-passed:
		t.Fatal("the engine's pass did not send bob's device")
	}
	answered := make(chan int)
	go func() {
		w := httptest.NewRecorder()
		e.srv.ServeHTTP(w, newRequest("POST", "/v1/user/rollouts", "Bearer "+e.alice.token, "application/json",
			strings.NewReader(apiJSON(map[string]any{"md5": e.img.md5, "device_uids": e.uids[:1]}))))
		answered <- w.Code
	}()
	select {
	case code := <-answered:
		if code != http.StatusCreated {
			t.Errorf("the create beside the engine's pass: got %d, want 201", code)
		}
	case <-time.After(30 * time.Second): // it takes milliseconds: this bound only ends a wait that would not end
		t.Error("alice's create waited for the engine's pass over bob's rollout")
	}
	close(link.release)
	<-passed
	if got := e.rollout(e.bob, bobs.ID).Devices[0].State; got != model.RdRunning {
		t.Errorf("after the engine's pass: bob's device is %s, want running", got)
	}
	if n := len(e.srv.rollouts.locks.held); n != 0 {
		t.Errorf("%d rollout locks kept after their last use, want none", n)
	}
}

// gatedLink is a recordingLink that, once hold names a device, holds the
// first command to it until release is closed; held says it got there.
type gatedLink struct {
	*recordingLink
	mu            sync.Mutex
	uid           string
	held, release chan struct{}
}

func (l *gatedLink) hold(uid string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.uid, l.held, l.release = uid, make(chan struct{}), make(chan struct{})
}

func (l *gatedLink) Publish(uid, id string, payload []byte) error {
	l.mu.Lock()
	gate := uid == l.uid
	if gate {
		l.uid = ""
	}
	l.mu.Unlock()
	if gate {
		close(l.held)
		<-l.release
	}
	return l.recordingLink.Publish(uid, id, payload)
}

func TestRolloutOfAnotherUserIsNotFound(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 2)
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids})
	before := dbState(t, e.st)
	for _, tt := range []struct{ method, path, token string }{
		{"GET", fmt.Sprintf("/v1/user/rollouts/%d", r.ID), e.bob.token},
		{"POST", fmt.Sprintf("/v1/user/rollouts/%d/pause", r.ID), e.bob.token},
		{"POST", fmt.Sprintf("/v1/user/rollouts/%d/resume", r.ID), e.bob.token},
		{"POST", fmt.Sprintf("/v1/user/rollouts/%d/cancel", r.ID), e.bob.token},
		{"GET", "/v1/user/rollouts/999999", e.alice.token},
		{"POST", "/v1/user/rollouts/999999/cancel", e.alice.token},
		{"GET", "/v1/user/rollouts/abc", e.alice.token},
		{"POST", "/v1/user/rollouts/0/pause", e.alice.token},
	} {
		w := e.request(tt.method, tt.path, tt.token, nil)
		if w.Code != http.StatusNotFound || strings.TrimSpace(w.Body.String()) != `{"message":"Rollout not found."}` {
			t.Errorf("%s %s: got %d %s, want 404 Rollout not found.", tt.method, tt.path, w.Code, w.Body)
		}
	}
	sameState(t, "another user's requests", before, dbState(t, e.st))
	if got := e.request("GET", "/v1/user/rollouts", e.bob.token, nil).Body.String(); strings.TrimSpace(got) != `{"data":[]}` {
		t.Errorf("bob's list: %s", got)
	}
	apiWantStatus(t, e.testEnv, "GET", "/v1/user/rollouts", "", http.StatusUnauthorized)
}

// TestRolloutStoreOfItsTeam: what the engine reads and writes of a
// rollout (its batch, failures, counts, health figures, device states)
// the store finds only for the rollout's team, a new rollout takes only
// the team's devices, and a rollout makes a device its target only when
// the device is of its team
// (docs/security.md, "Team scoping in the store").
func TestRolloutStoreOfItsTeam(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 2)
	ctx := context.Background()
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids})
	alice, bob := e.alice.id, e.bob.id
	ro, err := e.st.RolloutHead(ctx, alice, r.ID)
	must(t, err)
	batch, err := e.st.RolloutBatch(ctx, alice, ro)
	must(t, err)
	if len(batch) != 2 {
		t.Fatalf("alice's batch: %d devices, want 2", len(batch))
	}
	batch[0].State = model.RdSkipped
	before := dbState(t, e.st)
	for name, call := range map[string]func() error{
		"RolloutBatch":    func() error { _, err := e.st.RolloutBatch(ctx, bob, ro); return err },
		"RolloutFailures": func() error { _, err := e.st.RolloutFailures(ctx, bob, r.ID); return err },
		"RolloutCounts":   func() error { return e.st.RolloutCounts(ctx, bob, ro) },
		"RolloutHealthFigures": func() error {
			_, _, _, err := e.st.RolloutHealthFigures(ctx, bob, ro)
			return err
		},
		"SetRolloutDevices": func() error { return e.st.SetRolloutDevices(ctx, bob, r.ID, []*store.RolloutDeviceRow{&batch[0]}) },
	} {
		if err := call(); !errors.Is(err, store.ErrRolloutNotFound) {
			t.Errorf("%s of alice's rollout for bob's team: %v, want ErrRolloutNotFound", name, err)
		}
	}
	_, err = e.st.CreateRollout(ctx, alice, store.NewRollout{MD5: e.img.md5, Devices: []*store.DeviceRef{e.deviceRef(e.alice), e.deviceRef(e.bob)},
		BatchSize: 10, CreatedBy: e.alice.id, OnHalt: model.OnHaltStop}, nil)
	if !errors.Is(err, store.ErrDeviceNotFound) {
		t.Errorf("alice's rollout of bob's device: %v, want ErrDeviceNotFound", err)
	}
	sameState(t, "calls for another team", before, dbState(t, e.st))
	bobsFirmware, err := strconv.ParseInt(scalar(t, e.st, `SELECT f.id FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, e.bob.device), 10, 64)
	must(t, err)
	batch[0].Target = &store.NewTarget{Device: e.deviceRef(e.bob), FirmwareID: bobsFirmware}
	must(t, e.st.SetRolloutDevices(ctx, alice, r.ID, []*store.RolloutDeviceRow{&batch[0]}))
	wantDB(t, e.st, "skipped", `SELECT state FROM rollout_devices WHERE rollout_id = ? AND position = 0`, r.ID)
	wantDB(t, e.st, "<nil>", `SELECT target_firmware_id FROM devices WHERE uid = ?`, e.bob.device)
}

// A firmware that a running or paused rollout still has to send cannot be
// deleted, even when it is no longer the device's target.
func TestRolloutKeepsItsFirmware(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 2)
	uid := e.uids[1]
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids, "batch_size": 1})
	other := newOTAImage(14, rolloutImageSize)
	e.uploadImage(e.alice, uid, other, "other", "3")
	e.setTarget(withDevice(e.alice, uid), other.md5)
	for _, state := range []string{"running", "paused"} {
		if state == "paused" {
			e.MoveRollout(e.alice, r.ID, "pause", "paused")
		}
		before := dbState(t, e.st)
		w := e.request("DELETE", "/v1/user/devices/"+uid+"/firmwares/"+e.img.md5, e.alice.token, nil)
		if w.Code != http.StatusUnprocessableEntity || strings.TrimSpace(w.Body.String()) != `{"message":"Cannot delete firmware while it is assigned to any device."}` {
			t.Errorf("delete while %s: got %d %s", state, w.Code, w.Body)
		}
		sameState(t, "a refused delete", before, dbState(t, e.st))
	}
	e.MoveRollout(e.alice, r.ID, "cancel", "cancelled")
	apiWantStatus(t, e.testEnv, "DELETE", "/v1/user/devices/"+uid+"/firmwares/"+e.img.md5, e.alice.token, http.StatusOK) // after the cancel
	// The file stays: alice.device's row still uses it.
	if _, err := os.Stat(filepath.Join(firmwareDir(e.st), e.img.sha256+".bin")); err != nil {
		t.Errorf("shared file: %v", err)
	}
}

// rolloutOTACounts is how many ota commands for md5 each device of the
// user with that email was sent, read from the commands table.
func rolloutOTACounts(tb testing.TB, db *sql.DB, email, md5sum string) map[string]int {
	tb.Helper()
	counts := map[string]int{}
	for uid, n := range queryMap(tb, db, `SELECT d.uid, count(c.id) FROM devices d JOIN users u ON u.id = d.team_id
		LEFT JOIN commands c ON c.device_id = d.id AND c.kind = 'ota' AND json_extract(c.payload, '$.md5') = ?
		WHERE u.email = ? GROUP BY d.uid`, md5sum, email) {
		counts[uid], _ = strconv.Atoi(n)
	}
	return counts
}

// A rollout's running device keeps its ota command when newer commands
// push the device's history past store.KeepCommands: without it the engine would
// take the command for one never sent, and send the image again.
func TestRolloutKeepsARunningDevicesCommand(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 1)
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids})
	d := e.deviceRef(e.alice)
	insert := func(id string, kind model.CommandKind) {
		t.Helper()
		now := e.st.Timestamp()
		c := &model.Command{ID: id, Kind: kind, Payload: []byte(`{}`), State: "sent", CreatedAt: now, UpdatedAt: now}
		must(t, e.st.InsertCommand(c, d, now, nil))
	}
	insert("older", "custom")
	insert("rolloutota", "ota")
	mustExec(t, e.st, `UPDATE rollout_devices SET state = 'running', command_id = 'rolloutota' WHERE rollout_id = ?`, r.ID)
	for i := range store.KeepCommands {
		insert(fmt.Sprintf("newer%d", i), "custom")
	}
	if _, err := e.st.CommandOf(context.Background(), d, "older"); !errors.Is(err, store.ErrCommandNotFound) {
		t.Errorf("the oldest command: %v, want it deleted", err)
	}
	if _, err := e.st.CommandOf(context.Background(), d, "rolloutota"); err != nil {
		t.Errorf("the rollout's running command: %v, want it kept", err)
	}
	got := e.rollout(e.alice, r.ID)
	if got.Devices[0].State != "running" || got.Devices[0].CommandID == nil || *got.Devices[0].CommandID != "rolloutota" {
		t.Errorf("rollout device: %+v", got.Devices[0])
	}
}

// TestRolloutShowsOTAProgress: a rollout's device shows its name and its
// running OTA command's progress.
func TestRolloutShowsOTAProgress(t *testing.T) {
	t.Parallel()
	e := newRolloutEnv(t, 1)
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids})
	d := e.deviceRef(e.alice)
	now := e.st.Timestamp()
	must(t, e.st.InsertCommand(&model.Command{ID: "rolloutota", Kind: "ota", Payload: []byte(`{}`), State: "sent", CreatedAt: now,
		UpdatedAt: now}, d, now, nil))
	mustExec(t, e.st, `UPDATE rollout_devices SET state = 'running', command_id = 'rolloutota' WHERE rollout_id = ?`, r.ID)
	_, err := e.st.SetOTAProgress(context.Background(), map[string]int64{"rolloutota": 40})
	must(t, err)
	got := e.rollout(e.alice, r.ID).Devices[0]
	if got.Name != "Alice's device" || got.Progress == nil || *got.Progress != 40 {
		t.Errorf("rollout device: got name %q progress %v, want Alice's device at 40", got.Name, got.Progress)
	}
}

// What a SIGKILL can leave behind, replayed exactly: a device recorded as
// running whose command was recorded (it was sent: never again), and one
// whose command was not (the process died before it was sent: sent now).
func TestRolloutEngineAfterRestart(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	e := newRolloutEnv(t, 3)
	r := e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids, "batch_size": 3})
	f, err := e.st.FirmwareOf(context.Background(), e.deviceRef(e.alice), e.img.md5)
	must(t, err)
	sent, err := e.srv.commands.otaCommand(e.uids[0], f)
	must(t, err)
	now := e.st.Timestamp()
	// deadline "9999" sorts after every timestamp: it never times out.
	sent.ID, sent.State, sent.CreatedAt, sent.UpdatedAt = "sentbefore", "sent", now, now
	must(t, e.st.InsertCommand(sent, e.deviceRef(e.alice), "9999", nil))
	for pos, cmd := range []string{"sentbefore", "neverrecorded"} {
		mustExec(t, e.st, `UPDATE rollout_devices SET state = 'running', command_id = ? WHERE rollout_id = ? AND position = ?`, cmd, r.ID, pos)
	}
	for _, uid := range e.uids {
		e.setStatus(uid, "online")
	}

	// The restarted server: a new link, and the engine's passes.
	observer := testClient(t, b, "rollout-observer", "")
	published := subscribe(t, observer, "devices/+/cmd/+")
	linkTo(t, e.testEnv, b, 0)
	e.srv.rollouts.advance(context.Background())
	e.srv.rollouts.advance(context.Background())

	got := map[string]string{} // uid → command id
	timeout := time.After(5 * time.Second)
	for len(got) < 2 {
		select {
		case m := <-published:
			parts := strings.Split(m.Topic(), "/")
			if _, dup := got[parts[1]]; dup {
				t.Errorf("%s was sent a second command", parts[1])
			}
			got[parts[1]] = parts[3]
		case <-timeout:
			t.Fatalf("published: %v, want one ota each to %s and %s", got, e.uids[1], e.uids[2])
		}
	}
	select {
	case m := <-published:
		t.Errorf("one more command published: %s %s", m.Topic(), m.Payload())
	case <-time.After(300 * time.Millisecond):
	}
	if _, ok := got[e.uids[0]]; ok {
		t.Errorf("%s, whose command was recorded, was sent another", e.uids[0])
	}
	v := e.rollout(e.alice, r.ID)
	for i, want := range []string{"sentbefore", got[e.uids[1]], got[e.uids[2]]} {
		if d := v.Devices[i]; d.State != "running" || d.CommandID == nil || *d.CommandID != want || want == "" {
			t.Errorf("%s: %+v, want running with command %q", d.UID, d, want)
		}
	}
}

// An OTA that ends in nothing times out, and a timeout is a failure:
// past max_failures the rollout halts before the next batch.
func TestRolloutTimeoutIsAFailure(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t) // the fake clock: the OTA timeout is 15 minutes
	uids := append([]string{env.alice.device}, env.addDevices(env.alice, 1)...)
	img := newOTAImage(15, rolloutImageSize)
	env.uploadImage(env.alice, uids[0], img, "fw", "1")
	commands := subscribe(t, deviceOnline(t, b, env, env.alice), "devices/"+uids[0]+"/cmd/+") // it never answers
	runRolloutEngine(t, env)

	r := env.createRollout(env.alice, map[string]any{"md5": img.md5, "device_uids": uids, "batch_size": 1})
	if m := receive(t, commands, 5*time.Second, "ota command"); !strings.Contains(string(m.Payload()), img.md5) {
		t.Fatalf("command: %s", m.Payload())
	}
	env.clock.advance(env.srv.commands.otaTimeout + time.Second)
	var v model.Rollout
	eventually(t, 10*time.Second, "the rollout halted", func() bool {
		v = env.rollout(env.alice, r.ID)
		return v.State == "halted"
	})
	if v.Devices[0].State != "timed_out" || v.Devices[1].State != "pending" || v.Counts["timed_out"] != 1 {
		t.Errorf("halted rollout: %+v", v)
	}
	if want := `{"kind":"failures","failed":1,"limit":0}`; !jsonEqual(t, v.HaltReason, []byte(want)) {
		t.Errorf("halt_reason: got %s, want %s", v.HaltReason, want)
	}
}

// rolloutFleet is a server on the real clock, linked to a real Mosquitto,
// with its rollout engine running as serve runs it and its router behind
// a real HTTP server, which the download links name. It counts the
// downloads of each device.
type rolloutFleet struct {
	*testEnv
	t      *testing.T
	broker *testBroker

	mu        sync.Mutex
	downloads map[string]int // uid → GET /ota/{uid}/… requests
	held      sync.RWMutex   // write-locked: the downloads wait (holdDownloads)
}

// holdDownloads makes the devices' OTA downloads wait until release, so
// that no batch can finish meanwhile.
func (f *rolloutFleet) holdDownloads() (release func()) {
	f.held.Lock()
	release = sync.OnceFunc(f.held.Unlock)
	f.t.Cleanup(release)
	return release
}

// runRolloutEngine runs env's rollout engine, as serve does, until the
// test ends.
func runRolloutEngine(t *testing.T, env *testEnv) {
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		env.srv.rollouts.run(ctx)
		close(stopped)
	}()
	t.Cleanup(func() {
		cancel()
		<-stopped
	})
}

// newRolloutFleet is a rolloutFleet with n simulate devices of alice's
// that fail that share of commands, and an image uploaded to the first.
func newRolloutFleet(t *testing.T, n int, failRate float64) (*rolloutFleet, []string, otaImage) {
	t.Helper()
	broker := startBroker(t)
	ln, public := listenLocal(t)
	env := newTestEnv(t, nil, withPublicURL(public), withRealClock()) // no timeouts here: the real clock
	linkTo(t, env, broker, 0)
	f := &rolloutFleet{testEnv: env, t: t, broker: broker, downloads: map[string]int{}}
	serveOn(t, ln, http.HandlerFunc(f.serveHTTP))
	runRolloutEngine(t, env)
	uids := startFleet(t, env, broker, env.alice, n, failRate)
	img := newOTAImage(21, rolloutImageSize)
	f.uploadImage(f.alice, uids[0], img, "fw", "2.0")
	return f, uids, img
}

func (f *rolloutFleet) serveHTTP(w http.ResponseWriter, r *http.Request) {
	if rest, ok := strings.CutPrefix(r.URL.Path, "/ota/"); ok {
		uid, _, _ := strings.Cut(rest, "/")
		f.mu.Lock()
		f.downloads[uid]++
		f.mu.Unlock()
		f.held.RLock()
		defer f.held.RUnlock()
	}
	f.srv.ServeHTTP(w, r)
}

func (f *rolloutFleet) downloadsOf(uid string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.downloads[uid]
}

// waitRollout polls u's rollout until cond holds.
func (f *rolloutFleet) waitRollout(u testUser, id int64, what string, timeout time.Duration, cond func(model.Rollout) bool) model.Rollout {
	f.t.Helper()
	return pollRollout(f.t, what, timeout, 50*time.Millisecond, func() model.Rollout { return f.rollout(u, id) }, cond)
}

// pollRollout gets a rollout every poll until cond holds of it.
func pollRollout(t *testing.T, what string, timeout, poll time.Duration, get func() model.Rollout, cond func(model.Rollout) bool) model.Rollout {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		v := get()
		if cond(v) {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for rollout %d: %s; it stands %s %v", timeout, v.ID, what, v.State, v.Counts)
		}
		time.Sleep(poll)
	}
}

func stateIs(state model.RolloutState) func(model.Rollout) bool {
	return func(v model.Rollout) bool { return v.State == state }
}

// otaSent checks how many ota commands for md5 each of the uids was sent
// (the commands table) and how often it downloaded (the HTTP server).
func (f *rolloutFleet) otaSent(u testUser, md5sum string, uids []string, want int) {
	f.t.Helper()
	counts := rolloutOTACounts(f.t, storeReader(f.st), u.email, md5sum)
	for _, uid := range uids {
		if counts[uid] != want || f.downloadsOf(uid) != want {
			f.t.Errorf("%s: %d ota commands and %d downloads, want %d of each", uid, counts[uid], f.downloadsOf(uid), want)
		}
	}
}

// started lists the uids that have an ota command for md5.
func (f *rolloutFleet) started(u testUser, md5sum string) []string {
	var uids []string
	for uid, n := range rolloutOTACounts(f.t, storeReader(f.st), u.email, md5sum) {
		if n > 0 {
			uids = append(uids, uid)
		}
	}
	slices.Sort(uids)
	return uids
}

func allDevices(v model.Rollout, uids []string, state model.RolloutDeviceState) bool {
	states := stateOfDevice(v)
	for _, uid := range uids {
		if states[uid] != state {
			return false
		}
	}
	return true
}

// TestRolloutFleetCompletes: a rollout to 30 devices in batches of 10
// sends each batch once the one before has ended, and completes with
// every device succeeded and sent the image once. Bob's rollout runs on
// the same engine meanwhile; neither user's devices get the other's image.
// (Bob's requests on alice's rollout are TestRolloutOfAnotherUserIsNotFound
// and TestRolloutCreateRejected.)
func TestRolloutFleetCompletes(t *testing.T) {
	t.Parallel()
	f, uids, img := newRolloutFleet(t, 30, 0)
	bobUIDs := startFleet(t, f.testEnv, f.broker, f.bob, 3, 0)
	bobImg := newOTAImage(22, rolloutImageSize)
	f.uploadImage(f.bob, bobUIDs[0], bobImg, "bob-fw", "7")
	r := f.createRollout(f.alice, map[string]any{"md5": img.md5, "device_uids": uids, "batch_size": 10})
	bobs := f.createRollout(f.bob, map[string]any{"md5": bobImg.md5, "device_uids": bobUIDs, "batch_size": 1})
	// The first batch is sent before the answer (some may be done already).
	if r.Counts["running"]+r.Counts["succeeded"] != 10 || r.Counts["pending"] != 20 {
		t.Errorf("at creation: counts %v, want the first batch sent and the rest pending", r.Counts)
	}
	done := f.waitRollout(f.alice, r.ID, "completed", 60*time.Second, stateIs("completed"))
	want := map[model.RolloutDeviceState]int{"pending": 0, "waiting": 0, "running": 0, "succeeded": 30, "failed": 0, "timed_out": 0, "skipped": 0}
	if !maps.Equal(done.Counts, want) || done.FinishedAt == nil {
		t.Errorf("completed rollout: counts %v, finished_at %v", done.Counts, done.FinishedAt)
	}
	f.otaSent(f.alice, img.md5, uids, 1)
	for _, d := range done.Devices {
		dev := f.device(withDevice(f.alice, d.UID))
		if d.State != "succeeded" || d.CommandID == nil || d.Error != nil ||
			dev.CurrentFirmware == nil || dev.CurrentFirmware.MD5 == nil || *dev.CurrentFirmware.MD5 != img.md5 || dev.LastOTAAt == nil {
			t.Errorf("%s: rollout %+v, device current %+v last_ota_at %v", d.UID, d, dev.CurrentFirmware, dev.LastOTAAt)
		}
	}
	checkBatchOrder(t, storeReader(f.st), img.md5, uids, 10)
	f.waitRollout(f.bob, bobs.ID, "completed", 30*time.Second, stateIs("completed"))
	f.otaSent(f.bob, bobImg.md5, bobUIDs, 1)
	for _, c := range []map[string]int{rolloutOTACounts(t, storeReader(f.st), f.alice.email, bobImg.md5), rolloutOTACounts(t, storeReader(f.st), f.bob.email, img.md5)} {
		for uid, n := range c {
			if n != 0 {
				t.Errorf("%s got %d ota commands of the other user's image", uid, n)
			}
		}
	}
}

// checkBatchOrder checks that each batch's ota commands were all created
// after the previous batch's had all ended.
func checkBatchOrder(t *testing.T, db *sql.DB, md5sum string, uids []string, batch int) {
	t.Helper()
	const otaOf = ` FROM commands c JOIN devices d ON d.id = c.device_id WHERE c.kind = 'ota' AND json_extract(c.payload, '$.md5') = ?`
	created := queryMap(t, db, `SELECT d.uid, c.created_at`+otaOf, md5sum)
	finished := queryMap(t, db, `SELECT d.uid, coalesce(c.finished_at, '')`+otaOf, md5sum)
	for start := batch; start < len(uids); start += batch {
		var lastEnd, firstStart string
		for _, uid := range uids[start-batch : start] {
			lastEnd = max(lastEnd, finished[uid])
		}
		firstStart = created[uids[start]]
		for _, uid := range uids[start:min(start+batch, len(uids))] {
			firstStart = min(firstStart, created[uid])
		}
		if firstStart < lastEnd {
			t.Errorf("batch at %d started at %s, before the previous batch ended at %s", start, firstStart, lastEnd)
		}
	}
}

func TestRolloutFleetHaltsPastMaxFailures(t *testing.T) {
	t.Parallel()
	f, uids, img := newRolloutFleet(t, 30, 1)
	r := f.createRollout(f.alice, map[string]any{"md5": img.md5, "device_uids": uids, "batch_size": 10, "max_failures": 2})
	halted := f.waitRollout(f.alice, r.ID, "halted, the first batch failed", 30*time.Second, func(v model.Rollout) bool {
		return v.State == "halted" && v.Counts["failed"] == 10 // it halts at the third; the rest fail after
	})
	time.Sleep(2*rolloutTick + 500*time.Millisecond) // the engine had its chances to send more
	after := f.rollout(f.alice, r.ID)
	want := map[model.RolloutDeviceState]int{"pending": 20, "waiting": 0, "running": 0, "succeeded": 0, "failed": 10, "timed_out": 0, "skipped": 0}
	if after.State != "halted" || !maps.Equal(after.Counts, want) || halted.FinishedAt == nil {
		t.Errorf("halted rollout: %s %v finished_at %v; want halted %v", after.State, after.Counts, halted.FinishedAt, want)
	}
	for i, d := range after.Devices {
		if i < 10 && (d.State != "failed" || d.Error == nil || *d.Error != "simulated failure") {
			t.Errorf("first batch %s: %+v", d.UID, d)
		}
	}
	counts := rolloutOTACounts(t, storeReader(f.st), f.alice.email, img.md5)
	for i, uid := range uids {
		if want := map[bool]int{true: 1, false: 0}[i < 10]; counts[uid] != want || f.downloadsOf(uid) != 0 {
			t.Errorf("%s: %d ota commands (want %d), %d downloads (want 0)", uid, counts[uid], want, f.downloadsOf(uid))
		}
	}
	// Resumed, it goes on anyway, counting failures from the resume: the
	// second batch fails too, and it halts again before the third.
	f.MoveRollout(f.alice, r.ID, "resume", "running")
	again := f.waitRollout(f.alice, r.ID, "halted again, the second batch's first device failed", 30*time.Second, func(v model.Rollout) bool {
		return v.State == "halted" && stateOfDevice(v)[uids[10]] == "failed" // as above
	})
	if again.Counts["pending"] != 10 || again.Counts["failed"] < 13 {
		t.Errorf("halted again: %v, want the second batch failed and the third pending", again.Counts)
	}
}

func TestRolloutFleetWaitingDevice(t *testing.T) {
	t.Parallel()
	f, uids, img := newRolloutFleet(t, 30, 0)
	late := uids[3]
	observer := testClient(t, f.broker, "rollout-observer", "")
	// As its Last Will would say: the device has gone away.
	publishWait(t, observer, "devices/"+late+"/status", true, "offline")
	eventually(t, 5*time.Second, late+" offline", func() bool { return f.device(withDevice(f.alice, late)).Status == "offline" })

	r := f.createRollout(f.alice, map[string]any{"md5": img.md5, "device_uids": uids, "batch_size": 10})
	if got := stateOfDevice(r)[late]; got != "waiting" {
		t.Fatalf("the offline device at creation: %s, want waiting", got)
	}
	others := slices.Delete(slices.Clone(uids[:10]), 3, 4)
	f.waitRollout(f.alice, r.ID, "the rest of the first batch succeeded", 30*time.Second, func(v model.Rollout) bool {
		return allDevices(v, others, "succeeded")
	})
	time.Sleep(2*rolloutTick + 500*time.Millisecond)
	v := f.rollout(f.alice, r.ID)
	if v.State != "running" || stateOfDevice(v)[late] != "waiting" || !allDevices(v, uids[10:], "pending") {
		t.Fatalf("while %s is away: %s %v", late, v.State, v.Counts)
	}
	if got := f.started(f.alice, img.md5); !slices.Equal(got, slices.Sorted(slices.Values(others))) {
		t.Errorf("sent while %s is away: %v, want the rest of its batch", late, got)
	}

	// The device restarts and says online: it gets its OTA, and the
	// rollout goes on.
	publishWait(t, observer, "devices/"+late+"/cmd/wakeup", false, `{"cmd":"reboot"}`)
	done := f.waitRollout(f.alice, r.ID, "completed", 60*time.Second, stateIs("completed"))
	if done.Counts["succeeded"] != 30 || stateOfDevice(done)[late] != "succeeded" {
		t.Errorf("completed: %v", done.Counts)
	}
	f.otaSent(f.alice, img.md5, uids, 1)
}

// TestRolloutFleetPauseOrCancel: a rollout paused or cancelled once its
// first batch is sent lets that batch end, shows it, and sends nothing
// more (a cancelled one skips the devices it sent nothing); a paused one
// resumes and completes, a cancelled one cannot resume.
func TestRolloutFleetPauseOrCancel(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		move  string
		state model.RolloutState
	}{{"pause", "paused"}, {"cancel", "cancelled"}} {
		t.Run(tt.move, func(t *testing.T) {
			t.Parallel() // each has its own fleet
			f, uids, img := newRolloutFleet(t, 30, 0)
			release := f.holdDownloads() // the first batch cannot finish before the move
			r := f.createRollout(f.alice, map[string]any{"md5": img.md5, "device_uids": uids, "batch_size": 10})
			if v := f.MoveRollout(f.alice, r.ID, tt.move, tt.state); (v.FinishedAt != nil) != (tt.move == "cancel") {
				t.Errorf("%s: finished_at %v, want it set only when cancelled", tt.state, v.FinishedAt)
			}
			release()
			f.waitRollout(f.alice, r.ID, "the first batch succeeded", 30*time.Second, func(v model.Rollout) bool {
				return allDevices(v, uids[:10], "succeeded")
			})
			time.Sleep(2*rolloutTick + 500*time.Millisecond) // the engine had its chances to send more
			v := f.rollout(f.alice, r.ID)
			want := map[model.RolloutDeviceState]int{"pending": 20, "waiting": 0, "running": 0, "succeeded": 10, "failed": 0, "timed_out": 0, "skipped": 0}
			if tt.move == "cancel" { // the devices it sent nothing
				want["pending"], want["skipped"] = 0, 20
			}
			if v.State != tt.state || !maps.Equal(v.Counts, want) {
				t.Errorf("%s: %s %v, want %v", tt.state, v.State, v.Counts, want)
			}
			f.otaSent(f.alice, img.md5, uids[:10], 1)
			f.otaSent(f.alice, img.md5, uids[10:], 0)
			if tt.move == "cancel" {
				apiWantStatus(t, f.testEnv, "POST", fmt.Sprintf("/v1/user/rollouts/%d/resume", r.ID), f.alice.token, http.StatusUnprocessableEntity)
				return
			}
			f.MoveRollout(f.alice, r.ID, "resume", "running")
			if done := f.waitRollout(f.alice, r.ID, "completed", 60*time.Second, stateIs("completed")); done.Counts["succeeded"] != 30 {
				t.Errorf("completed: %v", done.Counts)
			}
			f.otaSent(f.alice, img.md5, uids, 1)
		})
	}
}

const binaryFleetOwner = "fleet@example.com"

// binaryFleet is the binary as it ships: `serve` and `simulate` as
// processes on one data directory and a real Mosquitto.
type binaryFleet struct {
	t         *testing.T
	bin, data string
	broker    *testBroker
	serveArgs []string
	srv       *crashServer
	api       *liveClient
	uids      []string // the owner's devices, oldest first
}

// startBinaryFleet starts serve (with serveArgs) and a simulate fleet of
// n devices, and waits until every device is online.
func startBinaryFleet(t *testing.T, n int, interval string, serveArgs ...string) *binaryFleet {
	t.Helper()
	f := &binaryFleet{t: t, bin: crashBuild(t), data: t.TempDir(), broker: startBroker(t), serveArgs: serveArgs}
	crashCLI(t, f.bin, "user", "add", "-data", f.data, "-email", binaryFleetOwner, "-name", "Fleet", "-password", "fleet-password")
	token := crashCLI(t, f.bin, "token", "create", "-data", f.data, "-email", binaryFleetOwner, "-name", "rollout")
	f.api = &liveClient{token: token, hc: &http.Client{Timeout: 30 * time.Second}}
	f.startServer()
	f.simulate(n, interval)
	deadline := time.Now().Add(time.Duration(30+n/20) * time.Second)
	for {
		var list struct {
			Data []struct{ UID, Status string }
		}
		json.Unmarshal(f.api.want(t, 200, "GET", "/v1/user/devices", "", nil), &list)
		f.uids = f.uids[:0]
		for _, d := range list.Data {
			if d.Status == "online" {
				f.uids = append(f.uids, d.UID)
			}
		}
		if len(f.uids) == n {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d simulated devices online", len(f.uids), n)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// startServer starts serve on the fleet's data directory.
func (f *binaryFleet) startServer() {
	f.srv = crashStart(f.t, f.bin, f.data, f.broker.URL(), f.serveArgs...)
	f.api.base = f.srv.base
}

// simulate runs `devicehub simulate` until the test ends, then interrupts it.
func (f *binaryFleet) simulate(n int, interval string) {
	t := f.t
	out := &syncBuffer{}
	cmd := exec.Command(f.bin, "simulate", "-data", f.data, "-mqtt", f.broker.URL(), "-owner", binaryFleetOwner,
		"-n", fmt.Sprint(n), "-interval", interval)
	cmd.Env = crashEnv()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start simulate: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("simulate: %v", err)
			}
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("simulate still running 30s after SIGINT")
		}
		if t.Failed() {
			t.Logf("simulate logged:\n%s", out)
		}
	})
}

func (f *binaryFleet) upload(uid string, img otaImage) {
	f.t.Helper()
	body, ct := multipartForm(map[string]string{"name": "fw", "version": "2.0"}, img.bytes)
	f.api.want(f.t, http.StatusCreated, "POST", "/v1/user/devices/"+uid+"/firmwares", ct, body)
}

func (f *binaryFleet) createRollout(body any) model.Rollout {
	f.t.Helper()
	return decodeRollout(f.t, f.api.want(f.t, http.StatusCreated, "POST", "/v1/user/rollouts", "application/json", []byte(apiJSON(body))))
}

// waitRollout polls the rollout every poll until cond holds.
func (f *binaryFleet) waitRollout(id int64, what string, timeout, poll time.Duration, cond func(model.Rollout) bool) model.Rollout {
	f.t.Helper()
	get := func() model.Rollout {
		return decodeRollout(f.t, f.api.want(f.t, 200, "GET", fmt.Sprintf("/v1/user/rollouts/%d", id), "", nil))
	}
	return pollRollout(f.t, what, timeout, poll, get, cond)
}

// otaCounts reads, from the database that serve writes, how many ota
// commands for md5 each device was sent.
func (f *binaryFleet) otaCounts(md5sum string) map[string]int {
	f.t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(f.data, "devicehub.db")+"?_pragma=query_only(1)&_pragma=busy_timeout(10000)")
	must(f.t, err)
	defer db.Close()
	return rolloutOTACounts(f.t, db, binaryFleetOwner, md5sum)
}

// TestRolloutSurvivesSIGKILL kills serve with SIGKILL while the second or
// third batch is under way and starts it again on the same data: the
// rollout completes, and no device was sent a second OTA for it.
func TestRolloutSurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds the binary and runs a fleet")
	}
	// A device that was downloading when serve died reports its failure
	// to nobody; it times out (20s here) instead of holding the rollout.
	f := startBinaryFleet(t, 30, "1s", "-ota-timeout", "20s")
	img := newOTAImage(31, rolloutImageSize)
	f.upload(f.uids[0], img)
	r := f.createRollout(map[string]any{"md5": img.md5, "device_uids": f.uids, "batch_size": 10, "max_failures": 30})

	before := f.waitRollout(r.ID, "a later batch under way", 60*time.Second, 20*time.Millisecond, func(v model.Rollout) bool {
		return v.Counts["succeeded"] >= 10 && v.Counts["running"] > 0
	})
	f.srv.kill()
	t.Logf("killed with %v", before.Counts)
	f.startServer()
	done := f.waitRollout(r.ID, "completed", 90*time.Second, 100*time.Millisecond, stateIs("completed"))

	t.Logf("after the restart: %v", done.Counts)
	if done.Counts["failed"] != 0 || done.Counts["succeeded"]+done.Counts["timed_out"] != 30 || done.Counts["succeeded"] < before.Counts["succeeded"] {
		t.Errorf("counts: %v (before the kill %v)", done.Counts, before.Counts)
	}
	beforeStates := stateOfDevice(before)
	for _, d := range done.Devices {
		if beforeStates[d.UID] == "succeeded" && d.State != "succeeded" {
			t.Errorf("%s: succeeded before the kill, %s after", d.UID, d.State)
		}
	}
	counts := f.otaCounts(img.md5)
	for _, uid := range f.uids {
		if counts[uid] != 1 {
			t.Errorf("%s was sent %d ota commands for the rollout's image, want 1", uid, counts[uid])
		}
	}
}

// TestRolloutBench (opt-in: DEVICEHUB_ROLLOUT_BENCH=1) rolls a 1 MiB image
// out to 1,000 simulated devices in batches of 100 through the binary, and
// reports the time, serve's peak RSS (at most 64 MiB) and that no device
// was sent the image twice.
func TestRolloutBench(t *testing.T) {
	t.Parallel()
	if os.Getenv("DEVICEHUB_ROLLOUT_BENCH") == "" {
		t.Skip("set DEVICEHUB_ROLLOUT_BENCH=1 to run the 1,000-device rollout benchmark")
	}
	const n, batch = 1000, 100
	f := startBinaryFleet(t, n, "30s")
	img := newOTAImage(41, 1<<20)
	f.upload(f.uids[0], img)
	loadBefore := loadavg(t)
	start := time.Now()
	r := f.createRollout(map[string]any{"md5": img.md5, "device_uids": f.uids, "batch_size": batch})
	answered := time.Since(start) // the create answers once the first batch is sent
	done := f.waitRollout(r.ID, "completed", 15*time.Minute, 500*time.Millisecond, func(v model.Rollout) bool {
		return v.State != "running"
	})
	elapsed := time.Since(start)
	hwm, err := procStatus(strconv.Itoa(f.srv.cmd.Process.Pid), "VmHWM")
	must(t, err)
	counts := f.otaCounts(img.md5)
	most := 0
	for _, uid := range f.uids {
		most = max(most, counts[uid])
		if counts[uid] != 1 {
			t.Errorf("%s was sent %d ota commands, want 1", uid, counts[uid])
		}
	}
	t.Logf("rollout of a %d-byte image to %d devices in batches of %d: %s in %v; counts %v", len(img.bytes), n, batch, done.State, elapsed.Round(time.Millisecond), done.Counts)
	t.Logf("the create answered in %v, with the first batch sent", answered.Round(time.Millisecond))
	t.Logf("serve peak RSS (VmHWM): %.1f MiB; most ota commands to one device: %d", float64(hwm)/(1<<20), most)
	t.Logf("loadavg before: %s; after: %s", loadBefore, loadavg(t))
	if done.State != "completed" || done.Counts["succeeded"] != n {
		t.Errorf("rollout: %s %v", done.State, done.Counts)
	}
	if hwm > 64<<20 {
		t.Errorf("serve peak RSS %d bytes, over 64 MiB", hwm)
	}
}

func loadavg(t *testing.T) string {
	b, err := os.ReadFile("/proc/loadavg")
	must(t, err)
	return strings.TrimSpace(string(b))
}

// TestRolloutSelect: a rollout's "select" takes the team's devices that
// match when it is created, in uid order, as device_uids would name them;
// a bad select is a 422 field error, and creates nothing.
func TestRolloutSelect(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		body      map[string]any // with the md5 of alice's firmware
		want      []int          // alice's fleet devices, by number (0: her first); nil: 422
		wantError string         // the 422's body
	}{
		{name: "status", body: map[string]any{"select": map[string]string{"status": "online"}}, want: []int{1, 5, 9}},
		{name: "platform and q", body: map[string]any{"select": map[string]string{"platform": "esp8266", "q": "fleet 1"}}, want: []int{10, 12}},
		{name: "board and status", body: map[string]any{"select": map[string]string{"board": "wroom", "status": "reconnecting,pending"}}, want: []int{3}},
		{name: "every device", body: map[string]any{"select": map[string]string{}}, want: []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}},
		{name: "with device_uids", body: map[string]any{"select": map[string]string{}, "device_uids": []string{"x"}},
			wantError: apiFieldError("select", "The select field must not be given with device_uids.")},
		{name: "not an object", body: map[string]any{"select": "online"},
			wantError: apiFieldError("select", "The select field must be an object of status, platform, board, q.")},
		{name: "null", body: map[string]any{"select": nil},
			wantError: apiFieldError("select", "The select field must be an object of status, platform, board, q.")},
		{name: "an unknown field", body: map[string]any{"select": map[string]string{"model": "x"}},
			wantError: apiFieldError("select", "The select field may only have the fields status, platform, board, q.")},
		{name: "status not a string", body: map[string]any{"select": map[string]any{"status": 1}},
			wantError: apiFieldError("select.status", "The select.status field must be a string.")},
		{name: "status empty", body: map[string]any{"select": map[string]any{"status": ""}},
			wantError: apiFieldError("select.status", "The select.status field must not be empty.")},
		{name: "unknown status", body: map[string]any{"select": map[string]any{"status": "asleep"}},
			wantError: apiFieldError("select.status", "The select.status field must be a comma-separated list of pending, online, offline, reconnecting.")},
		{name: "platform not a key", body: map[string]any{"select": map[string]any{"platform": "a/b"}},
			wantError: apiFieldError("select.platform", "The select.platform field must be a key: letters, digits, dots, underscores and dashes.")},
		{name: "no device matches", body: map[string]any{"select": map[string]any{"status": "online", "platform": "avr"}},
			wantError: apiFieldError("select", "The select field matches none of your devices.")},
		{name: "only another team's devices match", body: map[string]any{"select": map[string]any{"q": "fleet2x"}},
			wantError: apiFieldError("select", "The select field matches none of your devices.")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newRolloutEnv(t, 1)
			addFleet(t, e.st, e.teamOf(e.alice), 12)
			addFleet(t, e.st, e.teamOf(e.bob), 12)
			e.report("esp32_fleet1x5", e.img.md5) // runs the image already: skipped
			tt.body["md5"] = e.img.md5
			before := dbState(t, e.st)
			w := e.request("POST", "/v1/user/rollouts", e.alice.token, tt.body)
			if tt.want == nil {
				checkAnswer(t, w, http.StatusUnprocessableEntity, tt.wantError)
				sameState(t, "a refused rollout", before, dbState(t, e.st))
				return
			}
			checkAnswer(t, w, http.StatusCreated, "")
			sameState(t, "alice's rollout", before, dbState(t, e.st), e.bob.id)
			var want []string
			for _, i := range tt.want {
				want = append(want, e.fleetUID(i))
			}
			slices.Sort(want)
			got := decodeRollout(t, w.Body.Bytes())
			for i, d := range got.Devices {
				state := map[bool]model.RolloutDeviceState{true: "waiting", false: "pending"}[i < 10] // no broker: the first batch waits
				if d.UID == "esp32_fleet1x5" {
					state = "skipped"
				}
				if i >= len(want) || d.UID != want[i] || d.State != state {
					t.Errorf("device %d: got %s %s, want %s %s", i, d.UID, d.State, want[min(i, len(want)-1)], state)
				}
			}
			if len(got.Devices) != len(want) {
				t.Errorf("got %d devices, want %d", len(got.Devices), len(want))
			}
			wantDB(t, e.st, strings.Join(want, ","), `SELECT group_concat(d.uid, ',' ORDER BY rd.position)
				FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id JOIN firmwares f ON f.device_id = d.id
				WHERE rd.rollout_id = ? AND f.md5 = ?`, got.ID, e.img.md5)
			// No broker: no device was sent the OTA, none targets the image.
			wantDB(t, e.st, "0", `SELECT count(*) FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
				JOIN firmwares f ON f.id = d.target_firmware_id WHERE rd.rollout_id = ? AND f.md5 = ?`, got.ID, e.img.md5)
		})
	}
}

// fleetUID is the uid of alice's device number i of addFleet (0: her first).
func (e *rolloutEnv) fleetUID(i int) string {
	switch {
	case i == 0:
		return e.alice.device
	case i%2 == 1:
		return fmt.Sprintf("esp32_fleet%dx%d", e.teamOf(e.alice), i)
	}
	return fmt.Sprintf("esp8266_fleet%dx%d", e.teamOf(e.alice), i)
}

// TestRolloutSelectLarge: a select of 100,000 devices makes a rollout of
// all of them in uid order, each with its firmware row, made its target
// when its batch is sent, and the engine moves it on batch by batch (BenchmarkRolloutAdvance has its
// time and memory). Under the race detector, which makes SQLite several
// times slower, the fleet is 10,000: still ten batches and an answer far
// past what a buffered one holds.
func TestRolloutSelectLarge(t *testing.T) {
	t.Parallel()
	link := &recordingLink{}
	e := newTestEnv(t, link)
	img := newOTAImage(31, rolloutImageSize)
	e.uploadImage(e.alice, e.alice.device, img, "fw", "2.0")
	n := 100_000
	if raceEnabled {
		n = 10_000
	}
	addFleet(t, e.st, e.teamOf(e.alice), n)
	mustExec(t, e.st, `UPDATE devices SET status = 'online'`)
	w := e.want(t, http.StatusCreated, "POST", "/v1/user/rollouts", e.alice.token,
		map[string]any{"md5": img.md5, "select": map[string]string{"q": "fleet"}, "batch_size": 1000})
	created := decodeRollout(t, w.Body.Bytes()) // streamed: far past what an answer holds
	if id := created.ID; len(created.Devices) != n || created.Counts["running"] != 1000 || w.Header().Get("Content-Length") != "" {
		t.Fatalf("rollout %d: %d devices, counts %v, Content-Length %q; want %d devices, 1000 running, streamed",
			id, len(created.Devices), created.Counts, w.Header().Get("Content-Length"), n)
	}
	id := created.ID
	wantDB(t, e.st, fmt.Sprint(n), `SELECT count(*) FROM rollout_devices WHERE rollout_id = ?`, id)
	wantDB(t, e.st, "0", `SELECT count(*) FROM (SELECT rd.position, row_number() OVER (ORDER BY d.uid) - 1 AS nth
		FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id WHERE rd.rollout_id = ?) WHERE position != nth`, id)
	targets := func(want int) { // the devices sent the OTA, and only they, target the image
		t.Helper()
		wantDB(t, e.st, fmt.Sprint(want), `SELECT count(*) FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id
			JOIN firmwares f ON f.id = d.target_firmware_id WHERE rd.rollout_id = ? AND f.md5 = ? AND rd.position < ?`, id, img.md5, want)
		wantDB(t, e.st, fmt.Sprint(n), `SELECT count(*) FROM devices d JOIN firmwares f ON f.device_id = d.id
			WHERE d.name LIKE 'fleet %' AND f.md5 = ? AND (f.id IS d.target_firmware_id) = (d.id IN
			(SELECT device_id FROM rollout_devices WHERE rollout_id = ? AND position < ?))`, img.md5, id, want)
	}
	targets(1000)
	states := func(want string) {
		t.Helper()
		wantDB(t, e.st, want, `SELECT group_concat(state || ' ' || n || ' ' || lo || '-' || hi, ', ') FROM (SELECT state,
			count(*) AS n, min(position) AS lo, max(position) AS hi FROM rollout_devices WHERE rollout_id = ? GROUP BY state ORDER BY lo)`, id)
	}
	states(fmt.Sprintf("running 1000 0-999, pending %d 1000-%d", n-1000, n-1))
	if got := len(link.take()); got != 1000 {
		t.Errorf("first batch: %d commands sent, want 1000", got)
	}
	mustExec(t, e.st, `UPDATE commands SET state = 'succeeded', finished_at = updated_at`)
	e.srv.rollouts.advance(context.Background())
	states(fmt.Sprintf("succeeded 1000 0-999, running 1000 1000-1999, pending %d 2000-%d", n-2000, n-1))
	if got := len(link.take()); got != 1000 {
		t.Errorf("second batch: %d commands sent, want 1000", got)
	}
	targets(2000)
}
