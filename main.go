// Command devicehub serves a JSON REST API for managing a fleet of
// ESP32/ESP8266-class devices that talk to it through an MQTT broker.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

func main() {
	// Collect the heap at 75% growth, not Go's default 100%: an idle service
	// with a thousand devices then stays under 20 MiB (on a Raspberry Pi that
	// matters), for a few percent of read throughput (50% cost 10-17%; see
	// BENCHMARKS.md). GOGC, when set, decides.
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(75)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	if err == nil {
		return
	}
	fmt.Fprintln(os.Stderr, "devicehub:", err)
	if errors.As(err, new(usageError)) {
		os.Exit(2)
	}
	os.Exit(1)
}

// usageError marks bad command-line usage (exit status 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// config is the service configuration: flags over environment over defaults.
type config struct {
	addr, data, mqttURL, mqttUser, mqttPassword, topicPrefix, publicURL string
	corsOrigins                                                         string
	debug, dashboard                                                    bool
	commandTimeout, otaTimeout, offlineAfter                            time.Duration
	// maxConns caps concurrent HTTP connections (0: no limit).
	maxConns int
	// webhookQueue bounds each webhook's queue, in events (0: no limit);
	// webhookAllowPrivate lets webhooks reach private addresses.
	webhookQueue        int
	webhookAllowPrivate bool
	// limits are the per-device and per-user quotas.
	limits store.Quotas
	// trustedProxies are the peers whose X-Forwarded-For is believed.
	trustedProxies []netip.Prefix
	// envErrs are environment values that do not parse; parse reports them.
	envErrs []error
	// accessLog turns on one info line per HTTP request.
	accessLog bool
	// metricsAddr is where GET /metrics listens; "" is off.
	metricsAddr string
	// mqttDynsec turns on broker logins per device (dynsec.go);
	// publicMQTTURL is the broker's address given to devices ("": derived,
	// publicBrokerURL).
	mqttDynsec    bool
	publicMQTTURL string
	// settings are the other flags' values for the start-up line, secrets
	// left out (cmdServe fills it from the flag set).
	settings []any
}

