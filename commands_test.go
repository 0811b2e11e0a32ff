package main

// Command records, device results, timeouts and the presence backstop.
// Devices are raw MQTT clients on a real Mosquitto; tests about records
// alone use a recordingLink.

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
	"devicehub/sim"
)

// reply is one message a test device publishes when it gets a command:
// on "result" (then on its result topic for that command) or "telemetry".
type reply struct{ on, payload string }

// received is a command as a test device got it.
type received struct {
	id      string
	payload []byte
}

// cmdDevice is a raw MQTT client acting as one device: it says "online"
// (retained), takes its commands on devices/{uid}/cmd/+ and answers each
// with the replies the test queued on script, or with {"ok":true} when
// none are queued.
type cmdDevice struct {
	tb     testing.TB
	c      mqtt.Client
	u      testUser      // the owner, with device set to this device's uid
	got    chan received // each command, once its replies are published
	script chan []reply  // replies to the next commands, in order
}

// newCmdDevice connects u's device and waits until the server sees it online.
func newCmdDevice(tb testing.TB, b *testBroker, env *testEnv, u testUser) *cmdDevice {
	tb.Helper()
	d := &cmdDevice{tb: tb, u: u, got: make(chan received, 1024), script: make(chan []reply, 16)}
	d.c = testClient(tb, b, "dev-"+u.device, "")
	if t := d.c.Subscribe(d.topic("cmd/+"), 1, d.onCommand); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("subscribe to commands: %v", t.Error())
	}
	d.publish("status", "online", true)
	eventually(tb, 5*time.Second, u.device+" online", func() bool { return env.device(u).Status == "online" })
	return d
}

func (d *cmdDevice) topic(sub string) string { return "devices/" + d.u.device + "/" + sub }

// publish sends payload on the device's topic sub and waits for the broker.
func (d *cmdDevice) publish(sub, payload string, retained bool) {
	d.tb.Helper()
	publishWait(d.tb, d.c, d.topic(sub), retained, payload)
}

// onCommand answers a command from a goroutine of its own: paho's handler
// must not wait for a publish.
func (d *cmdDevice) onCommand(_ mqtt.Client, m mqtt.Message) {
	id := strings.TrimPrefix(m.Topic(), d.topic("cmd/"))
	replies := []reply{{"result", `{"ok":true}`}}
	select {
	case replies = <-d.script:
	default:
	}
	go func() {
		for _, r := range replies {
			topic := d.topic(r.on)
			if r.on == "result" {
				topic += "/" + id
			}
			if t := d.c.Publish(topic, 1, false, r.payload); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
				d.tb.Errorf("device reply on %s: %v", topic, t.Error())
			}
		}
		select {
		case d.got <- received{id, m.Payload()}:
		default: // nobody reads (a benchmark)
		}
	}()
}

// next returns the next command the device got.
func (d *cmdDevice) next(t *testing.T) received {
	t.Helper()
	return receive(t, d.got, 5*time.Second, "command to the device")
}

// withDevice is u with another of u's devices as its device.
func withDevice(u testUser, uid string) testUser {
	u.device = uid
	return u
}

// sendOK posts to a command endpoint of u's device (sub is the path after
// the uid) and returns the command id of its 200 answer.
func sendOK(tb testing.TB, env *testEnv, u testUser, sub string, body any) string {
	tb.Helper()
	w := env.request("POST", "/v1/user/devices/"+u.device+sub, u.token, body)
	id, _ := decode(tb, w)["command_id"].(string)
	if w.Code != http.StatusOK || id == "" {
		tb.Fatalf("POST %s: got %d %s, want 200 with a command_id", sub, w.Code, w.Body)
	}
	return id
}

// getCommand reads one of u's device's commands through the API.
func getCommand(tb testing.TB, env *testEnv, u testUser, id string) map[string]any {
	tb.Helper()
	w := env.want(tb, http.StatusOK, "GET", "/v1/user/devices/"+u.device+"/commands/"+id, u.token, nil)
	return decode(tb, w)["data"].(map[string]any)
}

// commandIDs lists u's device's commands through the API, page by page
// of limit, following before, and returns their ids in order.
func commandIDs(tb testing.TB, env *testEnv, u testUser, limit int) []string {
	tb.Helper()
	var ids []string
	before := ""
	for page := 0; ; page++ {
		path := fmt.Sprintf("/v1/user/devices/%s/commands?limit=%d", u.device, limit)
		if before != "" {
			path += "&before=" + before
		}
		data := decode(tb, env.want(tb, http.StatusOK, "GET", path, u.token, nil))["data"].([]any)
		if len(data) > limit {
			tb.Fatalf("page %d has %d commands, more than limit %d", page, len(data), limit)
		}
		if len(data) == 0 {
			return ids
		}
		for _, c := range data {
			ids = append(ids, c.(map[string]any)["id"].(string))
		}
		before = ids[len(ids)-1]
	}
}

// dropped is how many device messages the link dropped for reason.
func dropped(l *mqttlink.Link, reason string) int64 { return l.Stats().Drops[reason] }

// wantCommand is what a test expects of a command object.
type wantCommand struct {
	kind     string
	buttonID any    // string or nil
	payload  string // JSON
	state    string
	progress any    // float64 or nil
	result   string // JSON; "" is null
	error    any    // string or nil
}

// checkCommand compares a command object from the API with want.
func checkCommand(t *testing.T, c map[string]any, id string, want wantCommand) {
	t.Helper()
	commandKeys := []string{"button_id", "created_at", "error", "finished_at", "id", "kind", "payload",
		"progress", "result", "sent_by", "state", "updated_at"} // sorted
	if keys := slices.Sorted(maps.Keys(c)); !slices.Equal(keys, commandKeys) {
		t.Errorf("command keys = %v, want %v", keys, commandKeys)
	}
	payload, _ := json.Marshal(c["payload"])
	result, _ := json.Marshal(c["result"])
	wantResult := cmp.Or(want.result, "null")
	if c["id"] != id || c["kind"] != want.kind || c["button_id"] != want.buttonID || c["state"] != want.state ||
		c["progress"] != want.progress || c["error"] != want.error ||
		!jsonEqual(t, payload, []byte(want.payload)) || !jsonEqual(t, result, []byte(wantResult)) {
		got, _ := json.Marshal(c)
		t.Errorf("command = %s\nwant id %s kind %s button_id %v payload %s state %s progress %v result %s error %v",
			got, id, want.kind, want.buttonID, want.payload, want.state, want.progress, wantResult, want.error)
	}
	final := want.state != "sent" && want.state != "running"
	if (c["finished_at"] != nil) != final || c["created_at"] == nil || c["updated_at"] == nil {
		t.Errorf("state %s: created_at %v updated_at %v finished_at %v", want.state, c["created_at"], c["updated_at"], c["finished_at"])
	}
}

