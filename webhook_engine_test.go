package main

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Every delivery test runs with -webhook-allow-private against endpoints
// on 127.0.0.1, except TestWebhookPrivateAtConnection, which checks the
// refusal with it off.

// fastRetries are webhook settings whose waits between attempts are a
// millisecond.
var fastRetries = webhookSettings{allowPrivate: true, backoff: func(int) time.Duration { return time.Millisecond }}

// TestWebhookDelivery: an event is posted as JSON with its type, a
// delivery id and a signature that the secret verifies; the delivery is
// recorded and GET …/deliveries shows it.
func TestWebhookDelivery(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(fastRetries))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	rc := newReceiver(t, answerOK)
	id, secret := addWebhook(t, env, ada, rc.URL+"/hook", "audit.entry")
	startWebhooks(t, env)
	env.want(t, 200, "PATCH", "/v1/user/team", ada.token, `{"name":"Renamed"}`) // an audit entry
	// The first event is the webhook's own making (webhook.create).
	waitDB(t, env.st, "2", `SELECT count(*) FROM webhook_deliveries WHERE status = 200`)

	rc.mu.Lock()
	body, head, raw := rc.bodies[1], rc.heads[1], rc.raw[1]
	rc.mu.Unlock()
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write(raw)
	if got, want := head.Get("X-Devicehub-Signature-256"), "sha256="+hex.EncodeToString(mac.Sum(nil)); got != want {
		t.Errorf("signature %q, want %q", got, want)
	}
	if head.Get("Content-Type") != "application/json" || head.Get("X-Devicehub-Event") != "audit.entry" || body.Type != "audit.entry" {
		t.Errorf("headers %v, body %+v", head, body)
	}
	if !strings.Contains(string(body.Data), `"action":"team.update"`) || body.ID == "" || body.At == "" {
		t.Errorf("body %s", raw)
	}
	wantDB(t, env.st, head.Get("X-Devicehub-Delivery")+"|"+body.ID+"|audit.entry|200||1",
		`SELECT id || '|' || event_id || '|' || type || '|' || status || '|' || coalesce(error, '') || '|' || attempt FROM webhook_deliveries ORDER BY seq DESC LIMIT 1`)
	wantDB(t, env.st, "0|0", `SELECT queued || '|' || queued_bytes FROM webhooks`)
	list := decode(t, env.want(t, 200, "GET", "/v1/user/team/webhooks/"+id+"/deliveries", ada.token, nil))["data"].([]any)
	if d := list[0].(map[string]any); len(list) != 2 || d["status"] != 200.0 || d["error"] != nil || d["event_id"] != body.ID {
		t.Errorf("deliveries %v", list)
	}
	if d := decode(t, env.want(t, 200, "GET", "/v1/user/team/webhooks", ada.token, nil))["data"].([]any)[0].(map[string]any); d["last_delivery_at"] == nil {
		t.Errorf("webhook %v: no last_delivery_at", d)
	}

	// A ping on request.
	env.want(t, 202, "POST", "/v1/user/team/webhooks/"+id+"/test", ada.token, nil)
	waitDB(t, env.st, "ping", `SELECT type FROM webhook_deliveries WHERE status = 200 ORDER BY seq DESC LIMIT 1`)
}

// TestWebhookOrderAcrossFailures: an endpoint that fails its first
// requests (down, then up) receives every event, in the order published,
// each delivered once; each failure is a delivery recorded with its status.
func TestWebhookOrderAcrossFailures(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(fastRetries))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	rc := newReceiver(t, func(n int, w http.ResponseWriter) {
		if n <= 5 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	addWebhook(t, env, ada, rc.URL, "rollout.progress")
	startWebhooks(t, env)
	publishN(t, env, ada, 20)
	waitDB(t, env.st, "20", `SELECT count(*) FROM webhook_deliveries WHERE status = 200`)
	wantDB(t, env.st, "5|5", `SELECT count(*) || '|' || max(attempt) FROM webhook_deliveries WHERE status = 503`)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	var got []string
	for _, b := range rc.bodies[5:] {
		got = append(got, string(b.Data))
	}
	var want []string
	for i := 1; i <= 20; i++ {
		want = append(want, fmt.Sprintf(`{"n":%d}`, i))
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("delivered %v, want %v", got, want)
	}
	if rc.bodies[0].ID != rc.bodies[5].ID {
		t.Errorf("the first event was not the one retried: %s, then %s", rc.bodies[0].ID, rc.bodies[5].ID)
	}
}

// TestWebhookRedirect: a 3xx answer is a failure, and its Location is not
// followed.
func TestWebhookRedirect(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(fastRetries))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	elsewhere := newReceiver(t, answerOK)
	rc := newReceiver(t, func(_ int, w http.ResponseWriter) {
		w.Header().Set("Location", elsewhere.URL)
		w.WriteHeader(http.StatusFound)
	})
	addWebhook(t, env, ada, rc.URL, "rollout.progress")
	startWebhooks(t, env)
	publishN(t, env, ada, 1)
	waitDB(t, env.st, "302|answered 302 Found", `SELECT status || '|' || error FROM webhook_deliveries ORDER BY seq LIMIT 1`)
	waitDB(t, env.st, "1", `SELECT count(*) > 2 FROM webhook_deliveries`) // tried again, and again
	if n := elsewhere.count(); n != 0 {
		t.Errorf("the redirect was followed %d times", n)
	}
}