// newFlagSet returns a flag set for one command, with the configuration
// flags bound to cfg (defaults taken from the environment).
func newFlagSet(name string, cfg *config, getenv func(string) string, stderr io.Writer) *flag.FlagSet {
	env := func(key, def string) string {
		if v := getenv(key); v != "" {
			return v
		}
		return def
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.addr, "addr", env("DEVICEHUB_ADDR", ":8080"), "HTTP listen address ($DEVICEHUB_ADDR)")
	fs.StringVar(&cfg.data, "data", env("DEVICEHUB_DATA", "./data"), "data directory: database and firmware files ($DEVICEHUB_DATA)")
	fs.StringVar(&cfg.mqttURL, "mqtt", env("DEVICEHUB_MQTT_URL", "tcp://127.0.0.1:1883"), "MQTT broker URL: tcp://, ssl:// or mqtts:// ($DEVICEHUB_MQTT_URL)")
	fs.StringVar(&cfg.mqttUser, "mqtt-user", env("DEVICEHUB_MQTT_USER", ""), "MQTT user name ($DEVICEHUB_MQTT_USER; password only in $DEVICEHUB_MQTT_PASSWORD)")
	fs.StringVar(&cfg.topicPrefix, "topic-prefix", env("DEVICEHUB_TOPIC_PREFIX", "devices"), "MQTT topic prefix ($DEVICEHUB_TOPIC_PREFIX)")
	fs.StringVar(&cfg.publicURL, "public-url", env("DEVICEHUB_PUBLIC_URL", ""), "base URL devices use to download firmware ($DEVICEHUB_PUBLIC_URL; default http://<listen host:port>, on all interfaces the machine's first LAN IPv4 address)")
	fs.StringVar(&cfg.corsOrigins, "cors-origin", env("DEVICEHUB_CORS_ORIGIN", ""), "comma-separated browser origins allowed to call the API, e.g. https://dash.example.com ($DEVICEHUB_CORS_ORIGIN; default none)")
	fs.BoolVar(&cfg.debug, "debug", cfg.envBool(getenv, "DEVICEHUB_DEBUG", false), "log at debug level ($DEVICEHUB_DEBUG)")
	fs.BoolVar(&cfg.dashboard, "dashboard", cfg.envBool(getenv, "DEVICEHUB_DASHBOARD", true), "serve the dashboard at / ($DEVICEHUB_DASHBOARD)")
	duration := func(p *time.Duration, name, key string, def time.Duration, usage string) {
		*p = def
		if v := getenv(key); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil {
				cfg.envErrs = append(cfg.envErrs, fmt.Errorf("$%s: %w", key, err))
			}
			*p = d
		}
		fs.DurationVar(p, name, *p, usage+" ($"+key+")")
	}
	duration(&cfg.commandTimeout, "command-timeout", "DEVICEHUB_COMMAND_TIMEOUT", defaultCommandTimeout, "how long a command may take to end before it is timed_out")
	duration(&cfg.otaTimeout, "ota-timeout", "DEVICEHUB_OTA_TIMEOUT", defaultOTATimeout, "how long an OTA may take to end before it is timed_out")
	duration(&cfg.offlineAfter, "offline-after", "DEVICEHUB_OFFLINE_AFTER", 10*time.Minute, "a device silent this long is set offline; 0 turns it off")
	limit := func(p *int, name, key string, def int, usage string) {
		*p = def
		if v := getenv(key); v != "" {
			if err := (*limitValue)(p).Set(v); err != nil {
				cfg.envErrs = append(cfg.envErrs, fmt.Errorf("$%s: %w", key, err))
			}
		}
		fs.Var((*limitValue)(p), name, usage+" ($"+key+"; 0: no limit)")
	}
	proxies := func(v string) error {
		p, err := parseTrustedProxies(v)
		cfg.trustedProxies = p
		return err
	}
	if err := proxies(getenv("DEVICEHUB_TRUSTED_PROXIES")); err != nil {
		cfg.envErrs = append(cfg.envErrs, fmt.Errorf("$DEVICEHUB_TRUSTED_PROXIES: %w", err))
	}
	fs.Func("trusted-proxies", "comma-separated CIDRs of proxies whose X-Forwarded-For is believed ($DEVICEHUB_TRUSTED_PROXIES; default none)", proxies)
	limit(&cfg.maxConns, "max-conns", "DEVICEHUB_MAX_CONNS", 1024, "concurrent HTTP connections")
	limit(&cfg.limits.Firmwares, "max-firmwares", "DEVICEHUB_MAX_FIRMWARES", 20, "firmwares per device")
	limit(&cfg.limits.Buttons, "max-buttons", "DEVICEHUB_MAX_BUTTONS", 100, "command buttons per device")
	limit(&cfg.limits.FirmwareMiB, "max-firmware-mib", "DEVICEHUB_MAX_FIRMWARE_MIB", 256, "stored firmware MiB per team, a file shared by rows counted once per row, each by the 4 KiB disk blocks it takes")
	limit(&cfg.limits.LibraryFiles, "max-library-files", "DEVICEHUB_MAX_LIBRARY_FILES", 200, "files in a team's firmware library")
	limit(&cfg.limits.Tokens, "max-tokens", "DEVICEHUB_MAX_TOKENS", 100, "tokens per user; a login at the limit deletes the least recently used")
	limit(&cfg.limits.Devices, "max-devices", "DEVICEHUB_MAX_DEVICES", 10000, "devices a team adds through the API; the CLI is not limited")
	limit(&cfg.limits.TeamDataMiB, "max-team-data-mib", "DEVICEHUB_MAX_TEAM_DATA_MIB", 64, "MiB of JSON a team keeps: a button past it is refused, the oldest finished commands deleted")
	limit(&cfg.limits.Members, "max-members", "DEVICEHUB_MAX_MEMBERS", 100, "members of a team, invites not yet used included")
	limit(&cfg.limits.Webhooks, "max-webhooks", "DEVICEHUB_MAX_WEBHOOKS", 10, "webhooks per team")
	limit(&cfg.webhookQueue, "webhook-queue", "DEVICEHUB_WEBHOOK_QUEUE", defaultWebhookQueue, "events each webhook's queue holds (and at most 4 MiB); past it the oldest are dropped")
	fs.BoolVar(&cfg.webhookAllowPrivate, "webhook-allow-private", cfg.envBool(getenv, "DEVICEHUB_WEBHOOK_ALLOW_PRIVATE", false), "let webhooks reach loopback, private and link-local addresses: this host's and its network's services ($DEVICEHUB_WEBHOOK_ALLOW_PRIVATE)")
	limit(&cfg.limits.AuditDays, "audit-days", "DEVICEHUB_AUDIT_DAYS", 90, "days audit entries are kept, whatever their number")
	cfg.limits.HistoryDays = 30
	if v := getenv("DEVICEHUB_HISTORY_DAYS"); v != "" {
		if err := (*limitValue)(&cfg.limits.HistoryDays).Set(v); err != nil {
			cfg.envErrs = append(cfg.envErrs, fmt.Errorf("$DEVICEHUB_HISTORY_DAYS: %w", err))
		}
	}
	fs.Var((*limitValue)(&cfg.limits.HistoryDays), "history-days", "days of device history kept: readings in 5-minute buckets, presence ($DEVICEHUB_HISTORY_DAYS; 0: none)")
	fs.BoolVar(&cfg.accessLog, "access-log", cfg.envBool(getenv, "DEVICEHUB_ACCESS_LOG", true), "log one info line per request: method, route, status, duration, bytes ($DEVICEHUB_ACCESS_LOG)")
	fs.StringVar(&cfg.metricsAddr, "metrics-addr", env("DEVICEHUB_METRICS_ADDR", ""), "listen address of GET /metrics (Prometheus), which asks no token: keep it private, e.g. 127.0.0.1:9464 ($DEVICEHUB_METRICS_ADDR; default off)")
	fs.BoolVar(&cfg.mqttDynsec, "mqtt-dynsec", cfg.envBool(getenv, "DEVICEHUB_MQTT_DYNSEC", false), "manage a broker login per device through Mosquitto's dynamic security plugin; -mqtt-user needs its admin role ($DEVICEHUB_MQTT_DYNSEC)")
	fs.StringVar(&cfg.publicMQTTURL, "public-mqtt-url", env("DEVICEHUB_PUBLIC_MQTT_URL", ""), "broker URL given to devices with their login ($DEVICEHUB_PUBLIC_MQTT_URL; default the host of -public-url with the scheme and port of -mqtt)")
	cfg.mqttPassword = getenv("DEVICEHUB_MQTT_PASSWORD")
	return fs
}