// TestCommandStates: a raw MQTT device takes every command to each state,
// and every command endpoint publishes its payload, as the device contract
// gives it, under the command id it answers, and makes a record of its
// kind with that payload (an OTA also succeeds when the device just
// reports the new md5, as a stock updater does); ?wait= answers with the
// command once it has ended, or as it stands.
func TestCommandStates(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	dev := newCmdDevice(t, b, env, a)
	apiAddButton(t, env, a, model.CommandButton{ID: "led-on", Label: "LED on", Payload: json.RawMessage(`{"cmd":"led","on":true}`)})
	image, bare, empty := otaFirmware(4096, 3), []byte("\xe9no version"), []byte("\xe9empty version")
	_, bareMD5 := env.uploadOK(a, map[string]string{"name": "nv"}, bare)
	_, emptyMD5 := env.uploadOK(a, map[string]string{"name": "ev", "version": ""}, empty)
	sum, _ := otaAssign(t, env, a, "blink", "2.0.0", image)
	// ota is the payload of an ota command for the firmware with that md5:
	// version null when it has none, "&" in the url as is, not \u0026.
	ota := func(sum string, file []byte, version string) string {
		exp := env.clock.now().Add(otaLinkLifetime).Unix()
		return fmt.Sprintf(`{"cmd":"ota","url":"http://devicehub.test/ota/%s/%s.bin?exp=%d&sig=%s","md5":"%s","sha256":"%s","size":%d,"version":%s}`,
			a.device, sum, exp, otaSignature(env.srv.ota.key, a.device, sum, exp), sum, sha256Hex(file), len(file), version)
	}
	ok := []reply{{"result", `{"ok":true}`}}
	tests := []struct {
		name      string
		sub, body string // the endpoint and body; a custom command {"case":name} when sub is empty
		target    string // the md5 of the OTA target to set first
		message   string // of the answer; "Command sent." when empty
		replies   []reply
		wait      string // ?wait=; "" for none
		timeOut   bool   // move the clock past the command timeout once the device has the command
		want      wantCommand
	}{
		{name: "sent", wait: "0", want: wantCommand{state: "sent"}},
		{name: "running", replies: []reply{{"result", `{"progress":40,"state":"downloading"}`}},
			want: wantCommand{state: "running", progress: 40.0}},
		{name: "succeeded", wait: "5",
			replies: []reply{{"result", `{"progress":50,"state":"working"}`}, {"result", `{"ok":true,"result":{"uptime":12,"pins":[1,"a",null]}}`}},
			want:    wantCommand{state: "succeeded", progress: 50.0, result: `{"uptime":12,"pins":[1,"a",null]}`}},
		{name: "succeeded without result", wait: "5", replies: ok, want: wantCommand{state: "succeeded"}},
		{name: "failed", wait: "5", replies: []reply{{"result", `{"ok":false,"error":"no such pin"}`}},
			want: wantCommand{state: "failed", error: "no such pin"}},
		{name: "reboot", sub: "/reboot", message: "Reboot command sent.", replies: ok, wait: "5",
			want: wantCommand{kind: "reboot", payload: `{"cmd":"reboot"}`, state: "succeeded"}},
		{name: "wifi_reset", sub: "/wifi-reset", message: "Wi-Fi reset command sent.", replies: ok, wait: "5",
			want: wantCommand{kind: "wifi_reset", payload: `{"cmd":"wifi_reset"}`, state: "succeeded"}},
		{name: "custom, compacted, not HTML-escaped", sub: "/commands", body: `{"payload": {"a": [1, {"b": null}], "s": "x&y<z>"}}`, replies: ok, wait: "5",
			want: wantCommand{kind: "custom", payload: `{"a":[1,{"b":null}],"s":"x&y<z>"}`, state: "succeeded"}},
		{name: "button", sub: "/command-buttons/led-on/send", replies: ok, wait: "5",
			want: wantCommand{kind: "button", buttonID: "led-on", payload: `{"cmd":"led","on":true}`, state: "succeeded"}},
		// Without ?wait= the answer is the message and the ids alone.
		{name: "reboot without wait", sub: "/reboot", message: "Reboot command sent.", replies: ok,
			want: wantCommand{kind: "reboot", payload: `{"cmd":"reboot"}`, state: "succeeded"}},
		{name: "wifi_reset without wait", sub: "/wifi-reset", message: "Wi-Fi reset command sent.", replies: ok,
			want: wantCommand{kind: "wifi_reset", payload: `{"cmd":"wifi_reset"}`, state: "succeeded"}},
		{name: "button without wait", sub: "/command-buttons/led-on/send", replies: ok,
			want: wantCommand{kind: "button", buttonID: "led-on", payload: `{"cmd":"led","on":true}`, state: "succeeded"}},
		{name: "ota", sub: "/ota", message: "OTA check triggered.", wait: "5",
			replies: []reply{{"result", `{"progress":30,"state":"downloading"}`}, {"telemetry", `{"fw_md5":"` + sum + `"}`}},
			want:    wantCommand{kind: "ota", payload: ota(sum, image, `"2.0.0"`), progress: 30.0, state: "succeeded"}},
		{name: "ota without a version", sub: "/ota", target: bareMD5, message: "OTA check triggered.",
			want: wantCommand{kind: "ota", payload: ota(bareMD5, bare, "null"), state: "sent"}},
		{name: "ota with an empty version", sub: "/ota", target: emptyMD5, message: "OTA check triggered.",
			want: wantCommand{kind: "ota", payload: ota(emptyMD5, empty, "null"), state: "sent"}},
		// Last: it moves the clock, which the ota row's link is signed for.
		{name: "timed_out", wait: "5", timeOut: true, want: wantCommand{state: "timed_out"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dev.script <- tt.replies
			if tt.target != "" {
				env.setTarget(a, tt.target)
			}
			want, sub, body := tt.want, tt.sub, tt.body
			if sub == "" {
				want.kind, want.payload, sub = "custom", fmt.Sprintf(`{"case":%q}`, tt.name), "/commands"
				body = `{"payload":` + want.payload + `}`
			}
			path := "/v1/user/devices/" + a.device + sub
			if tt.wait != "" {
				path += "?wait=" + tt.wait
			}
			answered := make(chan *httptest.ResponseRecorder, 1)
			go func() { answered <- env.request("POST", path, a.token, body) }()
			got := dev.next(t)
			if string(got.payload) != want.payload {
				t.Errorf("device got %s, want %s", got.payload, want.payload)
			}
			if tt.timeOut {
				env.clock.advance(env.srv.commands.timeout)
				env.srv.commands.expire(context.Background())
			}
			w := receive(t, answered, 10*time.Second, "answer")
			v := decode(t, w)
			if message := cmp.Or(tt.message, "Command sent."); w.Code != http.StatusOK || v["command_id"] != got.id || v["message"] != message || v["device_uid"] != a.device {
				t.Fatalf("got %d %s, want 200 %q for command %s", w.Code, w.Body, message, got.id)
			}
			c, withCommand := v["command"].(map[string]any)
			if withCommand != (tt.wait != "") || !withCommand && len(v) != 3 {
				t.Errorf("answer %s carries a command: %v, want %v (?wait=%q), and nothing else", w.Body, withCommand, tt.wait != "", tt.wait)
			}
			if !withCommand {
				eventually(t, 5*time.Second, "state "+tt.want.state, func() bool {
					return getCommand(t, env, a, got.id)["state"] == tt.want.state
				})
				c = getCommand(t, env, a, got.id)
			}
			checkCommand(t, c, got.id, want)
			if stored := getCommand(t, env, a, got.id); !reflect.DeepEqual(stored, c) {
				t.Errorf("GET answers %v, the POST answered %v", stored, c)
			}
			if now := env.clock.now().UTC().Format(store.TimeFormat); tt.timeOut && c["finished_at"] != now {
				t.Errorf("finished_at = %v, want the clock's %s", c["finished_at"], now)
			}
		})
	}
}

