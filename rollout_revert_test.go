package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"devicehub/internal/model"
	"devicehub/sim"
)

// revertEnv is a healthRollout whose four devices ran earlier firmwares
// before a rollout of img to all four (batch_size 4, max_failures 1) that
// they all took: the first ran old, the second old or old2, the third a
// file nobody holds, the fourth nothing reported.
type revertEnv struct {
	*healthRollout
	old, old2 otaImage
	r         model.Rollout
}

const unheldMD5 = "0123456789abcdef0123456789abcdef"

func newRevertEnv(t *testing.T, secondOn string) *revertEnv {
	t.Helper()
	e := &revertEnv{healthRollout: newHealthRollout(t), old: newOTAImage(13, rolloutImageSize), old2: newOTAImage(14, rolloutImageSize)}
	e.uploadImage(e.alice, e.uids[0], e.old, "fw", "1.0")
	e.uploadImage(e.alice, e.uids[1], e.old2, "fw", "1.1")
	earlier := map[string]string{"old": e.old.md5, "old2": e.old2.md5}
	for i, sum := range []string{e.old.md5, earlier[secondOn], unheldMD5} {
		tell(e.testEnv, e.link, e.uids[i], "telemetry", `{"fw_md5":"`+sum+`","uptime_s":100}`)
	}
	e.clock.advance(time.Minute)
	e.r = e.createRollout(e.alice, map[string]any{"md5": e.img.md5, "device_uids": e.uids, "batch_size": 4, "max_failures": 1,
		"name": "spring", "health": map[string]any{"max_crash_rate": 5, "watch_minutes": 0}})
	e.flash(e.uids...)
	if v := e.states(e.r.ID); v.State != "completed" {
		t.Fatalf("the rollout: %s %v, want completed", v.State, stateOfDevice(v))
	}
	e.sent.take()
	return e
}

// devices lists the revert's devices as state/md5/error, in order.
func revertDevices(v model.Rollout) string {
	var s []string
	for _, d := range v.Devices {
		s = append(s, fmt.Sprintf("%s/%s/%s", d.State, deref(d.MD5), deref(d.Error)))
	}
	return strings.Join(s, " | ")
}

func deref(p *string) string {
	if p == nil {
		return "-"
	}
	return *p
}