// envBool reads a boolean environment variable (1, t, true, 0, f,
// false...), def when it is unset; a value that is neither goes to
// cfg.envErrs.
func (cfg *config) envBool(getenv func(string) string, key string, def bool) bool {
	v := getenv(key)
	if v == "" {
		return def
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		cfg.envErrs = append(cfg.envErrs, fmt.Errorf("$%s: %q is not true or false", key, v))
		return def
	}
	return b
}

// limitValue is a flag value for a limit: a whole number, 0 or more.
type limitValue int

func (v *limitValue) String() string { return strconv.Itoa(int(*v)) }

func (v *limitValue) Set(s string) error {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return fmt.Errorf("%q is not a whole number, 0 or more", s)
	}
	*v = limitValue(n)
	return nil
}

// broker returns how the MQTT link and broker logins reach the broker.
func (cfg *config) broker() mqttlink.Broker {
	return mqttlink.Broker{URL: cfg.mqttURL, User: cfg.mqttUser, Password: cfg.mqttPassword, Prefix: cfg.topicPrefix}
}

// subcommand is one of the program's commands. run defines its own flags on
// c.fs (which already holds the configuration flags) and parses args.
type subcommand struct {
	name, args, help string
	run              func(ctx context.Context, c *cli, args []string) error
}

