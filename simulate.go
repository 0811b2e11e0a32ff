package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"devicehub/internal/store"
	"devicehub/sim"
)

// simulateOptions configures `devicehub simulate`: whose devices, how many,
// and how the simulated devices behave.
type simulateOptions struct {
	Owner string // email of the user whose devices are simulated
	N     int    // create devices for the owner until there are at least N (esp32/devkit)
	sim.Options
}

// runSimulate runs every device of opts.Owner, creating esp32/devkit
// devices until there are opts.N, as simulated ESP32s until ctx is
// cancelled. It returns an error for bad options, an unknown owner, or an
// owner without devices; a broker that cannot be reached is retried in the
// background, like the server's link. The devices report the upload limit
// as their free sketch space, so every image the server accepts fits.
func runSimulate(ctx context.Context, st *store.Store, opts simulateOptions, log *slog.Logger) error {
	opts.FreeSpace = store.MaxFirmwareSize
	switch {
	case strings.TrimSpace(opts.Owner) == "":
		return errors.New("simulate: an owner email is required")
	case opts.N < 0:
		return fmt.Errorf("simulate: -n must be 0 or more, not %d", opts.N)
	}
	if err := opts.Normalize(); err != nil {
		return err
	}
	uids, created, err := simFleetUIDs(ctx, st, opts)
	if err != nil {
		return err
	}
	// A device keeps the firmware it flashed, as a real one does.
	running, err := st.RunningImagesOf(ctx, opts.Owner)
	if err != nil {
		return err
	}
	opts.Running = map[string]sim.Image{}
	for uid, img := range running {
		opts.Running[uid] = sim.Image{MD5: img.MD5, SHA256: img.SHA256, Version: img.Version, Size: img.Size}
	}
	if opts.Interval > time.Minute {
		log.Warn("simulate: telemetry less often than once a minute; the server may count the devices offline", "interval", opts.Interval)
	}
	fleet, err := sim.Start(ctx, uids, opts.Options, log)
	if err != nil {
		return err
	}
	log.Info("simulated fleet started", "devices", len(uids), "created", created,
		"owner", opts.Owner, "broker", opts.BrokerURL, "interval", opts.Interval, "fail_rate", opts.FailRate)
	fleet.Wait()
	log.Info("simulated fleet stopped", "devices", len(uids))
	return nil
}

// simFleetUIDs returns the owner's device uids, oldest first, after
// creating esp32/devkit devices until there are opts.N; created is how
// many it made.
func simFleetUIDs(ctx context.Context, st *store.Store, opts simulateOptions) (uids []string, created int, err error) {
	owner, err := st.UserByEmail(ctx, opts.Owner)
	if errors.Is(err, store.ErrUserNotFound) {
		return nil, 0, fmt.Errorf("simulate: no user with email %q", opts.Owner)
	}
	if err == nil {
		uids, err = st.DeviceUIDsOwnedBy(ctx, opts.Owner)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("simulate: list devices: %w", err)
	}
	port := brokerPort(opts.BrokerURL)
	for len(uids) < opts.N {
		name := fmt.Sprintf("Simulated ESP32 %d", len(uids)+1)
		uid, err := st.CreateDevice(ctx, owner.TeamID, store.NewDevice{Platform: "esp32", Board: "devkit", Name: name, MQTTPort: port}, nil)
		if err != nil {
			return nil, created, fmt.Errorf("simulate: create device: %w", err)
		}
		uids = append(uids, uid)
		created++
	}
	if len(uids) == 0 {
		return nil, 0, fmt.Errorf("simulate: %s has no devices; use -n to create some", opts.Owner)
	}
	return uids, created, nil
}

func cmdSimulate(ctx context.Context, c *cli, args []string) error {
	owner := c.fs.String("owner", "", "email of the user whose devices are simulated (required)")
	n := c.fs.Int("n", 0, "create devices for the owner until there are at least this many")
	interval := c.fs.Duration("interval", 10*time.Second, "telemetry period")
	failRate := c.fs.Float64("fail-rate", 0, "share of commands (0-1) that fail")
	crashMD5 := c.fs.String("crash-md5", "", "a firmware (md5) that crashes: devices running it reset with panic about every -crash-every")
	crashEvery := c.fs.Duration("crash-every", time.Minute, "how often a device running -crash-md5 crashes")
	if err := c.parse(args, "owner"); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	return runSimulate(ctx, st, simulateOptions{Owner: *owner, N: *n, Options: sim.Options{Interval: *interval, FailRate: *failRate, CrashMD5: *crashMD5, CrashEvery: *crashEvery,
		BrokerURL: c.cfg.mqttURL, Password: c.cfg.mqttPassword, Prefix: c.cfg.topicPrefix}}, c.logger())
}
