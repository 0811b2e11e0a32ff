package main

import (
	"cmp"
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// addFleet gives the team n more devices in one SQL statement. Device i
// (from 1, in id order) is named "fleet <i>", with uid
// <platform>_fleet<team>x<i>; its status is pending, online, offline or
// reconnecting as i%4 is 0, 1, 2 or 3; odd ones are esp32 (board wroom
// when i%3 is 0, else devkitc), even ones esp8266 (board d1); every tenth
// reports the md5 0…0<i%7>, of no uploaded firmware.
func addFleet(tb testing.TB, st *store.Store, teamID int64, n int) {
	tb.Helper()
	for table, keys := range map[string][]string{"platforms": {"esp32", "esp8266"}, "boards": {"devkitc", "wroom", "d1"}} {
		for _, key := range keys {
			mustExec(tb, st, `INSERT INTO `+table+` (team_id, number, key, name)
				VALUES (?1, (SELECT coalesce(max(number), 0) + 1 FROM `+table+` WHERE team_id = ?1), ?2, ?2) ON CONFLICT DO NOTHING`, teamID, key)
		}
	}
	mustExec(tb, st, `WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < ?2)
		INSERT INTO devices (uid, team_id, name, status, platform_id, board_id, current_md5, created_at)
		SELECT iif(i % 2, 'esp32', 'esp8266') || printf('_fleet%dx%d', ?1, i), ?1, 'fleet ' || i,
			CASE i % 4 WHEN 0 THEN 'pending' WHEN 1 THEN 'online' WHEN 2 THEN 'offline' ELSE 'reconnecting' END,
			(SELECT id FROM platforms WHERE team_id = ?1 AND key = iif(i % 2, 'esp32', 'esp8266')),
			(SELECT id FROM boards WHERE team_id = ?1 AND key = CASE WHEN i % 2 = 0 THEN 'd1' WHEN i % 3 = 0 THEN 'wroom' ELSE 'devkitc' END),
			iif(i % 10 = 0, printf('%032d', i % 7), NULL), '2026-01-01T00:00:00.000000Z'
		FROM seq`, teamID, n)
}

// listPage is a page of the device list as a client reads it.
type listPage struct {
	Data []json.RawMessage
	Meta struct {
		Total int
		Next  *string
	}
}

// uids are the uids of the page's devices.
func (p listPage) uids(tb testing.TB) []string {
	var uids []string
	for _, item := range p.Data {
		var d struct{ UID string }
		must(tb, json.Unmarshal(item, &d))
		uids = append(uids, d.UID)
	}
	return uids
}

func getPage(tb testing.TB, env *testEnv, token, query string) listPage {
	tb.Helper()
	var p listPage
	must(tb, json.Unmarshal(env.want(tb, http.StatusOK, "GET", "/v1/user/devices?"+query, token, nil).Body.Bytes(), &p))
	return p
}

// TestDeviceListPages: the list's parameters select the team's devices
// that match, a page at a time, with the total that match; never another
// team's. A bad value is a 422 field error.
func TestDeviceListPages(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	alice, bob := env.teamOf(env.alice), env.teamOf(env.bob)
	addFleet(t, env.st, alice, 12)
	addFleet(t, env.st, bob, 12) // the same devices, never in alice's answers
	// fleet names a team's devices by number; 0 is the one it started with.
	fleet := func(team int64, is ...int) []string {
		var uids []string
		for _, i := range is {
			switch {
			case i == 0 && team == alice:
				uids = append(uids, env.alice.device)
			case i%2 == 1:
				uids = append(uids, fmt.Sprintf("esp32_fleet%dx%d", team, i))
			default:
				uids = append(uids, fmt.Sprintf("esp8266_fleet%dx%d", team, i))
			}
		}
		return uids
	}
	bad := func(field, msg string) string { return apiFieldError(field, "The "+field+" field "+msg) }
	tests := []struct {
		name, query string
		token       string // alice's when empty
		want        []string
		total       int
		next        bool
		wantError   string // the 422's body
	}{
		{name: "limit", query: "limit=5", want: fleet(alice, 0, 1, 2, 3, 4), total: 13, next: true},
		{name: "limit takes all", query: "limit=13", want: fleet(alice, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), total: 13},
		{name: "status", query: "status=online", want: fleet(alice, 1, 5, 9), total: 3},
		{name: "statuses", query: "status=online,offline", want: fleet(alice, 1, 2, 5, 6, 9, 10), total: 6},
		{name: "status with a limit", query: "status=pending&limit=2", want: fleet(alice, 0, 4), total: 4, next: true},
		{name: "platform", query: "platform=esp8266", want: fleet(alice, 2, 4, 6, 8, 10, 12), total: 6},
		{name: "board", query: "board=wroom", want: fleet(alice, 3, 9), total: 2},
		{name: "platform and board", query: "platform=esp32&board=devkit", want: fleet(alice, 0), total: 1},
		{name: "board and status", query: "board=devkitc&status=online", want: fleet(alice, 1, 5), total: 2},
		{name: "q in names, any case", query: "q=FLEET%201", want: fleet(alice, 1, 10, 11, 12), total: 4},
		{name: "q in uids", query: "q=8266_fleet1x1", want: fleet(alice, 10, 12), total: 2},
		{name: "q is not a pattern", query: "q=%25", total: 0},
		{name: "an unknown platform", query: "platform=avr", total: 0},
		{name: "bob's", query: "status=online", token: env.bob.token, want: fleet(bob, 1, 5, 9), total: 3},
		{name: "limit 0", query: "limit=0", wantError: bad("limit", "must be an integer between 1 and 1000.")},
		{name: "limit 1001", query: "limit=1001", wantError: bad("limit", "must be an integer between 1 and 1000.")},
		{name: "limit x", query: "limit=x", wantError: bad("limit", "must be an integer between 1 and 1000.")},
		{name: "limit empty", query: "limit=", wantError: bad("limit", "must not be empty.")},
		{name: "limit twice", query: "limit=1&limit=2", wantError: bad("limit", "must be given only once.")},
		{name: "after not a cursor", query: "after=abc", wantError: bad("after", "must be the meta.next of a previous page.")},
		{name: "after of id 0", query: "after=AAAAAAAAAAA", wantError: bad("after", "must be the meta.next of a previous page.")},
		{name: "unknown status", query: "status=online,asleep", wantError: bad("status", "must be a comma-separated list of pending, online, offline, reconnecting.")},
		{name: "trailing comma", query: "status=online,", wantError: bad("status", "must be a comma-separated list of pending, online, offline, reconnecting.")},
		{name: "platform not a key", query: "platform=esp%2F32", wantError: bad("platform", "must be a key: letters, digits, dots, underscores and dashes.")},
		{name: "board not a key", query: "board=..", wantError: bad("board", "must be a key: letters, digits, dots, underscores and dashes.")},
		{name: "q empty", query: "q=", wantError: bad("q", "must not be empty.")},
		{name: "q too long", query: "q=" + strings.Repeat("x", 256), wantError: bad("q", "must not be greater than 255 characters.")},
		{name: "q not UTF-8", query: "q=%ff", wantError: bad("q", "must be valid UTF-8.")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			token := cmp.Or(tt.token, env.alice.token)
			before := dbState(t, env.st)
			if tt.wantError != "" {
				checkAnswer(t, env.request("GET", "/v1/user/devices?"+tt.query, token, nil), http.StatusUnprocessableEntity, tt.wantError)
				sameState(t, "a refused page", before, dbState(t, env.st))
				return
			}
			p := getPage(t, env, token, tt.query)
			if got := p.uids(t); !slices.Equal(got, tt.want) || p.Meta.Total != tt.total || (p.Meta.Next != nil) != tt.next {
				t.Errorf("got %v, total %d, next %v; want %v, total %d, next %v", got, p.Meta.Total, p.Meta.Next, tt.want, tt.total, tt.next)
			}
			sameState(t, "a page", before, dbState(t, env.st))
		})
	}
}

