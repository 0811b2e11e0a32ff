package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"devicehub/internal/brokertest"
	"devicehub/internal/model"
	"devicehub/internal/store"
)

// cliRun runs the program with args, the environment env and stdin, and
// returns what it wrote to stdout and stderr.
func cliRun(t *testing.T, env map[string]string, stdin string, args ...string) (string, string, error) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	getenv := func(k string) string { return env[k] }
	err := run(context.Background(), args, getenv, strings.NewReader(stdin), &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

// cliOK runs the program like cliRun, without environment, and returns
// its stdout, failing the test if it fails.
func cliOK(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	return cliOKIn(t, nil, stdin, args...)
}

// cliOKIn is cliOK in the environment env.
func cliOKIn(t *testing.T, env map[string]string, stdin string, args ...string) string {
	t.Helper()
	out, stderr, err := cliRun(t, env, stdin, args...)
	if err != nil {
		t.Fatalf("devicehub %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	return out
}

// TestCLI provisions a user, devices and a token through the admin
// commands, on one data directory.
func TestCLI(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ctx := context.Background()

	// user add, password from -password, with a warning. Hashing at the
	// production work factor is slow, so this test adds only two users.
	out, stderr, err := cliRun(t, nil, "", "user", "add", "-data", dir, "-email", "Ann@Example.com", "-name", "Ann", "-password", "ann password")
	if err != nil || out != "1\n" || !strings.Contains(stderr, "warning: -password shows the password in the process list") {
		t.Errorf("user add -password: got %q, %v, stderr %q; want the id \"1\\n\" and a warning against -password", out, err, stderr)
	}
	// user add, password from the first line of stdin.
	if out := cliOK(t, "from stdin\r\nsecond line\n", "user", "add", "-data", dir, "-email", "ops@example.com", "-name", "Ops", "-role", "admin"); out != "2\n" {
		t.Errorf("user add from stdin printed %q, want \"2\\n\"", out)
	}
	st := storeAt(t, dir)
	ann, err := st.UserByEmail(ctx, "ann@example.com")
	must(t, err)
	if ann.ID != 1 || ann.Name != "Ann" || ann.Email != "ann@example.com" || ann.Role != "user" {
		t.Errorf("user: got %+v, want id 1, Ann, ann@example.com, role user", ann)
	}
	ops, err := st.UserByEmail(ctx, "ops@example.com")
	must(t, err)
	if ops.Role != "admin" {
		t.Errorf("role: got %q, want admin", ops.Role)
	}
	prefix := fmt.Sprintf("pbkdf2-sha256$%d$", passwordIterations)
	for _, u := range []*store.UserRow{ann, ops} {
		if !strings.HasPrefix(u.PasswordHash, prefix) {
			t.Errorf("password hash of %s: got %q, want prefix %q", u.Email, u.PasswordHash, prefix)
		}
	}
	var wg sync.WaitGroup
	for u, password := range map[*store.UserRow]string{ann: "ann password", ops: "from stdin"} {
		wg.Go(func() {
			if !checkPassword(u.PasswordHash, password) {
				t.Errorf("password of %s does not check with %q", u.Email, password)
			}
		})
	}
	wg.Wait()

	// device add prints only the uid.
	out = cliOK(t, "", "device", "add", "-data", dir, "-owner", "ann@example.com", "-platform", "esp32", "-board", "devkit")
	if !regexp.MustCompile(`^esp32_[a-z0-9]+\n$`).MatchString(out) {
		t.Fatalf("device add printed %q, want only a uid esp32_<random>", out)
	}
	uid := strings.TrimSpace(out)
	d, err := st.Device(ctx, ann.ID, uid)
	must(t, err)
	meta, _ := json.Marshal(d.Meta)
	if d.Name != uid || d.Status != "pending" || d.Port != 1883 || string(meta) != `{"mqtt_port":1883}` ||
		d.Platform.Key != "esp32" || d.Platform.Name != "esp32" || d.Board.Key != "devkit" || d.Board.Name != "devkit" {
		t.Errorf("device: got name %q status %q port %d meta %s platform %+v board %+v; want name = uid, pending, 1883, esp32, devkit",
			d.Name, d.Status, d.Port, meta, d.Platform, d.Board)
	}

	out = cliOK(t, "", "device", "add", "-data", dir, "-owner", "ops@example.com",
		"-platform", "esp8266", "-board", "d1_mini", "-name", "Lab", "-mqtt-port", "8883")
	if !regexp.MustCompile(`^esp8266_[a-z0-9]+\n$`).MatchString(out) {
		t.Fatalf("device add printed %q, want only a uid esp8266_<random>", out)
	}
	d, err = st.Device(ctx, ops.ID, strings.TrimSpace(out))
	must(t, err)
	if d.Name != "Lab" || d.Port != 8883 || d.Board.Key != "d1_mini" {
		t.Errorf("device: got name %q port %d board %q, want Lab, 8883, d1_mini", d.Name, d.Port, d.Board.Key)
	}

	// token create prints a token that authenticates as the user.
	out = cliOK(t, "", "token", "create", "-data", dir, "-email", "ann@example.com", "-name", "ci")
	if !regexp.MustCompile(`^[0-9]+\|[A-Za-z0-9]{40}\n$`).MatchString(out) {
		t.Fatalf("token create printed %q, want <id>|<secret>", out)
	}
	if rec, err := authenticate(ctx, st, strings.TrimSpace(out)); err != nil || rec.User.ID != ann.ID {
		t.Errorf("the printed token authenticates %v (%v), want user %d", rec, err, ann.ID)
	}

	// Failures that are not usage errors: exit status 1, nothing on stdout.
	failures := []struct {
		name  string
		stdin string
		args  []string
	}{
		{"user add with an email taken", "", []string{"user", "add", "-data", dir, "-email", "ANN@example.com", "-name", "Ann 2", "-password", "x"}},
		{"user add with empty stdin", "", []string{"user", "add", "-data", dir, "-email", "new@example.com", "-name", "New"}},
		{"device add for an unknown owner", "", []string{"device", "add", "-data", dir, "-owner", "nobody@example.com", "-platform", "esp32", "-board", "devkit"}},
		{"token create for an unknown user", "", []string{"token", "create", "-data", dir, "-email", "nobody@example.com", "-name", "t"}},
	}
	for _, tt := range failures {
		t.Run(tt.name, func(t *testing.T) {
			out, _, err := cliRun(t, nil, tt.stdin, tt.args...)
			if err == nil {
				t.Fatal("got nil error, want a failure")
			}
			if errors.As(err, new(usageError)) {
				t.Errorf("got usage error %q, want another failure", err)
			}
			if out != "" {
				t.Errorf("stdout: got %q, want nothing", out)
			}
		})
	}
	wantDB(t, st, "2 2 1", `SELECT (SELECT count(*) FROM users) || ' ' || (SELECT count(*) FROM devices) || ' ' || (SELECT count(*) FROM tokens)`)
}

// TestCLIUsage: bad command lines are usage errors (exit status 2) that
// change nothing; user add refuses a malformed email and an undocumented
// role before it asks for a password.
func TestCLIUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	data := []string{"-data", dir}
	userAdd := func(email, role string) []string {
		return append([]string{"user", "add", "-email", email, "-name", "Ann", "-role", role}, data...)
	}
	tests := []struct {
		name string
		args []string
		want string // in the error, when set
	}{
		{"unknown command", []string{"frobnicate"}, ""},
		{"user without subcommand", []string{"user"}, ""},
		{"user unknown subcommand", []string{"user", "delete"}, ""},
		{"device without subcommand", []string{"device", "-owner", "a@example.com"}, ""},
		{"user add without email", append([]string{"user", "add", "-name", "N", "-password", "p"}, data...), ""},
		{"user add without name", append([]string{"user", "add", "-email", "e@example.com", "-password", "p"}, data...), ""},
		{"device add without owner", append([]string{"device", "add", "-platform", "esp32", "-board", "devkit"}, data...), ""},
		{"device add without platform", append([]string{"device", "add", "-owner", "a@example.com", "-board", "devkit"}, data...), ""},
		{"device add without board", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32"}, data...), ""},
		{"device add platform key with a space", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp 32", "-board", "devkit"}, data...), ""},
		{"device add board key with a slash", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "a/b"}, data...), ""},
		{"device add mqtt port 0", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "devkit", "-mqtt-port", "0"}, data...), ""},
		{"device add mqtt port 65536", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "devkit", "-mqtt-port", "65536"}, data...), ""},
		{"device add mqtt port not a number", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "devkit", "-mqtt-port", "x"}, data...), ""},
		{"device add unknown flag", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "devkit", "-color", "red"}, data...), ""},
		{"device add extra argument", append([]string{"device", "add", "-owner", "a@example.com", "-platform", "esp32", "-board", "devkit", "now"}, data...), ""},
		{"token create without name", append([]string{"token", "create", "-email", "a@example.com"}, data...), ""},
		{"serve with a flag of another command", []string{"serve", "-email", "a@example.com"}, ""},
		{"user add email without domain", userAdd("ann", "user"), `invalid email "ann"`},
		{"user add email without host", userAdd("ann@", "user"), `invalid email "ann@"`},
		{"user add email without local part", userAdd("@example.com", "user"), `invalid email "@example.com"`},
		{"user add email with a name", userAdd("Ann <ann@example.com>", "user"), `invalid email "Ann <ann@example.com>"`},
		{"user add email in brackets", userAdd("<ann@example.com>", "user"), `invalid email "<ann@example.com>"`},
		{"user add email with a space", userAdd(" ann@example.com", "user"), `invalid email " ann@example.com"`},
		{"user add two emails", userAdd("ann@example.com, bob@example.com", "user"), `invalid email "ann@example.com, bob@example.com"`},
		{"user add role root", userAdd("ann@example.com", "root"), `role "root" is not one of user, admin`},
		{"user add role in capitals", userAdd("ann@example.com", "Admin"), `role "Admin" is not one of user, admin`},
		{"user add role empty", userAdd("ann@example.com", ""), `role "" is not one of user, admin`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _, err := cliRun(t, nil, "", tt.args...)
			if !errors.As(err, new(usageError)) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run(%q): got %v, want a usage error saying %q", tt.args, err, tt.want)
			}
			if out != "" {
				t.Errorf("stdout: got %q, want nothing", out)
			}
		})
	}
	if _, err := os.Stat(filepath.Join(dir, "devicehub.db")); err == nil {
		wantDB(t, storeAt(t, dir), "0", `SELECT (SELECT count(*) FROM users) + (SELECT count(*) FROM devices) + (SELECT count(*) FROM tokens)`)
	}
}