// TestCommandBadResults: results that are malformed, too big, out of range,
// for unknown or finished commands or on another device's topic are
// dropped and counted, and change no command.
func TestCommandBadResults(t *testing.T) {
	t.Parallel()
	env, link, b := brokerEnv(t)
	a, bob := env.alice, env.bob
	dev := newCmdDevice(t, b, env, a)
	newCmdDevice(t, b, env, bob)

	dev.script <- nil // no answer: stays sent
	open := sendOK(t, env, a, "/reboot", nil)
	done := sendOK(t, env, a, "/commands?wait=5", `{"payload":{"n":1}}`) // {"ok":true}
	bobDone := sendOK(t, env, bob, "/commands", `{"payload":{}}`)        // bob's device answers at once
	eventually(t, 5*time.Second, "bob's command to end", func() bool { return getCommand(t, env, bob, bobDone)["finished_at"] != nil })
	dev.script <- nil
	aliceOpen2 := sendOK(t, env, a, "/wifi-reset", nil)
	snapshot := func() string {
		return fmt.Sprint(getCommand(t, env, a, open), getCommand(t, env, a, done), getCommand(t, env, a, aliceOpen2),
			getCommand(t, env, bob, bobDone))
	}
	before := snapshot()
	if !strings.Contains(before, "state:succeeded") {
		t.Fatalf("setup: %s", before)
	}

	result := func(uid, id string) string { return "devices/" + uid + "/result/" + id }
	tests := []struct{ name, topic, payload, reason string }{
		{"malformed JSON", result(a.device, open), `{"ok":tru`, "bad_result"},
		{"not an object", result(a.device, open), `[{"ok":true}]`, "bad_result"},
		{"empty", result(a.device, open), ``, "bad_result"},
		{"ok not a boolean", result(a.device, open), `{"ok":"yes"}`, "bad_result"},
		{"failure without error", result(a.device, open), `{"ok":false}`, "bad_result"},
		{"neither ok nor progress", result(a.device, open), `{"state":"working"}`, "bad_result"},
		{"progress -1", result(a.device, open), `{"progress":-1}`, "bad_result"},
		{"progress 101", result(a.device, open), `{"progress":101}`, "bad_result"},
		{"progress 50.5", result(a.device, open), `{"progress":50.5}`, "bad_result"},
		{"progress a string", result(a.device, open), `{"progress":"50"}`, "bad_result"},
		{"over 16 KiB", result(a.device, open), `{"ok":true,"result":"` + strings.Repeat("x", wire.MaxPayload) + `"}`, "bad_topic_or_size"},
		{"no id", result(a.device, ""), `{"ok":true}`, "bad_topic_or_size"},
		{"unknown id", result(a.device, "nosuchcommand"), `{"ok":true}`, "unknown_or_finished_command"},
		{"finished id", result(a.device, done), `{"ok":false,"error":"late"}`, "unknown_or_finished_command"},
		{"finished id, progress", result(a.device, done), `{"progress":10}`, "unknown_or_finished_command"},
		{"another device's finished command", result(bob.device, bobDone), `{"ok":false,"error":"late"}`, "unknown_or_finished_command"},
		{"on another device's topic", result(bob.device, open), `{"ok":true}`, "unknown_or_finished_command"},
		{"on an unknown device's topic", result("esp32_nosuchdevice0", open), `{"ok":true}`, "unknown_or_finished_command"},
	}
	for _, tt := range tests {
		n := dropped(link, tt.reason)
		publishWait(t, dev.c, tt.topic, false, tt.payload)
		eventually(t, 5*time.Second, tt.name+" counted as "+tt.reason, func() bool { return dropped(link, tt.reason) == n+1 })
	}
	time.Sleep(200 * time.Millisecond) // two of the link's flushes
	if after := snapshot(); after != before {
		t.Errorf("bad results changed commands:\nbefore %s\nafter  %s", before, after)
	}
	// The link still works: a good result ends the open command.
	publishWait(t, dev.c, result(a.device, open), false, `{"ok":true,"result":"rebooting"}`)
	eventually(t, 5*time.Second, "the open command to succeed", func() bool { return getCommand(t, env, a, open)["state"] == "succeeded" })
}

