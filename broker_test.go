package main

import (
	"context"
	"testing"
	"time"

	"devicehub/internal/brokertest"
	"devicehub/internal/mqttlink"
)

// The real Mosquitto of the tests and the MQTT clients that talk to it are
// internal/brokertest's, which internal/mqttlink's tests share; these are
// their names here.
type (
	testBroker   = brokertest.Broker
	dynsecBroker = brokertest.DynsecBroker
)

var (
	startBroker        = brokertest.Start
	startDefaultBroker = brokertest.StartDefault
	startBrokerWith    = brokertest.StartWith
	startDynsecBroker  = brokertest.StartDynsec
	testClient         = brokertest.Client
	subscribe          = brokertest.Subscribe
	publishWait        = brokertest.PublishWait
	eventually         = brokertest.Eventually
)

// newLinkedEnv is a testEnv whose server has a real MQTT link to b; with
// change its other options.
func newLinkedEnv(tb testing.TB, b *testBroker, with ...envOption) (*testEnv, *mqttlink.Link) {
	tb.Helper()
	return newLinkedEnvWith(tb, b, 0, with...)
}

// brokerEnv is a testEnv linked to a broker of its own (startBroker).
func brokerEnv(tb testing.TB, with ...envOption) (*testEnv, *mqttlink.Link, *testBroker) {
	tb.Helper()
	b := startBroker(tb)
	env, link := newLinkedEnv(tb, b, with...)
	return env, link, b
}

// newLinkedEnvWith is newLinkedEnv with -offline-after.
func newLinkedEnvWith(tb testing.TB, b *testBroker, offlineAfter time.Duration, with ...envOption) (*testEnv, *mqttlink.Link) {
	tb.Helper()
	env := newTestEnv(tb, nil, with...)
	return env, linkTo(tb, env, b, offlineAfter)
}

// newLink is a real MQTT link to b, as devicehub with user and password,
// that hands what devices say to env's store and event hub, as serve's
// does; it is closed at cleanup.
func newLink(tb testing.TB, env *testEnv, b *testBroker, user, password string) *mqttlink.Link {
	tb.Helper()
	link := mqttlink.New(mqttlink.Config{Broker: mqttlink.Broker{URL: b.URL(), User: user, Password: password, Prefix: "devices"},
		Sink: deviceSink{env.st, env.opts.events}, Now: env.st.Now, Log: env.log})
	tb.Cleanup(link.Close)
	return link
}

// linkTo rebuilds env's server on a real MQTT link to b, with
// -offline-after, whose commands time out and whose silent devices go
// offline, as serve's do; it returns once the link has connected.
func linkTo(tb testing.TB, env *testEnv, b *testBroker, offlineAfter time.Duration) *mqttlink.Link {
	tb.Helper()
	link := newLink(tb, env, b, "", "")
	env.rebuild(withLink(link), func(_ *testEnv, o *serverOptions) { o.offlineAfter = offlineAfter })
	tb.Cleanup(start(context.Background(), env.srv.commands.run, env.srv.presence.run))
	eventually(tb, 5*time.Second, "the link to connect", link.Connected)
	return link
}
