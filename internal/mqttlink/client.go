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

// tracker counts what a connection runs of ours on the client's
// goroutines (its handlers) and on goroutines of its own, so that closing
// the connection waits for them: nothing of a closed connection runs, or
// logs, after its Close has returned.
type tracker struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// do runs f, counted, unless the tracker is closed.
func (t *tracker) do(f func()) {
	if t.add() {
		defer t.wg.Done()
		f()
	}
}

// goDo runs f in a goroutine of its own, counted, unless the tracker is
// closed.
func (t *tracker) goDo(f func()) {
	if t.add() {
		go func() {
			defer t.wg.Done()
			f()
		}()
	}
}

func (t *tracker) add() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.wg.Add(1)
	}
	return !t.closed
}

// close runs nothing more and waits for what runs.
func (t *tracker) close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.wg.Wait()
}