// subcommands lists every command; usage prints this list.
func subcommands() []subcommand {
	return []subcommand{
		{"serve", "[flags]", "run the HTTP API and the MQTT link (the default command)", cmdServe},
		{"help", "", "list the commands (also -h and --help)", cmdHelp},
		{"user add", "-email E -name N [-role user|admin|viewer] [-team EMAIL] [-password P]", "create a user in a new team or EMAIL's, print its id; password from a prompt or stdin (-password is visible in ps)", cmdUserAdd},
		{"user list", "", "list the users", cmdUserList},
		{"user passwd", "-email E", "set a user's password (as user add) and revoke their tokens", cmdUserPasswd},
		{"user remove", "-email E [-with-devices]", "delete a user and their tokens (and devices: -with-devices)", cmdUserRemove},
		{"device add", "-owner EMAIL -platform KEY -board KEY [-name N] [-mqtt-port 1883]", "create a pending device (with a broker login: -mqtt-dynsec), print its uid", cmdDeviceAdd},
		{"device list", "[-owner EMAIL]", "list the devices, all or one user's", cmdDeviceList},
		{"device remove", "UID", "delete a device, its firmwares and their unneeded files (and its broker login: -mqtt-dynsec)", cmdDeviceRemove},
		{"device import", "-owner EMAIL [-mqtt-port 1883] < devices.csv", "create devices from CSV (uid,name,platform,board) in one transaction, print how many", cmdDeviceImport},
		{"device credentials", "UID", "issue the device a new broker password, print its credentials as JSON (-mqtt-dynsec)", cmdDeviceCredentials},
		{"device narrow-logins", "", "limit every device's broker login to the protocol's topics, once after upgrading from a version that allowed its whole prefix (-mqtt-dynsec)", cmdDeviceNarrowLogins},
		{"token create", "-email E -name N", "create a personal access token, print it", cmdTokenCreate},
		{"token list", "[-email E]", "list the tokens (never their secrets), all or one user's", cmdTokenList},
		{"token revoke", "ID", "delete a token", cmdTokenRevoke},
		{"backup", "-to DIR", "copy database, firmware files and ota.key to DIR, also live", cmdBackup},
		{"simulate", "-owner EMAIL [-n N] [-interval 10s] [-fail-rate 0] [-crash-md5 MD5 -crash-every 1m]", "run the owner's devices as simulated ESP32s until interrupted", cmdSimulate},
	}
}

// usage is the help text: every command with its arguments, one line each.
func usage() string {
	var b strings.Builder
	b.WriteString("usage: devicehub COMMAND [flags]\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
	for _, c := range subcommands() {
		fmt.Fprintf(tw, "  %s\t%s\n", strings.TrimSpace(c.name+" "+c.args), c.help)
	}
	tw.Flush()
	b.WriteString("\nEvery command takes the configuration flags (-data and the rest); 'devicehub COMMAND -h' lists them.")
	return b.String()
}

// cli is what a command works with: its flags, configuration and streams,
// and the store once openStore has opened it.
type cli struct {
	fs             *flag.FlagSet
	cfg            config
	stdin          io.Reader
	stdout, stderr io.Writer
	st             *store.Store // closed by run when the command returns
}

// run is the whole program: it parses args (without the program name) and
// runs the command they name until it finishes or ctx is cancelled.
func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	cmd, args, ok := findCommand(args)
	if !ok {
		return usageError{usage()}
	}
	c := &cli{stdin: stdin, stdout: stdout, stderr: stderr}
	c.fs = newFlagSet(cmd.name, &c.cfg, getenv, stderr)
	c.fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: devicehub %s %s\n  %s\n\nflags:\n", cmd.name, cmd.args, cmd.help)
		c.fs.PrintDefaults()
	}
	err := cmd.run(ctx, c, args)
	if c.st != nil {
		err = errors.Join(err, c.st.WaitAsideFiles(ctx, func() {
			fmt.Fprintln(stderr, "waiting for the backup that runs to end: it may need the firmware files deleted")
		}), c.st.Close())
	}
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

