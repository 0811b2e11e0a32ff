package main

import (
	"testing"
	"time"
)

// An ota command published while its device resets, before the server has
// seen it go, reaches no session (devices connect with clean sessions) and
// is lost. When the device reports its new boot the server sends the
// command again, with the same id; one the device answered is not sent
// again.
func TestOTAResentAfterAReset(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	otaAssign(t, env, a, "blink", "1.0.0", otaFirmware(4096, 1))

	d := newCmdDevice(t, b, env, a)
	// A reset: no "offline" yet, the server still sees it online. The
	// broker may read a disconnect after a publish that arrived on another
	// connection before it, and hand the command to this session as it
	// closes; an acknowledged unsubscribe first means it reaches none.
	if tok := d.c.Unsubscribe(d.topic("cmd/+")); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("unsubscribe: %v", tok.Error())
	}
	d.c.Disconnect(0)
	lost := sendOK(t, env, a, "/ota", nil)

	d = newCmdDevice(t, b, env, a) // back, with a new session
	d.publish("telemetry", `{"reset_reason":"panic","uptime_s":1}`, false)
	if got := d.next(t); got.id != lost {
		t.Fatalf("after the reset the device got command %s, want the lost ota %s again", got.id, lost)
	}
	eventually(t, 5*time.Second, "the command answered", func() bool {
		return getCommand(t, env, a, lost)["state"] == "succeeded"
	})

	// A command the device has answered in part is under way: a later
	// boot does not send it again. Commands reach the device in the order
	// they are published, so the next it gets after the boot shows it.
	d.script <- []reply{{"result", `{"progress":10}`}}
	running := sendOK(t, env, a, "/ota", nil)
	if got := d.next(t); got.id != running {
		t.Fatalf("the device got %s, want %s", got.id, running)
	}
	eventually(t, 5*time.Second, "the command running", func() bool {
		return getCommand(t, env, a, running)["state"] == "running"
	})
	d.publish("telemetry", `{"reset_reason":"sw","uptime_s":1}`, false)
	eventually(t, 5*time.Second, "the second boot recorded", func() bool {
		return scalar(t, env.st, `SELECT count(*) FROM boots`) == "2"
	})
	custom := sendOK(t, env, a, "/commands", `{"payload":{}}`)
	if got := d.next(t); got.id != custom {
		t.Fatalf("after the boot the device got %s, want the next command %s: an answered command was sent again", got.id, custom)
	}
}
