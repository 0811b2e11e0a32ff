package main

// A device's report is its own (docs/security.md, Bounds): readings past
// ±wire.MaxReading are left out, and a report or result the database
// refuses fails alone, never the batch of other devices and teams.

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
)

// otherTeamApplied checks that bob's device's messages were all written:
// its status and readings, its commands succeeded, and its history
// answers.
func otherTeamApplied(t *testing.T, env *testEnv, commands []string, readings int, status model.DeviceStatus) {
	t.Helper()
	bob := env.bob
	if d := env.device(bob); d.Status != status || d.LastRSSI == nil || *d.LastRSSI != -55 {
		t.Errorf("bob's device: %s, rssi %v; want %s at -55", d.Status, d.LastRSSI, status)
	}
	for _, id := range commands {
		if c := commandRecord(t, env, bob, id); c.State != "succeeded" {
			t.Errorf("bob's command %s: %s, want succeeded", id, c.State)
		}
	}
	for _, path := range []string{"/v1/user/devices/" + bob.device + "/history?series=rssi",
		"/v1/user/devices/" + bob.device + "/presence", "/v1/user/devices/" + bob.device + "/boots",
		"/v1/user/firmware-health"} {
		if w := env.request("GET", path, bob.token, nil); w.Code != http.StatusOK {
			t.Errorf("GET %s: %d %s, want 200", path, w.Code, w.Body)
		}
	}
	var rssi int64
	for _, s := range samplesOf(t, env, bob) {
		if s.Series == "rssi" {
			rssi += s.Count
		}
	}
	if rssi != int64(readings) {
		t.Errorf("bob's rssi readings in his history: %d, want %d", rssi, readings)
	}
}

