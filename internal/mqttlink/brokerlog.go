package mqttlink

import (
	"errors"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
)

// brokerLogInterval is how often a connection failure with an unchanged
// cause is logged again while it lasts.
const brokerLogInterval = time.Minute

// brokerWatch turns the MQTT client's connection attempts into log lines
// an operator can act on: a broker that cannot be reached (with its
// address) or that refuses us (with its CONNACK code) is logged at the
// first failed attempt, then once a minute while the cause stays the
// same, with the number of attempts that failed; a new cause is logged
// at once. The client retries every few seconds, so one line per attempt
// would flood the log.
type brokerWatch struct {
	log    *slog.Logger
	broker string // the broker URL without its password
	user   string
	now    func() time.Time

	mu       sync.Mutex
	cause    string    // why the last attempt failed; "" after a connect
	loggedAt time.Time // when cause was last logged
	failures int       // failed attempts since the last connect

	drops         int64     // the broker's count of dropped messages, as last heard
	dropsLoggedAt time.Time // when brokerDropped last logged
}

func newBrokerWatch(log *slog.Logger, brokerURL, user string, now func() time.Time) *brokerWatch {
	return &brokerWatch{log: log, broker: RedactURL(brokerURL), user: user, now: now}
}

// notify is the client's connection notification handler; paho calls it
// once per failed attempt, for the first connection and for reconnects.
func (w *brokerWatch) notify(_ mqtt.Client, n mqtt.ConnectionNotification) {
	if f, ok := n.(mqtt.ConnectionNotificationFailed); ok {
		w.failed(f.Reason)
	}
}

// failed records one failed connection attempt and logs it when its cause
// is new or was last logged a brokerLogInterval ago.
func (w *brokerWatch) failed(err error) {
	cause, msg, attrs := describeConnectError(err)
	now := w.now()
	w.mu.Lock()
	w.failures++
	failures := w.failures
	due := cause != w.cause || now.Sub(w.loggedAt) >= brokerLogInterval
	if due {
		w.cause, w.loggedAt = cause, now
	}
	w.mu.Unlock()
	if due {
		attrs = append([]any{"broker", w.broker}, attrs...)
		if w.user != "" {
			attrs = append(attrs, "user", w.user)
		}
		w.log.Warn(msg, append(attrs, "failed_attempts", failures, "logged_every", brokerLogInterval)...)
	}
}

// connected resets the watch after a successful connection and returns
// how many attempts had failed before it.
func (w *brokerWatch) connected() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.failures
	w.cause, w.failures = "", 0
	return n
}

// describeConnectError names the cause of a failed connection attempt:
// the broker refused it (a CONNACK return code) or could not be reached.
func describeConnectError(err error) (cause, msg string, attrs []any) {
	for code, e := range packets.ConnErrors {
		if e == nil || code == packets.ErrNetworkError || !errors.Is(err, e) {
			continue
		}
		attrs = []any{"code", code, "reason", e.Error()}
		if code == packets.ErrRefusedBadUsernameOrPassword || code == packets.ErrRefusedNotAuthorised {
			attrs = append(attrs, "hint", "check -mqtt-user ($DEVICEHUB_MQTT_USER), $DEVICEHUB_MQTT_PASSWORD and the broker's password file")
		}
		return "refused " + e.Error(), "mqtt broker refused the connection", attrs
	}
	return "unreachable", "mqtt broker unreachable", []any{"err", err}
}

// RedactURL is u with any password replaced by "xxxxx", for logs.
func RedactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(unparsable URL)"
	}
	return p.Redacted()
}

// brokerDropsTopic is Mosquitto's count of the messages it dropped since
// it started for want of queue room (max_queued_messages and
// max_queued_bytes), for any client: a retained message, published again
// only when the count changes, at most every sys_interval (10 s).
const brokerDropsTopic = "$SYS/broker/publish/messages/dropped"

// brokerDropped hears the broker's count of dropped messages. The
// retained copy a subscription brings is the count so far; any later
// (live) one means the broker dropped more, maybe statuses owed to us,
// which nothing else would tell. That is logged at most once a
// brokerLogInterval.
func (w *brokerWatch) brokerDropped(payload []byte, retained bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(string(payload)), 10, 64)
	if err != nil {
		return
	}
	now := w.now()
	w.mu.Lock()
	delta := n - w.drops
	w.drops = n
	due := !retained && delta > 0 && now.Sub(w.dropsLoggedAt) >= brokerLogInterval
	if due {
		w.dropsLoggedAt = now
	}
	w.mu.Unlock()
	if due {
		w.log.Warn(`the broker is dropping messages for want of queue room: device statuses may be lost; configure it as the README's section "Large fleets" says`,
			"broker", w.broker, "dropped", delta, "broker_total", n, "logged_every", brokerLogInterval)
	}
}

// drop counts a message that was not applied, by reason.
func (l *Link) drop(reason string) { l.dropMany(reason, 1) }

func (l *Link) dropMany(reason string, n int) {
	if n == 0 {
		return
	}
	l.mu.Lock()
	l.drops[reason] += int64(n)
	l.mu.Unlock()
}

// logDrops logs the dropped-message counts since start, by reason, at
// most once per dropLogInterval of the Now clock and only when more
// were dropped since the last such line.
func (l *Link) logDrops() {
	now := l.now()
	l.mu.Lock()
	var total int64
	args := []any{}
	for reason, n := range l.drops {
		total += n
		args = append(args, reason, n)
	}
	due := now.Sub(l.dropsLogged) >= dropLogInterval && total > l.dropsSeen
	if due {
		l.dropsLogged, l.dropsSeen = now, total
	}
	l.mu.Unlock()
	if due {
		l.log.Warn("mqtt messages dropped since start", append(args, "total", total)...)
	}
}