// teamOf returns the id of u's team.
func (e *testEnv) teamOf(u testUser) int64 {
	e.t.Helper()
	got, err := e.st.UserByEmail(context.Background(), u.email)
	must(e.t, err)
	return got.TeamID
}

// TestDeviceListPageWalk: following meta.next from the first page gives
// the full list's devices, each as the full list shows it, also when the
// device a cursor names is deleted in between.
func TestDeviceListPageWalk(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	addFleet(t, env.st, env.teamOf(env.alice), 10)
	var full listPage
	must(t, json.Unmarshal(env.want(t, http.StatusOK, "GET", "/v1/user/devices", env.alice.token, nil).Body.Bytes(), &full))
	var walked []json.RawMessage
	query, gone := "limit=4", 0
	for pages := 0; ; pages++ {
		p := getPage(t, env, env.alice.token, query)
		if p.Meta.Total != len(full.Data)-gone || pages > 3 {
			t.Fatalf("page %d: total %d, want %d", pages, p.Meta.Total, len(full.Data)-gone)
		}
		walked = append(walked, p.Data...)
		if p.Meta.Next == nil {
			break
		}
		if pages == 0 { // the cursor's device goes; the walk goes on after it
			mustExec(t, env.st, `DELETE FROM devices WHERE uid = ?`, p.uids(t)[3])
			gone++
		}
		query = "limit=4&after=" + *p.Meta.Next
	}
	if !slices.EqualFunc(walked, full.Data, func(a, b json.RawMessage) bool { return string(a) == string(b) }) {
		t.Errorf("walked %d devices, want the full list's %d:\n%s\n%s", len(walked), len(full.Data), walked, full.Data)
	}
}