// TestRolloutRevert: POST …/revert on a halted, cancelled or completed
// rollout makes "Revert of <name>" (201): each device the rollout updated
// is sent the md5 it ran before (the online ones at once), with the same
// batch size, failure limit and health gate; a device whose earlier file
// the team does not hold, or that ran nothing reported before, is
// skipped saying so; its md5 is null when the devices go back to
// different files. Each side names the other, and the audit log has
// rollout.revert. A running or paused rollout, or one already reverted:
// 422; another team's: 404; a viewer: 403.
func TestRolloutRevert(t *testing.T) {
	t.Parallel()
	noEarlier := "skipped/-/It ran no firmware reported before that rollout."
	unheld := "skipped/" + unheldMD5 + "/Your team no longer holds its earlier firmware (md5 " + unheldMD5 + ")."
	for _, tt := range []struct {
		name     string
		state    model.RolloutState // the rollout's, set before the revert
		secondOn string
		as       string // alice, bob or viewer
		again    bool   // reverted once before
		status   int
		message  string
		md5      string // the revert's: old, old2 or null
		devices  string // o: old's md5, p: old2's
	}{
		{"completed", "completed", "old", "alice", false, 201, "", "old", "running/o/- | running/o/- | " + unheld + " | " + noEarlier},
		{"halted", "halted", "old", "alice", false, 201, "", "old", "running/o/- | running/o/- | " + unheld + " | " + noEarlier},
		{"cancelled", "cancelled", "old", "alice", false, 201, "", "old", "running/o/- | running/o/- | " + unheld + " | " + noEarlier},
		{"mixed md5", "halted", "old2", "alice", false, 201, "", "null", "running/o/- | running/p/- | " + unheld + " | " + noEarlier},
		{"running", "running", "old", "alice", false, 422, "Only a halted, cancelled or completed rollout can be reverted.", "", ""},
		{"paused", "paused", "old", "alice", false, 422, "Only a halted, cancelled or completed rollout can be reverted.", "", ""},
		{"already reverted", "completed", "old", "alice", true, 422, "This rollout is already reverted.", "", ""},
		{"another team's", "completed", "old", "bob", false, 404, "Rollout not found.", "", ""},
		{"a viewer", "completed", "old", "viewer", false, 403, "", "", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRevertEnv(t, tt.secondOn)
			mustExec(t, e.st, `UPDATE rollouts SET state = ? WHERE id = ?`, tt.state, e.r.ID)
			path := fmt.Sprintf("/v1/user/rollouts/%d/revert", e.r.ID)
			if tt.again {
				e.want(t, http.StatusCreated, "POST", path, e.alice.token, nil)
				e.sent.take()
			}
			token := map[string]string{"alice": e.alice.token, "bob": e.bob.token, "viewer": viewerToken(t, e.testEnv)}[tt.as]
			before := dbState(t, e.st)
			w := e.request("POST", path, token, nil)
			if w.Code != tt.status {
				t.Fatalf("got %d %s, want %d", w.Code, w.Body, tt.status)
			}
			if tt.status != http.StatusCreated {
				if tt.message != "" && !strings.Contains(w.Body.String(), `"message":"`+tt.message+`"`) {
					t.Errorf("body %s, want message %q", w.Body, tt.message)
				}
				sameState(t, "a refused revert", before, dbState(t, e.st))
				if len(e.sent.take()) != 0 {
					t.Error("a refused revert sent commands")
				}
				return
			}
			v := decodeRollout(t, w.Body.Bytes())
			md5s := map[string]string{"old": e.old.md5, "old2": e.old2.md5, "null": "-"}
			wantDevices := strings.NewReplacer("/o/", "/"+e.old.md5+"/", "/p/", "/"+e.old2.md5+"/").Replace(tt.devices)
			if deref(v.Name) != "Revert of spring" || deref(v.MD5) != md5s[tt.md5] || v.State != "running" || v.BatchSize != 4 ||
				v.MaxFailures != 1 || v.Health == nil || *v.Health != (model.RolloutHealth{MaxCrashRate: 5, MinCrashes: 2, WatchMinutes: 0}) || v.OnHalt != "stop" ||
				v.Reverts == nil || *v.Reverts != e.r.ID || v.RevertedBy != nil || revertDevices(v) != wantDevices {
				t.Errorf("the revert: %s\ndevices %s\nwant     %s", w.Body, revertDevices(v), wantDevices)
			}
			if got := e.rollout(e.alice, e.r.ID); got.RevertedBy == nil || *got.RevertedBy != v.ID || got.Reverts != nil {
				t.Errorf("the rollout reverted: reverted_by %v, reverts %v; want %d, null", got.RevertedBy, got.Reverts, v.ID)
			}
			wantDB(t, e.st, fmt.Sprint(e.r.ID), `SELECT reverts FROM rollouts WHERE id = ?`, v.ID)
			wantDB(t, e.st, "rollout.revert "+fmt.Sprint(e.alice.id), `SELECT action || ' ' || actor_id FROM audit ORDER BY id DESC LIMIT 1`)
			// The two devices going back are sent the md5 each ran before,
			// and it becomes their target.
			sent := map[string]bool{}
			for _, p := range e.sent.take() {
				sent[p.uid] = true
			}
			if len(sent) != 2 || !sent[e.uids[0]] || !sent[e.uids[1]] {
				t.Errorf("OTA commands sent to %v, want the first two devices", sent)
			}
			e.old2 = map[string]otaImage{"old": e.old, "old2": e.old2}[tt.secondOn]
			want := e.old.md5 + " " + e.old2.md5
			got := scalar(t, e.st, `SELECT group_concat(f.md5, ' ') FROM (SELECT f.md5 FROM devices d JOIN firmwares f ON f.id = d.target_firmware_id
				WHERE d.uid IN (?, ?) ORDER BY d.uid = ?) f`, e.uids[0], e.uids[1], e.uids[1])
			if got != want {
				t.Errorf("targets %s, want %s", got, want)
			}
		})
	}
}

// viewerToken makes a viewer in alice's team and returns their token.
func viewerToken(t *testing.T, e *testEnv) string {
	t.Helper()
	v, err := e.st.CreateUser(context.Background(), "Vic", "vic@example.com", "viewer", "", e.alice.email)
	must(t, err)
	_, token, err := issueToken(context.Background(), e.st, v, "vic", nil, nil)
	must(t, err)
	return token
}

