package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"
)

// withWebhooks is an envOption: the webhook engine's settings. Names
// resolve through testLookup only: no test reaches past loopback.
func withWebhooks(ws webhookSettings) envOption {
	return func(_ *testEnv, o *serverOptions) {
		if ws.lookup == nil {
			ws.lookup = testLookup
		}
		o.webhooks = ws
	}
}

// testLookup resolves a few names, to loopback and private addresses and
// one public address (which no test connects to).
func testLookup(_ context.Context, host string) ([]netip.Addr, error) {
	names := map[string][]string{
		"localhost":          {"127.0.0.1", "::1"},
		"intranet.test":      {"10.1.2.3"},
		"metadata.test":      {"169.254.169.254"},
		"mixed.test":         {"203.0.113.5", "192.168.1.1"},
		"hooks.example.test": {"203.0.113.7"},
	}
	var addrs []netip.Addr
	for _, a := range names[host] {
		addrs = append(addrs, netip.MustParseAddr(a))
	}
	if addrs == nil {
		return nil, fmt.Errorf("no such host %s", host)
	}
	return addrs, nil
}

// startWebhooks runs env's webhook engine until the test ends.
func startWebhooks(t *testing.T, env *testEnv) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { env.srv.webhooks.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// waitDB waits until query gives want, for at most 20 s.
func waitDB(t *testing.T, st *store.Store, want, query string, args ...any) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		got := scalar(t, st, query, args...)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %q, want %q", query, got, want)
		}
	}
}

// receiver is an endpoint on 127.0.0.1 that records what it is posted
// and answers with answer(n), n counting the requests from 1.
type receiver struct {
	*httptest.Server
	mu     sync.Mutex
	bodies []webhookBody
	heads  []http.Header
	raw    [][]byte
	n      int
}

func newReceiver(t testing.TB, answer func(n int, w http.ResponseWriter)) *receiver {
	rc := &receiver{}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var body webhookBody
		json.Unmarshal(b, &body)
		rc.mu.Lock()
		rc.n++
		n := rc.n
		rc.bodies, rc.heads, rc.raw = append(rc.bodies, body), append(rc.heads, r.Header.Clone()), append(rc.raw, b)
		rc.mu.Unlock()
		answer(n, w)
	}))
	t.Cleanup(rc.Close)
	return rc
}

func answerOK(int, http.ResponseWriter) {}

func (rc *receiver) count() int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.n
}

// addWebhook makes a webhook through the API and returns its id and secret.
func addWebhook(t *testing.T, env *testEnv, u testUser, url string, events ...string) (string, string) {
	t.Helper()
	m := decode(t, env.want(t, 201, "POST", "/v1/user/team/webhooks", u.token, map[string]any{"url": url, "events": events}))
	return fmt.Sprint(m["data"].(map[string]any)["id"]), m["secret"].(string)
}

// publishN publishes n rollout.progress events numbered 1 to n to u's
// team (not audit.entry: a webhook's making is one).
func publishN(t *testing.T, env *testEnv, u testUser, n int) {
	team, _ := strconv.ParseInt(teamOf(t, env, u), 10, 64)
	for i := 1; i <= n; i++ {
		env.srv.events.publish(team, "rollout.progress", map[string]int{"n": i})
	}
}

// TestWebhookQueueOfItsTeam: the store reads a webhook's queue and its
// deliveries only for the webhook's team (docs/security.md, "Team scoping
// in the store").
func TestWebhookQueueOfItsTeam(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	ctx := context.Background()
	alice, bob := env.alice.id, env.bob.id
	mustExec(t, env.st, `INSERT INTO webhooks (id, team_id, url, events, offline_minutes, secret, created_at, offline_checked_at)
		VALUES (1, ?, 'https://hooks.example.test/', '["device.status"]', 5, 'secret', 't', 't')`, alice)
	mustExec(t, env.st, `INSERT INTO webhook_queue (webhook_id, event_id, type, body) VALUES (1, 'e1', 'device.status', '{}')`)
	mustExec(t, env.st, `INSERT INTO webhook_deliveries (id, webhook_id, event_id, type, at, duration_ms, attempt)
		VALUES ('d1', 1, 'e0', 'device.status', 't', 0, 1)`)
	for _, tt := range []struct {
		team          int64
		queued, shown string
	}{{alice, "e1", "d1"}, {bob, "", ""}} {
		q, err := env.st.NextQueued(ctx, tt.team, 1)
		must(t, err)
		list, err := env.st.WebhookDeliveries(ctx, tt.team, 1)
		must(t, err)
		queued, shown := "", ""
		if q != nil {
			queued = q.EventID
		}
		for _, d := range list {
			shown += d.ID
		}
		if queued != tt.queued || shown != tt.shown {
			t.Errorf("team %d: queued %q, deliveries %q; want %q and %q", tt.team, queued, shown, tt.queued, tt.shown)
		}
	}
}

