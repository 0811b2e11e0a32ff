package main

import (
	"context"
	"devicehub/internal/model"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// BenchmarkWebhookSlowEndpoint: two services in one process, one
// without a webhook and one whose team's webhook has 10,000 events
// waiting for an endpoint that takes 1 s to answer each. Each iteration
// asks each service for a device's page (as BenchmarkAPI/device), one
// after the other, so that whatever else the machine does slows both
// alike: base-ns and loaded-ns are their mean latencies, loaded/base their
// ratio. heap-B is the heap the 10,000 events took (after a GC, from
// before they were published), queued what the queue held.
//
//	go test -run '^$' -bench WebhookSlowEndpoint -benchtime 20000x .
func BenchmarkWebhookSlowEndpoint(b *testing.B) {
	base, baseUIDs := benchUser(b)
	env, uids := benchUser(b)
	env.rebuild(withWebhooks(webhookSettings{allowPrivate: true, queueEvents: defaultWebhookQueue}))
	ada := env.addMember("Ada", model.RoleAdmin, env.alice)
	release := make(chan struct{})
	slow := newReceiver(b, func(int, http.ResponseWriter) {
		select {
		case <-time.After(time.Second):
		case <-release:
		}
	})
	defer close(release)
	m := decode(b, env.want(b, 201, "POST", "/v1/user/team/webhooks", ada.token, map[string]any{"url": slow.URL, "events": []string{"rollout.progress"}}))
	id := strconv.Itoa(int(m["data"].(map[string]any)["id"].(float64)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { env.srv.webhooks.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	team, _ := strconv.ParseInt(teamOf(b, env, ada), 10, 64)
	heapBefore := heapAlloc()
	for i := range 10000 {
		env.srv.events.publish(team, "rollout.progress", rolloutProgress{ID: int64(i), State: "running", Counts: map[model.RolloutDeviceState]int{"pending": i}})
	}
	for scalar(b, env.st, `SELECT queued + (SELECT count(*) FROM webhook_deliveries WHERE status = 200) >= 10000 FROM webhooks`) != "1" {
		time.Sleep(10 * time.Millisecond) // until every event is queued
	}
	heap := heapAlloc() - heapBefore

	ask := func(e *testEnv, uid string) time.Duration {
		start := time.Now()
		w := httptest.NewRecorder()
		e.srv.ServeHTTP(w, newRequest("GET", "/v1/user/devices/"+uid, "Bearer "+e.alice.token, "", nil))
		if w.Code != http.StatusOK {
			b.Fatalf("%d %s", w.Code, w.Body)
		}
		return time.Since(start)
	}
	var baseTime, loadedTime time.Duration
	b.ResetTimer()
	for range b.N {
		baseTime += ask(base, baseUIDs[3])
		loadedTime += ask(env, uids[3])
	}
	b.StopTimer()
	b.ReportMetric(float64(baseTime.Nanoseconds())/float64(b.N), "base-ns")
	b.ReportMetric(float64(loadedTime.Nanoseconds())/float64(b.N), "loaded-ns")
	b.ReportMetric(float64(loadedTime)/float64(baseTime), "loaded/base")
	b.ReportMetric(float64(heap), "heap-B")
	queued, _ := strconv.Atoi(scalar(b, env.st, `SELECT queued FROM webhooks WHERE id = ?`, id))
	b.ReportMetric(float64(queued), "queued")
}

// heapAlloc is the heap in use after a GC.
func heapAlloc() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
