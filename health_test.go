package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
	"devicehub/internal/wire"
)

// tell hands a device message to the offline link at the clock's time
// and writes it, as one flush.
func tell(env *testEnv, l *mqttlink.Offline, uid, kind, payload string) {
	l.Handle("devices/"+uid+"/"+kind, []byte(payload), false)
	l.Flush()
}

// TestTelemetryFieldByField: a bad field or metric (a string, NaN as
// text, a nested object, a 17th metric, a bad key, a number past
// ±wire.MaxReading) is left out and
// counted on its own; the message's good fields still apply. A message
// with nothing good applies nothing.
func TestTelemetryFieldByField(t *testing.T) {
	t.Parallel()
	metrics17 := make([]string, 17)
	for i := range metrics17 {
		metrics17[i] = fmt.Sprintf(`"m%02d":%d`, i, i)
	}
	tests := []struct {
		name, payload string
		wantBad       int
		wantOK        bool
		want          string // what was kept, as keptOf renders it
	}{
		{"all good", `{"rssi":-60,"heap_free":120000,"uptime_s":12.5,"reset_reason":"panic","metrics":{"temp_c":21.5}}`,
			0, true, "rssi=-60 heap=120000 up=12.5 reason=panic metrics=[temp_c=21.5]"},
		{"string rssi, good heap", `{"rssi":"strong","heap_free":1000}`, 1, true, "heap=1000"},
		{"NaN as text and a nested object", `{"heap_free":"NaN","uptime_s":{"s":1},"rssi":-70}`, 2, true, "rssi=-70"},
		{"negative heap", `{"heap_free":-1,"rssi":-70}`, 1, true, "rssi=-70"},
		{"bad metrics one by one", `{"metrics":{"ok":1,"s":"x","n":{"a":1},"Bad":2,"nan":"NaN","big":1e999,"ok2":2}}`,
			5, true, "metrics=[ok=1 ok2=2]"},
		{"17 metrics: 16 kept", `{"metrics":{` + strings.Join(metrics17, ",") + `}}`, 1, true,
			"metrics=[m00=0 m01=1 m02=2 m03=3 m04=4 m05=5 m06=6 m07=7 m08=8 m09=9 m10=10 m11=11 m12=12 m13=13 m14=14 m15=15]"},
		{"metrics not an object", `{"metrics":[1,2],"rssi":-1}`, 1, true, "rssi=-1"},
		{"bad reason", `{"reset_reason":"PANIC!","rssi":-1}`, 1, true, "rssi=-1"},
		{"only bad fields", `{"rssi":"strong","fw_md5":"xyz"}`, 2, false, ""},
		{"nothing known", `{"extra":1}`, 0, true, ""},
		{"not an object", `[1]`, 1, false, ""},
		{"NaN literal is not JSON", `{"rssi":NaN}`, 1, false, ""},
		{"readings past ±1e12", `{"rssi":-1e13,"heap_free":1e308,"uptime_s":1e12,"metrics":{"a":1e12,"b":-1e12,"c":1.000001e12,"d":-1e308}}`,
			4, true, "up=1e+12 metrics=[a=1e+12 b=-1e+12]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tel, bad, ok := wire.ParseTelemetry([]byte(tt.payload))
			if bad != tt.wantBad || ok != tt.wantOK {
				t.Errorf("bad, ok: got %d, %v, want %d, %v", bad, ok, tt.wantBad, tt.wantOK)
			}
			if got := keptOf(tel); ok && got != tt.want {
				t.Errorf("kept: got %q, want %q", got, tt.want)
			}
		})
	}
}

// keptOf renders the health fields a telemetry kept.
func keptOf(t wire.Telemetry) string {
	var parts []string
	if t.RSSI != nil {
		parts = append(parts, fmt.Sprintf("rssi=%g", *t.RSSI))
	}
	if t.HeapFree != nil {
		parts = append(parts, fmt.Sprintf("heap=%g", *t.HeapFree))
	}
	if t.UptimeS != nil {
		parts = append(parts, fmt.Sprintf("up=%g", *t.UptimeS))
	}
	if t.ResetReason != nil {
		parts = append(parts, "reason="+*t.ResetReason)
	}
	if len(t.Metrics) > 0 {
		var ms []string
		for _, m := range t.Metrics {
			ms = append(ms, fmt.Sprintf("%s=%g", m.Key, m.Value))
		}
		parts = append(parts, "metrics=["+strings.Join(ms, " ")+"]")
	}
	return strings.Join(parts, " ")
}

