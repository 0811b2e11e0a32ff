package main

// Helpers every test file uses: the test environment (a server on a fresh
// store with two users, alice and bob, one device each), the one path every
// HTTP request of a table test takes (testEnv.serve), the database state a
// request may change, and one helper each for md5, multipart bodies and
// captured logs.

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"devicehub/internal/brokertest"
	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// TestMain runs more parallel tests at once than go test's default (one
// per CPU) unless -parallel is given: 4 per CPU, 2 under the race
// detector. The tests spend their time waiting on brokers, sockets, fsync
// and timers far more than computing, and the default left a 2-core
// machine mostly idle; under the race detector (SQLite, compiled from C,
// is instrumented too) they compute several times as much, and more at
// once would only make each wait longer. Tests that time what they check,
// or change something of the process, do not call t.Parallel: they run
// first, one at a time, before any parallel test starts.
func TestMain(m *testing.M) {
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		perCPU := 4
		if raceEnabled {
			perCPU = 2
		}
		flag.Set("test.parallel", strconv.Itoa(perCPU*runtime.GOMAXPROCS(0)))
	}
	os.Exit(m.Run())
}

// testIterations keeps password hashing fast in tests; production hashes
// use passwordIterations, and checkPassword reads the count from the hash.
const testIterations = 1000

// fakeClock is a settable clock for the store and server.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) { c.set(c.now().Add(d)) }

