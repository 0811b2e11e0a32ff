package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	osuser "os/user"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// testBroker is a real Mosquitto on a free loopback port, with its own
// config and persistence directory under t.TempDir().
type testBroker struct {
	tb     testing.TB
	bin    string
	conf   string
	port   int
	mu     sync.Mutex
	cmd    *exec.Cmd
	stderr *bytes.Buffer
}

// startBroker starts Mosquitto for one test as production runs it:
// retained messages survive a restart (persistence), and a burst of
// 10,000 messages reaches the service instead of being dropped by the
// default queue of 1,000 (max_queued_messages).
func startBroker(tb testing.TB) *testBroker {
	tb.Helper()
	return startBrokerWith(tb, "persistence true\npersistence_location {dir}/\nmax_queued_messages 100000\n"+
		"log_dest stderr\nlog_type error\nlog_type warning\n")
}

// startDefaultBroker starts Mosquitto as 'apt-get install mosquitto' runs
// it: its default queue limits, no persistence.
func startDefaultBroker(tb testing.TB) *testBroker {
	tb.Helper()
	return startBrokerWith(tb, "")
}

// startBrokerWith starts Mosquitto with the configuration lines in extra.
func startBrokerWith(tb testing.TB, extra string) *testBroker {
	tb.Helper()
	b := newBroker(tb, extra)
	b.start()
	return b
}

// newBroker configures Mosquitto on a free port with a listener,
// anonymous access and the current user, plus the lines in extra, where
// {dir} stands for the broker's own directory; it stops it at cleanup,
// and start starts it. When the binary is missing the test is skipped, or
// fails when DEVICEHUB_REQUIRE_MOSQUITTO is set (as .ci/run does).
func newBroker(tb testing.TB, extra string) *testBroker {
	tb.Helper()
	bin, err := exec.LookPath("mosquitto")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/mosquitto"); serr == nil {
			bin, err = "/usr/sbin/mosquitto", nil
		}
	}
	if err != nil {
		msg := "mosquitto not found: install the Debian package with 'apt-get install -y mosquitto'"
		if os.Getenv("DEVICEHUB_REQUIRE_MOSQUITTO") != "" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	dir := tb.TempDir()
	port := freePort(tb)
	me, err := osuser.Current()
	must(tb, err)
	conf := filepath.Join(dir, "mosquitto.conf")
	// user: when run as root, do not switch to the mosquitto user, who
	// could not write the test's directory.
	text := fmt.Sprintf("listener %d 127.0.0.1\nallow_anonymous true\nuser %s\n", port, me.Username) +
		strings.ReplaceAll(extra, "{dir}", dir)
	must(tb, os.WriteFile(conf, []byte(text), 0o600))
	b := &testBroker{tb: tb, bin: bin, conf: conf, port: port}
	tb.Cleanup(b.stop)
	return b
}

func freePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(tb, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (b *testBroker) url() string { return fmt.Sprintf("tcp://127.0.0.1:%d", b.port) }

// start runs the broker and waits until it accepts connections.
func (b *testBroker) start() {
	b.tb.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stderr = &bytes.Buffer{}
	b.cmd = exec.Command(b.bin, "-c", b.conf)
	b.cmd.Stderr = b.stderr
	must(b.tb, b.cmd.Start())
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", b.port), 100*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			b.tb.Fatalf("mosquitto did not start: %v\n%s", err, b.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop terminates the broker; SIGTERM makes it save its persistence file.
func (b *testBroker) stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd == nil {
		return
	}
	b.cmd.Process.Signal(syscall.SIGTERM)
	b.cmd.Wait()
	b.cmd = nil
}

// signal sends the running broker a signal (SIGSTOP freezes it, SIGCONT
// wakes it).
func (b *testBroker) signal(sig syscall.Signal) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.cmd.Process.Signal(sig); err != nil {
		b.tb.Fatalf("signal mosquitto: %v", err)
	}
}

// testClient connects a plain MQTT client (a device, or an observer).
// will, when non-empty, is a retained Last Will of "offline" on that topic.
func testClient(tb testing.TB, b *testBroker, id, will string) mqtt.Client {
	tb.Helper()
	opts := mqtt.NewClientOptions().AddBroker(b.url()).SetClientID(id).
		SetCleanSession(true).SetAutoReconnect(false).SetKeepAlive(2 * time.Second)
	if will != "" {
		opts.SetWill(will, "offline", 1, true)
	}
	c := mqtt.NewClient(opts)
	if t := c.Connect(); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("connect test client %s: %v", id, t.Error())
	}
	tb.Cleanup(func() {
		if c.IsConnected() {
			c.Disconnect(50)
		}
	})
	return c
}

// subscribe returns a channel that receives every message on topic.
func subscribe(tb testing.TB, c mqtt.Client, topic string) <-chan mqtt.Message {
	tb.Helper()
	ch := make(chan mqtt.Message, 1024)
	t := c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) { ch <- m })
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("subscribe %s: %v", topic, t.Error())
	}
	return ch
}