// TestRolloutRevertsOnHalt: a rollout with "on_halt": "revert" that the
// engine halts, for health or past max_failures, is reverted at once, as
// devicehub: the revert (its audit entry without an actor) sends the
// devices it updated the md5 each ran before, and the devices it never
// reached are left alone. With "on_halt": "stop" (the default) it halts
// and nothing more. A device of the rollout still running its OTA
// command when it halts holds the revert back until the command ends,
// and goes back with the others once it took the firmware.
func TestRolloutRevertsOnHalt(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, onHalt, halt string
		batch              int
		reverted           string // the uids (by index) the revert sends old, in order
	}{
		{"health, stop", "stop", "health", 2, ""},
		{"health, revert", "revert", "health", 2, "0 1"},
		{"failures, revert", "revert", "failures", 2, "0"},
		{"health, revert, a device still flashing", "revert", "health", 3, "0 1 2"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHealthRollout(t)
			old := newOTAImage(13, rolloutImageSize)
			h.uploadImage(h.alice, h.uids[0], old, "fw", "1.0")
			for _, uid := range h.uids {
				tell(h.testEnv, h.link, uid, "telemetry", `{"fw_md5":"`+old.md5+`","uptime_s":100}`)
			}
			h.clock.advance(time.Minute)
			r := h.createRollout(h.alice, map[string]any{"md5": h.img.md5, "device_uids": h.uids, "batch_size": tt.batch, "on_halt": tt.onHalt,
				"name": "night", "health": map[string]any{"max_crash_rate": 1, "min_crashes": 2, "watch_minutes": 30}})
			if r.OnHalt != tt.onHalt {
				t.Fatalf("created: on_halt %q, want %q", r.OnHalt, tt.onHalt)
			}
			h.sent.take()
			if tt.halt == "health" {
				h.flash(h.uids[0], h.uids[1])
				h.clock.advance(5 * time.Minute)
				tell(h.testEnv, h.link, h.uids[0], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
				tell(h.testEnv, h.link, h.uids[1], "telemetry", `{"reset_reason":"panic","uptime_s":1}`)
			} else {
				h.flash(h.uids[0])
				mustExec(t, h.st, `UPDATE commands SET state = 'failed', finished_at = updated_at
					WHERE id = (SELECT rd.command_id FROM rollout_devices rd JOIN devices d ON d.id = rd.device_id WHERE d.uid = ?)`, h.uids[1])
			}
			v := h.states(r.ID)
			if v.State != "halted" || !strings.Contains(string(v.HaltReason), `"kind":"`+tt.halt+`"`) {
				t.Fatalf("halted: %s %s, want halted for %s", v.State, v.HaltReason, tt.halt)
			}
			if tt.batch == 3 {
				if v.RevertedBy != nil || scalar(t, h.st, `SELECT count(*) FROM rollouts`) != "1" {
					t.Fatalf("reverted while %s still runs its OTA command", h.uids[2])
				}
				h.flash(h.uids[2])
				v = h.states(r.ID)
			}
			if tt.reverted == "" {
				if v.RevertedBy != nil {
					t.Errorf("on_halt stop: reverted_by %d", *v.RevertedBy)
				}
				wantDB(t, h.st, "1", `SELECT count(*) FROM rollouts`)
				return
			}
			if v.RevertedBy == nil {
				t.Fatalf("on_halt revert: reverted_by null")
			}
			revert := h.rollout(h.alice, *v.RevertedBy)
			var wantUIDs, gotUIDs []string
			for _, i := range strings.Fields(tt.reverted) {
				n, _ := strconv.Atoi(i)
				wantUIDs = append(wantUIDs, "running/"+h.uids[n]+"/"+old.md5)
			}
			for _, d := range revert.Devices {
				gotUIDs = append(gotUIDs, string(d.State)+"/"+d.UID+"/"+deref(d.MD5))
			}
			if deref(revert.Name) != "Revert of night" || revert.Reverts == nil || *revert.Reverts != r.ID || revert.OnHalt != "stop" ||
				strings.Join(gotUIDs, " ") != strings.Join(wantUIDs, " ") {
				t.Errorf("the revert: %+v\ndevices %v, want %v", revert, gotUIDs, wantUIDs)
			}
			wantDB(t, h.st, "rollout.revert <nil> "+fmt.Sprint(revert.ID),
				`SELECT action || ' ' || COALESCE(actor_id, '<nil>') || ' ' || json_extract(detail, '$.rollout_id') FROM audit ORDER BY id DESC LIMIT 1`)
			var sent []string
			for _, p := range h.sent.take() {
				if strings.Contains(string(p.payload), old.md5) {
					sent = append(sent, p.uid)
				}
			}
			if len(sent) != len(wantUIDs) {
				t.Errorf("OTA commands of the earlier firmware sent to %v, want %d devices", sent, len(wantUIDs))
			}
		})
	}
}