func (c *fakeClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// newTestStore opens a store on a fresh data directory under tb.TempDir().
func newTestStore(tb testing.TB, now func() time.Time) *store.Store {
	tb.Helper()
	if now == nil {
		now = time.Now
	}
	st, err := store.Open(context.Background(), tb.TempDir(), now, store.Quotas{})
	must(tb, err)
	tb.Cleanup(func() { st.Close() })
	return st
}

// syncBuffer is a buffer that a server's or process's goroutines may write
// while the test reads it, and captureLogs the logger that writes into
// one: the one way tests capture logs (brokertest's, which
// internal/mqttlink's tests share).
type syncBuffer = brokertest.LogBuffer

var (
	captureLogs = brokertest.CaptureLogs
	logLines    = brokertest.LogLines
)

// testLogger is captureLogs' logger, for code that needs only a logger.
func testLogger(tb testing.TB) *slog.Logger {
	log, _ := captureLogs(tb)
	return log
}

// testUser is a user provisioned for a test, with one device and a token.
type testUser struct {
	id       int64
	email    string
	password string
	token    string
	device   string // uid of the user's device
}

// testEnv is a server on a fresh store with two users, alice and bob,
// each owning one device.
type testEnv struct {
	t          testing.TB
	dir        string // the data directory
	st         *store.Store
	now        func() time.Time // st's clock: clock.now, or time.Now (withRealClock)
	quotas     store.Quotas     // what st was opened with
	srv        *server
	opts       serverOptions // what srv was built from
	clock      *fakeClock
	log        *slog.Logger
	logs       *syncBuffer // what the server logged
	alice, bob testUser
}

// newTestEnv builds a testEnv on a fresh data directory; link may be nil
// (no broker). Each of with changes the server's options before it is
// built.
func newTestEnv(tb testing.TB, link deviceLink, with ...envOption) *testEnv {
	tb.Helper()
	dir := tb.TempDir()
	db, err := migratedDB()
	must(tb, err)
	must(tb, os.WriteFile(filepath.Join(dir, "devicehub.db"), db, 0o600))
	return newTestEnvIn(tb, dir, link, with...)
}

// migratedDB is the file of an empty database at the newest schema
// version, made once by store.Open: newTestEnv starts each test's store
// from a copy of it, as running every migration again took most of a
// small test's time, above all under the race detector. The migrations
// have tests of their own (store_test.go).
var migratedDB = sync.OnceValues(func() ([]byte, error) {
	dir, err := os.MkdirTemp("", "devicehub-schema-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	st, err := store.Open(context.Background(), dir, time.Now, store.Quotas{})
	if err != nil {
		return nil, err
	}
	if err := st.Close(); err != nil {
		return nil, err
	}
	// The last connection to close wrote the log into the file.
	if _, err := os.Stat(filepath.Join(dir, "devicehub.db-wal")); !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("the schema's database kept its write-ahead log: %v", err)
	}
	return os.ReadFile(filepath.Join(dir, "devicehub.db"))
})

// envOption changes the options a testEnv's server is built from; the
// env's store, clock and logger are there by then.
type envOption func(env *testEnv, o *serverOptions)

// newTestEnvIn is newTestEnv with its data directory at dir.
func newTestEnvIn(tb testing.TB, dir string, link deviceLink, with ...envOption) *testEnv {
	tb.Helper()
	clock := newFakeClock()
	quotas := store.Quotas{HistoryDays: 30} // the service's default
	st, err := store.Open(context.Background(), dir, clock.now, quotas)
	must(tb, err)
	log, logs := captureLogs(tb)
	e := &testEnv{t: tb, dir: dir, st: st, now: clock.now, quotas: quotas, clock: clock, log: log, logs: logs}
	tb.Cleanup(func() { e.st.Close() }) // the store it has by then (withQuotas)
	e.opts = testOptions(st, link, log)
	e.rebuild(with...)
	e.alice = e.addUser("Alice", "alice@example.com", "alice-password")
	e.bob = e.addUser("Bob", "bob@example.com", "bob-password")
	return e
}

// rebuild builds env's server again from its options changed by with, on
// the same store and event hub: the server a restart with that
// configuration would run.
func (e *testEnv) rebuild(with ...envOption) {
	e.t.Helper()
	for _, w := range with {
		w(e, &e.opts)
	}
	e.srv = newTestServer(e.t, e.opts)
}

// withQuotas is an envOption: env's store is closed and opened again on
// its data directory with quotas q, as a restart with those flags would
// open it, and the server is built on it with an event hub of its own. At
// newTestEnv, the env starts with them; on an env in use (env.rebuild),
// whatever holds the old store (a link a test made) must be made again.
func withQuotas(q store.Quotas) envOption {
	return func(e *testEnv, o *serverOptions) {
		e.quotas = q
		e.reopen(o)
	}
}

// withRealClock is an envOption: env's store is opened again on the real
// clock, not env.clock, for tests whose devices run in real time.
func withRealClock() envOption {
	return func(e *testEnv, o *serverOptions) {
		e.now = time.Now
		e.reopen(o)
	}
}

// reopen closes env's store and opens it again on its data directory with
// its clock and quotas, and points o at it with a new event hub.
func (e *testEnv) reopen(o *serverOptions) {
	e.t.Helper()
	must(e.t, e.st.Close())
	st, err := store.Open(context.Background(), e.dir, e.now, e.quotas)
	must(e.t, err)
	e.st, o.store, o.events = st, st, newEventHub(st)
}

// withLink is an envOption: the server sends commands on link (nil: no
// broker).
func withLink(link deviceLink) envOption {
	return func(_ *testEnv, o *serverOptions) { o.link = link }
}

// withPublicURL is an envOption: the server's public URL, the base of its
// download and invite links, is url.
func withPublicURL(url string) envOption {
	return func(_ *testEnv, o *serverOptions) { o.publicURL = url }
}

// listenLocal listens on a free port of 127.0.0.1 for a server whose URL
// must be known before the server is built (withPublicURL); serveOn serves
// on it.
func listenLocal(tb testing.TB) (net.Listener, string) {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(tb, err)
	return ln, "http://" + ln.Addr().String()
}

// serveOn serves h on ln until the test ends.
func serveOn(tb testing.TB, ln net.Listener, h http.Handler) {
	ts := &httptest.Server{Listener: ln, Config: &http.Server{Handler: h}}
	ts.Start()
	tb.Cleanup(ts.Close)
}

// testOptions are the options of a test's server on st: serve's defaults,
// fast password hashing, and http://devicehub.test as its public URL.
func testOptions(st *store.Store, link deviceLink, log *slog.Logger) serverOptions {
	return serverOptions{store: st, link: link, events: newEventHub(st), log: log, otaKey: bytes.Repeat([]byte{7}, 32),
		publicURL: "http://devicehub.test", devicePort: 1883, broker: deviceBroker{"tcp://devicehub.test:1883", "devices"},
		commandTimeout: defaultCommandTimeout, otaTimeout: defaultOTATimeout, dashboard: true, iterations: testIterations,
		webhooks: webhookSettings{lookup: testLookup}} // no test resolves a name in the DNS
}

// newTestServer builds a server from opts, stopping tb if it cannot.
func newTestServer(tb testing.TB, opts serverOptions) *server {
	tb.Helper()
	s, err := newServer(context.Background(), opts)
	must(tb, err)
	tb.Cleanup(start(context.Background(), s.otaProgress.run))
	return s
}

// addUser creates a user with one esp32 device and a token; the password
// is hashed as the server's dummy hash is.
func (e *testEnv) addUser(name, email, password string) testUser {
	e.t.Helper()
	ctx := context.Background()
	hash, err := hashPassword(password, e.srv.iterations)
	must(e.t, err)
	id, err := e.st.CreateUser(ctx, name, email, "user", hash, "")
	must(e.t, err)
	uid, err := createDeviceOf(ctx, e.st, email, "esp32", "devkit", name+"'s device")
	must(e.t, err)
	_, tok, err := issueToken(ctx, e.st, id, "test", nil, nil)
	must(e.t, err)
	return testUser{id: id, email: email, password: password, token: tok, device: uid}
}

// createDeviceOf creates a device for the team of the user with that email.
func createDeviceOf(ctx context.Context, st *store.Store, email, platform, board, name string) (string, error) {
	u, err := st.UserByEmail(ctx, email)
	if err != nil {
		return "", err
	}
	return st.CreateDevice(ctx, u.TeamID, store.NewDevice{Platform: platform, Board: board, Name: name, MQTTPort: 1883}, nil)
}

// addDevice gives u another device of that platform and returns u as
// the owner of that device.
func addDevice(tb testing.TB, env *testEnv, u testUser, platform string) testUser {
	tb.Helper()
	uid, err := createDeviceOf(context.Background(), env.st, u.email, platform, "board", platform+" device")
	must(tb, err)
	u.device = uid
	return u
}

// newRequest builds an API request; authz is the whole Authorization
// header and contentType the Content-Type, each left out when empty.
func newRequest(method, path, authz, contentType string, body io.Reader) *http.Request {
	req := httptest.NewRequest(method, path, body)
	req.Header.Set("Accept", "application/json")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if authz != "" {
		req.Header.Set("Authorization", authz)
	}
	return req
}

// serve sends req through the real router. Every HTTP request of the
// table tests and fuzz targets goes through here, so that whatever should
// see all of them is added in one place.
func (e *testEnv) serve(tb testing.TB, req *http.Request) *httptest.ResponseRecorder {
	return e.serveWatched(tb, req, func() {})
}

// serveWatched is serve that calls begun when the answer begins: when
// its status is written.
func (e *testEnv) serveWatched(tb testing.TB, req *http.Request, begun func()) *httptest.ResponseRecorder {
	w := &watchedRecorder{httptest.NewRecorder(), begun}
	e.srv.ServeHTTP(w, req)
	recordResponse(tb, req, w.ResponseRecorder)
	return w.ResponseRecorder
}

// watchedRecorder calls begun once, when the status is written.
type watchedRecorder struct {
	*httptest.ResponseRecorder
	begun func()
}

func (w *watchedRecorder) WriteHeader(code int) {
	if begun := w.begun; begun != nil {
		w.begun = nil
		begun()
	}
	w.ResponseRecorder.WriteHeader(code)
}

func (w *watchedRecorder) Write(b []byte) (int, error) {
	w.WriteHeader(http.StatusOK) // the recorder ignores a second WriteHeader
	return w.ResponseRecorder.Write(b)
}

// request sends a request with a token; body is sent as is when it is a
// string or []byte, as JSON otherwise, and not at all when nil or "" (as
// an apiCase's).
func (e *testEnv) request(method, path, token string, body any) *httptest.ResponseRecorder {
	e.t.Helper()
	if body == "" {
		body = nil
	}
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	case []byte:
		r = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		must(e.t, err)
		r = bytes.NewReader(j)
	}
	ct, authz := "", ""
	if body != nil {
		ct = "application/json"
	}
	if token != "" {
		authz = "Bearer " + token
	}
	return e.serve(e.t, newRequest(method, path, authz, ct, r))
}

