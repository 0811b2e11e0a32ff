package main

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
)

// The command engine: commander issues commands to devices, waits for
// their ends and times out the ones past their deadlines. The handlers
// (commands.go) and the rollout engine send through it.

// How long a command may take to end before it is timed_out, unless
// -command-timeout and -ota-timeout say otherwise.
const (
	defaultCommandTimeout = 30 * time.Second
	defaultOTATimeout     = 15 * time.Minute
)

// The reasons the commander refuses a command.
var (
	errDeviceOffline      = errors.New("device is offline")
	errDeviceReconnecting = errors.New("device is reconnecting")
	errLinkDown           = errors.New("device link unavailable")
)

// commander issues commands to devices, waits for their ends and times
// out the ones past their deadlines. The handlers and the rollout engine
// send through it.
type commander struct {
	store commandStore
	link  commandLink // nil: no broker configured; commands answer 503
	ota   *otaLinks
	log   *slog.Logger
	// timeout and otaTimeout are how long a command may take to end.
	timeout, otaTimeout time.Duration
	// events hears every command it records and ends (nil: nobody).
	events *eventHub
}

// issue records c (Kind and Payload set; ID too, or a new one is drawn)
// for the device, with the request's audit entry (nil: none), then
// publishes it on P/{uid}/cmd/{id}. A device that is not online, or no broker, is refused
// and leaves no record. The record is
// committed before the publish, so a device's answer always finds it, and
// it is removed, with its audit entry, only when the client library
// refused the publish outright: a publish whose acknowledgement is late, or whose connection
// dropped, may still reach the device (the library sends it again after a
// reconnect), so its record stays, sent, until the device answers or it
// times out.
func (cm *commander) issue(ctx context.Context, d *store.DeviceRef, c *model.Command, audit *model.AuditEntry) error {
	switch {
	case d.Status() == model.StatusReconnecting:
		return errDeviceReconnecting
	case d.Status() != model.StatusOnline:
		return errDeviceOffline
	case !cm.linkUp():
		return errLinkDown
	}
	now := cm.store.Now()
	timeout := cm.timeout
	if c.Kind == model.KindOTA {
		timeout = cm.otaTimeout
	}
	if c.ID == "" {
		c.ID = newCommandID()
	}
	c.State = model.CommandSent
	c.CreatedAt = now.UTC().Format(store.TimeFormat)
	c.UpdatedAt = c.CreatedAt
	if err := cm.store.InsertCommand(c, d, now.Add(timeout).UTC().Format(store.TimeFormat), audit); err != nil {
		return err
	}
	// Told before the publish, so that no result can overtake it (a
	// record the client library refuses outright is deleted below, unsaid).
	cm.events.command(d.TeamID(), d.UID(), c)
	err := cm.link.Publish(d.UID(), c.ID, c.Payload)
	switch {
	case errors.Is(err, mqttlink.ErrNotPublished):
		if err := cm.store.DeleteCommand(ctx, d, c.ID, audit); err != nil {
			cm.log.Error("delete unpublished command", "id", c.ID, "err", err)
		}
		return errLinkDown
	case err != nil:
		cm.log.Warn("command published without the broker's acknowledgement; it may still arrive",
			"uid", d.UID(), "command", c.ID, "err", err)
	}
	return nil // audit, committed with the record, is told by the request (audited)
}

// newCommandID draws a command id.
func newCommandID() string { return store.RandomString(20, store.Alnum) }

// await returns the command once it has ended, or as it stands when wait
// has passed or the client has gone.
func (cm *commander) await(ctx context.Context, d *store.DeviceRef, id string, wait time.Duration) (*model.Command, error) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		changed := cm.store.CommandsChanged() // before the read: no change is missed
		c, err := cm.store.CommandOf(ctx, d, id)
		if err != nil || c.FinishedAt != nil {
			return c, err
		}
		select {
		case <-changed:
		case <-timer.C:
			return cm.store.CommandOf(ctx, d, id) // as it stands now
		case <-ctx.Done():
			return c, nil
		}
	}
}

// linkUp reports whether commands can be sent: a broker is configured
// and the link to it is up.
func (cm *commander) linkUp() bool { return cm.link != nil && cm.link.Connected() }

// expireInterval is how often the commander times out commands.
const expireInterval = time.Second

// run times out commands every expireInterval until ctx is done.
func (cm *commander) run(ctx context.Context) {
	if cm.link != nil { // no broker: no command was sent, none to time out
		every(ctx, expireInterval, cm.expire)
	}
}

// expire ends the commands past their deadline as timed_out, once the
// link has written every result it took before now: a result that came in
// time always beats the timeout.
func (cm *commander) expire(ctx context.Context) {
	now := cm.store.Now()
	if cm.link.AwaitApplied(ctx, now) != nil {
		return
	}
	ids, err := cm.store.ExpireCommands(ctx, now)
	if err != nil {
		cm.log.Error("expire commands", "err", err)
	}
	cm.events.CommandsChanged(ctx, ids)
}

// otaCommand is an ota command for the device to flash firmware f, an
// uploaded firmware of that device.
func (cm *commander) otaCommand(uid string, f *model.Firmware) (*model.Command, error) {
	payload, err := wire.EncodeJSON(otaPayload{Cmd: "ota", URL: cm.ota.url(uid, *f.MD5), MD5: *f.MD5,
		SHA256: *f.SHA256, Size: *f.Size, Version: f.Version})
	return &model.Command{Kind: model.KindOTA, Payload: payload}, err
}

// commandStore is what the command engine uses of the store: command
// records, their deadlines, and the wake-up when one ends.
type commandStore interface {
	Now() time.Time
	InsertCommand(c *model.Command, d *store.DeviceRef, deadline string, audit *model.AuditEntry) error
	DeleteCommand(ctx context.Context, d *store.DeviceRef, id string, audit *model.AuditEntry) error
	CommandOf(ctx context.Context, d *store.DeviceRef, id string) (*model.Command, error)
	CommandsChanged() <-chan struct{}
	ExpireCommands(ctx context.Context, now time.Time) ([]string, error)
}

// commandLink is the device link as the command engine sees it
// (internal/mqttlink's Link).
type commandLink interface {
	Connected() bool
	Publish(uid, commandID string, payload []byte) error
	AwaitApplied(ctx context.Context, t time.Time) error
}