// findCommand picks the command that args start with ("help" for -h and
// --help; "serve" when they start with another flag or are empty) and
// returns the arguments after its name.
func findCommand(args []string) (subcommand, []string, bool) {
	if len(args) > 0 && slices.Contains([]string{"-h", "-help", "--help"}, args[0]) {
		args = append([]string{"help"}, args[1:]...)
	}
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		args = append([]string{"serve"}, args...)
	}
	for _, c := range subcommands() {
		words := strings.Fields(c.name)
		if len(args) >= len(words) && slices.Equal(args[:len(words)], words) {
			return c, args[len(words):], true
		}
	}
	return subcommand{}, nil, false
}

// parse parses the command's flags; it allows no other arguments, nor an
// empty value of a flag named in required (the first one is named).
func (c *cli) parse(args []string, required ...string) error {
	if err := c.parseFlags(args); err != nil {
		return err
	}
	if c.fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected argument %q", c.fs.Arg(0))}
	}
	for _, name := range required {
		if c.fs.Lookup(name).Value.String() == "" {
			return usageError{fmt.Sprintf("%s: -%s is required", c.fs.Name(), name)}
		}
	}
	return nil
}

// parseArg parses the command's flags around exactly one positional
// argument, which it returns: "token revoke 7 -data DIR" works as well
// as "token revoke -data DIR 7".
func (c *cli) parseArg(args []string, name string) (string, error) {
	if err := c.parseFlags(args); err != nil {
		return "", err
	}
	if c.fs.NArg() == 0 {
		return "", usageError{fmt.Sprintf("%s: %s is required", c.fs.Name(), name)}
	}
	arg := c.fs.Arg(0)
	return arg, c.parse(c.fs.Args()[1:])
}

// parseFlags parses flags up to the first other argument, and reports
// environment values that did not parse.
func (c *cli) parseFlags(args []string) error {
	if err := c.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err.Error()}
	}
	if err := errors.Join(c.cfg.envErrs...); err != nil {
		return usageError{err.Error()}
	}
	return nil
}

// logger is the logger the configuration asks for, on stderr.
func (c *cli) logger() *slog.Logger {
	level := slog.LevelInfo
	if c.cfg.debug {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(c.stderr, &slog.HandlerOptions{Level: level}))
}

// openStore opens the configured data directory for a command that may
// run beside the service: it leaves the firmware files alone. run closes
// the store when the command returns.
func (c *cli) openStore(ctx context.Context) (*store.Store, error) {
	st, err := openDataDir(ctx, c.cfg, c.logger(), store.OpenBeside)
	c.st = st
	return st, err
}

// openDataDir makes the data directory owner-only and opens the store in
// it with open (store.Open for the service, which also sweeps the firmware
// files), with the configured quotas.
func openDataDir(ctx context.Context, cfg config, logger *slog.Logger,
	open func(context.Context, string, func() time.Time, store.Quotas) (*store.Store, error)) (*store.Store, error) {
	if err := secureDataDir(cfg.data, logger); err != nil {
		return nil, err
	}
	return open(ctx, cfg.data, time.Now, cfg.limits)
}

func cmdServe(ctx context.Context, c *cli, args []string) error {
	if err := c.parse(args); err != nil {
		return err
	}
	c.cfg.settings = startupSettings(c.fs, "addr", "public-url", "mqtt")
	return serve(ctx, c.cfg, c.logger())
}