// want sends a request like request and stops tb unless it is answered
// with status.
func (e *testEnv) want(tb testing.TB, status int, method, path, token string, body any) *httptest.ResponseRecorder {
	tb.Helper()
	w := e.request(method, path, token, body)
	if w.Code != status {
		tb.Fatalf("%s %s: got %d %s, want %d", method, path, w.Code, w.Body, status)
	}
	return w
}

// multipartForm encodes a firmware upload: the fields in key order, then
// the file part unless file is nil.
func multipartForm(fields map[string]string, file []byte) (body []byte, contentType string) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	mw.SetBoundary("b0undary") // short and fixed: the fuzzer mutates and shortens it
	for _, k := range slices.Sorted(maps.Keys(fields)) {
		mw.WriteField(k, fields[k])
	}
	if file != nil {
		fw, _ := mw.CreateFormFile("file", "firmware.bin")
		fw.Write(file)
	}
	mw.Close()
	return buf.Bytes(), mw.FormDataContentType()
}

// upload sends a firmware upload to u's device with u's token.
func (e *testEnv) upload(u testUser, fields map[string]string, file []byte) *httptest.ResponseRecorder {
	body, ct := multipartForm(fields, file)
	req := newRequest("POST", "/v1/user/devices/"+u.device+"/firmwares", "Bearer "+u.token, ct, bytes.NewReader(body))
	return e.serve(e.t, req)
}

