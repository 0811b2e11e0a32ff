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
	t.Parallel()
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

// The server sends an unanswered ota command again, with the same id, when
// the device reports a new boot: an update already under way for that id
// ignores the repeat, where another command is refused.
func TestRepeatedOTAIgnored(t *testing.T) {
	t.Parallel()
	f := &Fleet{ctx: context.Background(), opts: Options{Prefix: "devices"}, log: slog.New(slog.DiscardHandler)}
	d := newDevice(f, "esp32_again")
	c := &fakeMQTTClient{}
	d.otaBusy, d.otaID = true, "first"
	payload := []byte(`{"cmd":"ota","url":"http://127.0.0.1/fw","md5":"0123456789abcdef0123456789abcdef"}`)
	d.startOTA(c, "first", payload)
	if got := c.sent(); len(got) != 0 {
		t.Errorf("a repeat of the update under way was answered %v, want nothing", got)
	}
	d.startOTA(c, "second", payload)
	if got := c.sent(); len(got) != 1 || got[0] != `devices/esp32_again/result/second {"ok":false,"error":"ota: an update is already in progress"}` {
		t.Errorf("another update while one is under way was answered %v, want its refusal", got)
	}
}
