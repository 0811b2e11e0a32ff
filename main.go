// Command devicehub serves a JSON REST API for managing a fleet of
// ESP32/ESP8266-class devices that talk to it through an MQTT broker.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
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

const usage = `usage:
  devicehub [serve] [flags]
  devicehub user add -email E -name N [-role user] [-password P]
  devicehub device add -owner EMAIL -platform KEY -board KEY [-name N] [-mqtt-port 1883]
  devicehub token create -email E -name N
Every command takes -data; serve takes the flags listed by 'devicehub serve -h'.`

// config is the service configuration: flags over environment over defaults.
type config struct {
	addr, data, mqttURL, mqttUser, mqttPassword, topicPrefix, publicURL string
	corsOrigins                                                         string
	debug                                                               bool
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
	fs.StringVar(&cfg.publicURL, "public-url", env("DEVICEHUB_PUBLIC_URL", ""), "base URL devices use to download firmware ($DEVICEHUB_PUBLIC_URL; default http://<listen host:port>)")
	fs.StringVar(&cfg.corsOrigins, "cors-origin", env("DEVICEHUB_CORS_ORIGIN", ""), "comma-separated browser origins allowed to call the API, e.g. https://dash.example.com ($DEVICEHUB_CORS_ORIGIN; default none)")
	fs.BoolVar(&cfg.debug, "debug", getenv("DEVICEHUB_DEBUG") != "", "log at debug level ($DEVICEHUB_DEBUG)")
	cfg.mqttPassword = getenv("DEVICEHUB_MQTT_PASSWORD")
	return fs
}

// run is the whole program: it parses args (without the program name) and
// runs the command they name until it finishes or ctx is cancelled.
func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	cmd := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
		if cmd != "serve" {
			if len(args) == 0 || strings.HasPrefix(args[0], "-") {
				return usageError{usage}
			}
			cmd, args = cmd+" "+args[0], args[1:]
		}
	}
	var cfg config
	fs := newFlagSet(cmd, &cfg, getenv, stderr)
	var email, name, role, password, owner, platform, board string
	var mqttPort int
	switch cmd {
	case "serve":
	case "user add":
		fs.StringVar(&email, "email", "", "email (required)")
		fs.StringVar(&name, "name", "", "name (required)")
		fs.StringVar(&role, "role", "user", "role")
		fs.StringVar(&password, "password", "", "password (default: first line of stdin)")
	case "device add":
		fs.StringVar(&owner, "owner", "", "owner's email (required)")
		fs.StringVar(&platform, "platform", "", "platform key, e.g. esp32 (required)")
		fs.StringVar(&board, "board", "", "board key (required)")
		fs.StringVar(&name, "name", "", "device name (default: its uid)")
		fs.IntVar(&mqttPort, "mqtt-port", 1883, "broker port the device was provisioned with")
	case "token create":
		fs.StringVar(&email, "email", "", "user's email (required)")
		fs.StringVar(&name, "name", "", "token name (required)")
	default:
		return usageError{fmt.Sprintf("unknown command %q\n%s", cmd, usage)}
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	}
	level := slog.LevelInfo
	if cfg.debug {
		level = slog.LevelDebug
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	if cmd == "serve" {
		return serve(ctx, cfg, logger)
	}

	st, err := openStore(ctx, cfg.data, time.Now)
	if err != nil {
		return err
	}
	defer st.Close()
	switch cmd {
	case "user add":
		if email == "" || name == "" {
			return usageError{"user add: -email and -name are required"}
		}
		if password == "" {
			line, err := bufio.NewReader(stdin).ReadString('\n')
			if err != nil && line == "" {
				return fmt.Errorf("read password from stdin: %w", err)
			}
			password = strings.TrimRight(line, "\r\n")
		}
		if password == "" {
			return usageError{"user add: empty password"}
		}
		hash, err := hashPassword(password, passwordIterations)
		if err != nil {
			return err
		}
		id, err := st.createUser(ctx, name, email, role, hash)
		if errors.Is(err, errConflict) {
			return fmt.Errorf("a user with email %s exists already", email)
		}
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, id)
	case "device add":
		if owner == "" || platform == "" || board == "" {
			return usageError{"device add: -owner, -platform and -board are required"}
		}
		if !validKey(platform) || !validKey(board) {
			return usageError{"device add: keys may only contain letters, digits, dots, underscores and dashes"}
		}
		if mqttPort < 1 || mqttPort > 65535 {
			return usageError{"device add: -mqtt-port must be 1-65535"}
		}
		uid, err := st.createDevice(ctx, owner, platform, board, name, mqttPort)
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, uid)
	case "token create":
		if email == "" || name == "" {
			return usageError{"token create: -email and -name are required"}
		}
		u, err := st.userByEmail(ctx, email)
		if errors.Is(err, errNotFound) {
			return fmt.Errorf("no user with email %s", email)
		}
		if err != nil {
			return err
		}
		tok, err := st.issueToken(ctx, u.ID, name, false)
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, tok)
	}
	return nil
}

// validKey reports whether a platform or board key is safe in a uid, and
// so in an MQTT topic and a URL path.
func validKey(k string) bool { return buttonIDPattern.MatchString(k) && k != "." && k != ".." }

// serve runs the HTTP API and the MQTT link until ctx is cancelled, then
// shuts down: stop accepting, finish requests in flight, disconnect.
func serve(ctx context.Context, cfg config, logger *slog.Logger) error {
	st, err := openStore(ctx, cfg.data, time.Now)
	if err != nil {
		return err
	}
	defer st.Close()
	key, err := loadOTAKey(filepath.Join(cfg.data, "ota.key"))
	if err != nil {
		return err
	}
	// Listen first, so that a bad address fails here, before anything starts.
	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	publicURL := cfg.publicURL
	if publicURL == "" {
		publicURL = "http://" + advertisedAddr(ln.Addr().(*net.TCPAddr))
	}
	link := newMQTTLink(mqttConfig{cfg.mqttURL, cfg.mqttUser, cfg.mqttPassword, cfg.topicPrefix}, st, logger)
	defer link.close()

	api := newServer(st, link, logger, key, publicURL)
	for _, o := range strings.Split(cfg.corsOrigins, ",") {
		if o = strings.TrimSpace(o); o != "" {
			api.corsOrigins[o] = true
		}
	}
	api.setDashboard(true) // CONTRACT §9; the -dashboard flag will choose
	srv := newHTTPServer(api, logger)
	logger.Info("listening", "addr", ln.Addr().String(), "public_url", publicURL, "mqtt", cfg.mqttURL)
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

// newHTTPServer is the service's http.Server, its limits chosen for slow
// devices on one side and abusive clients on the other.
func newHTTPServer(h http.Handler, logger *slog.Logger) *http.Server {
	return &http.Server{
		Handler: h,
		// Slow or idle clients cannot hold connections for long...
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    16 << 10,
		// ...but a 4 MiB upload over a 64 kbit/s link takes about 9
		// minutes, and so does a download to a device on a weak signal.
		ReadTimeout:  15 * time.Minute,
		WriteTimeout: 15 * time.Minute,
		ErrorLog:     slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
}

// advertisedAddr is host:port for the default public URL: the listen
// address, or this machine's host name when listening on all interfaces.
func advertisedAddr(a *net.TCPAddr) string {
	host := a.IP.String()
	if a.IP.IsUnspecified() {
		host, _ = os.Hostname()
	}
	return net.JoinHostPort(host, strconv.Itoa(a.Port))
}