// uploadOK uploads a firmware and returns its id and md5.
func (e *testEnv) uploadOK(u testUser, fields map[string]string, file []byte) (int64, string) {
	e.t.Helper()
	w := e.upload(u, fields, file)
	var got struct{ Data model.Firmware }
	if err := json.Unmarshal(w.Body.Bytes(), &got); w.Code != http.StatusCreated || err != nil || got.Data.MD5 == nil || *got.Data.MD5 != md5Hex(file) {
		e.t.Fatalf("upload %v: got %d %s, want 201 with md5 %s", fields, w.Code, w.Body, md5Hex(file))
	}
	return *got.Data.ID, *got.Data.MD5
}

// setTarget makes u's firmware with that md5 the device's target.
func (e *testEnv) setTarget(u testUser, md5sum string) {
	e.t.Helper()
	must(e.t, e.st.SetTarget(context.Background(), e.deviceRef(u), md5sum, nil))
}

// device loads u's device from the store.
func (e *testEnv) device(u testUser) *model.Device {
	e.t.Helper()
	d, err := e.st.Device(context.Background(), u.id, u.device)
	if err != nil {
		e.t.Fatalf("deviceIn(%s): %v", u.device, err)
	}
	return d
}

// deviceRef is the user's device as the store's team-scoped read finds it.
func (e *testEnv) deviceRef(u testUser) *store.DeviceRef {
	e.t.Helper()
	d, err := e.st.DeviceRefOf(context.Background(), u.id, u.device)
	if err != nil {
		e.t.Fatalf("DeviceRefOf(%s): %v", u.device, err)
	}
	return d
}

// deviceRefByID is the device with that row id as the store's team-scoped
// read finds it, for a test that made the device in SQL.
func deviceRefByID(tb testing.TB, st *store.Store, id int64) *store.DeviceRef {
	tb.Helper()
	var teamID int64
	var uid string
	must(tb, storeReader(st).QueryRow(`SELECT team_id, uid FROM devices WHERE id = ?`, id).Scan(&teamID, &uid))
	d, err := st.DeviceRefOf(context.Background(), teamID, uid)
	must(tb, err)
	return d
}

// mustExec runs SQL on st's writer connection, for state the API cannot
// make (a device's report, another process's write), and stops the test if
// it fails.
func mustExec(tb testing.TB, st *store.Store, query string, args ...any) {
	tb.Helper()
	if _, err := storeWriter(st).Exec(query, args...); err != nil {
		tb.Fatalf("%.80s: %v", query, err)
	}
}

// setStatus writes a device status directly, as a device report would.
func (e *testEnv) setStatus(uid, status string) {
	e.t.Helper()
	mustExec(e.t, e.st, `UPDATE devices SET status = ? WHERE uid = ?`, status, uid)
}

