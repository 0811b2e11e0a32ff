package mqttlink

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/wire"
)

// Broker logins through Mosquitto's dynamic security plugin: devicehub
// sends the plugin's commands on its control topic and reads the answers
// on the response topic, matched by their correlationData.
const (
	dynsecTopic         = "$CONTROL/dynamic-security/v1"
	dynsecResponseTopic = dynsecTopic + "/response"
	// dynsecTimeout is how long a request waits for the plugin's answer.
	dynsecTimeout = 5 * time.Second
)

// ErrBrokerUnavailable: the broker did not answer a request in time (it is
// down, or runs without the plugin), so nothing is known to have changed.
var ErrBrokerUnavailable = errors.New("the broker did not answer")

// Logins manages one broker client per device: user name and client
// id are the device's uid, and a role of its own lets it publish and
// subscribe on its own topics of the protocol only (acls). A role per device, because the
// 2.0 plugin takes %c and %u in an ACL topic literally. It has its own
// connection, so that its requests never queue behind device traffic.
type Logins struct {
	client    mqtt.Client
	prefix    string // the topic prefix, without a trailing slash
	publicURL string // the broker as devices reach it (-public-mqtt-url)
	log       *slog.Logger
	timeout   time.Duration // dynsecTimeout; tests shorten it
	callbacks callbackGate  // the client's calls that may log: close waits for them

	mu      sync.Mutex
	ready   chan struct{}          // closed while the response topic is subscribed (setReady)
	waiting map[string]*dynsecCall // by correlationData
}

// Credentials are what a device needs to log in to the broker.
type Credentials struct {
	MQTTURL, Username, Password, ClientID string
	TopicPrefix                           string // P/{uid}, without a trailing slash
}

// dynsecCall is a request waiting for its responses.
type dynsecCall struct {
	done      chan struct{}
	responses []dynsecResponse
}

// dynsecResponse is one command's answer; Error is empty on success.
type dynsecResponse struct {
	Command         string          `json:"command"`
	Error           string          `json:"error"`
	CorrelationData string          `json:"correlationData"`
	Data            json.RawMessage `json:"data"`
}

// dynsecCommand is one command of the plugin, e.g. {"command": "deleteRole", "rolename": "…"}.
type dynsecCommand map[string]any

// NewLogins connects to the broker in the background, as b.User, who
// needs the plugin's admin rights; publicURL is the broker's address
// given to devices.
func NewLogins(b Broker, publicURL string, log *slog.Logger) *Logins {
	l := &Logins{
		prefix:    b.prefix(),
		publicURL: publicURL,
		log:       log,
		timeout:   dynsecTimeout,
		ready:     make(chan struct{}),
		waiting:   map[string]*dynsecCall{},
	}
	opts := clientOptions(b, "devicehub-dynsec-").
		// The client calls each handler on a goroutine of its own.
		SetOnConnectHandler(func(c mqtt.Client) { l.callbacks.do(func() { l.subscribe(c) }) }).
		SetConnectionLostHandler(func(mqtt.Client, error) { l.setReady(false) })
	l.client = mqtt.NewClient(opts)
	l.client.Connect()
	return l
}

// subscribe subscribes to the response topic on a new connection, and
// then lets requests go.
func (l *Logins) subscribe(c mqtt.Client) {
	t := c.Subscribe(dynsecResponseTopic, 1, func(_ mqtt.Client, m mqtt.Message) { l.handle(m.Payload()) })
	if !t.WaitTimeout(10*time.Second) || t.Error() != nil {
		if l.callbacks.closing() {
			return // it failed because close disconnected
		}
		l.log.Error("dynsec: subscribe to the response topic", "err", t.Error())
		return
	}
	if t.(*mqtt.SubscribeToken).Result()[dynsecResponseTopic] == 0x80 {
		l.log.Error("dynsec: the broker refused the response topic: does the MQTT user have the plugin's admin role?")
		return
	}
	l.setReady(true)
}

// setReady opens (up) or shuts the gate that requests wait at: an answer
// is lost unless the response topic is subscribed when it comes.
func (l *Logins) setReady(up bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.ready:
		if !up {
			l.ready = make(chan struct{})
		}
	default:
		if up {
			close(l.ready)
		}
	}
}

// handle hands the responses in one message to the requests that wait
// for them; others' (mosquitto_ctrl's, another instance's) are ignored.
func (l *Logins) handle(payload []byte) {
	var m struct{ Responses []dynsecResponse }
	if json.Unmarshal(payload, &m) != nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range m.Responses {
		if call := l.waiting[r.CorrelationData]; call != nil {
			call.responses = append(call.responses, r)
		}
	}
	for _, r := range m.Responses {
		if call := l.waiting[r.CorrelationData]; call != nil {
			delete(l.waiting, r.CorrelationData)
			close(call.done)
		}
	}
}