// TestCommandRequestErrors: bad ?wait=, ?limit= and ?before= are 422
// field errors; another user's device or command is a 404; none of it
// makes a record (runCase checks the data unchanged).
func TestCommandRequestErrors(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	a, bob := env.alice, env.bob
	env.setStatus(a.device, "online")
	env.setStatus(bob.device, "online")
	apiAddButton(t, env, a, model.CommandButton{ID: "led", Label: "LED", Payload: json.RawMessage(`{"cmd":"led"}`)})
	sendOK(t, env, a, "/reboot", nil)
	bobCmd := sendOK(t, env, bob, "/reboot", nil)
	mine, theirs := "/v1/user/devices/{alice}", "/v1/user/devices/{bob}"
	wait := apiFieldError("wait", "The wait field must be an integer between 0 and 30.")
	limit := apiFieldError("limit", "The limit field must be an integer between 1 and 100.")
	before := apiFieldError("before", "The before field must be the id of one of this device's commands.")
	const noCommand = `{"message":"Command not found."}`
	runSharedCases(t, env, newAPIVars(env), []apiCase{
		call("wait -1", "POST", mine+"/reboot?wait=-1", "{alice_token}", "", 422, wait),
		call("wait 31", "POST", mine+"/wifi-reset?wait=31", "{alice_token}", "", 422, wait),
		call("wait x", "POST", mine+"/commands?wait=x", "{alice_token}", `{"payload":{}}`, 422, wait),
		call("wait 1.5", "POST", mine+"/command-buttons/led/send?wait=1.5", "{alice_token}", "", 422, wait),
		call("wait empty", "POST", mine+"/ota?wait=", "{alice_token}", "", 422, wait),
		call("wait on bob's device", "POST", theirs+"/reboot?wait=x", "{alice_token}", "", 404, apiDeviceNotFound),
		call("limit 0", "GET", mine+"/commands?limit=0", "{alice_token}", "", 422, limit),
		call("limit 101", "GET", mine+"/commands?limit=101", "{alice_token}", "", 422, limit),
		call("limit x", "GET", mine+"/commands?limit=x", "{alice_token}", "", 422, limit),
		call("limit empty", "GET", mine+"/commands?limit=", "{alice_token}", "", 422, limit),
		call("before unknown", "GET", mine+"/commands?before=nosuchcommand", "{alice_token}", "", 422, before),
		call("before bob's command", "GET", mine+"/commands?before="+bobCmd, "{alice_token}", "", 422, before),
		call("bob's history", "GET", theirs+"/commands", "{alice_token}", "", 404, apiDeviceNotFound),
		call("bob's command on his device", "GET", theirs+"/commands/"+bobCmd, "{alice_token}", "", 404, apiDeviceNotFound),
		call("bob's command on my device", "GET", mine+"/commands/"+bobCmd, "{alice_token}", "", 404, noCommand),
		call("unknown command", "GET", mine+"/commands/nosuchcommand", "{alice_token}", "", 404, noCommand),
		call("reboot bob's device", "POST", theirs+"/reboot", "{alice_token}", "", 404, apiDeviceNotFound),
	})
	wantDB(t, env.st, "2", `SELECT count(*) FROM commands`) // the two sent above
}

// TestLateAcknowledgementKeepsTheCommand: when the broker's PUBACK comes
// too late (here the broker is frozen with SIGSTOP), the command may still
// reach the device, so it is answered with its id and kept as sent, not
// refused and forgotten; once the broker wakes, the device gets it and
// its answer ends it.
func TestLateAcknowledgementKeepsTheCommand(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	dev := newCmdDevice(t, b, env, a)
	b.Signal(syscall.SIGSTOP)
	w := env.request("POST", "/v1/user/devices/"+a.device+"/reboot", a.token, nil)
	b.Signal(syscall.SIGCONT)
	id, _ := decode(t, w)["command_id"].(string)
	if w.Code != http.StatusOK || id == "" {
		t.Fatalf("reboot while the broker is frozen: got %d %s, want 200 with a command_id", w.Code, w.Body)
	}
	if got := dev.next(t); got.id != id {
		t.Errorf("the device got command %q, want %q", got.id, id)
	}
	eventually(t, 5*time.Second, "the command to succeed", func() bool { return getCommand(t, env, a, id)["state"] == "succeeded" })
}

// TestCommandTimeouts: on the server's clock, a command ends as timed_out
// at -command-timeout and an OTA at -ota-timeout, not a moment before; an
// answered command never times out, and a result after the timeout is
// refused.
func TestCommandTimeouts(t *testing.T) {
	t.Parallel()
	if def := newTestEnv(t, nil).srv.commands; def.timeout != 30*time.Second || def.otaTimeout != 15*time.Minute {
		t.Errorf("timeouts %v and %v, want the documented defaults 30s and 15m", def.timeout, def.otaTimeout)
	}
	env := newTestEnv(t, &recordingLink{}, func(_ *testEnv, o *serverOptions) {
		o.commandTimeout, o.otaTimeout = 45*time.Second, 20*time.Minute // configured
	})
	a := env.alice
	ctx := context.Background()
	env.setStatus(a.device, "online")
	otaAssign(t, env, a, "blink", "1.0.0", otaFirmware(4096, 1))
	start := env.clock.now()
	ids := map[string]string{
		"reboot":   sendOK(t, env, a, "/reboot", nil),
		"ota":      sendOK(t, env, a, "/ota", nil),
		"answered": sendOK(t, env, a, "/commands", `{"payload":{}}`),
	}
	ok := true
	apply := func(id string) int {
		done, err := env.st.ApplyDeviceMessages(ctx, nil, []mqttlink.Result{{UID: a.device, ID: id, Result: wire.Result{OK: &ok}}})
		must(t, err)
		return done.Rejected
	}
	env.clock.advance(10 * time.Second)
	if apply(ids["answered"]) != 0 {
		t.Fatal("the answer was refused")
	}
	steps := []struct {
		at      time.Duration // since the commands were sent
		expired int64
		want    map[string]string
	}{
		{45*time.Second - time.Microsecond, 0, map[string]string{"reboot": "sent", "ota": "sent", "answered": "succeeded"}},
		{45 * time.Second, 1, map[string]string{"reboot": "timed_out", "ota": "sent", "answered": "succeeded"}},
		{20*time.Minute - time.Microsecond, 0, map[string]string{"reboot": "timed_out", "ota": "sent", "answered": "succeeded"}},
		{20 * time.Minute, 1, map[string]string{"reboot": "timed_out", "ota": "timed_out", "answered": "succeeded"}},
		{48 * time.Hour, 0, map[string]string{"reboot": "timed_out", "ota": "timed_out", "answered": "succeeded"}},
	}
	finished := map[string]any{}
	for _, s := range steps {
		env.clock.advance(start.Add(s.at).Sub(env.clock.now()))
		expired, err := env.st.ExpireCommands(ctx, env.clock.now())
		if n := int64(len(expired)); err != nil || n != s.expired {
			t.Errorf("at %v: expireCommands = %d, %v, want %d", s.at, n, err, s.expired)
		}
		for kind, want := range s.want {
			c := getCommand(t, env, a, ids[kind])
			if c["state"] != want {
				t.Errorf("at %v: %s is %v, want %s", s.at, kind, c["state"], want)
			}
			if _, seen := finished[kind]; !seen && c["finished_at"] != nil {
				finished[kind] = c["finished_at"]
				if now := env.clock.now().UTC().Format(store.TimeFormat); want == "timed_out" && c["finished_at"] != now {
					t.Errorf("%s finished_at %v, want the clock's %s", kind, c["finished_at"], now)
				}
			}
		}
	}
	if apply(ids["reboot"]) != 1 || getCommand(t, env, a, ids["reboot"])["state"] != "timed_out" {
		t.Error("a result after the timeout changed the command")
	}
}