func md5Hex(b []byte) string {
	sum := md5.Sum(b)
	return hex.EncodeToString(sum[:])
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// decode parses a JSON object answer.
func decode(tb testing.TB, w *httptest.ResponseRecorder) map[string]any {
	tb.Helper()
	var v map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
		tb.Fatalf("answer is not a JSON object: %v\n%s", err, w.Body)
	}
	return v
}

// jsonEqual reports whether two JSON texts are the same value.
func jsonEqual(tb testing.TB, a, b []byte) bool {
	tb.Helper()
	var va, vb any
	if err := json.Unmarshal(a, &va); err != nil {
		tb.Fatalf("bad JSON %s: %v", a, err)
	}
	if err := json.Unmarshal(b, &vb); err != nil {
		tb.Fatalf("bad JSON %s: %v", b, err)
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return bytes.Equal(ja, jb)
}

// dbState dumps every row a request could change, by the id of the user
// or team who owns it (0: the files under the firmware directory, tmp
// included). tokens.last_used_at is left out:
// every authenticated request may touch it. The tables of teams are left
// out of a database made before them, and invites before version 11.
func dbState(tb testing.TB, st *store.Store) map[int64][]string {
	tb.Helper()
	state := map[int64][]string{}
	// team is the column that names a device's or rollout's team: owner_id
	// before schema version 10.
	team := "team_id"
	if scalar(tb, st, `SELECT count(*) FROM pragma_table_info('devices') WHERE name = 'owner_id'`) == "1" {
		team = "owner_id"
	}
	// A command's columns but its team_id (version 14), its device's
	// team, which the row is dumped under.
	command := scalar(tb, st, `SELECT group_concat('c.' || name, ', ') FROM pragma_table_info('commands') WHERE name != 'team_id'`)
	// A user's columns but their password's version, and an audit
	// entry's but its number in the team (version 15), which an upgrade
	// adds ("*" for a table a database older than it lacks).
	columns := func(table, not string) string {
		return scalar(tb, st, `SELECT coalesce(group_concat(name, ', '), '*') FROM pragma_table_info(?) WHERE name != ?`, table, not)
	}
	// A rollout's columns but those a resume from a halt sets (version
	// 17) and those of a revert (version 19), which a database made
	// before has not; a rollout device's but the md5 a revert sends it.
	rollout := scalar(tb, st, `SELECT group_concat(name, ', ') FROM pragma_table_info('rollouts')
		WHERE name NOT IN ('gate_from', 'failures_before', 'on_halt', 'reverts')`)
	rolloutDevice := scalar(tb, st, `SELECT group_concat('rd.' || name, ', ') FROM pragma_table_info('rollout_devices') WHERE name != 'md5'`)
	for _, q := range []string{
		`SELECT id, 'user', ` + columns("users", "password_version") + ` FROM users`,
		`SELECT user_id, 'token', id, name, hex(secret_hash), created_at FROM tokens`,
		// A device's platform and board by their keys: the rows they are
		// kept in are the store's own (internal/store/schema.sql, version 11).
		`SELECT d.` + team + `, 'device', d.id, d.uid, d.name, d.description, d.status, d.public_ip, d.local_ip, d.last_rssi,
			d.first_seen_at, d.last_seen_at, d.last_ota_at, p.key, b.key, d.current_md5, d.current_version,
			d.target_firmware_id, d.meta, d.created_at
			FROM devices d JOIN platforms p ON p.id = d.platform_id JOIN boards b ON b.id = d.board_id`,
		`SELECT d.` + team + `, 'firmware', f.* FROM firmwares f JOIN devices d ON d.id = f.device_id`,
		`SELECT d.` + team + `, 'button', b.* FROM command_buttons b JOIN devices d ON d.id = b.device_id`,
		`SELECT d.` + team + `, 'command', ` + command + ` FROM commands c JOIN devices d ON d.id = c.device_id`,
		"SELECT team_id, 'library firmware', * FROM library_firmwares",
		`SELECT ` + team + `, 'rollout', ` + rollout + ` FROM rollouts`,
		`SELECT r.` + team + `, 'rollout device', ` + rolloutDevice + ` FROM rollout_devices rd JOIN rollouts r ON r.id = rd.rollout_id`,
		`SELECT id, 'team', id, name, created_at FROM teams`, // not the JSON it weighs, which its rows give
		`SELECT team_id, 'invite', id, name, email, role, hex(secret_hash), expires_at, created_at FROM invites`,
		`SELECT u.team_id, 'reset', r.* FROM password_resets r JOIN users u ON u.id = r.user_id`,
		`SELECT team_id, 'audit', ` + columns("audit", "number") + ` FROM audit`,
		"SELECT team_id, 'webhook', * FROM webhooks",
		"SELECT w.team_id, 'webhook queue', q.* FROM webhook_queue q JOIN webhooks w ON w.id = q.webhook_id",
		"SELECT w.team_id, 'webhook delivery', d.* FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id",
	} {
		err := dumpRows(storeReader(st), q, state)
		if err != nil && (strings.Contains(err.Error(), "no such table") || strings.Contains(err.Error(), "no such column")) {
			continue // a database older than the table, or than its columns (invites, version 12)
		}
		if err != nil {
			tb.Fatalf("%s: %v", q, err)
		}
	}
	err := filepath.WalkDir(firmwareDir(st), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		rel, _ := filepath.Rel(firmwareDir(st), p)
		state[0] = append(state[0], fmt.Sprintf("file | %s | %d | %s", rel, len(data), md5Hex(data)))
		return err
	})
	must(tb, err)
	for k := range state {
		slices.Sort(state[k])
	}
	return state
}

