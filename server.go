package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// The server: what it is built from (serverOptions), and newServer, which
// builds it whole. serve fills the options from the configuration; the
// tests from testOptions.

// server is the HTTP API. Everything it uses is passed in; nothing is global.
type server struct {
	store    *store.Store
	log      *slog.Logger
	ota      *otaLinks // signs and checks OTA download links
	commands *commander
	rollouts *rolloutEngine
	presence *presence
	history  *historyPruner
	// otaProgress writes the OTA downloads' progress when the writer can.
	otaProgress *otaProgress
	events      *eventHub // the event stream's hub (events.go)
	webhooks    *webhookEngine
	// publicURL is how devices and browsers reach this server, without a
	// trailing slash: the base of invite links (and of download links, ota).
	publicURL string
	// logins manages the devices' broker logins; nil without -mqtt-dynsec.
	// devicePort is the broker port new devices are given.
	logins *mqttlink.Logins
	// loginLocks serialise the operations on one device's broker login
	// (create, rotate, delete): a delete and a rotate of the same device
	// must not interleave, or the rotate re-makes the login just removed.
	loginLocks keyedLocks[string]
	devicePort int
	broker     deviceBroker
	limiter    *loginLimiter
	hashes     *hashPool // runs password checks on a few workers
	// iterations is the PBKDF2 count of the dummy hash that an unknown
	// email is checked against; it matches what 'user add' uses, so that
	// an unknown email costs what a real check costs.
	iterations int
	dummyHash  func() string
	// passwordChecked, when set, is called by a login once its password
	// check is done, before its token is stored: the tests hold a login
	// there to change the password meanwhile.
	passwordChecked func()
	// corsOrigins are the browser origins allowed to call the API; none
	// by default.
	corsOrigins map[string]bool
	// trustedProxies are the peers whose X-Forwarded-For is believed
	// (clientIP); none by default.
	trustedProxies []netip.Prefix
	// dashboard is the browser page at GET /; nil when -dashboard=false.
	dashboard http.Handler
	mux       *http.ServeMux
}

// serverOptions is everything a server is built from.
type serverOptions struct {
	store *store.Store
	// link is the device link commands go out on; nil: no broker, and
	// commands answer 503.
	link   deviceLink
	events *eventHub // hears what changes; the MQTT link and metrics share it
	// logins manages the devices' broker logins; nil without -mqtt-dynsec.
	logins *mqttlink.Logins
	log    *slog.Logger
	otaKey []byte // signs the download links handed to devices
	// publicURL is how devices and browsers reach this server: the base
	// of download and invite links.
	publicURL string
	// devicePort is the broker port recorded for new devices.
	devicePort int
	// broker is where devices reach the broker, and the prefix of their
	// topics: what a new device is told (deviceBroker).
	broker deviceBroker
	// commandTimeout and otaTimeout are how long a command may take to end.
	commandTimeout, otaTimeout time.Duration
	// offlineAfter is how long a device may say nothing before it is set
	// offline; 0: never.
	offlineAfter time.Duration
	// corsOrigins are the browser origins allowed to call the API
	// (surrounding spaces and empty entries ignored).
	corsOrigins []string
	// trustedProxies are the peers whose X-Forwarded-For is believed.
	trustedProxies []netip.Prefix
	dashboard      bool // serve the dashboard at GET /
	// iterations is the PBKDF2 count of the dummy hash (passwordIterations;
	// the tests' hashes use fewer).
	iterations int
	// passwordChecked is the server's passwordChecked; nil outside tests.
	passwordChecked func()
	// webhooks are the webhook engine's settings (-webhook-queue,
	// -webhook-allow-private).
	webhooks webhookSettings
}

// newServer builds the API and its engines from opts, and loads the
// clients known to the login throttle from the store.
func newServer(ctx context.Context, opts serverOptions) (*server, error) {
	st := opts.store
	publicURL := strings.TrimRight(opts.publicURL, "/")
	links := &otaLinks{key: opts.otaKey, baseURL: publicURL, now: st.Now}
	commands := &commander{store: st, link: opts.link, ota: links, log: opts.log,
		timeout: opts.commandTimeout, otaTimeout: opts.otaTimeout, events: opts.events}
	s := &server{
		store:           st,
		log:             opts.log,
		ota:             links,
		commands:        commands,
		rollouts:        newRolloutEngine(st, commands, opts.log, opts.events),
		presence:        &presence{store: st, link: opts.link, events: opts.events, log: opts.log, offlineAfter: opts.offlineAfter},
		history:         newHistoryPruner(st, opts.log),
		otaProgress:     newOTAProgress(st, opts.events, opts.log),
		events:          opts.events,
		webhooks:        newWebhookEngine(st, opts.log, opts.events, opts.webhooks),
		publicURL:       publicURL,
		logins:          opts.logins,
		devicePort:      opts.devicePort,
		broker:          opts.broker,
		limiter:         newLoginLimiter(),
		hashes:          newHashPool(hashWorkers(), hashQueue),
		iterations:      opts.iterations,
		passwordChecked: opts.passwordChecked,
		corsOrigins:     map[string]bool{},
		trustedProxies:  opts.trustedProxies,
		mux:             http.NewServeMux(),
	}
	for _, o := range opts.corsOrigins {
		if o = strings.TrimSpace(o); o != "" {
			s.corsOrigins[o] = true
		}
	}
	if opts.dashboard {
		s.dashboard = newDashboardPage(dashboardHTML)
	}
	s.dummyHash = sync.OnceValue(func() string {
		h, _ := hashPassword(store.RandomString(20, store.Alnum), s.iterations)
		return h
	})
	for _, rt := range s.routes() {
		s.mux.HandleFunc(rt.pattern, s.answer(rt.handler))
	}
	if err := s.loadKnownClients(ctx); err != nil {
		return nil, fmt.Errorf("load known clients: %w", err)
	}
	return s, nil
}

// checkpointEvery is how often the WAL is copied into the database.
const checkpointEvery = time.Second

// run runs the server's engines until ctx is done: the rollout engine,
// the pruning of old audit entries and expired invites and of device
// history, the WAL's checkpoints, the commander's time-outs, presence,
// the writing of OTA downloads' progress and the webhooks' deliveries.
func (s *server) run(ctx context.Context) {
	pruneHistory := func(ctx context.Context) { every(ctx, historyPruneTick, s.history.run) }
	checkpoint := func(ctx context.Context) {
		every(ctx, checkpointEvery, func(ctx context.Context) {
			if err := s.store.Checkpoint(ctx); err != nil && ctx.Err() == nil {
				s.log.Error("checkpoint the database", "err", err)
			}
		})
	}
	var engines sync.WaitGroup
	for _, run := range []func(context.Context){s.rollouts.run, pruneHistory, checkpoint, s.commands.run, s.presence.run, s.otaProgress.run, s.webhooks.run} {
		engines.Go(func() { run(ctx) })
	}
	engines.Wait()
}