// request is requestEach, with each command's error by command name (of
// a name sent twice, the last).
func (l *Logins) request(ctx context.Context, undo []dynsecCommand, cmds ...dynsecCommand) (map[string]string, error) {
	responses, err := l.requestEach(ctx, undo, cmds...)
	if err != nil {
		return nil, err
	}
	errs := map[string]string{}
	for _, c := range cmds {
		errs[c["command"].(string)] = "no answer"
	}
	for _, r := range responses {
		errs[r.Command] = r.Error
	}
	return errs, nil
}

// requestEach sends cmds in one message, which the plugin runs in order
// and answers in one message, and returns the answers in order;
// ErrBrokerUnavailable when the broker does not answer within l.timeout.
// When cmds may have gone out but no answer came, it sends undo (if any),
// which the broker runs after them: best effort, since nothing is known
// of a broker that does not answer.
func (l *Logins) requestEach(ctx context.Context, undo []dynsecCommand, cmds ...dynsecCommand) ([]dynsecResponse, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	id := rand.Text()
	for _, c := range cmds {
		c["correlationData"] = id
	}
	payload, err := json.Marshal(map[string]any{"commands": cmds})
	if err != nil {
		return nil, err
	}
	call := &dynsecCall{done: make(chan struct{})}
	l.mu.Lock()
	ready := l.ready
	l.waiting[id] = call
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.waiting, id)
		l.mu.Unlock()
	}()
	deadline := time.After(l.timeout)
	wait := func(done <-chan struct{}) error {
		select {
		case <-done:
			return nil
		case <-deadline:
			return ErrBrokerUnavailable
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := wait(ready); err != nil {
		return nil, err
	}
	t := l.client.Publish(dynsecTopic, 1, false, payload)
	err = wait(t.Done())
	if err == nil && t.Error() != nil {
		err = fmt.Errorf("%w: %v", ErrBrokerUnavailable, t.Error())
	}
	if err == nil {
		err = wait(call.done)
	}
	if err != nil {
		if undo != nil {
			undoPayload, _ := json.Marshal(map[string]any{"commands": undo})
			l.client.Publish(dynsecTopic, 1, false, undoPayload)
		}
		return nil, err
	}
	l.mu.Lock() // handle wrote call.responses under it
	defer l.mu.Unlock()
	return call.responses, nil
}

// Create makes the device's broker client and role (acls), and returns its new
// password. Nothing half-made remains: when either the role or the
// client cannot be made, the other is deleted again, and when the broker
// does not answer, a request to delete both follows.
func (l *Logins) Create(ctx context.Context, uid string) (string, error) {
	if uid == "" || strings.ContainsAny(uid, "/+#") {
		return "", fmt.Errorf("dynsec: %q cannot be a broker user", uid)
	}
	password, role := rand.Text(), l.role(uid)
	errs, err := l.request(ctx, l.removeCommands(uid),
		dynsecCommand{"command": "createRole", "rolename": role, "acls": l.acls(uid)},
		dynsecCommand{"command": "createClient", "username": uid, "password": password,
			"clientid": uid, "roles": []dynsecCommand{{"rolename": role}}})
	if err != nil {
		return "", err
	}
	if errs["createRole"] == "" && errs["createClient"] == "" {
		return password, nil
	}
	var undo []dynsecCommand // what was made: the role, or a client given a role made before
	if errs["createClient"] == "" {
		undo = append(undo, dynsecCommand{"command": "deleteClient", "username": uid})
	}
	if errs["createRole"] == "" {
		undo = append(undo, dynsecCommand{"command": "deleteRole", "rolename": role})
	}
	if len(undo) > 0 {
		l.request(context.WithoutCancel(ctx), nil, undo...)
	}
	return "", fmt.Errorf("dynsec: create %s: %s", uid, cmp.Or(errs["createRole"], errs["createClient"]))
}

// Rotate gives the device's broker client a new password and returns it;
// the old one is refused from the next connect on. A device without a
// client (added before -mqtt-dynsec was on, or its client deleted by
// hand) gets one, in place of any role of its left behind.
func (l *Logins) Rotate(ctx context.Context, uid string) (string, error) {
	password := rand.Text()
	errs, err := l.request(ctx, nil, dynsecCommand{"command": "setClientPassword", "username": uid, "password": password})
	switch {
	case err != nil:
		return "", err
	case errs["setClientPassword"] == "Client not found":
		if err := l.Remove(ctx, uid); err != nil {
			return "", err
		}
		return l.Create(ctx, uid)
	case errs["setClientPassword"] != "":
		return "", fmt.Errorf("dynsec: set password of %s: %s", uid, errs["setClientPassword"])
	}
	return password, nil
}

// Remove deletes the device's broker client, which the broker then
// disconnects, and its role. Either one already gone is no error.
func (l *Logins) Remove(ctx context.Context, uid string) error {
	errs, err := l.request(ctx, nil, l.removeCommands(uid)...)
	if err != nil {
		return err
	}
	if e := errs["deleteClient"]; e != "" && e != "Client not found" {
		return fmt.Errorf("dynsec: delete client %s: %s", uid, e)
	}
	if e := errs["deleteRole"]; e != "" && e != "Role not found" {
		return fmt.Errorf("dynsec: delete role %s: %s", l.role(uid), e)
	}
	return nil
}

// Narrow gives the device's role exactly the topics of the protocol
// (acls), in place of everything under its prefix, which the roles that
// earlier versions made allow. It reports whether the device has a role,
// and whether it changed it: a role without the prefix's ACL is only
// read, as changing a role may disconnect its device once. The protocol's
// ACLs go in before the prefix's goes, so that a run cut short leaves a
// role that works and is narrowed by the next.
func (l *Logins) Narrow(ctx context.Context, uid string) (has, changed bool, err error) {
	role, wide := l.role(uid), wire.DeviceTopic(l.prefix, uid)+"/#"
	answers, err := l.requestEach(ctx, nil, dynsecCommand{"command": "getRole", "rolename": role})
	switch {
	case err != nil:
		return false, false, err
	case len(answers) != 1:
		return false, false, fmt.Errorf("dynsec: get role %s: no answer", role)
	case answers[0].Error == "Role not found":
		return false, false, nil
	case answers[0].Error != "":
		return false, false, fmt.Errorf("dynsec: get role %s: %s", role, answers[0].Error)
	}
	var got struct {
		Role struct {
			ACLs []struct{ Topic string } `json:"acls"`
		} `json:"role"`
	}
	if err := json.Unmarshal(answers[0].Data, &got); err != nil {
		return true, false, fmt.Errorf("dynsec: get role %s: %w", role, err)
	}
	if !slices.ContainsFunc(got.Role.ACLs, func(a struct{ Topic string }) bool { return a.Topic == wide }) {
		return true, false, nil
	}
	var cmds []dynsecCommand
	for _, acl := range l.acls(uid) {
		cmds = append(cmds, dynsecCommand{"command": "addRoleACL", "rolename": role,
			"acltype": acl["acltype"], "topic": acl["topic"], "allow": true})
	}
	cmds = append(cmds,
		dynsecCommand{"command": "removeRoleACL", "rolename": role, "acltype": "publishClientSend", "topic": wide},
		dynsecCommand{"command": "removeRoleACL", "rolename": role, "acltype": "subscribePattern", "topic": wide})
	if answers, err = l.requestEach(ctx, nil, cmds...); err != nil {
		return true, false, err
	}
	if len(answers) != len(cmds) {
		return true, false, fmt.Errorf("dynsec: narrow %s: %d answers to %d commands", role, len(answers), len(cmds))
	}
	for i, a := range answers {
		// There already, or gone already: a run cut short before.
		if a.Error != "" && a.Error != "ACL with this topic already exists" && a.Error != "ACL not found" {
			return true, false, fmt.Errorf("dynsec: narrow %s: %s %s: %s", role, cmds[i]["command"], cmds[i]["topic"], a.Error)
		}
	}
	return true, true, nil
}

func (l *Logins) removeCommands(uid string) []dynsecCommand {
	return []dynsecCommand{
		{"command": "deleteClient", "username": uid},
		{"command": "deleteRole", "rolename": l.role(uid)},
	}
}

// acls are the device's rights: exactly the topics of the protocol
// (docs/devices.md), so that it can neither publish on nor retain a message
// at any other topic under its prefix. Status is also its Last Will's
// topic, which the broker checks at connect.
func (l *Logins) acls(uid string) []dynsecCommand {
	topic := func(kind, id string) string { return wire.Topic(l.prefix, uid, kind, id) }
	return []dynsecCommand{
		{"acltype": "publishClientSend", "topic": topic(wire.StatusKind, ""), "allow": true},
		{"acltype": "publishClientSend", "topic": topic(wire.TelemetryKind, ""), "allow": true},
		{"acltype": "publishClientSend", "topic": topic(wire.ResultKind, "+"), "allow": true},
		{"acltype": "subscribePattern", "topic": topic(wire.CommandKind, "+"), "allow": true},
	}
}

// role is the name of the device's own role.
func (l *Logins) role(uid string) string { return "devicehub-device-" + uid }

// Credentials are what the device uid needs to log in with password.
func (l *Logins) Credentials(uid, password string) Credentials {
	return Credentials{MQTTURL: l.publicURL, Username: uid, Password: password,
		ClientID: uid, TopicPrefix: wire.DeviceTopic(l.prefix, uid)}
}

// Close disconnects; a request still waiting ends at its timeout. When it
// returns, nothing of it runs or logs any more.
func (l *Logins) Close() {
	l.callbacks.close()
	l.client.Disconnect(250)
	l.callbacks.wait()
}