// TestResultInTimeBeatsTimeout: a result the link took before the
// command's deadline, and is still writing when the commander times
// commands out past it, ends the command: the commander waits until the
// link has written what it took before then.
func TestResultInTimeBeatsTimeout(t *testing.T) {
	b := startBroker(t)
	env := newTestEnv(t, nil)
	a := env.alice
	writing, write := make(chan struct{}, 1), make(chan struct{})
	link := mqttlink.New(mqttlink.Config{Broker: mqttlink.Broker{URL: b.URL(), Prefix: "devices"},
		Sink: heldSink{deviceSink{env.st, env.opts.events}, writing, write}, Now: env.st.Now, Log: env.log})
	t.Cleanup(link.Close)
	awaiting := make(chan struct{}, 1)
	env.rebuild(withLink(awaitingLink{link, awaiting}))
	eventually(t, 5*time.Second, "the link to connect", link.Connected)
	env.setStatus(a.device, "online")
	id := sendOK(t, env, a, "/reboot", nil)

	publishWait(t, testClient(t, b, "device", ""), "devices/"+a.device+"/result/"+id, false, `{"ok":true}`)
	receive(t, writing, 5*time.Second, "the link writing the result")
	env.clock.advance(env.srv.commands.timeout) // the deadline, after the result was taken
	expired := make(chan struct{})
	go func() { env.srv.commands.expire(context.Background()); close(expired) }()
	select {
	case <-awaiting: // the commander waits for the link
	case <-expired: // it did not
	}
	close(write)
	<-expired
	if c := getCommand(t, env, a, id); c["state"] != "succeeded" {
		t.Errorf("a result taken before the deadline: command %s, want succeeded", c["state"])
	}
}

// heldSink is a deviceSink whose writes of results wait until write is
// closed; writing hears that one has begun.
type heldSink struct {
	deviceSink
	writing chan<- struct{}
	write   <-chan struct{}
}

func (s heldSink) Apply(ctx context.Context, reports map[string]*mqttlink.Report, results []mqttlink.Result) (mqttlink.Applied, error) {
	if len(results) > 0 {
		select {
		case s.writing <- struct{}{}:
		default:
		}
		<-s.write
	}
	return s.deviceSink.Apply(ctx, reports, results)
}

// awaitingLink is a device link that tells awaiting when someone waits
// for it to write what it took (AwaitApplied).
type awaitingLink struct {
	*mqttlink.Link
	awaiting chan<- struct{}
}

func (l awaitingLink) AwaitApplied(ctx context.Context, t time.Time) error {
	select {
	case l.awaiting <- struct{}{}:
	default:
	}
	return l.Link.AwaitApplied(ctx, t)
}

// TestCommandTimeoutAcrossRestart: a command in flight when the process
// stops times out after the data directory is opened again, on time.
func TestCommandTimeoutAcrossRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir, clock := t.TempDir(), newFakeClock()
	env := &testEnv{t: t, clock: clock}
	open := func() {
		st, err := store.Open(ctx, dir, clock.now, store.Quotas{})
		if err != nil {
			t.Fatalf("openStore: %v", err)
		}
		env.st = st
		env.srv = newTestServer(t, testOptions(st, &recordingLink{}, testLogger(t)))
	}
	open()
	t.Cleanup(func() { env.st.Close() })
	a := env.addUser("Alice", "alice@example.com", "alice-password")
	env.setStatus(a.device, "online")
	id := sendOK(t, env, a, "/reboot", nil)

	steps := []struct {
		advance time.Duration
		expired int64
		want    string
	}{
		{30*time.Second - time.Microsecond, 0, "sent"},
		{time.Microsecond, 1, "timed_out"},
	}
	for _, s := range steps {
		must(t, env.st.Close()) // the process stops
		clock.advance(s.advance)
		open()
		if ids, err := env.st.ExpireCommands(ctx, clock.now()); err != nil || int64(len(ids)) != s.expired {
			t.Errorf("after %v: expireCommands = %q, %v, want %d", s.advance, ids, err, s.expired)
		}
		if c := getCommand(t, env, a, id); c["state"] != s.want {
			t.Errorf("after the restart: %v, want %s", c, s.want)
		}
	}
}

// TestDeleteCommandOfItsDevice: an unpublished command is deleted only
// through its own device's DeviceRef (docs/security.md, "Team scoping in
// the store").
func TestDeleteCommandOfItsDevice(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	ctx := context.Background()
	alice := env.deviceRef(env.alice)
	now := env.st.Timestamp()
	must(t, env.st.InsertCommand(&model.Command{ID: "unpublished", Kind: "custom", Payload: []byte(`{}`), State: "sent",
		CreatedAt: now, UpdatedAt: now}, alice, now, nil))
	must(t, env.st.DeleteCommand(ctx, env.deviceRef(env.bob), "unpublished", nil))
	wantDB(t, env.st, "1", `SELECT count(*) FROM commands WHERE id = 'unpublished'`)
	must(t, env.st.DeleteCommand(ctx, alice, "unpublished", nil))
	wantDB(t, env.st, "0", `SELECT count(*) FROM commands WHERE id = 'unpublished'`)
}