// dumpRows adds each row of q to state under its first column, the owner.
func dumpRows(db *sql.DB, q string, state map[int64][]string) error {
	rows, err := db.QueryContext(context.Background(), q)
	if err != nil {
		return err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return err
	}
	for rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return err
		}
		teamID, _ := strconv.ParseInt(fmt.Sprint(vals[0]), 10, 64)
		parts := make([]string, len(vals)-1)
		for i, val := range vals[1:] {
			if b, ok := val.([]byte); ok {
				val = string(b)
			}
			parts[i] = fmt.Sprint(val)
		}
		state[teamID] = append(state[teamID], strings.Join(parts, " | "))
	}
	return rows.Err()
}

// changedOwners lists the owners whose rows differ between two states.
func changedOwners(before, after map[int64][]string) []int64 {
	owners := map[int64]bool{}
	for k := range before {
		owners[k] = true
	}
	for k := range after {
		owners[k] = true
	}
	var changed []int64
	for _, k := range slices.Sorted(maps.Keys(owners)) {
		if !slices.Equal(before[k], after[k]) {
			changed = append(changed, k)
		}
	}
	return changed
}

// sameState fails unless the given owners' rows (all when none are
// given) are the same in before and after.
func sameState(tb testing.TB, what string, before, after map[int64][]string, owners ...int64) {
	tb.Helper()
	for _, o := range changedOwners(before, after) {
		if len(owners) == 0 || slices.Contains(owners, o) {
			tb.Errorf("%s changed the data of owner %d:\nbefore %q\nafter  %q", what, o, before[o], after[o])
		}
	}
}

// checkFirmwareFiles checks the firmware directory against the rows: one
// <sha256>.bin per sha256 with bytes of that sha256, the row's md5 and its
// size, no file without a row, and an empty tmp directory.
func checkFirmwareFiles(t testing.TB, db *sql.DB, dir string) {
	t.Helper()
	rows := queryMap(t, db, `SELECT sha256, md5 || ' ' || size FROM firmwares
		UNION SELECT sha256, md5 || ' ' || size FROM library_firmwares`)
	for sha, want := range rows {
		b, err := os.ReadFile(filepath.Join(dir, sha+".bin"))
		if got := fmt.Sprint(md5Hex(b), " ", len(b)); err != nil || sha256Hex(b) != sha || got != want {
			t.Errorf("file of firmware row %s: md5 and size %s, sha256 %s (%v), want %s", sha, got, sha256Hex(b), err, want)
		}
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if sha, isBin := strings.CutSuffix(e.Name(), ".bin"); isBin && rows[sha] == "" {
			t.Errorf("file %s has no firmware row", e.Name())
		}
	}
	if tmp, err := os.ReadDir(filepath.Join(dir, "tmp")); err != nil || len(tmp) != 0 {
		t.Errorf("firmware/tmp: %d entries (%v), want it empty", len(tmp), err)
	}
}