// TestWebhookPrivateAtConnection: without -webhook-allow-private, a
// webhook whose host has come to resolve to a private address (here made
// so in the database, past the API's check) connects nowhere: the dialer
// refuses the address.
func TestWebhookPrivateAtConnection(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(webhookSettings{backoff: fastRetries.backoff}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	rc := newReceiver(t, answerOK)
	addWebhook(t, env, ada, "https://hooks.example.test/", "rollout.progress")
	mustExec(t, env.st, `UPDATE webhooks SET url = ?`, rc.URL) // 127.0.0.1
	must(t, env.srv.webhooks.reload(context.Background()))
	startWebhooks(t, env)
	publishN(t, env, ada, 1)
	waitDB(t, env.st, "1", `SELECT count(*) >= 2 FROM webhook_deliveries WHERE status IS NULL AND error LIKE '%refused: a loopback, private%'`)
	if n := rc.count(); n != 0 {
		t.Errorf("the endpoint on 127.0.0.1 was reached %d times", n)
	}
}

// TestWebhookSlowEndpoint: an endpoint that does not answer holds only
// its own queue: another webhook's events are delivered meanwhile.
func TestWebhookSlowEndpoint(t *testing.T) {
	t.Parallel()
	ws := fastRetries
	ws.timeout = time.Hour // the slow endpoint's one request lasts the test
	env := newTestEnv(t, nil, withWebhooks(ws))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	release := make(chan struct{})
	slow := newReceiver(t, func(int, http.ResponseWriter) { <-release })
	t.Cleanup(func() { close(release) }) // before the server closes (cleanups run last first)
	fast := newReceiver(t, answerOK)
	addWebhook(t, env, ada, slow.URL, "rollout.progress")
	addWebhook(t, env, ada, fast.URL, "rollout.progress")
	startWebhooks(t, env)
	publishN(t, env, ada, 10)
	waitDB(t, env.st, "10", `SELECT count(*) FROM webhook_deliveries WHERE status = 200`)
	// The fast queue can be done before the slow request has arrived.
	eventually(t, 20*time.Second, "the slow endpoint's request", func() bool { return slow.count() > 0 })
	if n := slow.count(); n != 1 {
		t.Errorf("the slow endpoint got %d requests, want the 1 it holds", n)
	}
}

// TestWebhookTimeout: a delivery that takes longer than its time-out is
// a failure, and the queue moves on once the endpoint answers in time.
func TestWebhookTimeout(t *testing.T) {
	t.Parallel()
	ws := fastRetries
	ws.timeout = 300 * time.Millisecond
	env := newTestEnv(t, nil, withWebhooks(ws))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	release := make(chan struct{})
	rc := newReceiver(t, func(n int, _ http.ResponseWriter) {
		if n == 1 {
			<-release
		}
	})
	t.Cleanup(func() { close(release) })
	addWebhook(t, env, ada, rc.URL, "rollout.progress")
	startWebhooks(t, env)
	publishN(t, env, ada, 1)
	waitDB(t, env.st, "1", `SELECT count(*) FROM webhook_deliveries WHERE status = 200`)
	wantDB(t, env.st, "1", `SELECT count(*) > 0 FROM webhook_deliveries WHERE status IS NULL AND error LIKE '%Timeout%'`)
}

// TestWebhookQueueBound: past -webhook-queue events, or its bytes, a
// webhook's queue drops its oldest events; each is counted and recorded
// as a delivery with an error, and the newest are kept.
func TestWebhookQueueBound(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		ws   webhookSettings
	}{
		{"events", webhookSettings{allowPrivate: true, queueEvents: 3}},
		{"bytes", webhookSettings{allowPrivate: true, queueBytes: 3 * 120}}, // each body is about 100 bytes
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := newTestEnv(t, nil, withWebhooks(tc.ws))
			ada := env.addMember("Ada", model.RoleAdmin, env.alice)
			addWebhook(t, env, ada, "http://127.0.0.1:9/", "rollout.progress") // the engine is not started: nothing is delivered
			publishN(t, env, ada, 5)
			env.srv.webhooks.queueHeard(context.Background())
			wantDB(t, env.st, "3", `SELECT count(*) FROM webhook_queue`)
			wantDB(t, env.st, `{"n":3} {"n":4} {"n":5}`, `SELECT group_concat(json_extract(body, '$.data'), ' ') FROM (SELECT body FROM webhook_queue ORDER BY seq)`)
			wantDB(t, env.st, "3", `SELECT queued FROM webhooks`)
			wantDB(t, env.st, "2|dropped: the webhook's queue was full|0", `SELECT count(*) || '|' || error || '|' || attempt FROM webhook_deliveries WHERE status IS NULL`)
			if n := env.srv.webhooks.tap.dropped.Load(); n != 2 {
				t.Errorf("dropped %d, want 2", n)
			}
			m := newMetrics(env.st, nil, env.srv.events)
			b, err := m.write(context.Background())
			must(t, err)
			if !strings.Contains(string(b), "\ndevicehub_webhook_dropped_total 2\n") {
				t.Errorf("metrics lack the drops:\n%s", b)
			}
		})
	}
}