// TestCommandHistory: newest first, paged by limit and before with no gap
// or repeat, the newest 200 per device kept, and each user sees only
// their own commands.
func TestCommandHistory(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{})
	a, bob := env.alice, env.bob
	env.setStatus(a.device, "online")
	env.setStatus(bob.device, "online")
	var bobs []string
	for i := range 3 {
		bobs = append(bobs, sendOK(t, env, bob, "/commands", fmt.Sprintf(`{"payload":{"bob":%d}}`, i)))
	}
	var sent []string // alice's, oldest first
	for i := range store.KeepCommands + 5 {
		env.clock.advance(time.Second)
		sent = append(sent, sendOK(t, env, a, "/commands", fmt.Sprintf(`{"payload":{"n":%d}}`, i)))
	}
	kept := slices.Clone(sent[5:])
	slices.Reverse(kept) // newest first

	w := env.request("GET", "/v1/user/devices/"+a.device+"/commands", a.token, nil)
	page := decode(t, w)["data"].([]any)
	if len(page) != 25 {
		t.Fatalf("default page: %d commands, want 25", len(page))
	}
	for i, c := range page {
		c := c.(map[string]any)
		want := fmt.Sprintf(`{"n":%d}`, store.KeepCommands+4-i)
		if payload, _ := json.Marshal(c["payload"]); c["id"] != kept[i] || string(payload) != want {
			t.Errorf("default page [%d] = %v %s, want %s %s", i, c["id"], payload, kept[i], want)
		}
		if i > 0 && c["created_at"].(string) >= page[i-1].(map[string]any)["created_at"].(string) {
			t.Errorf("[%d] created_at %v is not older than the one before it", i, c["created_at"])
		}
	}
	for _, limit := range []int{1, 7, 100} {
		if got := commandIDs(t, env, a, limit); !slices.Equal(got, kept) {
			t.Errorf("limit %d: paged through %d commands, want the newest %d in order", limit, len(got), len(kept))
		}
	}
	for _, id := range sent[:5] { // past the newest store.KeepCommands
		apiWantStatus(t, env, "GET", "/v1/user/devices/"+a.device+"/commands/"+id, a.token, http.StatusNotFound)
	}
	// Isolation: bob keeps his three, and each sees only their own.
	slices.Reverse(bobs)
	if got := commandIDs(t, env, bob, 25); !slices.Equal(got, bobs) {
		t.Errorf("bob's history %v, want %v", got, bobs)
	}
	for _, id := range bobs {
		if slices.Contains(kept, id) {
			t.Errorf("bob's command %s is in alice's history", id)
		}
	}
}

// TestPresenceBackstop: a device silent for -offline-after becomes
// offline; any message keeps it online. While the server is disconnected
// from the broker nobody is set offline, and after it reconnects the
// clock starts again from the reconnection.
func TestPresenceBackstop(t *testing.T) {
	t.Parallel()
	const offlineAfter = 10 * time.Minute
	b := startBroker(t)
	env, link := newLinkedEnvWith(t, b, offlineAfter)
	ctx := context.Background()
	silent := newCmdDevice(t, b, env, env.alice)
	talker := newCmdDevice(t, b, env, addDevice(t, env, env.alice, "esp32"))
	answerer := newCmdDevice(t, b, env, addDevice(t, env, env.alice, "esp32"))
	flaky := newCmdDevice(t, b, env, addDevice(t, env, env.alice, "esp32"))
	flaky.publish("status", "reconnecting", true)
	eventually(t, 5*time.Second, "reconnecting", func() bool { return env.device(flaky.u).Status == "reconnecting" })
	devices := []*cmdDevice{silent, talker, answerer, flaky}
	start := env.clock.now()

	// at moves the clock to start+d and runs the backstop.
	at := func(d time.Duration) {
		env.clock.advance(start.Add(d).Sub(env.clock.now()))
		env.srv.presence.sweep(ctx)
	}
	check := func(when string, want ...model.DeviceStatus) {
		t.Helper()
		for i, d := range devices {
			if got := env.device(d.u).Status; got != want[i] {
				t.Errorf("%s: device %d is %s, want %s", when, i, got, want[i])
			}
		}
		if got := env.device(env.bob).Status; got != "pending" {
			t.Errorf("%s: bob's never-seen device is %s, want pending", when, got)
		}
	}

	at(6 * time.Minute)
	talker.publish("telemetry", `{"rssi":-50}`, false)
	if w := env.request("POST", "/v1/user/devices/"+answerer.u.device+"/reboot?wait=5", answerer.u.token, nil); !strings.Contains(w.Body.String(), `"state":"succeeded"`) {
		t.Fatalf("reboot: %d %s", w.Code, w.Body)
	}
	seen := start.Add(6 * time.Minute).UTC().Format(store.TimeFormat)
	eventually(t, 5*time.Second, "the telemetry applied", func() bool {
		d := env.device(talker.u)
		return d.LastSeenAt != nil && *d.LastSeenAt == seen
	})
	if d := env.device(answerer.u); d.LastSeenAt == nil || *d.LastSeenAt != seen {
		t.Errorf("a result did not count as a sign of life: last_seen_at %v, want %s", d.LastSeenAt, seen)
	}
	at(offlineAfter - time.Second)
	check("just before offline-after", "online", "online", "online", "reconnecting")
	at(offlineAfter + time.Second)
	check("just after offline-after", "offline", "online", "online", "offline")
	at(6*time.Minute + offlineAfter + time.Second)
	check("offline-after since their last message", "offline", "offline", "offline", "offline")

	// The server's side of the link goes down, for longer than offline-after.
	devices = devices[:2]
	for _, d := range devices {
		d.publish("status", "online", true)
		eventually(t, 5*time.Second, "online again", func() bool { return env.device(d.u).Status == "online" })
	}
	b.Stop()
	eventually(t, 5*time.Second, "the link to notice the outage", func() bool { return !link.Connected() })
	env.clock.advance(3 * offlineAfter)
	env.srv.presence.sweep(ctx)
	check("during the outage", "online", "online")
	b.Start()
	eventually(t, 15*time.Second, "the link to reconnect", link.Connected)
	start = env.clock.now() // the reconnection
	at(5 * time.Minute)
	talker = newCmdDevice(t, b, env, talker.u) // it reconnects too, and speaks
	talker.publish("telemetry", `{"rssi":-40}`, false)
	eventually(t, 5*time.Second, "the telemetry applied", func() bool { return *env.device(talker.u).LastRSSI == -40 })
	at(offlineAfter - time.Second)
	check("offline-after since the reconnection, not yet", "online", "online")
	at(offlineAfter + time.Second)
	check("offline-after since the reconnection", "offline", "online")
}