// bobSays hands the link what bob's device says in one batch: a reading,
// a result for each of its commands, and offline.
func bobSays(l *mqttlink.Offline, env *testEnv, commands []string) {
	uid := env.bob.device
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"rssi":-55,"heap_free":120000,"uptime_s":30,"metrics":{"temp_c":21.5,"rh":40}}`), false)
	for _, id := range commands {
		l.Handle("devices/"+uid+"/result/"+id, []byte(`{"ok":true}`), false)
	}
	l.Handle("devices/"+uid+"/status", []byte("offline"), false)
}

// samplesOf returns every bucket of the user's device's history, in
// memory and written.
func samplesOf(t *testing.T, env *testEnv, u testUser) []history.Sample {
	t.Helper()
	ctx := context.Background()
	d := env.deviceRef(u)
	series, err := env.st.SeriesOf(ctx, d)
	must(t, err)
	var all []history.Sample
	for _, s := range series {
		list, err := env.st.BucketsOf(ctx, d, s.Series, 0, math.MaxInt64)
		must(t, err)
		all = append(all, list...)
	}
	return all
}

// online sets both test users' devices online, so that they take commands.
func online(env *testEnv) {
	env.setStatus(env.alice.device, string(model.StatusOnline))
	env.setStatus(env.bob.device, string(model.StatusOnline))
}

// TestHugeReadingsLoseNothingElse: issue 35's attack. Alice's device sends
// readings of 1e308 twice, then -1e308 twice (a sum made infinite, then
// NaN, which the bucket's NOT NULL column refused, failing the whole
// batch: before, bob's status, reading and five results went with it, and
// his commands were left to time out). Now each such reading is left out
// and counted as a bad field, nothing infinite reaches the database, and
// every message of bob's team in the same batch is written.
func TestHugeReadingsLoseNothingElse(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	l := newOfflineLink(env.st, env.log)
	online(env)
	var commands []string
	for range 5 {
		commands = append(commands, sendOK(t, env, env.bob, "/commands", `{"payload":{}}`))
	}
	attacker := "devices/" + env.alice.device + "/telemetry"
	l.Handle(attacker, []byte(`{"rssi":-60,"metrics":{"x":1e308}}`), false)
	l.Handle(attacker, []byte(`{"metrics":{"x":1e308}}`), false)
	l.Flush()
	l.Handle(attacker, []byte(`{"metrics":{"x":-1e308}}`), false)
	l.Handle(attacker, []byte(`{"metrics":{"x":-1e308}}`), false)
	bobSays(l, env, commands)
	l.Flush()

	otherTeamApplied(t, env, commands, 1, model.StatusOffline)
	if d := l.Stats().Drops; d["bad_telemetry"] != 4 || d["write_failed"] != 0 {
		t.Errorf("drops: %v, want the 4 huge readings as bad_telemetry, nothing failed", d)
	}
	if got := samplesOf(t, env, env.alice); len(got) != 1 || got[0].Series != "rssi" || got[0].Sum != -60 || got[0].Count != 1 {
		t.Errorf("the attacker's history: %+v, want rssi -60 once and nothing of the huge readings", got)
	}
	if w := env.request("GET", "/v1/user/devices/"+env.alice.device+"/history?series=rssi", env.alice.token, nil); w.Code != http.StatusOK {
		t.Errorf("the attacker's own rssi history: %d %s, want 200", w.Code, w.Body)
	}
}

// TestFailedWriteFailsAlone: a report and a result the database refuses
// (the test's triggers refuse every write to alice's device and its
// commands) are undone alone, counted as write_failed and logged, and
// not tried again; the rest of their batch, bob's team's status, reading
// and results, is written. The same holds when the refused device is in
// a chunk of statuses written in one statement. Before, each batch
// failed whole.
func TestFailedWriteFailsAlone(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	l := newOfflineLink(env.st, env.log)
	online(env)
	aliceCmd := sendOK(t, env, env.alice, "/commands", `{"payload":{}}`)
	var commands []string
	for range 3 {
		commands = append(commands, sendOK(t, env, env.bob, "/commands", `{"payload":{}}`))
	}
	aliceID := env.device(env.alice).ID
	for table, column := range map[string]string{"devices": "NEW.id", "commands": "OLD.device_id"} {
		mustExec(t, env.st, fmt.Sprintf(`CREATE TRIGGER refuse_%s BEFORE UPDATE ON %[1]s WHEN %s = %d
			BEGIN SELECT RAISE(ABORT, 'refused by the test'); END`, table, column, aliceID))
	}

	// A report with telemetry, and a result, each refused.
	alice := "devices/" + env.alice.device
	l.Handle(alice+"/telemetry", []byte(`{"rssi":-40,"metrics":{"temp_c":30}}`), false)
	l.Handle(alice+"/result/"+aliceCmd, []byte(`{"ok":true}`), false)
	bobSays(l, env, commands[:2])
	l.Flush()
	// A status, refused in a chunk with bob's status and result.
	l.Handle(alice+"/status", []byte("offline"), false)
	l.Handle("devices/"+env.bob.device+"/result/"+commands[2], []byte(`{"ok":true}`), false)
	l.Handle("devices/"+env.bob.device+"/status", []byte("reconnecting"), false)
	l.Flush()

	otherTeamApplied(t, env, commands, 1, model.StatusReconnecting)
	if d := l.Stats().Drops; d["write_failed"] != 3 {
		t.Errorf("drops: %v, want alice's report, result and status as write_failed", d)
	}
	if d := env.device(env.alice); d.Status != model.StatusOnline || d.LastRSSI != nil {
		t.Errorf("alice's device: %s, rssi %v; want nothing of its refused reports", d.Status, d.LastRSSI)
	}
	if c := commandRecord(t, env, env.alice, aliceCmd); c.State != "sent" {
		t.Errorf("alice's command: %s, want sent: its refused result undone", c.State)
	}
	if got := samplesOf(t, env, env.alice); len(got) != 0 {
		t.Errorf("alice's history: %+v, want nothing of her refused report", got)
	}
	if logs := env.logs.String(); !strings.Contains(logs, "device messages not written") ||
		!strings.Contains(logs, env.alice.device) || !strings.Contains(logs, "refused by the test") {
		t.Errorf("log: %s; want the failed writes logged, naming alice's device and the error", logs)
	}

	// Not tried again: the next batch writes only what it holds.
	mustExec(t, env.st, `DROP TRIGGER refuse_devices`)
	l.Handle(alice+"/telemetry", []byte(`{"heap_free":1000}`), false)
	l.Flush()
	if d := env.device(env.alice); d.LastRSSI != nil {
		t.Errorf("alice's rssi after a later report: %v, want none: the refused report is not written later", d.LastRSSI)
	}
}

// TestClosedBucketFailsAlone: a closed 5-minute bucket whose row the
// database refuses (the test's trigger refuses alice's) is left out
// alone, counted as write_failed and not tried again, and bob's bucket,
// closed in the same flush, is written with the rest of the batch.
// Before, the refusal failed every batch while the bucket stayed in
// memory.
func TestClosedBucketFailsAlone(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	l := newOfflineLink(env.st, env.log)
	aliceID := env.device(env.alice).ID
	mustExec(t, env.st, fmt.Sprintf(`CREATE TRIGGER refuse_rows BEFORE INSERT ON history_rows WHEN NEW.device_id = %d
		BEGIN SELECT RAISE(ABORT, 'refused by the test'); END`, aliceID))
	for _, u := range []testUser{env.alice, env.bob} {
		l.Handle("devices/"+u.device+"/telemetry", []byte(`{"rssi":-50}`), false)
	}
	l.Flush()
	env.clock.advance(history.BucketSeconds * time.Second) // both buckets close
	l.Handle("devices/"+env.bob.device+"/status", []byte("offline"), false)
	l.Flush()
	l.Handle("devices/"+env.bob.device+"/status", []byte("online"), false)
	l.Flush()

	if d := l.Stats().Drops; d["write_failed"] != 1 {
		t.Errorf("drops: %v, want alice's bucket once as write_failed", d)
	}
	wantDB(t, env.st, "0", `SELECT count(*) FROM history_rows WHERE device_id = ?`, aliceID)
	wantDB(t, env.st, "1", `SELECT count(*) FROM history_rows WHERE device_id = ?`, env.device(env.bob).ID)
	if d := env.device(env.bob); d.Status != model.StatusOnline {
		t.Errorf("bob's device: %s, want online: the batches after the refusal written", d.Status)
	}
}