// TestWebhookDisabledAfterRetryWindow: an endpoint that fails for 24
// hours (on a fake clock, which each wait between attempts advances) has
// its webhook disabled, with a reason and an audit entry whose actor is
// devicehub (null); its queue is kept. The streams hear of the entry
// under its number in the team's log, which another team's entries do
// not move.
func TestWebhookDisabledAfterRetryWindow(t *testing.T) {
	t.Parallel()
	var env *testEnv
	ws := webhookSettings{allowPrivate: true, after: func(d time.Duration) <-chan time.Time {
		env.clock.advance(d)
		ch := make(chan time.Time, 1)
		ch <- env.clock.now()
		return ch
	}}
	env = newTestEnv(t, nil, withWebhooks(ws))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	rc := newReceiver(t, func(_ int, w http.ResponseWriter) { w.WriteHeader(500) })
	id, _ := addWebhook(t, env, ada, rc.URL, "rollout.progress")
	env.want(t, 201, "POST", "/v1/user/tokens", env.bob.token, map[string]string{"name": "ci"}) // another team's entry
	stream, err := env.srv.events.subscribe(env.alice.id, env.alice.id)
	must(t, err)
	start := env.clock.now()
	startWebhooks(t, env)
	publishN(t, env, ada, 1)
	waitDB(t, env.st, "0", `SELECT enabled FROM webhooks`)
	if waited := env.clock.now().Sub(start); waited < 24*time.Hour || waited > 25*time.Hour {
		t.Errorf("disabled after %v of failures, want 24 h", waited)
	}
	wantDB(t, env.st, "Every delivery failed for 24h0m0s; the last: answered 500 Internal Server Error", `SELECT disabled_reason FROM webhooks`)
	wantDB(t, env.st, fmt.Sprintf(`webhook.update|<nil>|{"disabled_reason":"Every delivery failed for 24h0m0s; the last: answered 500 Internal Server Error","enabled":false,"host":"%s","webhook_id":%s}`,
		strings.TrimPrefix(rc.URL, "http://"), id), `SELECT action || '|' || coalesce(actor_id, '<nil>') || '|' || detail FROM audit ORDER BY id DESC LIMIT 1`)
	wantDB(t, env.st, "1", `SELECT count(*) FROM webhook_queue`)
	number := scalar(t, env.st, `SELECT number FROM audit WHERE action = 'webhook.update'`)
	var told []string // the worker tells the streams after its write commits
	eventually(t, 5*time.Second, "the entry told", func() bool {
		for _, f := range env.srv.events.since(stream) {
			if _, data, ok := strings.Cut(firstFrame([][]byte{f}), "audit.entry "); ok {
				var e model.AuditEntry
				must(t, json.Unmarshal([]byte(data), &e))
				told = append(told, fmt.Sprint(e.ID, " ", e.Action))
			}
		}
		return len(told) > 0
	})
	if want := []string{number + " webhook.update"}; !slices.Equal(told, want) {
		t.Errorf("audit entries told: %q, want %q", told, want)
	}
	attempts := scalar(t, env.st, `SELECT max(attempt) FROM webhook_deliveries`)
	if n := rc.count(); fmt.Sprint(n) != attempts {
		t.Errorf("%d requests, %s attempts recorded", n, attempts)
	}
}

