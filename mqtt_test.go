package main

import (
	"testing"
	"time"
)

func TestBrokerHarness(t *testing.T) {
	b := startBroker(t)
	env, _ := newLinkedEnv(t, b)
	dev := testClient(t, b, "dev1", "")
	publishWait(t, dev, "devices/"+env.alice.device+"/status", true, "online")
	eventually(t, 2*time.Second, "device online", func() bool { return env.device(env.alice).Status == "online" })
}