// TestBurstThroughDefaultBroker: 20,000 reports from 1,000 devices, sent
// as fast as four clients can, through a Mosquitto with its default
// limits: every device's last report is in the database. Reports are
// published at QoS 1, so the QoS of the server's subscription decides how
// they are delivered: at QoS 1 Mosquitto drops all past its queue of
// 1,000 messages per client, at QoS 0 none.
func TestBurstThroughDefaultBroker(t *testing.T) {
	t.Parallel()
	const devices, reports, publishers = 1000, 20, 4
	b := startDefaultBroker(t)
	env, link := newLinkedEnv(t, b)
	uids := make([]string, devices)
	for i := range uids {
		uids[i] = addDevice(t, env, env.alice, "esp32").device
	}
	var pubs []mqtt.Client
	for i := range publishers {
		pubs = append(pubs, testClient(t, b, fmt.Sprintf("publisher-%d", i), ""))
	}
	// lastRSSI is device i's last report; earlier ones say -1.
	lastRSSI := func(i int) float64 { return float64(-10 - i) }
	var wg sync.WaitGroup
	for p, c := range pubs {
		wg.Go(func() {
			var tokens []mqtt.Token
			for r := range reports {
				for i := p; i < devices; i += publishers {
					rssi := -1.0
					if r == reports-1 {
						rssi = lastRSSI(i)
					}
					payload := fmt.Sprintf(`{"rssi":%g,"local_ip":"10.0.%d.%d"}`, rssi, r, i%250)
					tokens = append(tokens, c.Publish("devices/"+uids[i]+"/telemetry", 1, false, payload))
				}
			}
			for _, tok := range tokens {
				if !tok.WaitTimeout(30*time.Second) || tok.Error() != nil {
					t.Errorf("publisher %d: %v", p, tok.Error())
					return
				}
			}
		})
	}
	wg.Wait()
	stale := func() (n int) {
		got := queryMap(t, storeReader(env.st), `SELECT uid, coalesce(last_rssi, '') FROM devices WHERE team_id = ?`, env.alice.id)
		for i, uid := range uids {
			if got[uid] != fmt.Sprint(lastRSSI(i)) {
				n++
			}
		}
		return n
	}
	// A ceiling, not a goal: under the race detector on a loaded machine
	// the link takes the 20,000 reports in a minute or more.
	deadline := time.Now().Add(2 * time.Minute)
	for n := stale(); n > 0; n = stale() {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d devices do not show their last report (%d messages dropped by the link)", n, devices, dropTotal(link))
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n := dropTotal(link); n != 0 {
		t.Errorf("the link dropped %d messages", n)
	}
}

// startFleet runs every device of u, creating them until there are n, as
// a simulate fleet on b that fails that share of commands, until the test
// ends; it returns their uids once the server sees all of them online.
func startFleet(tb testing.TB, env *testEnv, b *testBroker, u testUser, n int, failRate float64) []string {
	tb.Helper()
	return startFleetWith(tb, env, b, u, n, sim.Options{FailRate: failRate})
}

// startFleetWith is startFleet with more of the simulator's options (its
// interval, reboot delay, broker and prefix are startFleet's).
func startFleetWith(tb testing.TB, env *testEnv, b *testBroker, u testUser, n int, o sim.Options) []string {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	o.Interval, o.RebootDelay, o.BrokerURL, o.Prefix = time.Second, 100*time.Millisecond, b.URL(), "devices"
	opts := simulateOptions{Owner: u.email, N: n, Options: o}
	go func() { done <- runSimulate(ctx, env.st, opts, testLogger(tb)) }()
	tb.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				tb.Errorf("runSimulate: %v", err)
			}
		case <-time.After(10 * time.Second):
			tb.Error("the fleet did not stop within 10 s")
		}
	})
	var uids []string
	eventually(tb, 10*time.Second, "the fleet's devices", func() bool {
		uids, _ = env.st.DeviceUIDsOwnedBy(context.Background(), u.email)
		return len(uids) >= n
	})
	waitOnline(tb, env, u, uids)
	return uids
}

// waitOnline waits until the server sees every one of u's devices in
// uids online.
func waitOnline(tb testing.TB, env *testEnv, u testUser, uids []string) {
	tb.Helper()
	eventually(tb, 20*time.Second, "every device online", func() bool {
		for _, uid := range uids {
			if env.device(withDevice(u, uid)).Status != "online" {
				return false
			}
		}
		return true
	})
}

// TestSimulateCommandStates: simulate devices take commands to every
// state: a custom command and an OTA (downloaded, flashed, confirmed)
// succeed, and an OTA whose download stalls is running until it times
// out; the device's late failure is dropped. (A fleet with -fail-rate 1
// failing every kind is TestSimulateFailRate; the failure reaching a
// rollout, TestRolloutFleetHaltsPastMaxFailures.)
func TestSimulateCommandStates(t *testing.T) {
	t.Parallel()
	// The download link leads to a server that stalls half-way while stall
	// is set. The server serves the whole file into a recorder first, so
	// its own record of the download passes 50% on its way to 100% before
	// the device has a byte: stalled tells when the half has gone out, and
	// only the device's own reports follow.
	ln, public := listenLocal(t)
	env, link, b := brokerEnv(t, withPublicURL(public))
	a := env.alice
	var stall atomic.Bool
	release := make(chan struct{})
	stalled := make(chan struct{}, 1)
	serveOn(t, ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !stall.Load() {
			env.srv.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		env.srv.ServeHTTP(rec, r)
		maps.Copy(w.Header(), rec.Header())
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes()[:rec.Body.Len()/2])
		w.(http.Flusher).Flush()
		select {
		case stalled <- struct{}{}:
		default:
		}
		<-release
	}))
	uids := startFleet(t, env, b, a, 2, 0)
	second := withDevice(a, uids[1])
	firstMD5, _ := otaAssign(t, env, a, "blink", "2.0.0", otaFirmware(64<<10, 4))
	otaAssign(t, env, second, "blink", "2.0.0", otaFirmware(64<<10, 5))

	post := func(u testUser, sub, body string) map[string]any {
		t.Helper()
		w := env.request("POST", "/v1/user/devices/"+u.device+sub, u.token, body)
		v := decode(t, w)
		if w.Code != http.StatusOK {
			t.Fatalf("POST %s: %d %s", sub, w.Code, w.Body)
		}
		if c, ok := v["command"].(map[string]any); ok {
			return c
		}
		return getCommand(t, env, u, v["command_id"].(string))
	}
	check := func(what string, c map[string]any, state string, progress, result, errText any) {
		t.Helper()
		if c["state"] != state || c["progress"] != progress || !reflect.DeepEqual(c["result"], result) || c["error"] != errText {
			t.Errorf("%s: %v, want state %s progress %v result %v error %v", what, c, state, progress, result, errText)
		}
	}
	check("custom", post(a, "/commands?wait=10", `{"payload":{"led":"on"}}`), "succeeded", nil, map[string]any{"led": "on"}, nil)
	check("ota", post(a, "/ota?wait=10", ""), "succeeded", 100.0, nil, nil)
	if d := env.device(a); d.CurrentFirmware == nil || d.CurrentFirmware.MD5 == nil || *d.CurrentFirmware.MD5 != firstMD5 {
		t.Errorf("after the OTA the device runs %+v, want %s", d.CurrentFirmware, firstMD5)
	}

	stall.Store(true)
	id := post(second, "/ota", "")["id"].(string)
	receive(t, stalled, 10*time.Second, "the stalled download's first half")
	eventually(t, 10*time.Second, "the stalled OTA running at 50%", func() bool {
		return getCommand(t, env, second, id)["progress"] == 50.0
	})
	check("stalled ota", getCommand(t, env, second, id), "running", 50.0, nil, nil)
	env.clock.advance(env.srv.commands.otaTimeout)
	env.srv.commands.expire(context.Background())
	check("stalled ota, past -ota-timeout", getCommand(t, env, second, id), "timed_out", 50.0, nil, nil)
	late := dropped(link, "unknown_or_finished_command")
	close(release) // the download ends short: the device reports a failure
	eventually(t, 10*time.Second, "the device's late failure dropped", func() bool {
		return dropped(link, "unknown_or_finished_command") > late
	})
	check("stalled ota, after the late failure", getCommand(t, env, second, id), "timed_out", 50.0, nil, nil)
}