// TestCLIEnvironment: DEVICEHUB_DATA is used when -data is absent, and
// -data overrides it.
func TestCLIEnvironment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	envDir, flagDir := t.TempDir(), t.TempDir()
	st := storeAt(t, envDir)
	id, err := st.CreateUser(ctx, "Env", "env@example.com", "user", "x", "")
	must(t, err)
	env := map[string]string{"DEVICEHUB_DATA": envDir}

	out, _, err := cliRun(t, env, "", "token", "create", "-email", "env@example.com", "-name", "from env")
	must(t, err)
	rec, err := authenticate(ctx, st, strings.TrimSpace(out))
	if err != nil || rec.User.ID != id {
		t.Errorf("token from DEVICEHUB_DATA's store: got %v, %v; want a token of user %d", rec, err, id)
	}

	// -data wins: flagDir has no such user.
	out, _, err = cliRun(t, env, "", "token", "create", "-data", flagDir, "-email", "env@example.com", "-name", "from flag")
	if err == nil {
		t.Errorf("token create with -data %s: got %q, want an error (no such user there)", flagDir, out)
	}
	if _, err := os.Stat(filepath.Join(flagDir, "devicehub.db")); err != nil {
		t.Errorf("-data directory: %v, want a database there", err)
	}
	wantDB(t, st, "1", `SELECT count(*) FROM tokens`)

	// The flag also wins for device add.
	out, _, err = cliRun(t, map[string]string{"DEVICEHUB_DATA": flagDir}, "", "device", "add", "-data", envDir,
		"-owner", "env@example.com", "-platform", "esp32", "-board", "devkit")
	if err != nil {
		t.Fatalf("device add with -data over DEVICEHUB_DATA: %v", err)
	}
	if _, err := st.Device(ctx, id, strings.TrimSpace(out)); err != nil {
		t.Errorf("device %q in the -data store: %v", out, err)
	}
}