// TestRolloutBadBuildRevertsItself is issue 36's goal: a bad build rolled
// to a simulated fleet of 100 (real Mosquitto) with a health gate and
// "on_halt": "revert" halts, and with nobody acting every device that
// took it goes back to the firmware it ran before, and stops crashing;
// the devices it never reached are left on theirs.
// An OTA command published to a device in the instant it resets (before
// the server has seen it go) is lost, and sent again when it reports its
// new boot (TestOTAResentAfterAReset).
func TestRolloutBadBuildRevertsItself(t *testing.T) {
	t.Parallel()
	broker := startBroker(t)
	ln, public := listenLocal(t)
	env := newTestEnv(t, nil, withPublicURL(public), withRealClock()) // the real clock: crashes come as it runs
	linkTo(t, env, broker, 0)
	serveOn(t, ln, env.srv)
	runRolloutEngine(t, env)
	good, bad := newOTAImage(31, rolloutImageSize), newOTAImage(32, rolloutImageSize)
	uids := startFleetWith(t, env, broker, env.alice, 100, sim.Options{CrashMD5: bad.md5, CrashEvery: 2 * time.Second})
	env.uploadImage(env.alice, uids[0], good, "greenhouse", "1.0")
	env.uploadImage(env.alice, uids[0], bad, "greenhouse", "1.1-bad")
	wait := func(id int64, what string, cond func(model.Rollout) bool) model.Rollout {
		t.Helper()
		return pollRollout(t, what, 90*time.Second, 100*time.Millisecond, func() model.Rollout { return env.rollout(env.alice, id) }, cond)
	}
	first := env.createRollout(env.alice, map[string]any{"md5": good.md5, "device_uids": uids, "batch_size": 100})
	wait(first.ID, "the good build everywhere", stateIs(model.RolloutCompleted))

	r := env.createRollout(env.alice, map[string]any{"name": "greenhouse 1.1", "md5": bad.md5, "device_uids": uids, "batch_size": 10,
		"on_halt": "revert", "health": map[string]any{"max_crash_rate": 1, "min_crashes": 3, "watch_minutes": 10}})
	halted := wait(r.ID, "halted and reverted", func(v model.Rollout) bool { return v.RevertedBy != nil })
	if halted.State != model.RolloutHalted || !strings.Contains(string(halted.HaltReason), `"kind":"health"`) {
		t.Fatalf("the bad build: %s %s, want halted for health", halted.State, halted.HaltReason)
	}
	// The revert has the bad build's health gate: it watches its last
	// batch for 10 minutes before it completes.
	revert := wait(*halted.RevertedBy, "the revert's devices updated", func(v model.Rollout) bool {
		return v.Counts[model.RdSucceeded]+v.Counts[model.RdSkipped] == len(v.Devices)
	})
	wantDB(t, env.st, "<nil>", `SELECT COALESCE(actor_id, '<nil>') FROM audit WHERE action = 'rollout.revert'`)

	took := queryMap(t, storeReader(env.st), `SELECT d.uid, count(*) FROM firmware_runs fr JOIN devices d ON d.id = fr.device_id
		WHERE fr.md5 = ? GROUP BY d.uid`, bad.md5)
	if len(took) == 0 || len(took) > 10 || len(revert.Devices) != len(took) {
		t.Fatalf("%d devices took the bad build, the revert has %d: %v", len(took), len(revert.Devices), revert.Devices)
	}
	for _, d := range revert.Devices {
		if _, ok := took[d.UID]; !ok || d.State != model.RdSucceeded || deref(d.MD5) != good.md5 {
			t.Errorf("the revert's %s: %s %s, want succeeded, sent %s", d.UID, d.State, deref(d.MD5), good.md5)
		}
	}
	// Back on the earlier firmware, each stops crashing: it runs on it
	// well past the bad build's crash interval (2 s, give or take half)
	// without a crash.
	eventually(t, 30*time.Second, "every device that took the bad build up 4 s on the good one", func() bool {
		for uid := range took {
			up := scalar(t, env.st, `SELECT fr.md5 = ?2 AND unixepoch(d.last_seen_at) - fr.from_at >= 4
				AND NOT EXISTS (SELECT 1 FROM boots b WHERE b.device_id = d.id AND b.crash AND b.fw_md5 = ?2 AND b.at >= fr.from_at)
				FROM devices d JOIN firmware_runs fr ON fr.device_id = d.id AND fr.to_at IS NULL WHERE d.uid = ?1`, uid, good.md5)
			if up != "1" {
				return false
			}
		}
		return true
	})
	fleet, _ := json.Marshal(uids)
	wantDB(t, env.st, "0", `SELECT count(*) FROM devices WHERE uid IN (SELECT value FROM json_each(?)) AND current_md5 IS NOT ?`, string(fleet), good.md5)
	wantDB(t, env.st, "0", `SELECT count(*) FROM boots WHERE crash AND fw_md5 IS NOT ?`, bad.md5)
	wantDB(t, env.st, fmt.Sprint(len(took)), `SELECT count(DISTINCT c.device_id) FROM commands c WHERE c.kind = 'ota' AND c.payload LIKE ?`, "%"+bad.md5+"%")
}
