// Package brokertest starts a real Mosquitto for a test, and connects the
// MQTT clients that talk to it (a device, an observer). The server's tests
// and internal/mqttlink's share it. A test that needs Mosquitto skips
// when it is not installed, or fails when DEVICEHUB_REQUIRE_MOSQUITTO is
// set (as .ci/run does).
package brokertest

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
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

// Broker is a real Mosquitto on a free loopback port, with its own
// config and persistence directory under t.TempDir().
type Broker struct {
	tb      testing.TB
	bin     string
	Conf    string // its configuration file
	Port    int
	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{} // closed when cmd has ended
	stderr  *LogBuffer
	started bool // it has run on Port: a restart must keep it
}

// Start starts Mosquitto for one test as production runs it: retained
// messages survive a restart (persistence), and a burst of 10,000
// messages reaches the service instead of being dropped by the default
// queue of 1,000 (max_queued_messages).
func Start(tb testing.TB) *Broker {
	tb.Helper()
	return StartWith(tb, "persistence true\npersistence_location {dir}/\nmax_queued_messages 100000\n"+
		"log_dest stderr\nlog_type error\nlog_type warning\n")
}

// StartDefault starts Mosquitto as 'apt-get install mosquitto' runs it:
// its default queue limits, no persistence.
func StartDefault(tb testing.TB) *Broker {
	tb.Helper()
	return StartWith(tb, "")
}

// StartWith starts Mosquitto with the configuration lines in extra.
func StartWith(tb testing.TB, extra string) *Broker {
	tb.Helper()
	b := New(tb, extra)
	b.Start()
	return b
}

// New configures Mosquitto on a free port with a listener, anonymous
// access and the current user, plus the lines in extra, where {dir}
// stands for the broker's own directory; it stops it at cleanup, and
// Start starts it. When the binary is missing the test is skipped, or
// fails under DEVICEHUB_REQUIRE_MOSQUITTO.
func New(tb testing.TB, extra string) *Broker {
	tb.Helper()
	bin, err := exec.LookPath("mosquitto")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/mosquitto"); serr == nil {
			bin, err = "/usr/sbin/mosquitto", nil
		}
	}
	if err != nil {
		missing(tb, "mosquitto not found: install the Debian package with 'apt-get install -y mosquitto'")
	}
	dir := tb.TempDir()
	port := FreePort(tb)
	me, err := osuser.Current()
	Must(tb, err)
	conf := filepath.Join(dir, "mosquitto.conf")
	// user: when run as root, do not switch to the mosquitto user, who
	// could not write the test's directory.
	text := fmt.Sprintf("listener %d 127.0.0.1\nallow_anonymous true\nuser %s\n", port, me.Username) +
		strings.ReplaceAll(extra, "{dir}", dir)
	Must(tb, os.WriteFile(conf, []byte(text), 0o600))
	b := &Broker{tb: tb, bin: bin, Conf: conf, Port: port}
	tb.Cleanup(b.Stop)
	return b
}

// missing skips the test for want of a Mosquitto tool, or fails it under
// DEVICEHUB_REQUIRE_MOSQUITTO.
func missing(tb testing.TB, msg string) {
	tb.Helper()
	if os.Getenv("DEVICEHUB_REQUIRE_MOSQUITTO") != "" {
		tb.Fatal(msg)
	}
	tb.Skip(msg)
}

