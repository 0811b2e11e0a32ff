package mqttlink

import (
	"crypto/rand"
	"crypto/tls"
	"strings"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/wire"
)

// Broker is how the package's connections reach the broker, and the
// topic prefix P that the devices' topics are under.
type Broker struct {
	URL, User, Password string
	Prefix              string // trailing slashes are ignored
}

// clientOptions are the MQTT client options both of the package's
// connections (the link, broker logins) use, under a client id that
// starts with idPrefix.
func clientOptions(b Broker, idPrefix string) *mqtt.ClientOptions {
	opts := mqtt.NewClientOptions().
		AddBroker(b.URL).
		// Unique per process, so two instances never kick each other off.
		SetClientID(idPrefix + strings.ToLower(rand.Text()[:12])).
		SetUsername(b.User).
		SetPassword(b.Password).
		// A clean session: the broker keeps nothing for us while we are
		// away. A command whose PUBACK is late stays recorded: the
		// library may send it again after a reconnect.
		SetCleanSession(true).
		// MQTT 3.1.1 only: without an explicit version paho retries a
		// refused connection with 3.1, which hides the broker's answer.
		SetProtocolVersion(4).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second).
		SetMaxReconnectInterval(5 * time.Second).
		SetConnectTimeout(5 * time.Second).
		SetKeepAlive(30 * time.Second)
	if wire.IsTLSURL(b.URL) {
		opts.SetTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12}) // system roots
	}
	return opts
}

// prefix is b's topic prefix without trailing slashes.
func (b Broker) prefix() string { return strings.TrimRight(b.Prefix, "/") }

// callbackGate holds the MQTT client's calls into us that may log or
// start work (connected, connection lost, its notifications), so that
// closing can wait for them: the client runs each on a goroutine of its
// own and may still call after Disconnect has returned. Once close has
// returned, nothing is logged any more, which a caller that reads the
// log next (a CLI command's stderr) relies on.
type callbackGate struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// do runs f unless close has begun; wait waits for it.
func (g *callbackGate) do(f func()) {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return
	}
	g.wg.Add(1)
	g.mu.Unlock()
	defer g.wg.Done()
	f()
}

// close lets no more calls in.
func (g *callbackGate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// closing reports whether close has begun: a call that fails then
// failed because the connection is being closed, and says nothing.
func (g *callbackGate) closing() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.closed
}

// wait waits for the calls let in before close to end.
func (g *callbackGate) wait() { g.wg.Wait() }
