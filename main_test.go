package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
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

// cliOK runs the program like cliRun and returns its stdout, failing the
// test if it fails.
func cliOK(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	out, stderr, err := cliRun(t, nil, stdin, args...)
	if err != nil {
		t.Fatalf("devicehub %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	return out
}

// TestCLI provisions a user, devices and a token through the admin
// commands, on one data directory.
func TestCLI(t *testing.T) {
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
	ann, err := st.userByEmail(ctx, "ann@example.com")
	must(t, err)
	if ann.ID != 1 || ann.Name != "Ann" || ann.Email != "ann@example.com" || ann.Role != "user" {
		t.Errorf("user: got %+v, want id 1, Ann, ann@example.com, role user", ann)
	}
	ops, err := st.userByEmail(ctx, "ops@example.com")
	must(t, err)
	if ops.Role != "admin" {
		t.Errorf("role: got %q, want admin", ops.Role)
	}
	prefix := fmt.Sprintf("pbkdf2-sha256$%d$", passwordIterations)
	for _, u := range []*user{ann, ops} {
		if !strings.HasPrefix(u.passwordHash, prefix) {
			t.Errorf("password hash of %s: got %q, want prefix %q", u.Email, u.passwordHash, prefix)
		}
	}
	var wg sync.WaitGroup
	for u, password := range map[*user]string{ann: "ann password", ops: "from stdin"} {
		wg.Go(func() {
			if !checkPassword(u.passwordHash, password) {
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
	d, err := deviceIn(ctx, st.read, ann.ID, uid)
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
	d, err = deviceIn(ctx, st.read, ops.ID, strings.TrimSpace(out))
	must(t, err)
	if d.Name != "Lab" || d.Port != 8883 || d.Board.Key != "d1_mini" {
		t.Errorf("device: got name %q port %d board %q, want Lab, 8883, d1_mini", d.Name, d.Port, d.Board.Key)
	}

	// token create prints a token that authenticates as the user.
	out = cliOK(t, "", "token", "create", "-data", dir, "-email", "ann@example.com", "-name", "ci")
	if !regexp.MustCompile(`^[0-9]+\|[A-Za-z0-9]{40}\n$`).MatchString(out) {
		t.Fatalf("token create printed %q, want <id>|<secret>", out)
	}
	if rec, err := authenticate(ctx, st, strings.TrimSpace(out)); err != nil || rec.user.ID != ann.ID {
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
	ctx := context.Background()
	envDir, flagDir := t.TempDir(), t.TempDir()
	st := storeAt(t, envDir)
	id, err := st.createUser(ctx, "Env", "env@example.com", "user", "x")
	must(t, err)
	env := map[string]string{"DEVICEHUB_DATA": envDir}

	out, _, err := cliRun(t, env, "", "token", "create", "-email", "env@example.com", "-name", "from env")
	rec, err := authenticate(ctx, st, strings.TrimSpace(out))
	if err != nil || rec.user.ID != id {
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
	if _, err := deviceIn(ctx, st.read, id, strings.TrimSpace(out)); err != nil {
		t.Errorf("device %q in the -data store: %v", out, err)
	}
}

// TestServeEndToEnd runs the whole program on 127.0.0.1:0 without a
// reachable broker, provisioned through the CLI, and shuts it down.
func TestServeEndToEnd(t *testing.T) {
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
		"platform":{"id":1,"name":"esp32","key":"esp32"},"board":{"id":1,"name":"devkit","key":"devkit"},"board_variant":null}]}`, uid)
	if b := c.want(t, 200, "GET", "/v1/user/devices", "", nil); !jsonEqual(t, b, []byte(want)) {
		t.Errorf("device list: got %s, want %s", b, want)
	}
	c.want(t, 422, "POST", "/v1/user/devices/"+uid+"/reboot", "", nil)

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
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		_, _, err := cliRun(t, nil, "", "serve", "-addr", ln.Addr().String(), "-data", t.TempDir(), "-mqtt", "tcp://127.0.0.1:1")
		done <- err
	}()
	if err := receive(t, done, 10*time.Second, "return of serve on a busy address"); err == nil || errors.As(err, new(usageError)) {
		t.Errorf("serve on a busy address: got %v, want a listen error", err)
	}
}

// TestAdvertisedAddr: the default public URL's host is the listen address,
// or, when listening on all interfaces, the first IPv4 address of this
// machine that is neither loopback nor link-local (devices rarely resolve
// host names); 127.0.0.1, reported, when there is none.
func TestAdvertisedAddr(t *testing.T) {
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