// TestServeEndToEnd runs the whole program on 127.0.0.1:0 without a
// reachable broker, provisioned through the CLI, and shuts it down.
func TestServeEndToEnd(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cliOK(t, "", "user", "add", "-data", dir, "-email", "e2e@example.com", "-name", "E2E", "-password", "e2e password")
	uid := strings.TrimSpace(cliOK(t, "", "device", "add", "-data", dir, "-owner", "e2e@example.com", "-platform", "esp32", "-board", "devkit", "-name", "Bench"))

	// The flags override the environment, which fills in the rest: a
	// listen address or data directory taken from it would fail the test.
	env := map[string]string{
		"DEVICEHUB_ADDR":       "127.0.0.1:-1",
		"DEVICEHUB_DATA":       t.TempDir(),
		"DEVICEHUB_MQTT_URL":   "tcp://127.0.0.1:2",
		"DEVICEHUB_PUBLIC_URL": "https://hub.example.test",
		// Devices reach the broker elsewhere, and are told so.
		"DEVICEHUB_PUBLIC_MQTT_URL": "mqtts://broker.example.test:8883",
	}
	base, log, stop := serveInProcess(t, env, "-data", dir)
	addr := strings.TrimPrefix(base, "http://")
	if line := log.String(); !strings.Contains(line, "public_url=https://hub.example.test mqtt=tcp://127.0.0.1:1") {
		t.Errorf("listening line %q: want public_url from DEVICEHUB_PUBLIC_URL and mqtt from -mqtt", line)
	}
	// Generous: a login hashes at the production work factor, which takes
	// seconds under -race on a busy machine.
	c := &liveClient{base: base, hc: &http.Client{Timeout: 60 * time.Second}}
	if b := c.want(t, 200, "GET", "/healthz", "", nil); !jsonEqual(t, b, []byte(`{"status":"ok","mqtt":"disconnected"}`)) {
		t.Errorf("healthz: got %s", b)
	}
	var login struct{ Token string }
	json.Unmarshal(c.want(t, 200, "POST", "/v1/auth/login", "application/json", []byte(`{"email":"e2e@example.com","password":"e2e password","token_name":"e2e"}`)), &login)
	c.want(t, 401, "GET", "/v1/user/devices", "", nil)
	c.token = login.Token
	want := fmt.Sprintf(`{"data":[{"uid":%q,"name":"Bench","status":"pending","last_seen_at":null,
		"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},"board_variant":null,"current_firmware":null}]}`, uid)
	if b := c.want(t, 200, "GET", "/v1/user/devices", "", nil); !jsonEqual(t, b, []byte(want)) {
		t.Errorf("device list: got %s, want %s", b, want)
	}
	c.want(t, 422, "POST", "/v1/user/devices/"+uid+"/reboot", "", nil)
	if b := c.want(t, 201, "POST", "/v1/user/devices", "application/json", []byte(`{"platform":"esp32","board":"devkit"}`)); !strings.Contains(string(b), `"port":8883,`) {
		t.Errorf("a new device: got %s, want the port of -public-mqtt-url", b)
	}

	// A request in flight when shutdown starts is finished: send half of
	// a PATCH, cancel, then send the rest.
	conn, err := net.Dial("tcp", addr)
	must(t, err)
	defer conn.Close()
	patch := `{"name":"Renamed on shutdown"}`
	fmt.Fprintf(conn, "PATCH /v1/user/devices/%s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		uid, addr, login.Token, len(patch), patch[:10])
	time.Sleep(200 * time.Millisecond) // the server reads the headers
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	time.Sleep(200 * time.Millisecond) // shutdown has begun
	io.WriteString(conn, patch[10:])
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	must(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"name":"Renamed on shutdown"`) {
		t.Errorf("request in flight during shutdown: got %d %s, want 200 with the new name", resp.StatusCode, b)
	}

	if err := <-stopped; err != nil {
		t.Errorf("run after cancel: got %v, want nil", err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Errorf("%s still accepts connections after shutdown", addr)
	}
}

// TestServeListenError: a bad listen address fails run at once.
func TestServeListenError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		_, _, err := cliRun(t, nil, "", "serve", "-addr", ln.Addr().String(), "-data", t.TempDir(), "-mqtt", "tcp://127.0.0.1:1")
		done <- err
	}()
	if err := receive(t, done, time.Minute, "return of serve on a busy address"); err == nil || errors.As(err, new(usageError)) {
		t.Errorf("serve on a busy address: got %v, want a listen error", err)
	}
}

// TestAdvertisedAddr: the default public URL's host is the listen address,
// or, when listening on all interfaces, the first IPv4 address of this
// machine that is neither loopback nor link-local (devices rarely resolve
// host names); 127.0.0.1, reported, when there is none.
func TestAdvertisedAddr(t *testing.T) {
	t.Parallel()
	ipNet := func(cidr string) net.Addr {
		ip, n, err := net.ParseCIDR(cidr)
		must(t, err)
		n.IP = ip
		return n
	}
	loopbacks := []net.Addr{ipNet("127.0.0.1/8"), ipNet("::1/128")}
	lan := slices.Concat(loopbacks, []net.Addr{ipNet("fe80::1c2b:3aff:fe4d:5e6f/64"),
		ipNet("192.168.1.20/24"), ipNet("10.0.0.5/8")})
	tests := []struct {
		name   string
		listen string
		ifaces []net.Addr
		want   string
		ok     bool
	}{
		{"a given IPv4 address", "192.168.1.99:8080", lan, "192.168.1.99:8080", true},
		{"loopback", "127.0.0.1:8080", lan, "127.0.0.1:8080", true},
		{"a given IPv6 address", "[2001:db8::7]:8080", lan, "[2001:db8::7]:8080", true},
		{"all IPv4 interfaces", "0.0.0.0:8080", lan, "192.168.1.20:8080", true},
		{"no host, as the CLI reads -addr", ":8080", lan, "192.168.1.20:8080", true},
		{"all interfaces", "[::]:9000", lan, "192.168.1.20:9000", true},
		{"IPv4 in 16-byte form", "[::]:8080", slices.Concat(loopbacks, []net.Addr{&net.IPNet{IP: net.ParseIP("10.1.2.3"), Mask: net.CIDRMask(8, 32)}}), "10.1.2.3:8080", true},
		{"an IPAddr", "[::]:8080", []net.Addr{&net.IPAddr{IP: net.ParseIP("172.16.0.9")}}, "172.16.0.9:8080", true},
		{"link-local skipped", "[::]:8080", slices.Concat([]net.Addr{ipNet("169.254.7.8/16")}, lan), "192.168.1.20:8080", true},
		{"loopback and IPv6 only", "[::]:8080", slices.Concat(loopbacks, []net.Addr{ipNet("2001:db8::1/64")}), "127.0.0.1:8080", false},
		{"only link-local", "[::]:8080", []net.Addr{ipNet("169.254.7.8/16")}, "127.0.0.1:8080", false},
		{"no addresses", "[::]:8080", nil, "127.0.0.1:8080", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			listen, err := net.ResolveTCPAddr("tcp", tt.listen)
			must(t, err)
			got, ok := advertisedAddr(listen, tt.ifaces)
			if got != tt.want || ok != tt.ok {
				t.Errorf("advertisedAddr(%s, %v) = %q, %v; want %q, %v", tt.listen, tt.ifaces, got, ok, tt.want, tt.ok)
			}
		})
	}
}

// TestDefaultPublicURLFallback: without an address devices can reach, the
// default public URL is 127.0.0.1's, and the start-up log says so and
// what to do.
func TestDefaultPublicURLFallback(t *testing.T) {
	t.Parallel()
	listen := &net.TCPAddr{IP: net.IPv6unspecified, Port: 8080}
	loopbackOnly := func() ([]net.Addr, error) {
		return []net.Addr{&net.IPNet{IP: net.IPv4(127, 0, 0, 1), Mask: net.CIDRMask(8, 32)}}, nil
	}
	failing := func() ([]net.Addr, error) { return nil, errors.New("netlink refused") }
	for name, list := range map[string]func() ([]net.Addr, error){"loopback only": loopbackOnly, "listing fails": failing} {
		var log syncBuffer
		got := defaultPublicURL(listen, list, slog.New(slog.NewTextHandler(&log, nil)))
		if got != "http://127.0.0.1:8080" {
			t.Errorf("%s: got %q, want http://127.0.0.1:8080", name, got)
		}
		if !strings.Contains(log.String(), "level=WARN") || !strings.Contains(log.String(), "set -public-url") {
			t.Errorf("%s: log %q, want a warning that says to set -public-url", name, log.String())
		}
	}
	lan := func() ([]net.Addr, error) {
		return []net.Addr{&net.IPNet{IP: net.IPv4(192, 168, 1, 20), Mask: net.CIDRMask(24, 32)}}, nil
	}
	var log syncBuffer
	if got := defaultPublicURL(listen, lan, slog.New(slog.NewTextHandler(&log, nil))); got != "http://192.168.1.20:8080" || log.String() != "" {
		t.Errorf("with a LAN address: got %q and log %q, want http://192.168.1.20:8080 and no warning", got, log.String())
	}
}

// TestEnvBooleans: the boolean variables read one way, strconv.ParseBool's:
// unset is the default, "1", "t", "true" (any case) on, "0", "f", "false"
// off, and anything else a usage error that names the variable. A flag
// still wins over its variable.
func TestEnvBooleans(t *testing.T) {
	t.Parallel()
	vars := []struct {
		key, flag string
		def       bool
		value     func(*config) bool
	}{
		{"DEVICEHUB_DEBUG", "debug", false, func(c *config) bool { return c.debug }},
		{"DEVICEHUB_DASHBOARD", "dashboard", true, func(c *config) bool { return c.dashboard }},
		{"DEVICEHUB_ACCESS_LOG", "access-log", true, func(c *config) bool { return c.accessLog }},
	}
	values := []struct {
		env  string
		want string // "on", "off", "default" or "error"
	}{
		{"", "default"}, {"true", "on"}, {"TRUE", "on"}, {"1", "on"}, {"t", "on"},
		{"false", "off"}, {"False", "off"}, {"0", "off"}, {"f", "off"},
		{"yes", "error"}, {"no", "error"}, {"off", "error"}, {"2", "error"}, {" true", "error"},
	}
	for _, v := range vars {
		for _, tt := range values {
			env := map[string]string{v.key: tt.env}
			var cfg config
			fs := newFlagSet("serve", &cfg, func(k string) string { return env[k] }, io.Discard)
			must(t, fs.Parse(nil))
			if tt.want == "error" {
				_, _, err := cliRun(t, env, "", "help")
				if !errors.As(err, new(usageError)) || !strings.Contains(err.Error(), "$"+v.key) {
					t.Errorf("%s=%q: help got %v, want a usage error naming $%s", v.key, tt.env, err, v.key)
				}
				continue
			}
			want := map[string]bool{"on": true, "off": false, "default": v.def}[tt.want]
			if got := v.value(&cfg); got != want || len(cfg.envErrs) > 0 {
				t.Errorf("%s=%q: got %v (errors %v), want %v", v.key, tt.env, got, cfg.envErrs, want)
			}
		}
		var cfg config
		env := map[string]string{v.key: strconv.FormatBool(!v.def)}
		fs := newFlagSet("serve", &cfg, func(k string) string { return env[k] }, io.Discard)
		must(t, fs.Parse([]string{"-" + v.flag + "=" + strconv.FormatBool(v.def)}))
		if got := v.value(&cfg); got != v.def {
			t.Errorf("%s=%v with -%s=%v: got %v, want the flag's", v.key, !v.def, v.flag, v.def, got)
		}
	}
}

// TestSystemdUnit: deploy/devicehub.service runs 'devicehub serve' as a
// user of its own, on its state directory, hardened, restarted on
// failure, logging to the journal; and systemd-analyze (where installed)
// finds nothing wrong with it.
func TestSystemdUnit(t *testing.T) {
	t.Parallel()
	text, err := os.ReadFile(filepath.Join("deploy", "devicehub.service"))
	must(t, err)
	settings := map[string][]string{}
	for _, line := range strings.Split(string(text), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok && !strings.HasPrefix(line, "#") {
			settings[k] = append(settings[k], v)
		}
	}
	for key, want := range map[string]string{
		"ExecStart":               "/usr/local/bin/devicehub serve",
		"User":                    "devicehub",
		"StateDirectory":          "devicehub",
		"Environment":             "DEVICEHUB_DATA=%S/devicehub",
		"Restart":                 "on-failure",
		"StandardOutput":          "journal",
		"NoNewPrivileges":         "yes",
		"ProtectSystem":           "strict",
		"ProtectHome":             "yes",
		"PrivateTmp":              "yes",
		"PrivateDevices":          "yes",
		"RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
		"SystemCallFilter":        "@system-service",
		"CapabilityBoundingSet":   "",
		"UMask":                   "0077",
	} {
		found := false
		for _, v := range settings[key] {
			found = found || v == want
		}
		if !found {
			t.Errorf("%s=%s missing (have %q)", key, want, settings[key])
		}
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed: the unit's syntax is not checked")
	}
	// verify wants ExecStart to exist: point it at this test binary.
	self, err := os.Executable()
	must(t, err)
	unit := filepath.Join(t.TempDir(), "devicehub.service")
	os.WriteFile(unit, []byte(strings.ReplaceAll(string(text), "/usr/local/bin/devicehub", self)), 0o644)
	cmd := exec.Command(analyze, "verify", unit)
	cmd.Dir = filepath.Dir(unit)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// cliFleet is a data directory with two users (ann with two devices,
// bob with one), tokens, and firmware files, one of them shared by a
// device of each user. It is made through a store, at the test work
// factor; the commands under test then run on the same directory.
type cliFleet struct {
	dir          string
	st           *store.Store
	ann, bob     int64  // user ids
	annA, annB   string // ann's device uids
	bobA         string
	annTokens    []string
	bobToken     string
	shared, only string // sha256 of a file on annA and bobA; of a file only on annA
}

func newCLIFleet(t *testing.T) *cliFleet {
	t.Helper()
	ctx := context.Background()
	f := &cliFleet{dir: t.TempDir()}
	f.st = storeAt(t, f.dir)
	hash, err := hashPassword("old password", testIterations)
	must(t, err)
	f.ann, err = f.st.CreateUser(ctx, "Ann Admin", "ann@example.com", "admin", hash, "")
	must(t, err)
	f.bob, err = f.st.CreateUser(ctx, "Bob", "bob@example.com", "user", hash, "")
	must(t, err)
	f.annA, err = createDeviceOf(ctx, f.st, "ann@example.com", "esp32", "devkit", "Porch light")
	must(t, err)
	f.annB, err = createDeviceOf(ctx, f.st, "ann@example.com", "esp8266", "d1mini", "")
	must(t, err)
	f.bobA, err = createDeviceOf(ctx, f.st, "bob@example.com", "esp32", "devkit", "")
	must(t, err)
	for _, name := range []string{"laptop", "ci"} {
		_, tok, err := issueToken(ctx, f.st, f.ann, name, nil, nil)
		must(t, err)
		f.annTokens = append(f.annTokens, tok)
	}
	_, f.bobToken, err = issueToken(ctx, f.st, f.bob, "phone", nil, nil)
	must(t, err)
	shared := []byte("\xe9 firmware both users have")
	f.shared = addFirmwareFile(t, f.st, f.annA, shared)
	addFirmwareFile(t, f.st, f.bobA, shared)
	f.only = addFirmwareFile(t, f.st, f.annA, []byte("\xe9 firmware only ann's porch light has"))
	return f
}

// run runs the program on the fleet's data directory.
func (f *cliFleet) run(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	return cliRun(t, map[string]string{"DEVICEHUB_DATA": f.dir}, stdin, args...)
}

// ok runs the program like run and returns its stdout, failing the test
// if it fails.
func (f *cliFleet) ok(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	return cliOKIn(t, map[string]string{"DEVICEHUB_DATA": f.dir}, stdin, args...)
}

// addFirmwareFile stores content as a firmware of the device with that
// uid, the way an upload does, and returns its sha256.
func addFirmwareFile(t *testing.T, st *store.Store, uid string, content []byte) string {
	t.Helper()
	var deviceID int64
	must(t, storeReader(st).QueryRow(`SELECT id FROM devices WHERE uid = ?`, uid).Scan(&deviceID))
	d := deviceRefByID(t, st, deviceID)
	tmp, err := st.NewFirmwareTemp()
	must(t, err)
	sums, _, err := hashToTemp(tmp, bytes.NewReader(content), store.MaxFirmwareSize)
	tmp.Close()
	must(t, err)
	name := "fw " + sums.md5[:6]
	nf := store.NewFirmware{Name: &name, MD5: sums.md5, SHA256: sums.sha256, Size: sums.size, TmpPath: tmp.Name()}
	if _, err := st.CreateFirmware(context.Background(), d, nf, nil); err != nil {
		t.Fatalf("createFirmware: %v", err)
	}
	return sums.sha256
}

// fileExists reports whether path exists, failing the test on other errors.
func fileExists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return err == nil
}

// tableRows splits a command's table output into rows of cells, header first.
func tableRows(out string) [][]string {
	var rows [][]string
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		rows = append(rows, regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1))
	}
	return rows
}

// TestCLIHelp: help, -h, -help and --help print every command, one line
// each, on stdout, and exit 0; so does -h after a command. Each command's
// line names every flag the command defines beyond the configuration flags.
func TestCLIHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"-h"}, {"-help"}, {"--help"}} {
		out, stderr, err := cliRun(t, nil, "", args...)
		if err != nil {
			t.Errorf("%q: got %v, want success (exit 0)", args, err)
		}
		if stderr != "" {
			t.Errorf("%q: stderr %q, want nothing", args, stderr)
		}
		for _, c := range subcommands() {
			re := regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(strings.TrimSpace(c.name+" "+c.args)) + ` +` + regexp.QuoteMeta(c.help) + `$`)
			if n := len(re.FindAllString(out, -1)); n != 1 {
				t.Errorf("%q: command %q on %d lines with its help, want 1:\n%s", args, c.name, n, out)
			}
		}
	}
	noEnv := func(string) string { return "" }
	configFlags := newFlagSet("config", new(config), noEnv, io.Discard)
	for _, cmd := range subcommands() {
		args := append(strings.Fields(cmd.name), "-h")
		_, stderr, err := cliRun(t, nil, "", args...)
		if err != nil {
			t.Errorf("%q: got %v, want success (exit 0)", args, err)
		}
		if !strings.Contains(stderr, "usage: devicehub "+cmd.name) || !strings.Contains(stderr, "-data") {
			t.Errorf("%q: stderr %q, want the command's usage line and its flags", args, stderr)
		}
		c := &cli{stdin: strings.NewReader(""), stdout: io.Discard, stderr: io.Discard}
		c.fs = newFlagSet(cmd.name, &c.cfg, noEnv, io.Discard)
		if err := cmd.run(context.Background(), c, []string{"-h"}); !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%s -h: got %v, want flag.ErrHelp", cmd.name, err)
		}
		c.fs.VisitAll(func(f *flag.Flag) {
			named := regexp.MustCompile(`(^|[\s\[])-` + regexp.QuoteMeta(f.Name) + `\b`)
			if configFlags.Lookup(f.Name) == nil && !named.MatchString(cmd.args) {
				t.Errorf("help line %q for %s does not name its flag -%s", cmd.args, cmd.name, f.Name)
			}
		})
	}
}

// checkTable compares rows with want, where "*" matches any cell.
func checkTable(t *testing.T, what string, rows, want [][]string) {
	t.Helper()
	if len(rows) != len(want) {
		t.Fatalf("%s: got %d rows %q, want %d", what, len(rows), rows, len(want))
	}
	for i := range want {
		if len(rows[i]) != len(want[i]) {
			t.Errorf("%s row %d: got %q, want %q", what, i, rows[i], want[i])
			continue
		}
		for j := range want[i] {
			if want[i][j] != "*" && rows[i][j] != want[i][j] {
				t.Errorf("%s row %d: got %q, want %q", what, i, rows[i], want[i])
				break
			}
		}
	}
}

// TestCLIUserPasswd sets a new password from stdin and revokes every
// token of that user, and no one else's.
func TestCLIUserPasswd(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	ctx := context.Background()
	out := f.ok(t, "new password\n", "user", "passwd", "-email", "ANN@example.com")
	if want := "password of \"ann@example.com\" changed; 2 tokens revoked\n"; out != want {
		t.Errorf("user passwd printed %q, want %q", out, want)
	}
	u, err := f.st.UserByEmail(ctx, "ann@example.com")
	must(t, err)
	if !checkPassword(u.PasswordHash, "new password") || checkPassword(u.PasswordHash, "old password") {
		t.Error("after user passwd: the new password does not check, or the old one still does")
	}
	for _, tok := range f.annTokens {
		if _, err := authenticate(ctx, f.st, tok); !errors.Is(err, store.ErrTokenNotFound) {
			t.Errorf("ann's token after user passwd: got %v, want errTokenNotFound", err)
		}
	}
	if _, err := authenticate(ctx, f.st, f.bobToken); err != nil {
		t.Errorf("bob's token after ann's user passwd: %v, want it valid", err)
	}

	// Failures change nothing.
	bob, _ := f.st.UserByEmail(ctx, "bob@example.com")
	for _, tt := range []struct {
		stdin string
		args  []string
		want  string
	}{
		{"x\n", []string{"user", "passwd", "-email", "nobody@example.com"}, `no user with email "nobody@example.com"`},
		{"", []string{"user", "passwd", "-email", "bob@example.com"}, "no password on stdin"},
		{"\n", []string{"user", "passwd", "-email", "bob@example.com"}, "empty password"},
		{"x\n", []string{"user", "passwd"}, "-email is required"},
	} {
		if _, _, err := f.run(t, tt.stdin, tt.args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q with stdin %q: got %v, want an error saying %s", tt.args, tt.stdin, err, tt.want)
		}
	}
	if after, _ := f.st.UserByEmail(ctx, "bob@example.com"); after.PasswordHash != bob.PasswordHash {
		t.Error("a failed user passwd changed bob's password")
	}
	if _, err := authenticate(ctx, f.st, f.bobToken); err != nil {
		t.Errorf("bob's token after failed user passwd: %v", err)
	}
}

// TestCLIUserRemove: a user who owns devices is removed only with
// -with-devices, which also deletes the firmware files no one else needs;
// a team's last admin stays while it has other members.
func TestCLIUserRemove(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	_, _, err := f.run(t, "", "user", "remove", "-email", "ann@example.com")
	if err == nil || !strings.Contains(err.Error(), `user "ann@example.com" owns 2 devices`) {
		t.Fatalf("user remove of a user with devices: got %v, want a refusal naming 2 devices", err)
	}
	wantDB(t, f.st, "1", `SELECT count(*) FROM users WHERE id = ?`, f.ann) // the refused remove kept ann
	// With a member beside her, ann, the team's only admin, stays until
	// another is one; the member leaves without the team's devices.
	f.ok(t, "a password\n", "user", "add", "-email", "cy@example.com", "-name", "Cy", "-team", "ann@example.com")
	_, _, err = f.run(t, "", "user", "remove", "-email", "ann@example.com")
	if err == nil || !strings.Contains(err.Error(), `user "ann@example.com" is the last admin of a team with other members`) {
		t.Fatalf("user remove of a team's last admin: got %v, want a refusal", err)
	}
	f.ok(t, "", "user", "remove", "-email", "cy@example.com")
	wantDB(t, f.st, "1 2", `SELECT count(*) || ' ' || (SELECT count(*) FROM devices WHERE team_id = ?1) FROM users WHERE id = ?1`, f.ann)
	out := f.ok(t, "", "user", "remove", "-email", "ann@example.com", "-with-devices")
	if want := "removed user \"ann@example.com\" with 2 devices; 1 firmware files deleted\n"; out != want {
		t.Errorf("user remove printed %q, want %q", out, want)
	}
	// None of ann's users, devices, tokens or firmwares rows is left; bob's 3 are.
	wantDB(t, f.st, "0", `SELECT (SELECT count(*) FROM users WHERE id = ?1) + (SELECT count(*) FROM devices WHERE team_id = ?1) +
		(SELECT count(*) FROM tokens WHERE user_id = ?1) + (SELECT count(*) FROM firmwares WHERE device_id NOT IN (SELECT id FROM devices))`, f.ann)
	wantDB(t, f.st, "3", `SELECT (SELECT count(*) FROM devices) + (SELECT count(*) FROM tokens) + (SELECT count(*) FROM firmwares)`)
	if fileExists(t, firmwarePath(f.st, f.only)) {
		t.Error("the file only ann's device needed is still there")
	}
	if !fileExists(t, firmwarePath(f.st, f.shared)) {
		t.Error("the file bob's device also needs was deleted")
	}

	// bob has a device: without -with-devices he stays; unknown emails fail.
	if _, _, err := f.run(t, "", "user", "remove", "-email", "bob@example.com"); err == nil {
		t.Error("user remove of bob (one device): got success, want a refusal")
	}
	if _, _, err := f.run(t, "", "user", "remove", "-email", "ann@example.com"); err == nil || !strings.Contains(err.Error(), `no user with email "ann@example.com"`) {
		t.Errorf("user remove of a removed user: got %v, want no user", err)
	}
}

// TestCLIUserRemoveLibraryFiles: the last member of a team takes the
// team's library files with them, but for one another team's library
// holds too. Before, only the files of the team's devices went, and the
// library's stayed on disk with no row until the service's next start.
func TestCLIUserRemoveLibraryFiles(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	f.ok(t, "a password\n", "user", "add", "-email", "dee@example.com", "-name", "Dee")
	dee, err := strconv.ParseInt(scalar(t, f.st, `SELECT id FROM users WHERE email = 'dee@example.com'`), 10, 64)
	must(t, err)
	own := addLibraryFile(t, f.st, dee, []byte("\xe9 firmware only dee's library has"))
	shared := addLibraryFile(t, f.st, dee, []byte("\xe9 firmware dee's and bob's libraries have"))
	addLibraryFile(t, f.st, f.bob, []byte("\xe9 firmware dee's and bob's libraries have"))
	if out, want := f.ok(t, "", "user", "remove", "-email", "dee@example.com"), "removed user \"dee@example.com\" with 0 devices; 1 firmware files deleted\n"; out != want {
		t.Errorf("user remove printed %q, want %q", out, want)
	}
	if fileExists(t, firmwarePath(f.st, own)) || !fileExists(t, firmwarePath(f.st, shared)) {
		t.Error("after removing dee: want the file only dee's library had gone and the one bob's library has kept")
	}
	checkFirmwareFiles(t, storeReader(f.st), firmwareDir(f.st))
}

// addLibraryFile stores content in the library of the team of the user
// with that id, sent by them, the way an upload does, and returns its
// sha256.
func addLibraryFile(t *testing.T, st *store.Store, userID int64, content []byte) string {
	t.Helper()
	tmp, err := st.NewFirmwareTemp()
	must(t, err)
	sums, _, err := hashToTemp(tmp, bytes.NewReader(content), store.MaxFirmwareSize)
	tmp.Close()
	must(t, err)
	name := "lib " + sums.md5[:6]
	team, err := strconv.ParseInt(scalar(t, st, `SELECT team_id FROM users WHERE id = ?`, userID), 10, 64)
	must(t, err)
	nf := store.NewLibraryFirmware{UploadedBy: userID,
		NewFirmware: store.NewFirmware{Name: &name, MD5: sums.md5, SHA256: sums.sha256, Size: sums.size, TmpPath: tmp.Name()}}
	if _, err := st.CreateLibraryFirmware(context.Background(), team, nf, nil); err != nil {
		t.Fatalf("CreateLibraryFirmware: %v", err)
	}
	return sums.sha256
}

// TestCLIUserAndDeviceList: user list lists every user with their
// team and counts, a user added with -team in that user's team;
// device list all devices, or one owner's.
func TestCLIUserAndDeviceList(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	f.ok(t, "cat password\n", "user", "add", "-email", "cat@example.com", "-name", "Cat", "-role", "viewer", "-team", "Bob@Example.com")
	if _, _, err := f.run(t, "x password\n", "user", "add", "-email", "x@example.com", "-name", "X", "-team", "nobody@example.com"); err == nil ||
		!strings.Contains(err.Error(), `no user with email "nobody@example.com"`) {
		t.Errorf("user add -team unknown: got %v, want no user", err)
	}
	checkTable(t, "user list", tableRows(f.ok(t, "", "user", "list")), [][]string{
		{"ID", "EMAIL", "ROLE", "TEAM", "DEVICES", "TOKENS", "CREATED", "LAST_LOGIN", "NAME"},
		{"1", "ann@example.com", "admin", "Ann Admin's team", "2", "2", "*", "-", "Ann Admin"},
		{"2", "bob@example.com", "user", "Bob's team", "1", "1", "*", "-", "Bob"},
		{"3", "cat@example.com", "viewer", "Bob's team", "1", "0", "*", "-", "Cat"},
	})
	out := f.ok(t, "", "device", "list")
	header := []string{"UID", "TEAM", "STATUS", "PLATFORM", "BOARD", "LAST_SEEN", "NAME"}
	checkTable(t, "device list", tableRows(out), [][]string{header,
		{f.annA, "Ann Admin's team", "pending", "esp32", "devkit", "-", "Porch light"},
		{f.annB, "Ann Admin's team", "pending", "esp8266", "d1mini", "-", f.annB},
		{f.bobA, "Bob's team", "pending", "esp32", "devkit", "-", f.bobA},
	})
	checkTable(t, "device list -owner", tableRows(f.ok(t, "", "device", "list", "-owner", "Bob@Example.com")), [][]string{header,
		{f.bobA, "Bob's team", "pending", "esp32", "devkit", "-", f.bobA}})
	if _, _, err := f.run(t, "", "device", "list", "-owner", "nobody@example.com"); err == nil || !strings.Contains(err.Error(), `no user with email "nobody@example.com"`) {
		t.Errorf("device list -owner unknown: got %v, want no user", err)
	}
}

// TestCLIQuotesText: the lists print a name that holds a control
// character or a bidirectional override Go-quoted, so that it can
// neither forge a row nor drive the terminal; plain names, accents and
// emoji included, as they are. Such names come from rows older than the
// API's check, or from the database itself.
func TestCLIQuotesText(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	forged := "Evil\n9\tmallory@example.com\tadmin\tEvil\t0\t0\t-\t-\tMallory"
	mustExec(t, f.st, `UPDATE teams SET name = ? WHERE id = ?`, forged, f.ann)
	mustExec(t, f.st, `UPDATE users SET name = ? WHERE id = ?`, "\x1b[2J\x1b[HBob", f.bob)
	mustExec(t, f.st, `UPDATE devices SET name = ? WHERE uid = ?`, "Porch\u202etxt.exe", f.annA)
	mustExec(t, f.st, `UPDATE devices SET name = ? WHERE uid = ?`, "Küche ☕ \u0085", f.annB)
	mustExec(t, f.st, `UPDATE devices SET name = ? WHERE uid = ?`, "Küche ☕", f.bobA)
	mustExec(t, f.st, `UPDATE tokens SET name = ? WHERE name = 'ci'`, "ci\tx")
	users, devices, tokens := f.ok(t, "", "user", "list"), f.ok(t, "", "device", "list"), f.ok(t, "", "token", "list")
	for _, out := range []string{users, devices, tokens} {
		if strings.ContainsAny(out, "\x1b\u202e\u0085") {
			t.Errorf("a list holds a control character or an override:\n%q", out)
		}
	}
	checkTable(t, "user list", tableRows(users), [][]string{
		{"ID", "EMAIL", "ROLE", "TEAM", "DEVICES", "TOKENS", "CREATED", "LAST_LOGIN", "NAME"},
		{"1", "ann@example.com", "admin", strconv.Quote(forged), "2", "2", "*", "-", "Ann Admin"},
		{"2", "bob@example.com", "user", "Bob's team", "1", "1", "*", "-", `"\x1b[2J\x1b[HBob"`},
	})
	checkTable(t, "device list", tableRows(devices), [][]string{
		{"UID", "TEAM", "STATUS", "PLATFORM", "BOARD", "LAST_SEEN", "NAME"},
		{f.annA, strconv.Quote(forged), "pending", "esp32", "devkit", "-", `"Porch\u202etxt.exe"`},
		{f.annB, strconv.Quote(forged), "pending", "esp8266", "d1mini", "-", `"Küche ☕ \u0085"`},
		{f.bobA, "Bob's team", "pending", "esp32", "devkit", "-", "Küche ☕"},
	})
	checkTable(t, "token list", tableRows(tokens), [][]string{
		{"ID", "EMAIL", "CREATED", "LAST_USED", "NAME"},
		{"1", "ann@example.com", "*", "-", "laptop"},
		{"2", "ann@example.com", "*", "-", `"ci\tx"`},
		{"3", "bob@example.com", "*", "-", "phone"},
	})
}

// TestCLIDeviceRemove deletes a device's rows and the firmware files that no
// other device needs, and keeps the shared one until its last row goes.
func TestCLIDeviceRemove(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	mustExec(t, f.st, `UPDATE devices SET target_firmware_id = (SELECT id FROM firmwares WHERE sha256 = ? AND device_id = devices.id) WHERE uid = ?`, f.only, f.annA)
	mustExec(t, f.st, `INSERT INTO command_buttons (device_id, id, label, payload) SELECT id, 'b', 'B', '{}' FROM devices WHERE uid = ?`, f.annA)
	out := f.ok(t, "", "device", "remove", f.annA)
	if want := "removed device \"" + f.annA + "\"; 1 firmware files deleted\n"; out != want {
		t.Errorf("device remove printed %q, want %q", out, want)
	}
	// Only bob's firmware is left of the device, firmwares and buttons.
	wantDB(t, f.st, "1", `SELECT (SELECT count(*) FROM devices WHERE uid = ?) + (SELECT count(*) FROM firmwares) + (SELECT count(*) FROM command_buttons)`, f.annA)
	if fileExists(t, firmwarePath(f.st, f.only)) || !fileExists(t, firmwarePath(f.st, f.shared)) {
		t.Error("after removing ann's device: want its own file gone and the one bob's device shares kept")
	}
	// Flags may come after the uid; the last row of the shared file goes.
	cliOK(t, "", "device", "remove", f.bobA, "-data", f.dir)
	if fileExists(t, firmwarePath(f.st, f.shared)) {
		t.Error("the shared file is still there after its last device was removed")
	}
	wantDB(t, f.st, "1", `SELECT count(*) FROM devices`) // ann's other one
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"device", "remove", f.annA}, `no device with uid "` + f.annA + `"`},
		{[]string{"device", "remove"}, "device remove: UID is required"},
		{[]string{"device", "remove", f.annB, "extra"}, `unexpected argument "extra"`},
	} {
		if _, _, err := f.run(t, "", tt.args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: got %v, want an error saying %s", tt.args, err, tt.want)
		}
	}
}

// TestCLITokens lists tokens without their secrets and revokes one by id.
func TestCLITokens(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	out := f.ok(t, "", "token", "list")
	header := []string{"ID", "EMAIL", "CREATED", "LAST_USED", "NAME"}
	checkTable(t, "token list", tableRows(out), [][]string{header,
		{"1", "ann@example.com", "*", "-", "laptop"},
		{"2", "ann@example.com", "*", "-", "ci"},
		{"3", "bob@example.com", "*", "-", "phone"},
	})
	for _, tok := range append(f.annTokens, f.bobToken) {
		_, secret, _ := strings.Cut(tok, "|")
		if strings.Contains(out, secret) {
			t.Errorf("token list shows a secret: %q", out)
		}
	}
	checkTable(t, "token list -email", tableRows(f.ok(t, "", "token", "list", "-email", "bob@example.com")), [][]string{header, {"3", "bob@example.com", "*", "-", "phone"}})

	ctx := context.Background()
	if out := f.ok(t, "", "token", "revoke", "1"); out != "revoked token 1\n" {
		t.Fatalf("token revoke 1: got %q", out)
	}
	if _, err := authenticate(ctx, f.st, f.annTokens[0]); !errors.Is(err, store.ErrTokenNotFound) {
		t.Errorf("revoked token: got %v, want errTokenNotFound", err)
	}
	if _, err := authenticate(ctx, f.st, f.annTokens[1]); err != nil {
		t.Errorf("ann's other token after revoking one: %v", err)
	}
	for _, tt := range []struct {
		arg, want string
	}{
		{"1", `no token with id "1"`},
		{"99", `no token with id "99"`},
		{f.annTokens[1], strconv.Quote(f.annTokens[1]) + " is not a token id"},
		{"0", `"0" is not a token id`},
	} {
		if _, _, err := f.run(t, "", "token", "revoke", tt.arg); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("token revoke %q: got %v, want an error saying %s", tt.arg, err, tt.want)
		}
	}
	wantDB(t, f.st, "2", `SELECT count(*) FROM tokens`)
}

// TestCLIErrorsQuoteInput: every message that repeats what the user typed
// quotes it the same way, as Go's %q does.
func TestCLIErrorsQuoteInput(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	odd := "no one@example.com"
	for _, args := range [][]string{
		{"user", "passwd", "-email", odd},
		{"user", "remove", "-email", odd},
		{"device", "list", "-owner", odd},
		{"device", "add", "-owner", odd, "-platform", "esp32", "-board", "devkit"},
		{"token", "create", "-email", odd, "-name", "t"},
		{"token", "list", "-email", odd},
		{"user", "add", "-email", odd, "-name", "N"},
		{"device", "remove", odd},
		{"token", "revoke", odd},
		{"device", "add", "-owner", "ann@example.com", "-platform", odd, "-board", "devkit"},
	} {
		_, _, err := f.run(t, "pw\n", args...)
		if err == nil || !strings.Contains(err.Error(), strconv.Quote(odd)) {
			t.Errorf("%q: got %v, want an error quoting %s", args, err, strconv.Quote(odd))
		}
	}
}

// TestCLILeavesServiceFilesAlone: an admin command run beside the service
// does not sweep the firmware directory. An upload in progress and a file
// the service has just moved into place (its row not yet committed) look
// unused from outside; deleting them broke uploads.
func TestCLILeavesServiceFilesAlone(t *testing.T) {
	t.Parallel()
	f := newCLIFleet(t)
	upload, err := f.st.NewFirmwareTemp()
	must(t, err)
	upload.WriteString("\xe9 half an upload")
	upload.Close()
	placed := firmwarePath(f.st, sha256Hex([]byte("\xe9 a file whose row is being committed")))
	must(t, os.WriteFile(placed, []byte("\xe9 a file whose row is being committed"), 0o600))
	for _, args := range [][]string{{"user", "list"}, {"device", "list"}, {"token", "list"}, {"device", "remove", f.annB}} {
		if _, _, err := f.run(t, "", args...); err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		if !fileExists(t, upload.Name()) || !fileExists(t, placed) {
			t.Fatalf("after %q: the upload in progress or the file just placed is gone", args)
		}
	}
}

// TestCLIBrokerLogins: with -mqtt-dynsec, device add makes the device's
// login, device credentials prints a password it logs in with, and device
// remove deletes it; a device remove of a uid that is no device touches no
// broker client, even one of that name.
func TestCLIBrokerLogins(t *testing.T) {
	t.Parallel()
	b := startDynsecBroker(t)
	env := map[string]string{"DEVICEHUB_DATA": t.TempDir(), "DEVICEHUB_MQTT_URL": b.URL(), "DEVICEHUB_MQTT_USER": b.User,
		"DEVICEHUB_MQTT_PASSWORD": b.Password, "DEVICEHUB_MQTT_DYNSEC": "true", "DEVICEHUB_PUBLIC_MQTT_URL": "tcp://hub.example:1883"}
	cliOKIn(t, env, "a password\n", "user", "add", "-email", "ann@example.com", "-name", "Ann")
	uid := strings.TrimSpace(cliOKIn(t, env, "", "device", "add", "-owner", "ann@example.com", "-platform", "esp32", "-board", "devkit"))
	var cr model.Credentials
	must(t, json.Unmarshal([]byte(cliOKIn(t, env, "", "device", "credentials", uid)), &cr))
	if cr.Username != uid || cr.MQTTURL != "tcp://hub.example:1883" {
		t.Errorf("credentials: got %+v, want the login of %s at the public URL", cr, uid)
	}
	dialDevice(t, b.Broker, cr)

	b.Ctrl("createClient", "victim", "-p", "victim password")
	if _, _, err := cliRun(t, env, "", "device", "remove", "victim"); err == nil || !strings.Contains(err.Error(), `no device with uid "victim"`) {
		t.Errorf("device remove victim: got %v, want no such device", err)
	}
	if _, err := brokertest.Dial(t, b.Broker, "victim", "victim", "victim password"); err != nil {
		t.Errorf("the broker client victim, after a device remove of that name: %v, want it untouched", err)
	}
	// A login as earlier versions made it, with the whole prefix, is
	// narrowed to the protocol's topics; a device without one is counted.
	old := strings.TrimSpace(cliOKIn(t, env, "", "device", "add", "-owner", "ann@example.com", "-platform", "esp32", "-board", "devkit"))
	role := "devicehub-device-" + old
	b.Ctrl("removeRoleACL", role, "publishClientSend", "devices/"+old+"/status")
	b.Ctrl("addRoleACL", role, "publishClientSend", "devices/"+old+"/#", "allow")
	var oldCr model.Credentials
	must(t, json.Unmarshal([]byte(cliOKIn(t, env, "", "device", "credentials", old)), &oldCr))
	noLogin := maps.Clone(env)
	delete(noLogin, "DEVICEHUB_MQTT_DYNSEC")
	cliOKIn(t, noLogin, "", "device", "add", "-owner", "ann@example.com", "-platform", "esp32", "-board", "devkit")
	for _, args := range [][]string{{"device", "credentials", uid}, {"device", "narrow-logins"}} {
		want := strings.Join(args[:2], " ") + ": broker logins are not managed by devicehub: pass -mqtt-dynsec"
		if _, _, err := cliRun(t, noLogin, "", args...); err == nil || err.Error() != want {
			t.Errorf("%q without -mqtt-dynsec: got %v, want %q", args, err, want)
		}
	}
	if got, want := cliOKIn(t, env, "", "device", "narrow-logins"), "broker logins narrowed to the protocol's topics: 1; narrow already: 1; devices without one: 1\n"; got != want {
		t.Errorf("device narrow-logins printed %q, want %q", got, want)
	}
	service, err := brokertest.Dial(t, b.Broker, "devicehub-test", b.User, b.Password)
	must(t, err)
	brokertest.Denied(t, dialDevice(t, b.Broker, oldCr), brokertest.Subscribe(t, service, "devices/#"), "devices/"+old+"/other", "devices/"+old+"/status")

	cliOKIn(t, env, "", "device", "remove", uid)
	if _, err := brokertest.Dial(t, b.Broker, uid, cr.Username, cr.Password); err == nil {
		t.Error("a removed device still logs in")
	}
}