// startupSettings lists every flag's effective value as log attributes,
// for the start-up line, except those in skip (logged on their own) and
// any whose name suggests a secret (-max-tokens is a limit, not one).
// The MQTT password is no flag: it shows only as whether it is set.
func startupSettings(fs *flag.FlagSet, skip ...string) []any {
	var attrs []any
	fs.VisitAll(func(f *flag.Flag) {
		if slices.Contains(skip, f.Name) || strings.Contains(f.Name, "password") ||
			strings.Contains(f.Name, "secret") || strings.HasSuffix(f.Name, "token") {
			return
		}
		attrs = append(attrs, strings.ReplaceAll(f.Name, "-", "_"), f.Value.String())
	})
	return attrs
}

func cmdHelp(ctx context.Context, c *cli, args []string) error {
	if err := c.parse(args); err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, usage())
	return nil
}

// serve runs the HTTP API and the MQTT link until ctx is cancelled, then
// shuts down: stop accepting, finish requests in flight, disconnect.
func serve(ctx context.Context, cfg config, logger *slog.Logger) error {
	st, err := openDataDir(ctx, cfg, logger, store.Open)
	if err != nil {
		return err
	}
	defer st.Close()
	key, err := loadOTAKey(filepath.Join(cfg.data, "ota.key"))
	if err != nil {
		return err
	}
	// Listen first, so that a bad address fails here, before anything
	// starts. Shutdown closes the listeners too; closing twice is harmless.
	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	defer ln.Close()
	mln, err := listenMetrics(cfg.metricsAddr)
	if err != nil {
		return err
	}
	if mln != nil {
		defer mln.Close()
	}
	publicURL := cfg.publicURL
	if publicURL == "" {
		publicURL = defaultPublicURL(ln.Addr().(*net.TCPAddr), net.InterfaceAddrs, logger)
	}
	logins, err := openBrokerLogins(cfg, publicURL, logger)
	if err != nil {
		return err
	}
	if logins != nil {
		defer logins.Close()
	}
	events := newEventHub(st)
	link := mqttlink.New(mqttlink.Config{Broker: cfg.broker(), Sink: deviceSink{st, events}, Now: st.Now, Log: logger})
	defer link.Close()
	// Without -mqtt-dynsec a broker URL that cannot be derived is no
	// error: a new device is told its topics, and no URL.
	brokerURL, _ := cfg.publicBrokerURL(publicURL)
	api, err := newServer(ctx, serverOptions{store: st, link: link, events: events, logins: logins, log: logger,
		otaKey: key, publicURL: publicURL, devicePort: brokerPort(cmp.Or(cfg.publicMQTTURL, cfg.mqttURL)),
		broker:         deviceBroker{url: brokerURL, prefix: cfg.topicPrefix},
		commandTimeout: cfg.commandTimeout, otaTimeout: cfg.otaTimeout, offlineAfter: cfg.offlineAfter,
		corsOrigins: strings.Split(cfg.corsOrigins, ","), trustedProxies: cfg.trustedProxies, dashboard: cfg.dashboard,
		iterations: passwordIterations, webhooks: webhookSettings{queueEvents: cfg.webhookQueue, allowPrivate: cfg.webhookAllowPrivate}})
	if err != nil {
		return err
	}
	// The engines stop before the link and the store close (the defers
	// run last first), so they never send through a closed one.
	defer start(ctx, api.run, events.run)()
	watchers, stopMetrics := requestWatchers(cfg.accessLog, logger, mln, newMetrics(st, link, events))
	defer stopMetrics()
	srv := newHTTPServer(observe(api, watchers...), logger, requestReadTimeout)
	// The one start-up line: the effective configuration, secrets left out.
	logger.Info("listening", append([]any{"addr", ln.Addr().String(), "public_url", publicURL,
		"mqtt", mqttlink.RedactURL(cfg.mqttURL), "mqtt_password_set", cfg.mqttPassword != ""}, cfg.settings...)...)
	return serveUntil(ctx, srv, limitConns(srv, ln, newConnLimits(cfg.maxConns)), logger)
}

