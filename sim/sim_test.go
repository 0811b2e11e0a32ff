package sim

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// A connection that completes after its boot has ended (the device was
// stopped or rebooted meanwhile) must not say "online": nothing would say
// "offline" after it, and the broker would keep it.
func TestLateConnectStaysQuiet(t *testing.T) {
	f := &Fleet{ctx: context.Background(), opts: Options{Prefix: "devices"}, log: slog.New(slog.DiscardHandler)}
	d := newDevice(f, "esp32_late")
	ended := &fakeMQTTClient{}
	d.onConnect(ended) // d.client is nil: this boot is over
	if got := ended.sent(); len(got) != 0 {
		t.Errorf("a connection of an ended boot published %v, want nothing", got)
	}
	current := &fakeMQTTClient{}
	d.client = current
	d.onConnect(current)
	if got := current.sent(); len(got) != 2 || got[0] != "devices/esp32_late/status online" {
		t.Errorf("the current connection published %v, want online and telemetry", got)
	}
}

// fakeMQTTClient records publishes; every token is already complete.
type fakeMQTTClient struct {
	mqtt.Client
	mu        sync.Mutex
	published []string
}

func (c *fakeMQTTClient) Subscribe(string, byte, mqtt.MessageHandler) mqtt.Token {
	return doneToken{}
}

func (c *fakeMQTTClient) Publish(topic string, _ byte, _ bool, payload any) mqtt.Token {
	c.mu.Lock()
	defer c.mu.Unlock()
	text, _ := payload.(string)
	if b, ok := payload.([]byte); ok {
		text = string(b)
	}
	c.published = append(c.published, topic+" "+text)
	return doneToken{}
}

func (c *fakeMQTTClient) sent() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.published...)
}

type doneToken struct{}

func (doneToken) Wait() bool                     { return true }
func (doneToken) WaitTimeout(time.Duration) bool { return true }
func (doneToken) Error() error                   { return nil }
func (doneToken) Done() <-chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}
