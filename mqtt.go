package main

import (
	"context"
	"crypto/tls"
	"database/sql"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

const (
	// maxDevicePayload is the largest status or telemetry message applied.
	maxDevicePayload = 16 << 10
	// maxPendingDevices bounds the reports held between two flushes; a
	// flood of messages for made-up uids cannot grow memory past it.
	maxPendingDevices = 50_000
	// flushInterval is how often device reports are written, in one
	// transaction for all of them.
	flushInterval = 100 * time.Millisecond
)

var errPublishTimeout = errors.New("broker did not acknowledge in time")

// mqttLink is the process's one MQTT client: it publishes commands and
// applies what devices report on P/{uid}/status and P/{uid}/telemetry.
type mqttLink struct {
	client         mqtt.Client
	prefix         string
	store          *store
	log            *slog.Logger
	publishTimeout time.Duration

	subscribed atomic.Bool // the device topics are subscribed on this connection

	dropped atomic.Int64 // messages ignored: malformed, oversized, unknown uid
	applied atomic.Int64 // device reports written to the database

	mu      sync.Mutex
	pending map[string]*deviceReport
	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
}

// deviceReport merges what one device said since the last flush.
type deviceReport struct {
	seen      string // time of the newest message
	live      bool   // a message that was not a retained replay
	status    *string
	localIP   *string
	publicIP  *string
	rssi      *float64
	fwMD5     *string
	fwVersion *string
}

// mqttConfig is what the link needs from the configuration.
type mqttConfig struct {
	url, user, password, prefix string
}

// newMQTTLink creates the link and starts connecting in the background; it
// keeps trying, and re-subscribes after every reconnect.
func newMQTTLink(cfg mqttConfig, st *store, log *slog.Logger) *mqttLink {
	l := &mqttLink{
		prefix:         strings.TrimRight(cfg.prefix, "/"),
		store:          st,
		log:            log,
		publishTimeout: 1500 * time.Millisecond,
		pending:        map[string]*deviceReport{},
		kick:           make(chan struct{}, 1),
		stop:           make(chan struct{}),
		done:           make(chan struct{}),
	}
	opts := mqtt.NewClientOptions().
		AddBroker(cfg.url).
		// Unique per process, so two instances never kick each other off.
		SetClientID("devicehub-" + randomString(12, lowerAlnum)).
		SetUsername(cfg.user).
		SetPassword(cfg.password).
		// A clean session drops unacknowledged commands on reconnect: a
		// command that answered 503 is never delivered late.
		SetCleanSession(true).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second).
		SetMaxReconnectInterval(5 * time.Second).
		SetConnectTimeout(5 * time.Second).
		SetKeepAlive(30 * time.Second).
		SetPingTimeout(5 * time.Second).
		SetWriteTimeout(5 * time.Second).
		SetOnConnectHandler(l.onConnect).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) {
			l.subscribed.Store(false)
			log.Warn("mqtt connection lost", "err", err)
		})
	if scheme, _, _ := strings.Cut(cfg.url, "://"); scheme == "ssl" || scheme == "mqtts" || scheme == "tls" {
		opts.SetTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12}) // system roots
	}
	l.client = mqtt.NewClient(opts)
	l.client.Connect() // with ConnectRetry it keeps trying in the background
	go l.flushLoop()
	return l
}

func (l *mqttLink) onConnect(c mqtt.Client) {
	l.log.Info("mqtt connected")
	topics := map[string]byte{l.prefix + "/+/status": 1, l.prefix + "/+/telemetry": 1}
	t := c.SubscribeMultiple(topics, func(_ mqtt.Client, m mqtt.Message) {
		l.handle(m.Topic(), m.Payload(), m.Retained())
	})
	go func() {
		if !t.WaitTimeout(10*time.Second) || t.Error() != nil {
			l.log.Error("mqtt subscribe failed", "err", t.Error())
			return
		}
		l.subscribed.Store(true)
	}()
}

// connected reports whether the broker connection is up and the device
// topics are subscribed on it.
func (l *mqttLink) connected() bool { return l.client.IsConnectionOpen() && l.subscribed.Load() }

// publish sends payload to P/{uid}/cmd at QoS 1, not retained, and waits a
// bounded time for the broker's acknowledgement.
func (l *mqttLink) publish(uid string, payload []byte) error {
	t := l.client.Publish(l.prefix+"/"+uid+"/cmd", 1, false, payload)
	if !t.WaitTimeout(l.publishTimeout) {
		return errPublishTimeout
	}
	return t.Error()
}

// close stops the link: it disconnects and writes what is pending.
func (l *mqttLink) close() {
	l.client.Disconnect(250)
	close(l.stop)
	<-l.done
}

// telemetry is the JSON a device publishes on P/{uid}/telemetry.
type telemetry struct {
	LocalIP   *string  `json:"local_ip"`
	PublicIP  *string  `json:"public_ip"`
	RSSI      *float64 `json:"rssi"`
	FWMD5     *string  `json:"fw_md5"`
	FWVersion *string  `json:"fw_version"`
}