// TestWebhookRoutes: each route's answers (status and body) and the
// database afterwards, for an admin; a user, a viewer and another team
// are refused (TestTeamRoles has every role on every route).
func TestWebhookRoutes(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(webhookSettings{}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	vic := env.addMember("Vic", model.RoleViewer, env.alice)
	const hooks = "/v1/user/team/webhooks"
	urlErr := `{"url":["The url field must be an http or https URL with a host."]}`
	privateErr := `{"url":["The url field must not point to a loopback, private, link-local or unspecified address."]}`
	for _, tc := range []struct {
		name, body string
		status     int
		errors     string // the 422's field errors
	}{
		{"ftp", `{"url":"ftp://hooks.example.test/","events":["device.status"]}`, 422, urlErr},
		{"no host", `{"url":"https:///x","events":["device.status"]}`, 422, urlErr},
		{"not a url", `{"url":"hooks.example.test","events":["device.status"]}`, 422, urlErr},
		{"loopback", `{"url":"http://127.0.0.1:9/","events":["device.status"]}`, 422, privateErr},
		{"loopback v6", `{"url":"http://[::1]/","events":["device.status"]}`, 422, privateErr},
		{"mapped loopback", `{"url":"http://[::ffff:127.0.0.1]/","events":["device.status"]}`, 422, privateErr},
		{"localhost", `{"url":"http://localhost:8080/","events":["device.status"]}`, 422, privateErr},
		{"private", `{"url":"https://10.0.0.8/","events":["device.status"]}`, 422, privateErr},
		{"private name", `{"url":"https://intranet.test/","events":["device.status"]}`, 422, privateErr},
		{"link-local", `{"url":"http://169.254.169.254/latest","events":["device.status"]}`, 422, privateErr},
		{"link-local name", `{"url":"http://metadata.test/","events":["device.status"]}`, 422, privateErr},
		{"one address private", `{"url":"http://mixed.test/","events":["device.status"]}`, 422, privateErr},
		{"unspecified", `{"url":"http://0.0.0.0/","events":["device.status"]}`, 422, privateErr},
		{"unresolved", `{"url":"http://nowhere.test/","events":["device.status"]}`, 422, `{"url":["The url field must have a host that resolves."]}`},
		{"unknown event", `{"url":"https://hooks.example.test/","events":["device.exploded"]}`, 422,
			`{"events":["The events field must each be one of: device.status, device.boot, device.updated, command.state, rollout.progress, audit.entry, device.offline."]}`},
		{"no events", `{"url":"https://hooks.example.test/","events":[]}`, 422, `{"events":["The events field must not be empty."]}`},
		{"minutes 0", `{"url":"https://hooks.example.test/","events":["device.offline"],"offline_minutes":0}`, 422,
			`{"offline_minutes":["The offline minutes field must be an integer between 1 and 1440."]}`},
		{"minutes 1441", `{"url":"https://hooks.example.test/","events":["device.offline"],"offline_minutes":1441}`, 422,
			`{"offline_minutes":["The offline minutes field must be an integer between 1 and 1440."]}`},
		{"created", `{"url":"https://hooks.example.test/in?k=1","events":["device.offline","audit.entry"],"offline_minutes":30}`, 201, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env.t = t
			w := env.request("POST", hooks, ada.token, tc.body)
			if w.Code != tc.status {
				t.Fatalf("got %d %s, want %d", w.Code, w.Body, tc.status)
			}
			m := decode(t, w)
			if tc.status == 422 {
				got, _ := json.Marshal(m["errors"])
				if !jsonEqual(t, got, []byte(tc.errors)) {
					t.Errorf("errors %s, want %s", got, tc.errors)
				}
				wantDB(t, env.st, "0", `SELECT count(*) FROM webhooks`)
				return
			}
			d := m["data"].(map[string]any)
			if d["url"] != "https://hooks.example.test/in?k=1" || fmt.Sprint(d["events"]) != "[audit.entry device.offline]" ||
				d["offline_minutes"] != 30.0 || d["enabled"] != true || d["disabled_reason"] != nil || d["last_delivery_at"] != nil {
				t.Errorf("webhook %v", d)
			}
			secret := m["secret"].(string)
			if len(secret) < 22 { // 22 alphanumerics hold 128 bits
				t.Errorf("secret %q is too short", secret)
			}
			wantDB(t, env.st, "1|https://hooks.example.test/in?k=1|"+secret+`|["audit.entry","device.offline"]|30`,
				`SELECT team_id || '|' || url || '|' || secret || '|' || events || '|' || offline_minutes FROM webhooks`)
			wantDB(t, env.st, fmt.Sprintf(`webhook.create|%d|{"events":["audit.entry","device.offline"],"host":"hooks.example.test","webhook_id":%v}`, ada.id, d["id"]),
				`SELECT action || '|' || actor_id || '|' || detail FROM audit ORDER BY id DESC LIMIT 1`)
		})
	}
	env.t = t
	id := scalar(t, env.st, `SELECT id FROM webhooks`)
	one := hooks + "/" + id

	list := decode(t, env.want(t, 200, "GET", hooks, ada.token, nil))["data"].([]any)
	if len(list) != 1 || list[0].(map[string]any)["secret"] != nil {
		t.Errorf("list %v: one webhook, and never its secret", list)
	}
	for _, who := range []testUser{env.alice, vic} { // a user, a viewer
		env.want(t, 403, "GET", hooks, who.token, nil)
		env.want(t, 403, "POST", hooks, who.token, `{"url":"https://hooks.example.test/","events":["device.status"]}`)
		env.want(t, 403, "POST", one+"/test", who.token, nil)
	}
	bea := env.addMember("Bea", model.RoleAdmin, env.bob)
	for _, m := range []string{"PATCH", "DELETE"} {
		checkAnswer(t, env.request(m, one, bea.token, `{"enabled":false}`), 404, `{"message":"Webhook not found."}`)
	}
	env.want(t, 404, "GET", one+"/deliveries", bea.token, nil)
	env.want(t, 404, "GET", hooks+"/x/deliveries", ada.token, nil)

	d := decode(t, env.want(t, 200, "PATCH", one, ada.token, `{"events":["device.status"],"enabled":false,"offline_minutes":5}`))["data"].(map[string]any)
	if fmt.Sprint(d["events"]) != "[device.status]" || d["enabled"] != false || d["offline_minutes"] != 5.0 {
		t.Errorf("patched %v", d)
	}
	wantDB(t, env.st, `["device.status"]|0|5`, `SELECT events || '|' || enabled || '|' || offline_minutes FROM webhooks`)
	checkAnswer(t, env.request("POST", one+"/test", ada.token, nil), 422, `{"message":"This webhook is disabled: enable it first."}`)
	mustExec(t, env.st, `UPDATE webhooks SET disabled_reason = 'failing'`)
	d = decode(t, env.want(t, 200, "PATCH", one, ada.token, `{"enabled":true}`))["data"].(map[string]any)
	if d["enabled"] != true || d["disabled_reason"] != nil {
		t.Errorf("enabled again: %v, want no disabled_reason", d)
	}
	env.want(t, 422, "PATCH", one, ada.token, `{"url":"http://localhost/"}`)
	wantDB(t, env.st, "https://hooks.example.test/in?k=1", `SELECT url FROM webhooks`)

	checkAnswer(t, env.request("POST", one+"/test", ada.token, nil), 202, `{"message":"Ping queued."}`)
	wantDB(t, env.st, "ping|1", `SELECT type || '|' || queued FROM webhook_queue JOIN webhooks ON webhooks.id = webhook_id`)
	checkAnswer(t, env.request("GET", one+"/deliveries", ada.token, nil), 200, `{"data":[]}`)

	checkAnswer(t, env.request("DELETE", one, ada.token, nil), 200, `{"message":"Webhook deleted."}`)
	wantDB(t, env.st, "0|0", `SELECT (SELECT count(*) FROM webhooks) || '|' || (SELECT count(*) FROM webhook_queue)`)
	env.want(t, 404, "DELETE", one, ada.token, nil)
}