// TestDeviceListStreamed: the full list, past what the read cache keeps,
// streams (no Content-Length) the very bytes that encoding the list whole
// gives; a short list is answered whole.
func TestDeviceListStreamed(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	team := env.teamOf(env.alice)
	addFleet(t, env.st, team, 2000)
	var list []*model.DeviceSummary
	must(t, env.st.EachDevice(context.Background(), team, store.DeviceFilter{}, func(d *model.DeviceSummary) error {
		list = append(list, d)
		return nil
	}))
	whole, err := json.Marshal(dataBody{list})
	must(t, err)
	if len(whole) <= maxHeldAnswer {
		t.Fatalf("the list is %d bytes: it does not stream", len(whole))
	}
	w := env.want(t, http.StatusOK, "GET", "/v1/user/devices", env.alice.token, nil)
	if got := w.Body.String(); got != string(whole)+"\n" {
		t.Errorf("streamed list (%d bytes) differs from the list encoded whole (%d bytes)", len(got), len(whole)+1)
	}
	if cl := w.Header().Get("Content-Length"); cl != "" {
		t.Errorf("streamed list: Content-Length %s", cl)
	}
	if cl := env.request("GET", "/v1/user/devices", env.bob.token, nil).Header().Get("Content-Length"); cl == "" {
		t.Errorf("short list: no Content-Length")
	}
}

// brokenWriter takes the answer's first write, then fails as a
// connection to a client that went away does.
type brokenWriter struct {
	*httptest.ResponseRecorder
	writes int
}

func (w *brokenWriter) Write(b []byte) (int, error) {
	if w.writes++; w.writes > 1 {
		return 0, syscall.EPIPE
	}
	return w.ResponseRecorder.Write(b)
}

// TestDeviceListCutShort: a streamed list that fails half-way cuts the
// connection (http.ErrAbortHandler), so no client takes a part of the
// list for the whole.
func TestDeviceListCutShort(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	addFleet(t, env.st, env.teamOf(env.alice), 3000)
	req := newRequest("GET", "/v1/user/devices", "Bearer "+env.alice.token, "", nil)
	w := &brokenWriter{ResponseRecorder: httptest.NewRecorder()}
	defer func() {
		if got := recover(); got != http.ErrAbortHandler {
			t.Errorf("panic %v, want http.ErrAbortHandler; answered %d bytes", got, w.Body.Len())
		}
	}()
	env.srv.ServeHTTP(w, req)
}