// handle applies one message from a device topic. Anything malformed is
// dropped and counted; nothing here can fail the process.
func (l *mqttLink) handle(topic string, payload []byte, retained bool) {
	rest, ok := strings.CutPrefix(topic, l.prefix+"/")
	uid, kind, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 || uid == "" || len(uid) > 128 || len(payload) > maxDevicePayload {
		l.drop("bad topic or size", topic)
		return
	}
	var rep deviceReport
	switch kind {
	case "status":
		s := string(payload)
		if s != "online" && s != "offline" && s != "reconnecting" {
			l.drop("bad status", topic)
			return
		}
		rep.status = &s
	case "telemetry":
		var t telemetry
		if err := json.Unmarshal(payload, &t); err != nil || !validTelemetry(&t) {
			l.drop("bad telemetry", topic)
			return
		}
		if t.FWMD5 != nil {
			*t.FWMD5 = strings.ToLower(*t.FWMD5)
		}
		rep = deviceReport{localIP: t.LocalIP, publicIP: t.PublicIP, rssi: t.RSSI, fwMD5: t.FWMD5, fwVersion: t.FWVersion}
	default:
		l.drop("bad topic", topic)
		return
	}
	rep.seen = l.store.timestamp()
	rep.live = !retained
	l.mu.Lock()
	p := l.pending[uid]
	if p == nil {
		if len(l.pending) >= maxPendingDevices {
			l.mu.Unlock()
			l.drop("too many pending", topic)
			return
		}
		p = &deviceReport{}
		l.pending[uid] = p
	}
	p.merge(&rep)
	n := len(l.pending)
	l.mu.Unlock()
	if n >= maxPendingDevices/2 {
		select {
		case l.kick <- struct{}{}:
		default:
		}
	}
}

func validTelemetry(t *telemetry) bool {
	for _, s := range []*string{t.LocalIP, t.PublicIP, t.FWVersion} {
		if s != nil && len(*s) > 255 {
			return false
		}
	}
	return t.FWMD5 == nil || isMD5(*t.FWMD5)
}

// merge folds a newer report into p.
func (p *deviceReport) merge(n *deviceReport) {
	p.seen = n.seen
	p.live = p.live || n.live
	for _, f := range []struct{ dst, src **string }{
		{&p.status, &n.status}, {&p.localIP, &n.localIP}, {&p.publicIP, &n.publicIP},
		{&p.fwMD5, &n.fwMD5}, {&p.fwVersion, &n.fwVersion},
	} {
		if *f.src != nil {
			*f.dst = *f.src
		}
	}
	if n.rssi != nil {
		p.rssi = n.rssi
	}
}

func (l *mqttLink) drop(why, topic string) {
	l.dropped.Add(1)
	l.log.Debug("mqtt message dropped", "why", why, "topic", topic)
}

func (l *mqttLink) flushLoop() {
	defer close(l.done)
	t := time.NewTicker(flushInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-l.kick:
		case <-l.stop:
			l.flush()
			return
		}
		l.flush()
	}
}

// deviceReportSQL applies one merged report. A retained replay (not live)
// fills the seen times only where they are empty. last_ota_at is set when
// the reported md5 changes to the target's.
const deviceReportSQL = `UPDATE devices SET
	status = COALESCE(?1, status),
	first_seen_at = COALESCE(first_seen_at, ?2),
	last_seen_at = CASE WHEN ?3 THEN ?2 ELSE COALESCE(last_seen_at, ?2) END,
	local_ip = COALESCE(?4, local_ip),
	public_ip = COALESCE(?5, public_ip),
	last_rssi = COALESCE(?6, last_rssi),
	last_ota_at = CASE WHEN ?7 IS NOT NULL AND ?7 IS NOT current_md5
		AND ?7 = (SELECT md5 FROM firmwares WHERE id = target_firmware_id) THEN ?2 ELSE last_ota_at END,
	current_md5 = COALESCE(?7, current_md5),
	current_version = CASE WHEN ?7 IS NOT NULL THEN ?8 ELSE COALESCE(?8, current_version) END
	WHERE uid = ?9`

// flush writes every pending report in one transaction.
func (l *mqttLink) flush() {
	l.mu.Lock()
	batch := l.pending
	if len(batch) == 0 {
		l.mu.Unlock()
		return
	}
	l.pending = make(map[string]*deviceReport, len(batch))
	l.mu.Unlock()

	ctx := context.Background()
	var unknown int64
	err := l.store.inTx(ctx, func(tx *sql.Tx) error {
		stmt, err := tx.PrepareContext(ctx, deviceReportSQL)
		if err != nil {
			return err
		}
		defer stmt.Close()
		unknown = 0
		for uid, p := range batch {
			res, err := stmt.ExecContext(ctx, p.status, p.seen, p.live, p.localIP, p.publicIP, p.rssi, p.fwMD5, p.fwVersion, uid)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				unknown++
			}
		}
		return nil
	})
	if err != nil {
		l.log.Error("apply device reports", "devices", len(batch), "err", err)
		l.dropped.Add(int64(len(batch)))
		return
	}
	l.dropped.Add(unknown)
	l.applied.Add(int64(len(batch)) - unknown)
}