// TestWebhookLimit: a team holds -max-webhooks webhooks; one more is
// refused, and nothing is made.
func TestWebhookLimit(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil, withWebhooks(webhookSettings{}), withQuotas(store.Quotas{Webhooks: 2}))
	ada, bea := env.addMember("Ada", model.RoleAdmin, env.alice), env.addMember("Bea", model.RoleAdmin, env.bob)
	body := `{"url":"https://hooks.example.test/","events":["device.status"]}`
	env.want(t, 201, "POST", "/v1/user/team/webhooks", ada.token, body)
	env.want(t, 201, "POST", "/v1/user/team/webhooks", ada.token, body)
	checkAnswer(t, env.request("POST", "/v1/user/team/webhooks", ada.token, body), 422,
		`{"message":"Your team has reached its limit of 2 webhooks."}`)
	wantDB(t, env.st, "2", `SELECT count(*) FROM webhooks`)
	env.want(t, 201, "POST", "/v1/user/team/webhooks", bea.token, body) // another team's own limit
}

// TestWebhookFlags: -webhook-queue and -webhook-allow-private, and their
// environment fallbacks, reach the webhook engine's settings.
func TestWebhookFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		env   map[string]string
		args  []string
		queue int
		allow bool
	}{
		{"defaults", nil, nil, 10000, false},
		{"environment", map[string]string{"DEVICEHUB_WEBHOOK_QUEUE": "50", "DEVICEHUB_WEBHOOK_ALLOW_PRIVATE": "true"}, nil, 50, true},
		{"flags over environment", map[string]string{"DEVICEHUB_WEBHOOK_QUEUE": "50", "DEVICEHUB_WEBHOOK_ALLOW_PRIVATE": "true"},
			[]string{"-webhook-queue", "0", "-webhook-allow-private=false"}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &cli{}
			c.fs = newFlagSet("serve", &c.cfg, func(k string) string { return tc.env[k] }, io.Discard)
			must(t, c.parse(tc.args))
			if c.cfg.webhookQueue != tc.queue || c.cfg.webhookAllowPrivate != tc.allow {
				t.Errorf("queue %d, allow private %v; want %d, %v", c.cfg.webhookQueue, c.cfg.webhookAllowPrivate, tc.queue, tc.allow)
			}
		})
	}
}