// checkOwnerOnly checks that everything under dir is its owner's only
// (files 0600, directories 0700) with no temporary file left, and that
// the paths want (relative to dir) are there.
func checkOwnerOnly(t testing.TB, dir, when string, want ...string) {
	t.Helper()
	seen := map[string]bool{}
	must(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		rel, _ := filepath.Rel(dir, p)
		seen[rel] = true
		wantMode := fs.FileMode(0o600)
		if d.IsDir() {
			wantMode = 0o700
		}
		if err == nil && info.Mode().Perm() != wantMode {
			t.Errorf("%s: %s has mode %04o, want %04o", when, rel, info.Mode().Perm(), wantMode)
		}
		if strings.HasSuffix(p, ".tmp") {
			t.Errorf("%s: a temporary file %s is left", when, rel)
		}
		return err
	}))
	for _, name := range want {
		if !seen[name] {
			t.Errorf("%s: no %s in %s (have %v)", when, name, dir, seen)
		}
	}
}

// queryMap returns the rows of a two-column query as a map.
func queryMap(t testing.TB, db *sql.DB, query string, args ...any) map[string]string {
	t.Helper()
	rows, err := db.Query(query, args...)
	if err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	defer rows.Close()
	m := map[string]string{}
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			t.Fatalf("%s: %v", query, err)
		}
		m[k] = v
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return m
}

// scalar runs a one-value query and returns the value as text: "<nil>"
// for NULL, "<no row>" when there is no row.
func scalar(tb testing.TB, st *store.Store, query string, args ...any) string {
	tb.Helper()
	var v any
	err := storeReader(st).QueryRow(query, args...).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return "<no row>"
	}
	if err != nil {
		tb.Fatalf("%s: %v", query, err)
	}
	if b, ok := v.([]byte); ok {
		return string(b)
	}
	return fmt.Sprint(v)
}

// wantDB checks a one-value query's result.
func wantDB(tb testing.TB, st *store.Store, want, query string, args ...any) {
	tb.Helper()
	if got := scalar(tb, st, query, args...); got != want {
		tb.Errorf("%s %v: got %q, want %q", query, args, got, want)
	}
}

// recordingLink is a device link without a broker: up or down, and
// recording every publish (which must not happen while it is down); a
// publish while up fails with err when it is set.
type recordingLink struct {
	down bool
	err  error
	mu   sync.Mutex
	sent []published
}

type published struct {
	uid, id string // the device and the command
	payload []byte
}

func (l *recordingLink) Connected() bool { return !l.down }

// ConnectedSince is zero: no broker, so presence sets nobody offline.
func (l *recordingLink) ConnectedSince() time.Time { return time.Time{} }

// AwaitApplied returns at once: the link takes no device messages.
func (l *recordingLink) AwaitApplied(context.Context, time.Time) error { return nil }

func (l *recordingLink) Publish(uid, id string, payload []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sent = append(l.sent, published{uid, id, bytes.Clone(payload)})
	if l.down {
		return errors.New("not connected")
	}
	return l.err
}

// take returns what was published since the last take.
func (l *recordingLink) take() []published {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.sent
	l.sent = nil
	return s
}

// newOfflineLink is a link with no broker behind it that applies the
// device messages handed to its Handle method through the server's sink,
// at its Flush.
func newOfflineLink(st *store.Store, log *slog.Logger) *mqttlink.Offline {
	return mqttlink.NewOffline(mqttlink.Config{Broker: mqttlink.Broker{Prefix: "devices"},
		Sink: deviceSink{st, newEventHub(st)}, Now: st.Now, Log: log})
}

// dropTotal is how many device messages the link has dropped since start.
func dropTotal(l interface{ Stats() mqttlink.Stats }) int64 {
	var n int64
	for _, c := range l.Stats().Drops {
		n += c
	}
	return n
}

// liveClient calls the API of a server on a real socket with a token.
type liveClient struct {
	base, token string
	hc          *http.Client
}

// do sends one request. code is the status when an answer arrived (even
// if reading its body then failed), 0 when none did.
func (c *liveClient) do(ctx context.Context, method, path, contentType string, body []byte) (code int, resp []byte, err error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Accept", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	r, err := c.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer r.Body.Close()
	resp, err = io.ReadAll(r.Body)
	return r.StatusCode, resp, err
}