// TestSimulateFleetCommands: a simulate fleet of 50 devices answers a custom
// command and then a reboot on each, sent 8 at a time with ?wait=10, and
// every one of the 100 succeeds; the rebooted devices come back online.
func TestSimulateFleetCommands(t *testing.T) {
	t.Parallel()
	const n, parallel = 50, 8
	env, _, b := brokerEnv(t)
	uids := startFleet(t, env, b, env.alice, n, 0)
	type outcome struct{ uid, kind, state, result string }
	outcomes := make(chan outcome, 2*n)
	send := func(uid, sub, body string) outcome {
		w := env.request("POST", "/v1/user/devices/"+uid+sub+"?wait=10", env.alice.token, body)
		var v struct {
			Command struct {
				Kind, State string
				Result      json.RawMessage
			}
		}
		if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil || w.Code != http.StatusOK {
			return outcome{uid, sub, fmt.Sprintf("HTTP %d %s", w.Code, w.Body), ""}
		}
		return outcome{uid, v.Command.Kind, v.Command.State, string(v.Command.Result)}
	}
	work := make(chan string)
	var wg sync.WaitGroup
	for range parallel {
		wg.Go(func() {
			for uid := range work {
				outcomes <- send(uid, "/commands", fmt.Sprintf(`{"payload":{"led":%q}}`, uid))
				outcomes <- send(uid, "/reboot", "")
			}
		})
	}
	for _, uid := range uids {
		work <- uid
	}
	close(work)
	wg.Wait()
	close(outcomes)
	succeeded := map[string]int{}
	for o := range outcomes {
		want := outcome{o.uid, o.kind, "succeeded", "null"}
		if o.kind == "custom" {
			want.result = fmt.Sprintf(`{"led":%q}`, o.uid)
		}
		if o != want {
			t.Errorf("%s: got %+v, want %+v", o.uid, o, want)
			continue
		}
		succeeded[o.kind]++
	}
	if succeeded["custom"] != n || succeeded["reboot"] != n {
		t.Errorf("succeeded: %v, want %d of each", succeeded, n)
	}
	waitOnline(t, env, env.alice, uids)
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	must(tb, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkCommandRoundTrip: POST …/commands?wait=5, one at a time, to a
// simulate device (which answers at once) over a real Mosquitto, until the answer
// says succeeded. It reports the p50 and p99 latency, with Mosquitto's
// default configuration and with set_tcp_nodelay: by default Mosquitto
// leaves Nagle's algorithm on for its clients, and the command waits for
// the device's delayed ACK of the previous packet (40 ms on Linux).
func BenchmarkCommandRoundTrip(b *testing.B) {
	for _, conf := range []struct{ name, extra string }{
		{"default", ""},
		{"set_tcp_nodelay", "set_tcp_nodelay true\n"},
	} {
		b.Run(conf.name, func(b *testing.B) { benchRoundTrip(b, startBrokerWith(b, conf.extra)) })
	}
}

func benchRoundTrip(b *testing.B, br *testBroker) {
	env, _ := newLinkedEnv(b, br)
	a := env.alice
	startFleet(b, env, br, a, 1, 0)
	path := "/v1/user/devices/" + a.device + "/commands?wait=5"
	body := []byte(`{"payload":{"cmd":"ping"}}`)
	var latencies []time.Duration
	for b.Loop() {
		start := time.Now()
		w := env.request("POST", path, a.token, body)
		latencies = append(latencies, time.Since(start))
		if w.Code != http.StatusOK || !bytes.Contains(w.Body.Bytes(), []byte(`"state":"succeeded"`)) {
			b.Fatalf("got %d %s, want 200 with the command succeeded", w.Code, w.Body)
		}
	}
	slices.Sort(latencies)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(latencies[len(latencies)/2]), "p50-ms")
	b.ReportMetric(ms(latencies[len(latencies)*99/100]), "p99-ms")
}

// BenchmarkCommandThroughput posts commands through the HTTP API to 20
// online devices over a real Mosquitto, 16 requests in flight per CPU, and
// checks that every one reached the broker's subscribers. Besides cmds/s
// it reports the process's CPU time per command (the broker's not
// included): on a machine shared with other work, cmds/s varies with the
// load, and the cores divided by cpu-µs/cmd is the rate they can carry.
func BenchmarkCommandThroughput(b *testing.B) {
	br := startBroker(b)
	env, _ := newLinkedEnv(b, br)
	var paths []string
	for range 20 {
		u := addDevice(b, env, env.alice, "esp32")
		env.setStatus(u.device, "online")
		paths = append(paths, "/v1/user/devices/"+u.device+"/commands")
	}
	var delivered atomic.Int64
	obs := testClient(b, br, "observer", "")
	if t := obs.Subscribe("devices/+/cmd/+", 1, func(mqtt.Client, mqtt.Message) { delivered.Add(1) }); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		b.Fatalf("subscribe: %v", t.Error())
	}
	body := []byte(`{"payload":{"cmd":"led","on":true}}`)
	var next atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(16) // requests wait on the disk and the broker; keep several in flight
	cpu := cpuTime(b)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			path := paths[next.Add(1)%int64(len(paths))]
			req := httptest.NewRequest("POST", path, bytes.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+env.alice.token)
			req.Header.Set("Content-Type", "application/json")
			w := httptest.NewRecorder()
			env.srv.ServeHTTP(w, req)
			if w.Code != http.StatusOK {
				b.Errorf("POST %s: %d %s", path, w.Code, w.Body)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cmds/s")
	b.ReportMetric(float64(cpuTime(b)-cpu)/float64(time.Microsecond)/float64(b.N), "cpu-µs/cmd")
	sent := next.Load()
	eventually(b, 10*time.Second, "every command delivered", func() bool { return delivered.Load() >= sent })
}