// Must stops the test at an error in its set-up.
func Must(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

// FreePort is a loopback port nothing listens on.
func FreePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	Must(tb, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// URL is the broker's address for an MQTT client.
func (b *Broker) URL() string { return fmt.Sprintf("tcp://127.0.0.1:%d", b.Port) }

// Start runs the broker and waits until it answers. The port came from
// FreePort, free a moment before Mosquitto binds it: should another test
// take it meanwhile, the first start moves to another one.
func (b *Broker) Start() {
	b.tb.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	for attempt := 1; ; attempt++ {
		err := b.run()
		if err == nil {
			b.started = true
			return
		}
		if b.started || attempt == 3 || !strings.Contains(b.stderr.String(), "Address already in use") {
			b.tb.Fatalf("mosquitto did not start: %v\n%s", err, b.stderr)
		}
		conf, rerr := os.ReadFile(b.Conf)
		Must(b.tb, rerr)
		old := fmt.Sprintf("listener %d ", b.Port)
		b.Port = FreePort(b.tb)
		Must(b.tb, os.WriteFile(b.Conf, []byte(strings.Replace(string(conf), old, fmt.Sprintf("listener %d ", b.Port), 1)), 0o600))
	}
}

// run starts Mosquitto and waits until it answers on b.Port; an error
// when it exits first or does not answer within 5 s. The caller holds mu.
func (b *Broker) run() error {
	b.stderr = &LogBuffer{}
	b.cmd = exec.Command(b.bin, "-c", b.Conf)
	b.cmd.Stderr = b.stderr
	Must(b.tb, b.cmd.Start())
	exited := make(chan struct{})
	b.exited = exited
	go func() {
		b.cmd.Wait()
		close(exited)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		select {
		case <-exited: // it could not listen; a connect would reach whoever took the port
			b.cmd = nil
			return errors.New("mosquitto exited")
		default:
		}
		err := mqttAnswers(b.Port)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// mqttAnswers sends an MQTT CONNECT to port and reads the first byte of
// the answer: a CONNACK (whether it accepts or refuses) is an MQTT broker,
// and not whoever else might listen there.
func mqttAnswers(port int) error {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 100*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	// MQTT 3.1.1 CONNECT: protocol "MQTT" level 4, clean session, keepalive 10 s, client id "probe".
	if _, err := c.Write([]byte("\x10\x11\x00\x04MQTT\x04\x02\x00\x0a\x00\x05probe")); err != nil {
		return err
	}
	first := make([]byte, 1)
	if _, err := io.ReadFull(c, first); err != nil {
		return err
	}
	if first[0] != 0x20 {
		return fmt.Errorf("port %d answered %#x, not a CONNACK", port, first[0])
	}
	return nil
}

// Stop terminates the broker; SIGTERM makes it save its persistence file.
func (b *Broker) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd == nil {
		return
	}
	b.cmd.Process.Signal(syscall.SIGTERM)
	<-b.exited
	b.cmd = nil
}

// Signal sends the running broker a signal (SIGSTOP freezes it, SIGCONT
// wakes it).
func (b *Broker) Signal(sig syscall.Signal) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.cmd.Process.Signal(sig); err != nil {
		b.tb.Fatalf("signal mosquitto: %v", err)
	}
}

// StartAuth is a broker that refuses anonymous clients and accepts only
// user with password.
func StartAuth(tb testing.TB, user, password string) *Broker {
	tb.Helper()
	passwd, err := exec.LookPath("mosquitto_passwd")
	if err != nil {
		missing(tb, "mosquitto_passwd not found (Debian package mosquitto)")
	}
	b := Start(tb)
	b.Stop()
	file := filepath.Join(filepath.Dir(b.Conf), "passwd")
	if out, err := exec.Command(passwd, "-b", "-c", file, user, password).CombinedOutput(); err != nil {
		tb.Fatalf("mosquitto_passwd: %v\n%s", err, out)
	}
	os.Chmod(file, 0o600)
	conf, err := os.ReadFile(b.Conf)
	Must(tb, err)
	text := strings.Replace(string(conf), "allow_anonymous true", "allow_anonymous false\npassword_file "+file, 1)
	Must(tb, os.WriteFile(b.Conf, []byte(text), 0o600))
	b.Start()
	return b
}

// DynsecBroker is a Broker with Mosquitto's dynamic security plugin and
// no anonymous access; User and Password are devicehub's login, made as
// the README tells an operator to make it.
type DynsecBroker struct {
	*Broker
	User, Password string
	Ctrl           func(args ...string) // runs 'mosquitto_ctrl dynsec ARGS' as the plugin's admin
}

// DynsecPlugin is the path of Mosquitto's dynamic security plugin:
// DEVICEHUB_MOSQUITTO_DYNSEC, or where Debian installs it on any
// architecture. It skips the test, or fails it under
// DEVICEHUB_REQUIRE_MOSQUITTO, when there is none.
func DynsecPlugin(tb testing.TB) string {
	tb.Helper()
	if plugin := os.Getenv("DEVICEHUB_MOSQUITTO_DYNSEC"); plugin != "" {
		return plugin
	}
	found, _ := filepath.Glob("/usr/lib/*/mosquitto_dynamic_security.so")
	if len(found) == 0 {
		missing(tb, "mosquitto_dynamic_security.so not found: install the Debian package mosquitto, or set DEVICEHUB_MOSQUITTO_DYNSEC to its path")
	}
	return found[0]
}

// StartDynsec starts Mosquitto with the dynamic security plugin, its file
// made by 'mosquitto_ctrl dynsec init', and makes devicehub's login: the
// plugin's admin role, and the right to publish commands. It skips the
// test, or fails it under DEVICEHUB_REQUIRE_MOSQUITTO, when mosquitto_ctrl
// or the plugin is missing (DEVICEHUB_MOSQUITTO_DYNSEC can give the
// plugin's path).
func StartDynsec(tb testing.TB) *DynsecBroker {
	tb.Helper()
	ctrl, err := exec.LookPath("mosquitto_ctrl")
	if err != nil {
		missing(tb, "mosquitto_ctrl not found: install the Debian package with 'apt-get install -y mosquitto'")
	}
	plugin := DynsecPlugin(tb)
	// The operator's admin login is not devicehub's: a change to a
	// client's roles disconnects that client, mosquitto_ctrl included.
	admin := rand.Text()
	file := filepath.Join(tb.TempDir(), "dynamic-security.json")
	if out, err := exec.Command(ctrl, "dynsec", "init", file, "admin", admin).CombinedOutput(); err != nil {
		tb.Fatalf("mosquitto_ctrl dynsec init: %v\n%s", err, out)
	}
	b := &DynsecBroker{User: "devicehub", Password: rand.Text()}
	b.Broker = StartWith(tb, fmt.Sprintf("allow_anonymous false\nplugin %s\nplugin_opt_config_file %s\n", plugin, file))
	b.Ctrl = func(args ...string) {
		tb.Helper()
		args = append([]string{"-p", fmt.Sprint(b.Port), "-u", "admin", "-P", admin, "dynsec"}, args...)
		if out, err := exec.Command(ctrl, args...).CombinedOutput(); err != nil || bytes.Contains(out, []byte("Error")) {
			tb.Fatalf("mosquitto_ctrl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	b.Ctrl("createClient", b.User, "-p", b.Password)
	b.Ctrl("addClientRole", b.User, "admin")
	b.Ctrl("createRole", "devicehub-commands")
	b.Ctrl("addRoleACL", "devicehub-commands", "publishClientSend", "devices/+/cmd/#", "allow")
	b.Ctrl("addClientRole", b.User, "devicehub-commands")
	return b
}

// Client connects a plain MQTT client (a device, or an observer). will,
// when non-empty, is a retained Last Will of "offline" on that topic.
func Client(tb testing.TB, b *Broker, id, will string) mqtt.Client {
	tb.Helper()
	opts := mqtt.NewClientOptions().AddBroker(b.URL()).SetClientID(id).
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

// Dial connects to b as user with client id id, without retrying: a
// refused login is its error.
func Dial(tb testing.TB, b *Broker, id, user, password string) (mqtt.Client, error) {
	tb.Helper()
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.URL()).SetClientID(id).
		SetUsername(user).SetPassword(password).SetProtocolVersion(4).
		SetCleanSession(true).SetAutoReconnect(false).SetKeepAlive(2 * time.Second))
	t := c.Connect()
	if !t.WaitTimeout(5 * time.Second) {
		return nil, errors.New("connect: no answer")
	}
	if t.Error() != nil {
		return nil, t.Error()
	}
	tb.Cleanup(func() { c.Disconnect(50) })
	return c, nil
}

// MustDial is Dial for a login that must be accepted: a device with its
// credentials.
func MustDial(tb testing.TB, b *Broker, id, user, password string) mqtt.Client {
	tb.Helper()
	c, err := Dial(tb, b, id, user, password)
	if err != nil {
		tb.Fatalf("%s connects with its credentials: %v", user, err)
	}
	return c
}

// Subscribe returns a channel that receives every message on topic.
func Subscribe(tb testing.TB, c mqtt.Client, topic string) <-chan mqtt.Message {
	tb.Helper()
	ch := make(chan mqtt.Message, 1024)
	t := c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) { ch <- m })
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("subscribe %s: %v", topic, t.Error())
	}
	return ch
}

// PublishWait publishes and waits for the broker's acknowledgement.
func PublishWait(tb testing.TB, c mqtt.Client, topic string, retained bool, payload any) {
	tb.Helper()
	t := c.Publish(topic, 1, retained, payload)
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		tb.Fatalf("publish %s: %v", topic, t.Error())
	}
}

// Denied publishes on denied from c, then on allowed, and fails when
// sub, which sees both topics, receives the first: messages from one
// client arrive in order, so the second's arrival proves the first's
// absence.
func Denied(tb testing.TB, c mqtt.Client, sub <-chan mqtt.Message, denied, allowed string) {
	tb.Helper()
	PublishWait(tb, c, denied, false, "forbidden")
	PublishWait(tb, c, allowed, false, "marker")
	for {
		select {
		case m := <-sub:
			if m.Topic() == denied {
				tb.Fatalf("a message on %s reached the subscriber", denied)
			}
			if m.Topic() == allowed {
				return
			}
		case <-time.After(5 * time.Second):
			tb.Fatalf("the marker on %s never arrived", allowed)
		}
	}
}

// Eventually polls cond every 10 ms until it holds or timeout passes.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