// TestBadTelemetryCounted: through the link, bad fields are counted as
// dropped and the good ones reach the device and its history.
func TestBadTelemetryCounted(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	tell(env, l, env.alice.device, "telemetry", `{"rssi":-55,"local_ip":"10.0.0.9","heap_free":"lots","metrics":{"temp_c":20,"x":"y"}}`)
	if got := dropTotal(l); got != 2 {
		t.Errorf("dropped: got %d, want 2", got)
	}
	d := env.device(env.alice)
	if d.LocalIP == nil || *d.LocalIP != "10.0.0.9" || d.LastRSSI == nil || *d.LastRSSI != -55 {
		t.Errorf("device after telemetry: %s", apiJSON(d))
	}
	w := env.request("GET", "/v1/user/devices/"+env.alice.device+"/series", env.alice.token, nil)
	checkAnswer(t, w, 200, `{"data":[
		{"series":"metrics.temp_c","first_at":"2026-11-21T12:00:00.000000Z","last_at":"2026-11-21T12:00:00.000000Z"},
		{"series":"rssi","first_at":"2026-11-21T12:00:00.000000Z","last_at":"2026-11-21T12:00:00.000000Z"}]}`)
}

// TestHistoryBuckets: samples fold into 5-minute buckets (min, max,
// mean, last, count) written once per flush; history merges them into at
// most points, as JSON and CSV; a device past history.MaxSeries series keeps
// its first ones, and the rest is counted.
func TestHistoryBuckets(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	// 12:00 bucket: -60, -70 in one flush, -50 in the next; 12:05: -40;
	// 12:20: -80.
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"rssi":-60}`), false)
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"rssi":-70}`), false)
	l.Flush()
	env.clock.advance(time.Minute)
	tell(env, l, uid, "telemetry", `{"rssi":-50}`)
	env.clock.advance(5 * time.Minute)
	tell(env, l, uid, "telemetry", `{"rssi":-40}`)
	env.clock.advance(15 * time.Minute)
	tell(env, l, uid, "telemetry", `{"rssi":-80}`)
	// The buckets of 12:00 and 12:05 closed, written in the row of their
	// hour; 12:20's is open, in memory (and shown all the same).
	wantDB(t, env.st, "1", `SELECT count(*) FROM history_rows`)

	series := "/v1/user/devices/" + uid + "/history?series=rssi&to=2026-11-21T12:30:00Z"
	base := series + "&from=2026-11-21T12:00:00Z"
	tests := []struct {
		name, query string
		wantStatus  int
		wantBody    string
	}{
		{"every bucket", "", 200, `{"data":{"series":"rssi","step_s":300,"points":[
			{"t":"2026-11-21T12:00:00.000000Z","min":-70,"max":-50,"mean":-60,"last":-50,"count":3},
			{"t":"2026-11-21T12:05:00.000000Z","min":-40,"max":-40,"mean":-40,"last":-40,"count":1},
			{"t":"2026-11-21T12:20:00.000000Z","min":-80,"max":-80,"mean":-80,"last":-80,"count":1}]}}`},
		{"merged to 2 points", "&points=2", 200, `{"data":{"series":"rssi","step_s":900,"points":[
			{"t":"2026-11-21T12:00:00.000000Z","min":-70,"max":-40,"mean":-55,"last":-40,"count":4},
			{"t":"2026-11-21T12:15:00.000000Z","min":-80,"max":-80,"mean":-80,"last":-80,"count":1}]}}`},
		{"one point", "&points=1", 200, `{"data":{"series":"rssi","step_s":1800,"points":[
			{"t":"2026-11-21T12:00:00.000000Z","min":-80,"max":-40,"mean":-60,"last":-80,"count":5}]}}`},
		{"points 0", "&points=0", 422, ""},
		{"points 1001", "&points=1001", 422, ""},
		{"points empty", "&points=", 422, ""},
		{"bad from", "&from=yesterday", 422, ""},
		{"from after to", "&from=2026-11-21T13:00:00Z", 422, ""},
		{"from at to", "&from=2026-11-21T12:30:00Z", 422, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.query == "" || strings.Contains(tt.query, "points") {
				tt.query = "&from=2026-11-21T12:00:00Z" + tt.query
			}
			checkAnswer(t, env.request("GET", series+tt.query, env.alice.token, nil), tt.wantStatus, tt.wantBody)
		})
	}
	checkAnswer(t, env.request("GET", base+"&format=xml", env.alice.token, nil), 422, "")
	for _, q := range []string{"series=temp", "series=metrics.nope", "series=metrics.Bad"} {
		w := env.request("GET", "/v1/user/devices/"+uid+"/history?"+q, env.alice.token, nil)
		if w.Code != 422 || !strings.Contains(w.Body.String(), `"series"`) {
			t.Errorf("%s: got %d %s, want a 422 field error on series", q, w.Code, w.Body)
		}
	}
	// The default range is the last 24 h up to now (12:21).
	w := env.request("GET", "/v1/user/devices/"+uid+"/history?series=rssi", env.alice.token, nil)
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"count":3`) {
		t.Errorf("default range: got %d %s", w.Code, w.Body)
	}
	// CSV: the same points.
	w = env.request("GET", base+"&points=2&format=csv", env.alice.token, nil)
	wantCSV := "t,min,max,mean,last,count\n2026-11-21T12:00:00.000000Z,-70,-40,-55,-40,4\n2026-11-21T12:15:00.000000Z,-80,-80,-80,-80,1\n"
	if w.Code != 200 || w.Body.String() != wantCSV || !strings.HasPrefix(w.Header().Get("Content-Type"), "text/csv") {
		t.Errorf("csv: got %d %q (%s), want %q", w.Code, w.Body, w.Header().Get("Content-Type"), wantCSV)
	}
	// Bob cannot read Alice's device.
	checkAnswer(t, env.request("GET", base, env.bob.token, nil), 404, `{"message":"Device not found."}`)

	// history.MaxSeries: rssi, then 17 more metrics over two messages: 17 series
	// more fit, the last metric's sample is counted.
	var ms []string
	for i := range wire.MaxMetrics {
		ms = append(ms, fmt.Sprintf(`"m%02d":1`, i))
	}
	tell(env, l, uid, "telemetry", `{"metrics":{`+strings.Join(ms, ",")+`}}`)
	dropped := dropTotal(l)
	tell(env, l, uid, "telemetry", `{"heap_free":5,"metrics":{"m99":1}}`)
	if list, err := env.st.SeriesOf(context.Background(), env.deviceRef(env.alice)); err != nil || len(list) != history.MaxSeries {
		t.Errorf("series: got %d (%v), want %d", len(list), err, history.MaxSeries)
	}
	if got := dropTotal(l) - dropped; got != 1 {
		t.Errorf("samples past history.MaxSeries counted: got %d, want 1", got)
	}
}

// TestHistoryRetention: the pruner deletes buckets, presence and boots
// older than -history-days, and series left empty; newer ones stay.
// With -history-days 0 nothing is written.
func TestHistoryRetention(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	tell(env, l, uid, "status", "online")
	tell(env, l, uid, "telemetry", `{"rssi":-60,"heap_free":1000,"reset_reason":"poweron"}`)
	env.clock.advance(time.Minute) // a change sooner would change the interval (TestPresenceFlapping)
	tell(env, l, uid, "status", "offline")
	env.clock.advance(20 * 24 * time.Hour)
	tell(env, l, uid, "status", "online")
	tell(env, l, uid, "telemetry", `{"rssi":-61}`)
	// Rows of history (5-minute slots, hourly ones), series, presence,
	// boots.
	count := func() string {
		series, err := env.st.SeriesOf(context.Background(), env.deviceRef(env.alice))
		must(t, err)
		return fmt.Sprint(scalar(t, env.st, `SELECT (SELECT count(*) FILTER (WHERE step = 300) || ' ' || count(*) FILTER (WHERE step = 3600)
			FROM history_rows) || ' ' || (SELECT count(*) FROM presence) || ' ' || (SELECT count(*) FROM boots)`), " series ", len(series))
	}
	// The first bucket closed when the second came: written, in an hour's
	// row; the second is in memory.
	if got := count(); got != "1 0 3 1 series 2" {
		t.Fatalf("before: got %s, want 1 0 3 1 series 2", got)
	}
	p := &historyPruner{store: env.st, log: env.log}
	pass := func() { // a whole pass, however many runs it takes
		for p.run(context.Background()); p.pass != nil; p.run(context.Background()) {
		}
	}
	pass()
	// At 20 days all is kept, the first hour rolled up into its day.
	if got := count(); got != "0 1 3 1 series 2" {
		t.Errorf("at 20 days: got %s, want 0 1 3 1 series 2", got)
	}
	env.clock.advance(11 * 24 * time.Hour) // the first ones are 31 days old
	pass()
	// heap_free's only bucket goes, and with it its series, and the boot;
	// of the presence, the first online interval (it ended 31 days ago),
	// not the offline one that ended 11 days ago, nor the open one.
	if got := count(); got != "0 0 2 0 series 1" {
		t.Errorf("at 31 days: got %s, want 0 0 2 0 series 1", got)
	}

	// A restart with -history-days 0: the store writes the open bucket as
	// it closes (TestHistoryWrittenAtClose), and nothing after.
	env.rebuild(withQuotas(store.Quotas{HistoryDays: 0}))
	l = newOfflineLink(env.st, env.log) // on the store restarted
	tell(env, l, uid, "telemetry", `{"rssi":-62,"heap_free":1}`)
	tell(env, l, uid, "status", "offline")
	if got := count(); got != "1 0 2 0 series 1" {
		t.Errorf("with -history-days 0: got %s, want nothing written but the open bucket", got)
	}
}

// TestPresence: intervals of online and offline, reconnecting counted as
// offline, the current one open; the silent-device sweep closes one.
func TestPresence(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	tell(env, l, uid, "status", "online")
	env.clock.advance(10 * time.Minute)
	tell(env, l, uid, "status", "reconnecting")
	env.clock.advance(time.Minute)
	tell(env, l, uid, "status", "offline") // still offline: no new interval
	env.clock.advance(time.Minute)
	tell(env, l, uid, "status", "online")
	env.clock.advance(time.Hour)
	if _, err := env.st.MarkSilentOffline(context.Background(), env.clock.now()); err != nil {
		t.Fatal(err)
	}
	path := "/v1/user/devices/" + uid + "/presence"
	checkAnswer(t, env.request("GET", path, env.alice.token, nil), 200, `{"data":[
		{"status":"online","from":"2026-11-21T12:00:00.000000Z","to":"2026-11-21T12:10:00.000000Z"},
		{"status":"offline","from":"2026-11-21T12:10:00.000000Z","to":"2026-11-21T12:12:00.000000Z"},
		{"status":"online","from":"2026-11-21T12:12:00.000000Z","to":"2026-11-21T13:12:00.000000Z"},
		{"status":"offline","from":"2026-11-21T13:12:00.000000Z","to":null}]}`)
	checkAnswer(t, env.request("GET", path+"?from=2026-11-21T12:11:00Z&to=2026-11-21T12:13:00Z", env.alice.token, nil), 200, `{"data":[
		{"status":"offline","from":"2026-11-21T12:10:00.000000Z","to":"2026-11-21T12:12:00.000000Z"},
		{"status":"online","from":"2026-11-21T12:12:00.000000Z","to":"2026-11-21T13:12:00.000000Z"}]}`)
	checkAnswer(t, env.request("GET", path+"?to=now", env.alice.token, nil), 422, "")
}

// TestPresenceFlapping: a change less than a minute after the current
// interval began changes its status instead of opening another, so a
// device flapping every 5 s for an hour costs a row a minute at most; the presence route pages, the next page
// from the last interval's end.
func TestPresenceFlapping(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	tell(env, l, uid, "status", "online")
	env.clock.advance(10 * time.Minute)
	tell(env, l, uid, "status", "offline")
	env.clock.advance(5 * time.Second)
	tell(env, l, uid, "status", "online") // a 5 s blip: the offline interval turns online
	wantDB(t, env.st, "2 1", `SELECT count(*) || ' ' || count(*) FILTER (WHERE to_at IS NULL AND online) FROM presence`)
	env.clock.advance(10 * time.Minute)
	for i := range 720 { // an hour of a change every 5 s
		tell(env, l, uid, "status", map[bool]string{true: "offline", false: "online"}[i%2 == 0])
		env.clock.advance(5 * time.Second)
	}
	wantDB(t, env.st, "1", `SELECT count(*) <= 62 FROM presence`)
	path := "/v1/user/devices/" + uid + "/presence?from=2026-11-21T11:00:00Z&limit=2"
	var page, next struct{ Data []model.PresenceInterval }
	must(t, json.Unmarshal(env.request("GET", path, env.alice.token, nil).Body.Bytes(), &page))
	if len(page.Data) != 2 || page.Data[0].From != "2026-11-21T12:00:00.000000Z" || page.Data[1].To == nil {
		t.Fatalf("first page: %+v", page.Data)
	}
	must(t, json.Unmarshal(env.request("GET", "/v1/user/devices/"+uid+"/presence?limit=2&from="+*page.Data[1].To, env.alice.token, nil).Body.Bytes(), &next))
	if len(next.Data) != 2 || next.Data[0].From != *page.Data[1].To {
		t.Errorf("next page: %+v, want it to begin at %s", next.Data, *page.Data[1].To)
	}
	for _, q := range []string{"limit=0", "limit=1001", "limit=x", "limit="} {
		checkAnswer(t, env.request("GET", "/v1/user/devices/"+uid+"/presence?"+q, env.alice.token, nil), 422, "")
	}
}

// TestBootsDeduplicated: a boot per telemetry with reset_reason, but a
// message sent again (the same reason, uptime_s and boot_count within
// 60 s: a QoS 1 resend), in one flush or the next; boot_count tells two
// boots apart even at the same boot time; each boot is charged to the
// firmware the device reported, is a crash by its reason, and is told as
// a device.boot event and in the metric.
func TestBootsDeduplicated(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	const fw1, fw2 = "11111111111111111111111111111111", "22222222222222222222222222222222"
	tell(env, l, uid, "telemetry", `{"fw_md5":"`+fw1+`","fw_version":"1.0","reset_reason":"poweron","uptime_s":3}`)
	// The same message again, 10 s later (a resend): the same boot.
	env.clock.advance(10 * time.Second)
	tell(env, l, uid, "telemetry", `{"fw_md5":"`+fw1+`","fw_version":"1.0","reset_reason":"poweron","uptime_s":3}`)
	// In one flush: a message, its resend, and another boot that only
	// boot_count tells apart.
	env.clock.advance(time.Hour)
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"reset_reason":"panic","uptime_s":1,"boot_count":7}`), false)
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"reset_reason":"panic","uptime_s":1,"boot_count":7}`), false)
	l.Handle("devices/"+uid+"/telemetry", []byte(`{"reset_reason":"panic","uptime_s":1,"boot_count":8}`), false)
	l.Flush()
	// Another panic 2 minutes later is another boot, on the new firmware.
	env.clock.advance(2 * time.Minute)
	tell(env, l, uid, "telemetry", `{"fw_md5":"`+fw2+`","reset_reason":"panic"}`)
	// A different reason at the same time is another boot.
	tell(env, l, uid, "telemetry", `{"reset_reason":"sw"}`)

	w := env.request("GET", "/v1/user/devices/"+uid+"/boots", env.alice.token, nil)
	checkAnswer(t, w, 200, `{"data":[
		{"id":5,"at":"2026-11-21T13:02:10.000000Z","reason":"sw","crash":false,"firmware":{"md5":"`+fw2+`","version":null}},
		{"id":4,"at":"2026-11-21T13:02:10.000000Z","reason":"panic","crash":true,"firmware":{"md5":"`+fw2+`","version":null}},
		{"id":3,"at":"2026-11-21T13:00:09.000000Z","reason":"panic","crash":true,"firmware":{"md5":"`+fw1+`","version":"1.0"}},
		{"id":2,"at":"2026-11-21T13:00:09.000000Z","reason":"panic","crash":true,"firmware":{"md5":"`+fw1+`","version":"1.0"}},
		{"id":1,"at":"2026-11-21T11:59:57.000000Z","reason":"poweron","crash":false,"firmware":{"md5":"`+fw1+`","version":"1.0"}}]}`)
	checkAnswer(t, env.request("GET", "/v1/user/devices/"+uid+"/boots?limit=1&before=3", env.alice.token, nil), 200, `{"data":[
		{"id":2,"at":"2026-11-21T13:00:09.000000Z","reason":"panic","crash":true,"firmware":{"md5":"`+fw1+`","version":"1.0"}}]}`)
	for _, q := range []string{"limit=0", "limit=101", "before=0", "before=x", "limit=", "before="} {
		checkAnswer(t, env.request("GET", "/v1/user/devices/"+uid+"/boots?"+q, env.alice.token, nil), 422, "")
	}
	s := l.Stats()
	boots, crashes := s.Boots-s.Crashes, s.Crashes
	if boots != 2 || crashes != 3 {
		t.Errorf("boots counted: got %d and %d crashes, want 2 and 3", boots, crashes)
	}
}

// TestCrashLoopCounted: a device that panics every 10 s for 10 minutes,
// each boot's message sent twice (QoS 1) within a second, has 60 crashes
// counted, with boot_count, with only an uptime_s with a fraction, and
// with neither but the arrival (the resends still one).
func TestCrashLoopCounted(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name    string
		message func(i int) string
	}{
		{"boot_count", func(i int) string { return fmt.Sprintf(`{"reset_reason":"panic","uptime_s":1,"boot_count":%d}`, i) }},
		{"uptime_s with a fraction", func(i int) string {
			return fmt.Sprintf(`{"reset_reason":"panic","uptime_s":%.3f}`, 1+float64(i%7)/1000)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil)
			l := newOfflineLink(env.st, env.log)
			uid := env.alice.device
			for i := range 60 {
				tell(env, l, uid, "telemetry", tt.message(i))
				env.clock.advance(time.Second)
				tell(env, l, uid, "telemetry", tt.message(i)) // the QoS 1 resend
				env.clock.advance(9 * time.Second)
			}
			wantDB(t, env.st, "60 60", `SELECT count(*) || ' ' || sum(crash) FROM boots`)
			if got := l.Stats().Crashes; got != 60 {
				t.Errorf("crashes counted: got %d, want 60", got)
			}
		})
	}
}

// TestStoreMigrateHealth: version 9 on a database of the release before
// gives each device that reports an md5 a firmware run since it was
// first seen, and rollouts no health gate and no halt reason.
func TestStoreMigrateHealth(t *testing.T) {
	// Not parallel: it swaps the package's migrations (oldReleaseDB).
	ctx := context.Background()
	_, v5 := oldReleaseDB(t, 5)
	dir := t.TempDir()
	must(t, v5.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))
	old := storeAtVersion(t, dir, 8) // the release before fleet health
	mustExec(t, old, `UPDATE devices SET current_md5 = 'md5a', current_version = '1.0', first_seen_at = '2026-02-01T00:00:00.000000Z' WHERE id = 1`)
	mustExec(t, old, `UPDATE devices SET current_md5 = 'md5b' WHERE id = 3`)
	dir = t.TempDir()
	must(t, old.VacuumInto(ctx, filepath.Join(dir, "devicehub.db")))
	st := storeAt(t, dir)
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	wantDB(t, st, "1 md5a 1.0 2026-02-01T00:00:00.000000Z,3 md5b  2026-01-01T00:00:00.000000Z",
		`SELECT group_concat(device_id || ' ' || md5 || ' ' || coalesce(version, '') || ' ' ||
			strftime('%Y-%m-%dT%H:%M:%S.000000Z', from_at, 'unixepoch') || coalesce(to_at, ''))
		FROM (SELECT * FROM firmware_runs ORDER BY device_id)`) // Unix seconds since version 16
	wantDB(t, st, "1", `SELECT count(*) FROM rollouts WHERE health IS NULL AND halt_reason IS NULL`)
}

// TestFirmwareHealth: each firmware the team ran in the window, with its
// device-days, boots and crashes charged to it, offline transitions per
// device-day and the medians of its devices' mean rssi and heap_free;
// the worst first; another team's devices are not in it.
func TestFirmwareHealth(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	const fw1, fw2 = "11111111111111111111111111111111", "22222222222222222222222222222222"
	a, a2 := env.alice.device, addDevice(t, env, env.alice, "esp32").device
	tell(env, l, a, "telemetry", `{"fw_md5":"`+fw1+`","fw_version":"1.0","rssi":-60,"heap_free":1000,"reset_reason":"poweron"}`)
	tell(env, l, a2, "status", "online")
	tell(env, l, a2, "telemetry", `{"fw_md5":"`+fw2+`","fw_version":"2.0","rssi":-70,"heap_free":500,"reset_reason":"panic"}`)
	tell(env, l, env.bob.device, "telemetry", `{"fw_md5":"`+fw2+`","reset_reason":"panic"}`)
	env.clock.advance(12 * time.Hour)
	tell(env, l, a2, "status", "offline")
	env.clock.advance(time.Minute)
	tell(env, l, a2, "status", "online")
	tell(env, l, a2, "telemetry", `{"reset_reason":"task_wdt","uptime_s":1,"rssi":-80}`)
	env.clock.advance(12*time.Hour - time.Minute)

	checkAnswer(t, env.request("GET", "/v1/user/firmware-health", env.alice.token, nil), 200, `{"data":[
		{"md5":"`+fw2+`","version":"2.0","name":null,"devices":1,"device_days":1,"boots":2,"crashes":2,
		 "crashes_per_device_day":2,"offline_per_device_day":1,"rssi_median":-75,"heap_free_median":500},
		{"md5":"`+fw1+`","version":"1.0","name":null,"devices":1,"device_days":1,"boots":1,"crashes":0,
		 "crashes_per_device_day":0,"offline_per_device_day":0,"rssi_median":-60,"heap_free_median":1000}]}`)
	// The last 6 hours: a quarter of the time, none of the boots.
	w := env.request("GET", "/v1/user/firmware-health?hours=6", env.alice.token, nil)
	if !strings.Contains(w.Body.String(), `"device_days":0.25,"boots":0`) {
		t.Errorf("6 hours: %s", w.Body)
	}
	for _, q := range []string{"hours=0", "hours=721", "hours=x"} {
		checkAnswer(t, env.request("GET", "/v1/user/firmware-health?"+q, env.alice.token, nil), 422, "")
	}
}

// TestHealthBounds: a device keeps at most history.MaxBoots boots and history.MaxRuns
// firmware runs (the newest, trimmed as a new one comes), and the
// pruner trims its presence to the newest history.MaxPresence intervals.
func TestHealthBounds(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	l := newOfflineLink(env.st, env.log)
	uid := env.alice.device
	id := env.device(env.alice).ID
	mustExec(t, env.st, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
		INSERT INTO boots (device_id, number, at, reason, crash) SELECT ?, i, unixepoch('2026-11-21T00:00:00Z'), 'r' || i, 0 FROM n`, history.MaxBoots, id)
	mustExec(t, env.st, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
		INSERT INTO firmware_runs (device_id, md5, from_at, to_at) SELECT ?, 'old', unixepoch('2026-11-21T00:00:00Z'), unixepoch('2026-11-21T00:00:00Z') FROM n`, history.MaxRuns, id)
	mustExec(t, env.st, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
		INSERT INTO presence (device_id, online, from_at, to_at) SELECT ?, i % 2, unixepoch('2026-11-21T00:00:00Z'), unixepoch('2026-11-21T00:00:00Z') FROM n`, history.MaxPresence+5, id)
	tell(env, l, uid, "telemetry", `{"fw_md5":"11111111111111111111111111111111","reset_reason":"panic"}`)
	(&historyPruner{store: env.st, log: env.log}).run(context.Background())
	want := fmt.Sprintf("%d %d %d", history.MaxBoots, history.MaxRuns, history.MaxPresence)
	if got := scalar(t, env.st, `SELECT (SELECT count(*) FROM boots) || ' ' || (SELECT count(*) FROM firmware_runs) || ' ' ||
		(SELECT count(*) FROM presence)`); got != want {
		t.Errorf("boots, runs, presence: got %s, want %s", got, want)
	}
	wantDB(t, env.st, "panic 11111111111111111111111111111111", `SELECT (SELECT reason FROM boots ORDER BY id DESC LIMIT 1) || ' ' ||
		(SELECT md5 FROM firmware_runs ORDER BY id DESC LIMIT 1)`)
}

// TestHistoryStepsAfterStart: the history steps of the pruner's first
// pass wait historyStepsAfter after the service starts, so that a
// restart's replay of retained statuses has the writer to itself.
func TestHistoryStepsAfterStart(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	p := newHistoryPruner(env.st, env.log)
	p.run(context.Background())
	if p.pass == nil {
		t.Fatal("the first pass's history steps ran at the start")
	}
	env.clock.advance(historyStepsAfter)
	p.run(context.Background())
	if p.pass != nil {
		t.Errorf("the first pass's history steps had not run %v after the start", historyStepsAfter)
	}
}