// want sends one request and fails the test unless it is answered with
// the wanted status; it returns the body.
func (c *liveClient) want(tb testing.TB, status int, method, path, contentType string, body []byte) []byte {
	tb.Helper()
	code, resp, err := c.do(context.Background(), method, path, contentType, body)
	if err != nil || code != status {
		tb.Fatalf("%s %s: got %d %s (%v), want %d", method, path, code, resp, err, status)
	}
	return resp
}

// serveInProcess runs 'devicehub serve' in this process on a free loopback
// port with the environment env and args (after defaults of a fresh data
// directory and an unreachable broker), until the test ends. It returns its
// base URL, its log, and a function that stops it and returns run's error.
func serveInProcess(t *testing.T, env map[string]string, args ...string) (base string, log *syncBuffer, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	log = &syncBuffer{}
	done := make(chan error, 1)
	args = append([]string{"serve", "-addr", "127.0.0.1:0", "-data", t.TempDir(), "-mqtt", "tcp://127.0.0.1:1"}, args...)
	go func() {
		done <- run(ctx, args, func(k string) string { return env[k] }, strings.NewReader(""), io.Discard, log)
	}()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("serve did not stop")
			}
		})
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("serve: %v", err)
		}
		if t.Failed() {
			t.Logf("serve's log:\n%s", log)
		}
	})
	listening := regexp.MustCompile(`msg=listening addr=(127\.0\.0\.1:[0-9]+)`)
	eventually(t, 30*time.Second, "serve to listen", func() bool {
		select {
		case err := <-done:
			done <- err // for stop
			t.Fatalf("serve returned before listening: %v\n%s", err, log)
		default:
		}
		m := listening.FindStringSubmatch(log.String())
		if m != nil {
			base = "http://" + m[1]
		}
		return m != nil
	})
	return base, log, stop
}

// receive returns the next value on ch, and stops the test if none comes
// within d.
func receive[T any](tb testing.TB, ch <-chan T, d time.Duration, what string) T {
	tb.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(d):
		tb.Fatalf("no %s within %v", what, d)
		panic("unreachable")
	}
}

// must stops the test at an error in its set-up (brokertest's, which
// internal/mqttlink's tests share).
var must = brokertest.Must

// recordEnv names the file that the HTTP tests append every response they
// check to, one JSON line each. .ci/openapi sets it and then validates each
// line against openapi.json (tools/openapi/validate.mjs).
const recordEnv = "DEVICEHUB_RECORD_RESPONSES"

// recordedResponse is one line of the record file. Pattern is the
// ServeMux pattern that routed the request: "/" for the catch-all, ""
// when the server answered before routing (a path not in its clean form).
type recordedResponse struct {
	Method  string            `json:"method"`
	Path    string            `json:"path"`
	Pattern string            `json:"pattern"`
	Status  int               `json:"status"`
	Headers map[string]string `json:"headers"` // lowercased names; repeated values joined by ", "
	Body    string            `json:"body"`
}

// recordResponse appends the answer w gave to req to the file named by
// DEVICEHUB_RECORD_RESPONSES, and does nothing when it is unset. Call it
// after the server's ServeHTTP returned: the mux sets req.Pattern then.
// Each record is a single write to a file opened with O_APPEND, so records
// from parallel tests (or goroutines of one test) never interleave and no
// lock is needed.
func recordResponse(tb testing.TB, req *http.Request, w *httptest.ResponseRecorder) {
	tb.Helper()
	name := os.Getenv(recordEnv)
	if name == "" {
		return
	}
	res := w.Result()
	headers := map[string]string{}
	for k, v := range res.Header {
		headers[strings.ToLower(k)] = strings.Join(v, ", ")
	}
	line, _ := json.Marshal(recordedResponse{ // strings, an int and a map of strings: it cannot fail
		Method:  req.Method,
		Path:    req.URL.RequestURI(),
		Pattern: req.Pattern,
		Status:  res.StatusCode,
		Headers: headers,
		Body:    w.Body.String(),
	})
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err == nil {
		_, err = f.Write(append(line, '\n'))
		err = errors.Join(err, f.Close())
	}
	if err != nil {
		tb.Errorf("record response: %v", err)
	}
}