// requestWatchers are what watches every request: the access log (with
// accessLog) and, with a metrics listener, the metrics m, served on mln
// until stop.
func requestWatchers(accessLog bool, logger *slog.Logger, mln net.Listener, m *metrics) (watchers []func(*http.Request, requestDone), stop func()) {
	if accessLog {
		watchers = append(watchers, logRequest(logger))
	}
	if mln != nil {
		watchers = append(watchers, m.record)
	}
	return watchers, serveMetrics(mln, m, logger)
}

// serveUntil serves srv on ln until ctx is cancelled, then shuts it down:
// it stops accepting and lets the requests in flight finish.
func serveUntil(ctx context.Context, srv *http.Server, ln net.Listener, logger *slog.Logger) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	logger.Info("shutting down")
	// A fresh context: the cancelled one would abort requests in flight.
	shutCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}

// openBrokerLogins opens the connection that manages the devices' broker
// logins, with -mqtt-dynsec; nil without.
func openBrokerLogins(cfg config, publicURL string, logger *slog.Logger) (*mqttlink.Logins, error) {
	if !cfg.mqttDynsec {
		return nil, nil
	}
	brokerURL, err := cfg.publicBrokerURL(publicURL)
	if err != nil {
		return nil, err
	}
	return mqttlink.NewLogins(cfg.broker(), brokerURL, logger), nil
}

// every runs f every interval until ctx is done.
func every(ctx context.Context, interval time.Duration, f func(context.Context)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			f(ctx)
		case <-ctx.Done():
			return
		}
	}
}

// start runs each engine in a goroutine of its own until the returned
// stop, which cancels them and waits until every one has returned.
func start(ctx context.Context, engines ...func(context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var running sync.WaitGroup
	for _, run := range engines {
		running.Go(func() { run(ctx) })
	}
	return func() { cancel(); running.Wait() }
}

// Read deadlines: a request's headers and body must arrive
// within requestReadTimeout; an authenticated firmware upload then gets
// uploadReadTimeout for its body (handleFirmwareUpload).
const (
	requestReadTimeout = 30 * time.Second
	// A 4 MiB upload over a 64 kbit/s link takes about 9 minutes.
	uploadReadTimeout = 15 * time.Minute
)

// newHTTPServer is the service's http.Server, its limits chosen for slow
// devices on one side and abusive clients on the other. readTimeout bounds
// reading a whole request (requestReadTimeout in production).
func newHTTPServer(h http.Handler, logger *slog.Logger, readTimeout time.Duration) *http.Server {
	return &http.Server{
		Handler: h,
		// Slow or idle clients cannot hold connections for long: a
		// request's headers within 10 s and all of it within readTimeout,
		// without a token; only an authenticated upload gets longer.
		ReadHeaderTimeout: min(10*time.Second, readTimeout),
		ReadTimeout:       readTimeout,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    16 << 10,
		// A download to a device on a weak signal takes as long as an
		// upload on a slow link.
		WriteTimeout: uploadReadTimeout,
		ErrorLog:     slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
}

// secureDataDir creates the data directory owner-only, or makes an
// existing one that its group or others can enter owner-only, and says so:
// it holds the password hashes and the OTA signing key.
func secureDataDir(dir string, logger *slog.Logger) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create data dir: %w", err)
	}
	info, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	if mode := info.Mode().Perm(); mode&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("make data dir owner-only: %w", err)
		}
		logger.Warn("tightened the data directory to owner-only: it was open to other users",
			"dir", dir, "was", fmt.Sprintf("%04o", mode), "now", "0700")
	}
	return nil
}