// TestWebhookDeviceOffline: device.offline goes out once a device has
// been offline for the webhook's offline_minutes, once per spell.
func TestWebhookDeviceOffline(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(webhookSettings{allowPrivate: true}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	env.want(t, 201, "POST", "/v1/user/team/webhooks", ada.token, `{"url":"http://127.0.0.1:9/","events":["device.offline"],"offline_minutes":15}`)
	must(t, env.srv.webhooks.reload(context.Background()))
	check := func() { env.srv.webhooks.checkOffline(context.Background()) }
	seen := env.clock.now().UTC().Format(store.TimeFormat)
	mustExec(t, env.st, `UPDATE devices SET status = 'offline', last_seen_at = ? WHERE uid = ?`, seen, env.alice.device)
	env.clock.advance(14 * time.Minute)
	check()
	wantDB(t, env.st, "0", `SELECT count(*) FROM webhook_queue`)
	env.clock.advance(2 * time.Minute)
	check()
	wantDB(t, env.st, fmt.Sprintf(`{"uid":"%s","name":"Alice's device","last_seen_at":"%s","offline_minutes":15}`, env.alice.device, seen),
		`SELECT json_extract(body, '$.data') FROM webhook_queue WHERE type = 'device.offline'`)
	env.clock.advance(time.Hour)
	check()
	wantDB(t, env.st, "1", `SELECT count(*) FROM webhook_queue`) // once per spell

	// Back, and gone again: a new spell.
	seen = env.clock.now().UTC().Format(store.TimeFormat)
	mustExec(t, env.st, `UPDATE devices SET last_seen_at = ? WHERE uid = ?`, seen, env.alice.device)
	env.clock.advance(16 * time.Minute)
	check()
	wantDB(t, env.st, "2", `SELECT count(*) FROM webhook_queue`)
}

// TestWebhookQueueSurvivesRestart: events queued when the service stops
// are delivered by the next one, in order.
func TestWebhookQueueSurvivesRestart(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(fastRetries))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	rc := newReceiver(t, answerOK)
	addWebhook(t, env, ada, rc.URL, "rollout.progress")
	publishN(t, env, ada, 3)
	env.srv.webhooks.queueHeard(context.Background()) // queued; never delivered by this server
	env.rebuild()
	startWebhooks(t, env)
	waitDB(t, env.st, "3", `SELECT count(*) FROM webhook_deliveries WHERE status = 200`)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if got := string(rc.bodies[0].Data) + " " + string(rc.bodies[2].Data); got != `{"n":1} {"n":3}` {
		t.Errorf("delivered %s", got)
	}
}

// TestWebhookLogsBounded: the events heard and not yet queued in the
// store are at most webhookInbox (the oldest dropped and counted), and a
// webhook keeps its newest store.KeepDeliveries deliveries.
func TestWebhookLogsBounded(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(webhookSettings{allowPrivate: true, queueEvents: 1}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	addWebhook(t, env, ada, "http://127.0.0.1:9/", "rollout.progress") // the engine is not started: nothing is delivered
	publishN(t, env, ada, webhookInbox+1)
	if n, dropped := len(env.srv.webhooks.tap.inbox), env.srv.webhooks.tap.dropped.Load(); n != webhookInbox || dropped != 1 {
		t.Fatalf("inbox %d, dropped %d: want %d and 1", n, dropped, webhookInbox)
	}
	env.srv.webhooks.queueHeard(context.Background())
	wantDB(t, env.st, fmt.Sprint(store.KeepDeliveries), `SELECT count(*) FROM webhook_deliveries`)
	wantDB(t, env.st, fmt.Sprintf(`{"n":%d}`, webhookInbox+1), `SELECT json_extract(body, '$.data') FROM webhook_queue`)
}

// TestWebhookHearsWithoutStream: a team's webhooks hear its events though
// nobody of the team has a stream open: a command recorded, a device's
// new status and boot, a command's result; not the telemetry between.
func TestWebhookHearsWithoutStream(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, &recordingLink{}, withWebhooks(webhookSettings{allowPrivate: true}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	addWebhook(t, env, ada, "http://127.0.0.1:9/", "command.state", "device.status", "device.boot")
	team, _ := strconv.ParseInt(teamOf(t, env, ada), 10, 64)
	env.setStatus(env.alice.device, "online")
	env.want(t, 200, "POST", "/v1/user/devices/"+env.alice.device+"/reboot", ada.token, nil)
	status := model.DeviceStatusEvent{UID: env.alice.device, Status: "online"}
	env.srv.events.devicesChanged(context.Background(), []store.DeviceChange{
		{TeamID: team, DeviceStatusEvent: status, StatusChanged: true, Boots: []store.BootEvent{{UID: env.alice.device, Reason: "panic", Crash: true}}},
		{TeamID: team, DeviceStatusEvent: status}, // telemetry alone
	})
	id := scalar(t, env.st, `SELECT id FROM commands`)
	env.srv.events.CommandsChanged(context.Background(), []string{id})
	env.srv.webhooks.queueHeard(context.Background())
	wantDB(t, env.st, "command.state device.boot device.status command.state", `SELECT group_concat(type, ' ') FROM (SELECT type FROM webhook_queue ORDER BY seq)`)
}