// publishWait publishes and waits for the broker's acknowledgement.
func publishWait(tb testing.TB, c mqtt.Client, topic string, retained bool, payload any) {
	tb.Helper()
	t := c.Publish(topic, 1, retained, payload)
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("publish %s: %v", topic, t.Error())
	}
}

// eventually polls cond every 10 ms until it holds or timeout passes.
func eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// newLinkedEnv is a testEnv whose server has a real MQTT link to b; with
// change its other options.
func newLinkedEnv(tb testing.TB, b *testBroker, with ...envOption) (*testEnv, *mqttLink) {
	tb.Helper()
	return newLinkedEnvWith(tb, b, 0, with...)
}

// brokerEnv is a testEnv linked to a broker of its own (startBroker).
func brokerEnv(tb testing.TB, with ...envOption) (*testEnv, *mqttLink, *testBroker) {
	tb.Helper()
	b := startBroker(tb)
	env, link := newLinkedEnv(tb, b, with...)
	return env, link, b
}

// newLinkedEnvWith is newLinkedEnv with the link's -offline-after.
func newLinkedEnvWith(tb testing.TB, b *testBroker, offlineAfter time.Duration, with ...envOption) (*testEnv, *mqttLink) {
	tb.Helper()
	env := newTestEnv(tb, nil, with...)
	return env, linkTo(tb, env, b, offlineAfter)
}

// linkTo rebuilds env's server on a real MQTT link to b, with
// -offline-after, that times out its commands, as serve does; it returns
// once the link has connected.
func linkTo(tb testing.TB, env *testEnv, b *testBroker, offlineAfter time.Duration) *mqttLink {
	tb.Helper()
	link := newMQTTLink(mqttConfig{url: b.url(), prefix: "devices", offlineAfter: offlineAfter}, env.st, env.log)
	tb.Cleanup(link.close)
	env.rebuild(withLink(link))
	link.onSweep(env.srv.commands.expire)
	eventually(tb, 5*time.Second, "the link to connect", link.connected)
	return link
}

// dynsecBroker is a testBroker with Mosquitto's dynamic security plugin
// and no anonymous access; user and password are devicehub's login, made
// as the README tells an operator to make it.
type dynsecBroker struct {
	*testBroker
	user, password string
	ctrl           func(args ...string) // runs 'mosquitto_ctrl dynsec ARGS' as the plugin's admin
}

// startDynsecBroker starts Mosquitto with the dynamic security plugin,
// its file made by 'mosquitto_ctrl dynsec init', and makes devicehub's
// login: the plugin's admin role, and the right to publish commands. It
// skips the test, or fails it under DEVICEHUB_REQUIRE_MOSQUITTO, when
// mosquitto_ctrl or the plugin is missing (DEVICEHUB_MOSQUITTO_DYNSEC
// can give the plugin's path).
func startDynsecBroker(tb testing.TB) *dynsecBroker {
	tb.Helper()
	missing := func(msg string) {
		if os.Getenv("DEVICEHUB_REQUIRE_MOSQUITTO") != "" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	ctrl, err := exec.LookPath("mosquitto_ctrl")
	if err != nil {
		missing("mosquitto_ctrl not found: install the Debian package with 'apt-get install -y mosquitto'")
	}
	plugin := os.Getenv("DEVICEHUB_MOSQUITTO_DYNSEC")
	if plugin == "" {
		found, _ := filepath.Glob("/usr/lib/*/mosquitto_dynamic_security.so")
		if len(found) == 0 {
			missing("mosquitto_dynamic_security.so not found: install the Debian package mosquitto, or set DEVICEHUB_MOSQUITTO_DYNSEC to its path")
		}
		plugin = found[0]
	}
	// The operator's admin login is not devicehub's: a change to a
	// client's roles disconnects that client, mosquitto_ctrl included.
	admin := randomString(20, alnum)
	file := filepath.Join(tb.TempDir(), "dynamic-security.json")
	if out, err := exec.Command(ctrl, "dynsec", "init", file, "admin", admin).CombinedOutput(); err != nil {
		tb.Fatalf("mosquitto_ctrl dynsec init: %v\n%s", err, out)
	}
	b := &dynsecBroker{user: "devicehub", password: randomString(20, alnum)}
	b.testBroker = startBrokerWith(tb, fmt.Sprintf("allow_anonymous false\nplugin %s\nplugin_opt_config_file %s\n", plugin, file))
	b.ctrl = func(args ...string) {
		tb.Helper()
		args = append([]string{"-p", fmt.Sprint(b.port), "-u", "admin", "-P", admin, "dynsec"}, args...)
		if out, err := exec.Command(ctrl, args...).CombinedOutput(); err != nil || bytes.Contains(out, []byte("Error")) {
			tb.Fatalf("mosquitto_ctrl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	b.ctrl("createClient", b.user, "-p", b.password)
	b.ctrl("addClientRole", b.user, "admin")
	b.ctrl("createRole", "devicehub-commands")
	b.ctrl("addRoleACL", "devicehub-commands", "publishClientSend", "devices/+/cmd/#", "allow")
	b.ctrl("addClientRole", b.user, "devicehub-commands")
	return b
}
