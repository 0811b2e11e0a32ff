package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// revertEnv is a healthRollout whose four devices ran earlier firmwares
// before a rollout of img to all four (batch_size 4, max_failures 1) that
// they all took: the first ran old, the second old or old2, the third a
// file nobody holds, the fourth nothing reported.
type revertEnv struct {
	*healthRollout
	old, old2 otaImage
	r         rollout
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
		t.Fatalf("the rollout: %s %v, want completed", v.State, v.deviceStates())
	}
	e.sent.take()
	return e
}

// devices lists the revert's devices as state/md5/error, in order.
func (v rollout) revertDevices() string {
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
		state    rolloutState // the rollout's, set before the revert
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
				v.MaxFailures != 1 || v.Health == nil || *v.Health != (rolloutHealth{5, 2, 0}) || v.OnHalt != "stop" ||
				v.Reverts == nil || *v.Reverts != e.r.ID || v.RevertedBy != nil || v.revertDevices() != wantDevices {
				t.Errorf("the revert: %s\ndevices %s\nwant     %s", w.Body, v.revertDevices(), wantDevices)
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
	v, err := e.st.createUser(context.Background(), "Vic", "vic@example.com", "viewer", "", e.alice.email)
	must(t, err)
	_, token, err := issueToken(context.Background(), e.st, v, "vic", nil)
	must(t, err)
	return token
}
