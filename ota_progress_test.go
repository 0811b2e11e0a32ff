package main

// OTA as issue 11 made it: firmware stored by SHA-256, so that an MD5
// collision cannot swap one user's image for another's, and the migration
// of an older data directory to it; the sha256 header; the progress and
// outcome of an OTA command without help from the device; and the check
// that an upload is an image the device can flash.

import (
	"bytes"
	"context"
	"database/sql"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// deviceOnline brings the user's device online the way a device does (a
// retained "online" with an "offline" Last Will) and returns its client.
func deviceOnline(t *testing.T, b *testBroker, env *testEnv, u testUser) mqtt.Client {
	t.Helper()
	dev := testClient(t, b, "dev-"+u.device, "devices/"+u.device+"/status")
	publishWait(t, dev, "devices/"+u.device+"/status", true, "online")
	eventually(t, 5*time.Second, u.device+" online", func() bool { return env.device(u).Status == "online" })
	return dev
}

// reportFirmware publishes the device's telemetry saying it runs md5sum
// and waits until the server shows it.
func reportFirmware(t *testing.T, env *testEnv, dev mqtt.Client, u testUser, md5sum string) {
	t.Helper()
	publishWait(t, dev, "devices/"+u.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q}`, md5sum))
	eventually(t, 5*time.Second, "current firmware "+md5sum, func() bool {
		d := env.device(u)
		return d.CurrentFirmware != nil && d.CurrentFirmware.MD5 != nil && *d.CurrentFirmware.MD5 == md5sum
	})
}

// commandRecord reads the command record of the user's device.
func commandRecord(t *testing.T, env *testEnv, u testUser, id string) *model.Command {
	t.Helper()
	c, err := env.st.CommandOf(context.Background(), env.deviceRef(u), id)
	if err != nil {
		t.Fatalf("command %s: %v", id, err)
	}
	return c
}

// otaPayloadOf is the ota command as published.
func otaPayloadOf(t *testing.T, c *model.Command) otaPayload {
	t.Helper()
	var p otaPayload
	if err := json.Unmarshal(c.Payload, &p); err != nil {
		t.Fatalf("ota payload %s: %v", c.Payload, err)
	}
	return p
}

// waitCommand waits until the command is in that state and, when
// progress is not negative, running at that progress: the server records
// progress once the bytes have gone out, so a client can have them first.
func waitCommand(t *testing.T, env *testEnv, u testUser, id string, state model.CommandState, progress int64) *model.Command {
	t.Helper()
	what := "command " + id + " " + string(state)
	if progress >= 0 {
		what += fmt.Sprintf(" at %d%%", progress)
	}
	var c *model.Command
	eventually(t, 5*time.Second, what, func() bool {
		c = commandRecord(t, env, u, id)
		return c.State == state && (progress < 0 || c.Progress != nil && *c.Progress == progress)
	})
	return c
}

// pct renders a command's progress for a message.
func pct(p *int64) string {
	if p == nil {
		return "null"
	}
	return fmt.Sprintf("%d%%", *p)
}

// deviceDetail is the device detail as the API answers it.
type deviceDetail struct {
	LastOTAAt       *string         `json:"last_ota_at"`
	CurrentFirmware *model.Firmware `json:"current_firmware"`
	OTA             json.RawMessage `json:"ota"`
}

func getDetail(t *testing.T, env *testEnv, u testUser) deviceDetail {
	t.Helper()
	w := env.request("GET", "/v1/user/devices/"+u.device, u.token, nil)
	var d struct{ Data deviceDetail }
	if err := json.Unmarshal(w.Body.Bytes(), &d); w.Code != http.StatusOK || err != nil {
		t.Fatalf("device detail: got %d %s (%v), want 200", w.Code, w.Body, err)
	}
	return d.Data
}

// checkDetailOTA checks that device detail's ota is the command c, field
// for field, as the command endpoint renders it.
func checkDetailOTA(t *testing.T, env *testEnv, u testUser, c *model.Command) {
	t.Helper()
	want, err := json.Marshal(c)
	must(t, err)
	if got := getDetail(t, env, u).OTA; !jsonEqual(t, got, want) {
		t.Errorf("device detail ota: got %s, want %s", got, want)
	}
}

// otaServeNarrow serves env's server like otaServe, with a 4 KiB socket
// send buffer per connection. Over loopback (64 KiB segments) Linux grows
// a send buffer past a megabyte, and the server would read a whole image
// into it before a slow client had read 100 KiB; over Wi-Fi to an lwIP
// device (1460-byte segments, a 5.7 KiB window) it stays tens of KiB.
func otaServeNarrow(tb testing.TB, env *testEnv) *httptest.Server {
	tb.Helper()
	ts := httptest.NewUnstartedServer(env.srv)
	ts.Listener = narrowListener{ts.Listener}
	ts.Start()
	tb.Cleanup(ts.Close)
	return ts
}

// narrowListener gives each accepted TCP connection a 4 KiB send buffer.
type narrowListener struct{ net.Listener }

func (l narrowListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		if err := tc.SetWriteBuffer(4096); err != nil {
			c.Close()
			return nil, err
		}
	}
	return c, err
}

// slowFlash is where a slowUpdater writes the image: it takes the body 4
// KiB at a time (the updater's buffer), pausing after each piece as a
// flash write does, and calls each with the bytes taken so far.
type slowFlash struct {
	bytes.Buffer
	pause time.Duration
	each  func(n int64)
}

func (f *slowFlash) Write(p []byte) (int, error) {
	f.Buffer.Write(p)
	if f.each != nil {
		f.each(int64(f.Len()))
	}
	time.Sleep(f.pause)
	return len(p), nil
}

// slowUpdater is the ESP32 updater behind a 4 KiB receive window.
func slowUpdater() espUpdater {
	u := esp32Updater("")
	u.rcvBuf = 4096
	return u
}

// md5Collision reads the published MD5 collision pair (testdata's
// README): two 128-byte files with one md5 and two sha256s.
func md5Collision(t *testing.T) (a, b []byte) {
	t.Helper()
	a, errA := os.ReadFile(filepath.Join("testdata", "md5-collision", "a.bin"))
	b, errB := os.ReadFile(filepath.Join("testdata", "md5-collision", "b.bin"))
	if errA != nil || errB != nil {
		t.Fatalf("read the collision pair: %v %v", errA, errB)
	}
	if md5Hex(a) != md5Hex(b) || sha256Hex(a) == sha256Hex(b) || bytes.Equal(a, b) {
		t.Fatalf("testdata/md5-collision: want two files with one md5 and two sha256s; md5 %s %s, sha256 %s %s",
			md5Hex(a), md5Hex(b), sha256Hex(a), sha256Hex(b))
	}
	return a, b
}

// TestMD5CollisionCannotOverwrite plays the md5-collision attack: user A uploads
// a.bin, assigns it and triggers an OTA; user B uploads b.bin, which has
// the same md5, to B's own device. A's signed link must still serve a.bin,
// and neither file may replace the other. The pair does not start with the
// ESP image byte, so the devices are rp2040s (testdata's README).
func TestMD5CollisionCannotOverwrite(t *testing.T) {
	t.Parallel()
	imgA, imgB := md5Collision(t)
	sum := md5Hex(imgA)
	env, _, b := brokerEnv(t)
	ts := otaServe(t, env)
	alice := addDevice(t, env, env.alice, "rp2040")
	bob := addDevice(t, env, env.bob, "rp2040")

	otaAssign(t, env, alice, "a", "1", imgA)
	deviceOnline(t, b, env, alice)
	cmd := otaPayloadOf(t, commandRecord(t, env, alice, sendOK(t, env, alice, "/ota", nil)))
	if cmd.MD5 != sum || cmd.SHA256 != sha256Hex(imgA) {
		t.Errorf("A's ota command: md5 %s sha256 %s, want %s %s", cmd.MD5, cmd.SHA256, sum, sha256Hex(imgA))
	}

	// B uploads the colliding file to B's device: a new firmware, not a duplicate.
	env.uploadOK(bob, map[string]string{"name": "b", "version": "1"}, imgB)
	aLink := otaLocal(t, ts, cmd.URL)
	bLink := otaLocal(t, ts, env.srv.ota.url(bob.device, sum))
	for _, c := range []struct {
		who, link string
		want      []byte
	}{{"A", aLink, imgA}, {"B", bLink, imgB}} {
		r, err := esp32Updater("").get(c.link, nil, nil)
		must(t, err)
		checkOTAAnswer(t, r, 200, c.want)
		if got := sha256Hex(r.body); got != sha256Hex(c.want) {
			t.Errorf("%s's link: served sha256 %s, want %s", c.who, got, sha256Hex(c.want))
		}
	}
	wantFirmwareFiles(t, env, map[string][]byte{sha256Hex(imgA): imgA, sha256Hex(imgB): imgB})

	// Within one device, duplicates are still found by md5 (the spec's message).
	checkAnswer(t, env.upload(alice, map[string]string{"name": "b too"}, imgB), 422, `{"message":"This firmware file is already uploaded."}`)
	// Deleting B's firmware removes B's file only.
	checkAnswer(t, env.request("DELETE", "/v1/user/devices/"+bob.device+"/firmwares/"+sum, bob.token, nil), 200, `{"message":"Firmware deleted."}`)
	wantFirmwareFiles(t, env, map[string][]byte{sha256Hex(imgA): imgA})
	r, err := esp32Updater("").get(aLink, nil, nil)
	must(t, err)
	checkOTAAnswer(t, r, 200, imgA)
}

// wantFirmwareFiles checks that the firmware rows name exactly the
// sha256s that are the keys of want and, with checkFirmwareFiles, that the
// directory holds one file of those bytes per sha256 and no other.
func wantFirmwareFiles(t *testing.T, env *testEnv, want map[string][]byte) {
	t.Helper()
	checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st))
	got := slices.Sorted(maps.Keys(queryMap(t, storeReader(env.st), `SELECT DISTINCT sha256, '' FROM firmwares`)))
	if wantSHAs := slices.Sorted(maps.Keys(want)); !slices.Equal(got, wantSHAs) {
		t.Errorf("firmware files: got %q, want %q", got, wantSHAs)
	}
}

// v2Firmware is a firmware row as the previous version stored it.
type v2Firmware struct {
	device  int // index into the devices
	name    string
	content []byte
}

// v2DataDir writes a data directory the way the version before sha256 storage
// did: schema versions 1 and 2 only, firmware files named <md5>.bin, the same
// bytes on two devices sharing one file, a target, a reported current
// firmware and an unfinished ota command. It returns the device uids.
func v2DataDir(t *testing.T, dir string, fws []v2Firmware) []string {
	t.Helper()
	fwDir := filepath.Join(dir, "firmware")
	must(t, os.MkdirAll(filepath.Join(fwDir, "tmp"), 0o700))
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "devicehub.db")+
		"?_pragma=foreign_keys(1)&_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)")
	must(t, err)
	defer db.Close()
	const now = "2026-01-02T03:04:05.000000Z"
	exec := func(q string, args ...any) sql.Result {
		t.Helper()
		res, err := db.Exec(q, args...)
		if err != nil {
			t.Fatalf("%.60s: %v", q, err)
		}
		return res
	}
	for i, m := range store.Migrations[:2] {
		exec(m)
		exec(fmt.Sprintf("PRAGMA user_version = %d", i+1))
	}
	exec(`INSERT INTO platforms (key, name) VALUES ('esp32', 'esp32')`)
	exec(`INSERT INTO boards (key, name) VALUES ('devkit', 'devkit')`)
	uids := []string{"esp32_oldalice00001", "esp32_oldbob0000001"}
	for i, who := range []string{"alice", "bob"} {
		exec(`INSERT INTO users (name, email, role, password_hash, created_at) VALUES (?, ?, 'user', 'x', ?)`,
			who, who+"@example.com", now)
		exec(`INSERT INTO devices (uid, owner_id, name, platform_id, board_id, meta, created_at)
			VALUES (?, ?, ?, 1, 1, '{"mqtt_port":1883}', ?)`, uids[i], i+1, who+"'s device", now)
	}
	for _, f := range fws {
		sum := md5Hex(f.content)
		exec(`INSERT INTO firmwares (device_id, name, version, notes, md5, size, created_at) VALUES (?, ?, NULL, NULL, ?, ?, ?)`,
			f.device+1, f.name, sum, len(f.content), now)
		must(t, os.WriteFile(filepath.Join(fwDir, sum+".bin"), f.content, 0o600))
	}
	// Alice runs her first firmware and targets her second; an ota
	// command for it (the old payload, without sha256) is unfinished.
	first, second := md5Hex(fws[0].content), md5Hex(fws[1].content)
	exec(`UPDATE devices SET current_md5 = ?, target_firmware_id = (SELECT id FROM firmwares WHERE device_id = 1 AND md5 = ?) WHERE id = 1`,
		first, second)
	payload := fmt.Sprintf(`{"cmd":"ota","url":"http://devicehub.test/ota/x","md5":%q,"size":%d,"version":null}`, second, len(fws[1].content))
	exec(`INSERT INTO commands (id, device_id, kind, payload, state, created_at, updated_at, deadline)
		VALUES ('oldota', 1, 'ota', ?, 'sent', ?, ?, '2099-01-01T00:00:00.000000Z')`, payload, now, now)
	return uids
}

// checkMigrated opens dir with today's code and checks the result: every
// row has the sha256 of its bytes, every file is at <sha256>.bin with its
// bytes, no <md5>.bin is left, downloads serve the bytes, and the old ota
// command is tracked.
func checkMigrated(t *testing.T, dir string, uids []string, fws []v2Firmware) {
	t.Helper()
	ctx := context.Background()
	st, err := store.Open(ctx, dir, newFakeClock().now, store.Quotas{})
	if err != nil {
		t.Fatalf("open the old data directory: %v", err)
	}
	defer st.Close()
	wantDB(t, st, fmt.Sprint(len(store.Migrations)), `PRAGMA user_version`)
	// Every row has its file at <sha256>.bin with the row's md5, and no
	// <md5>.bin is left.
	checkFirmwareFiles(t, storeReader(st), firmwareDir(st))
	wantDB(t, st, fmt.Sprint(len(fws)), `SELECT count(*) FROM firmwares`)

	// The downloads work, for both devices of the shared file.
	srv := newTestServer(t, testOptions(st, nil, testLogger(t)))
	for _, f := range fws {
		uid, sum := uids[f.device], md5Hex(f.content)
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, httptest.NewRequest("GET", srv.ota.url(uid, sum), nil))
		if w.Code != http.StatusOK || !bytes.Equal(w.Body.Bytes(), f.content) || w.Header().Get("x-MD5") != sum {
			t.Errorf("download of %s for %s: got %d, %d bytes, x-MD5 %q; want 200 and the %d bytes",
				sum, uid, w.Code, w.Body.Len(), w.Header().Get("x-MD5"), len(f.content))
		}
	}
	// The old unfinished ota command is the one that download moved,
	// once its progress is written (as the writer can: otaProgress).
	eventually(t, 5*time.Second, "the old ota command running at 100% after its download", func() bool {
		c, err := st.CommandOf(ctx, deviceRefByID(t, st, 1), "oldota")
		must(t, err)
		return c.State == "running" && c.Progress != nil && *c.Progress == 100
	})
	d, err := st.Device(ctx, 1, uids[0])
	must(t, err)
	if d.TargetFirmware == nil || d.TargetFirmware.SHA256 == nil || *d.TargetFirmware.SHA256 != sha256Hex(fws[1].content) {
		t.Errorf("alice's target firmware: %+v, want sha256 %s", d.TargetFirmware, sha256Hex(fws[1].content))
	}
	if d.CurrentFirmware == nil || d.CurrentFirmware.SHA256 == nil || *d.CurrentFirmware.SHA256 != sha256Hex(fws[0].content) {
		t.Errorf("alice's current firmware: %+v, want sha256 %s", d.CurrentFirmware, sha256Hex(fws[0].content))
	}
}

// TestMigrateDataDirFromV2 opens data directories the previous version
// wrote, whole and as a crash in the middle of the migration left them.
func TestMigrateDataDirFromV2(t *testing.T) {
	t.Parallel()
	// Alice has two firmwares; bob has the bytes of alice's first.
	one, two := otaFirmware(5000, 31), otaFirmware(7000, 32)
	fws := []v2Firmware{{0, "alice one", one}, {0, "alice two", two}, {1, "bob's copy of alice one", one}}
	// linked is the first file under both names, as the migration links it.
	linked := func(t *testing.T, dir string) {
		fw := filepath.Join(dir, "firmware")
		must(t, os.Link(filepath.Join(fw, md5Hex(fws[0].content)+".bin"), filepath.Join(fw, sha256Hex(fws[0].content)+".bin")))
	}
	tests := []struct {
		name  string
		crash func(t *testing.T, dir string) // what a crash in the middle left, or nil
	}{
		{"untouched", nil},
		{"crash after linking the new name", linked}, // no row knows the sha256 yet
		{"crash after the rows of one file were migrated", func(t *testing.T, dir string) {
			// Schema 3, the first file's rows have its sha256 and both
			// names exist; the second file is not migrated yet.
			linked(t, dir)
			db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "devicehub.db"))
			must(t, err)
			defer db.Close()
			for _, q := range []string{store.Migrations[2], "PRAGMA user_version = 3",
				fmt.Sprintf(`UPDATE firmwares SET sha256 = '%s' WHERE md5 = '%s'`, sha256Hex(fws[0].content), md5Hex(fws[0].content))} {
				_, err := db.Exec(q)
				must(t, err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			uids := v2DataDir(t, dir, fws)
			if tt.crash != nil {
				tt.crash(t, dir)
			}
			checkMigrated(t, dir, uids, fws)
			// A second start finds nothing left to do and changes nothing.
			checkMigrated(t, dir, uids, fws)
		})
	}
}

// TestOTAProgressFromSlowDownload: an ESP32 updater on a slow link reads
// the image in small pieces; the command goes running and its progress
// climbs with the bytes served, each step waking ?wait= waiters. The device
// then reports the new fw_md5: the command succeeds, a request waiting on
// it answers at once, last_ota_at is set and device detail shows the OTA.
func TestOTAProgressFromSlowDownload(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	ts := otaServeNarrow(t, env)
	old := otaFirmware(10_000, 50)
	_, oldSum := env.uploadOK(a, map[string]string{"name": "old", "version": "1"}, old)
	img := otaFirmware(1<<20, 51)
	sum, _ := otaAssign(t, env, a, "new", "2", img)
	dev := deviceOnline(t, b, env, a)
	reportFirmware(t, env, dev, a, oldSum)

	// The trigger waits for the end, as a fleet owner's script would.
	cmds := subscribe(t, testClient(t, b, "observer", ""), "devices/"+a.device+"/cmd/+")
	answered := make(chan *httptest.ResponseRecorder, 1)
	go func() {
		answered <- env.request("POST", "/v1/user/devices/"+a.device+"/ota?wait=30", a.token, nil)
	}()
	m := receive(t, cmds, 5*time.Second, "ota command")
	id := m.Topic()[strings.LastIndex(m.Topic(), "/")+1:]
	c := commandRecord(t, env, a, id)
	if c.State != "sent" {
		t.Fatalf("command before the download: %s, want sent", c.State)
	}
	checkDetailOTA(t, env, a, c)

	woken := env.st.CommandsChanged()
	var seen []int64
	next := int64(0)
	sample := func(n int64) { // every 64 KiB read
		if n < next {
			return
		}
		next = n + 64<<10
		// The server has served at least what the client read, and
		// records progress at least every tenth, written as soon as the
		// writer can (otaProgress): waited for, not read at once.
		read := n * 100 / int64(len(img))
		var c *model.Command
		eventually(t, 5*time.Second, fmt.Sprintf("running at %d%% or more after %d bytes read", read-10, n), func() bool {
			c = commandRecord(t, env, a, id)
			return c.State == "running" && c.Progress != nil && *c.Progress >= read-10
		})
		seen = append(seen, *c.Progress)
	}
	flash := &slowFlash{pause: 2 * time.Millisecond, each: sample}
	r, err := slowUpdater().get(otaLocal(t, ts, otaPayloadOf(t, c).URL), map[string]string{"x-ESP32-sketch-sha256": strings.ToUpper(sha256Hex(old))}, flash)
	if body := flash.Bytes(); err != nil || r.status != http.StatusOK || sha256Hex(body) != sha256Hex(img) {
		t.Fatalf("download: got %v %v, %d bytes (sha256 %s), want 200 and the image", err, r, len(body), sha256Hex(body))
	}
	select {
	case <-woken:
	default:
		t.Error("the download's progress did not wake the requests waiting on commands")
	}
	t.Logf("progress seen every 64 KiB read: %v", seen)
	distinct := slices.Compact(slices.Clone(seen))
	if len(distinct) < 3 || !slices.IsSorted(seen) || seen[0] >= 100 {
		t.Errorf("progress seen while the image was read: %v; want at least 3 distinct rising values below 100", seen)
	}
	c = waitCommand(t, env, a, id, "running", 100)
	checkDetailOTA(t, env, a, c)

	// The device reboots into the image and says so, a minute later.
	env.clock.advance(time.Minute)
	otaAt := env.clock.now().UTC().Format(store.TimeFormat)
	sent := time.Now()
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q,"fw_version":"2"}`, sum))
	w := receive(t, answered, 10*time.Second, "answer to the ?wait=30 request after the report")
	if waited := time.Since(sent); waited > 5*time.Second {
		t.Errorf("?wait= answered %v after the report, want it woken by the report", waited)
	}
	var answer model.CommandAnswer
	if err := json.Unmarshal(w.Body.Bytes(), &answer); err != nil || w.Code != http.StatusOK || answer.Command == nil {
		t.Fatalf("?wait= answer: %d %s (%v)", w.Code, w.Body, err)
	}
	if answer.Command.State != "succeeded" || answer.Command.FinishedAt == nil || *answer.Command.FinishedAt != otaAt {
		t.Errorf("?wait= answer: command %s finished at %v, want succeeded at %s", answer.Command.State, answer.Command.FinishedAt, otaAt)
	}
	c = commandRecord(t, env, a, id)
	if c.State != "succeeded" {
		t.Errorf("command: %s, want succeeded", c.State)
	}
	checkDetailOTA(t, env, a, c)
	if d := getDetail(t, env, a); d.LastOTAAt == nil || *d.LastOTAAt != otaAt {
		t.Errorf("last_ota_at: got %v, want %s", d.LastOTAAt, otaAt)
	}
}

// TestOTAProgressOfPartialAnswers: a 304, a 416 for a range past the end
// and a HEAD do not move the OTA command; a download resumed with a Range
// from the middle starts at 50%.
func TestOTAProgressOfPartialAnswers(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	ts := otaServeNarrow(t, env)
	img := otaFirmware(1<<20, 52)
	otaAssign(t, env, a, "new", "2", img)
	deviceOnline(t, b, env, a)
	id := sendOK(t, env, a, "/ota", nil)
	link := otaLocal(t, ts, otaPayloadOf(t, commandRecord(t, env, a, id)).URL)
	r, err := esp32Updater("").get(link, map[string]string{"x-ESP32-sketch-sha256": strings.ToUpper(sha256Hex(img))}, nil)
	if err != nil || r.status != http.StatusNotModified {
		t.Fatalf("sketch-sha256 of the image: got %v %+v, want 304", err, r)
	}
	r, err = esp32Updater("").get(link, map[string]string{"Range": fmt.Sprintf("bytes=%d-", len(img))}, nil)
	if err != nil || r.status != http.StatusRequestedRangeNotSatisfiable {
		t.Fatalf("range past the end: got %v %+v, want 416", err, r)
	}
	resp, err := http.Head(link)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("HEAD: got %v %+v, want 200", err, resp)
	}
	resp.Body.Close()
	if c := commandRecord(t, env, a, id); c.State != "sent" || c.Progress != nil {
		t.Errorf("command after answers without the image: %s at %s, want sent without progress", c.State, pct(c.Progress))
	}

	// The progress at the first piece: written as soon as the writer can
	// (otaProgress), so waited for; the narrow socket keeps the server
	// from running far ahead meanwhile.
	var first *int64
	flash := &slowFlash{pause: time.Millisecond, each: func(int64) {
		if first == nil {
			eventually(t, 5*time.Second, "the first progress of the range", func() bool {
				first = commandRecord(t, env, a, id).Progress
				return first != nil
			})
		}
	}}
	r, err = slowUpdater().get(link, map[string]string{"Range": fmt.Sprintf("bytes=%d-", len(img)/2)}, flash)
	if err != nil || r.status != http.StatusPartialContent || !bytes.Equal(flash.Bytes(), img[len(img)/2:]) {
		t.Fatalf("range download: got %v %v, %d bytes, want 206 and the second half", err, r, flash.Len())
	}
	if first == nil || *first < 50 || *first >= 100 {
		t.Errorf("progress at the first piece of a range from the middle: %s, want 50 to 99", pct(first))
	}
	waitCommand(t, env, a, id, "running", 100)
}

// TestOTAStockUpdaterWithoutResults: a stock HTTPUpdate client publishes
// nothing during an update. Its download makes the command running; its
// telemetry with the old md5 changes nothing; the new md5 after the
// reboot makes it succeeded. Meanwhile the target changed: last_ota_at is
// still set, because the device did flash that image.
func TestOTAStockUpdaterWithoutResults(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	ts := otaServe(t, env)
	old := otaFirmware(8_000, 60)
	_, oldSum := env.uploadOK(a, map[string]string{"name": "old", "version": "1"}, old)
	img := otaFirmware(200_000, 61)
	sum, _ := otaAssign(t, env, a, "new", "2", img)
	dev := deviceOnline(t, b, env, a)
	id := sendOK(t, env, a, "/ota", nil)

	updater := esp32Updater(oldSum)
	r, err := updater.get(otaLocal(t, ts, otaPayloadOf(t, commandRecord(t, env, a, id)).URL), nil, nil)
	must(t, err)
	if got := updater.verdict(r); got != "updated" {
		t.Fatalf("updater: %q, want updated", got)
	}
	waitCommand(t, env, a, id, "running", 100)
	reportFirmware(t, env, dev, a, oldSum)
	if c := commandRecord(t, env, a, id); c.State != "running" {
		t.Errorf("command after a report of the old md5: %s, want running", c.State)
	}

	// The owner assigns the old image back before the device comes back.
	env.setTarget(a, oldSum)
	env.clock.advance(time.Minute)
	otaAt := env.clock.now().UTC().Format(store.TimeFormat)
	publishWait(t, dev, "devices/"+a.device+"/telemetry", false, fmt.Sprintf(`{"fw_md5":%q}`, sum))
	c := waitCommand(t, env, a, id, "succeeded", -1)
	if c.FinishedAt == nil || *c.FinishedAt != otaAt || c.Result != nil || c.Error != nil {
		t.Errorf("succeeded command: finished %v, result %s, error %v; want finished at %s, no result, no error",
			c.FinishedAt, c.Result, c.Error, otaAt)
	}
	d := getDetail(t, env, a)
	if d.LastOTAAt == nil || *d.LastOTAAt != otaAt {
		t.Errorf("last_ota_at: got %v, want %s", d.LastOTAAt, otaAt)
	}
	if d.CurrentFirmware == nil || d.CurrentFirmware.MD5 == nil || *d.CurrentFirmware.MD5 != sum || d.CurrentFirmware.SHA256 == nil || *d.CurrentFirmware.SHA256 != sha256Hex(img) {
		t.Errorf("current_firmware: %+v, want md5 %s with its sha256", d.CurrentFirmware, sum)
	}
	checkDetailOTA(t, env, a, c)
}

// TestOTAFailedAndTimedOut: ok:false ends an OTA failed; an OTA with no
// end within -ota-timeout (on the server's clock) is timed_out, even one
// whose download ran; an ended OTA stays ended, whatever comes later.
func TestOTAFailedAndTimedOut(t *testing.T) {
	t.Parallel()
	env, _, b := brokerEnv(t)
	a := env.alice
	ts := otaServe(t, env)
	img := otaFirmware(30_000, 70)
	sum, _ := otaAssign(t, env, a, "new", "2", img)
	dev := deviceOnline(t, b, env, a)

	t.Run("ok false", func(t *testing.T) {
		id := sendOK(t, env, a, "/ota", nil)
		publishWait(t, dev, "devices/"+a.device+"/result/"+id, false, `{"ok":false,"error":"Update.end: MD5 check failed"}`)
		c := waitCommand(t, env, a, id, "failed", -1)
		if c.Error == nil || *c.Error != "Update.end: MD5 check failed" {
			t.Errorf("error: got %v, want the device's", c.Error)
		}
		checkDetailOTA(t, env, a, c)
		// A later download of the link does not revive it.
		r, err := esp32Updater("").get(otaLocal(t, ts, otaPayloadOf(t, c).URL), nil, nil)
		if err != nil || r.status != http.StatusOK {
			t.Fatalf("download: %v %+v", err, r)
		}
		if got := commandRecord(t, env, a, id); got.State != "failed" || got.Progress != nil {
			t.Errorf("failed command after a download: %s at %s, want failed as it was", got.State, pct(got.Progress))
		}
	})
	t.Run("nothing within the timeout", func(t *testing.T) {
		silent := sendOK(t, env, a, "/ota", nil)
		downloaded := sendOK(t, env, a, "/ota", nil)
		r, err := esp32Updater("").get(otaLocal(t, ts, otaPayloadOf(t, commandRecord(t, env, a, downloaded)).URL), nil, nil)
		if err != nil || r.status != http.StatusOK {
			t.Fatalf("download: %v %+v", err, r)
		}
		waitCommand(t, env, a, downloaded, "running", 100)
		if c := commandRecord(t, env, a, silent); c.State != "sent" {
			t.Fatalf("older command with the same md5: %s, want sent: the download moves the newest only", c.State)
		}
		env.clock.advance(env.srv.commands.otaTimeout - time.Second)
		time.Sleep(1500 * time.Millisecond) // more than a sweep
		if c := commandRecord(t, env, a, downloaded); c.State != "running" {
			t.Fatalf("command a second before its timeout: %s, want running", c.State)
		}
		env.clock.advance(time.Second)
		for _, id := range []string{silent, downloaded} {
			waitCommand(t, env, a, id, "timed_out", -1)
		}
		checkDetailOTA(t, env, a, commandRecord(t, env, a, downloaded))
		// The device comes back with the image after all: the commands stay ended.
		reportFirmware(t, env, dev, a, sum)
		for _, id := range []string{silent, downloaded} {
			if c := commandRecord(t, env, a, id); c.State != "timed_out" {
				t.Errorf("command %s after the late report: %s, want timed_out", id, c.State)
			}
		}
	})
}

// TestUploadMustBeAnImage: an ESP device takes only an ESP application
// image (0xE9; an ESP8266 also gzip); other platforms take any file. A
// refused upload leaves no row and no file.
func TestUploadMustBeAnImage(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	esp32 := env.alice
	esp8266 := addDevice(t, env, env.alice, "esp8266")
	esp32s3 := addDevice(t, env, env.alice, "esp32s3")
	rp2040 := addDevice(t, env, env.alice, "rp2040")
	elf := append([]byte{0x7F, 'E', 'L', 'F', 1, 1, 1, 0}, bytes.Repeat([]byte{0}, 56)...)
	zip := []byte("PK\x03\x04\x14\x00\x00\x00\x08\x00firmware.bin")
	hex := []byte(":100000000C9434000C9446000C9446000C9446006A\n:00000001FF\n")
	gzip := []byte{0x1F, 0x8B, 0x08, 0x00, 0, 0, 0, 0, 0, 3}
	image := otaFirmware(4096, 80)
	const msg = "The file field must be an ESP application image: a .bin whose first byte is 0xE9 (on an ESP8266 also a .bin.gz)."
	refused, _ := json.Marshal(map[string]any{"message": msg, "errors": map[string][]string{"file": {msg}}})
	tests := []struct {
		name    string
		device  testUser
		content []byte
		ok      bool
	}{
		{"esp32: an .elf", esp32, elf, false},
		{"esp32: a .zip", esp32, zip, false},
		{"esp32: Intel HEX", esp32, hex, false},
		{"esp32: gzip", esp32, gzip, false},
		{"esp32: an image", esp32, image, true},
		{"esp32: one byte 0xE9", esp32, []byte{0xE9}, true},
		{"esp32s3: an .elf", esp32s3, elf, false},
		{"esp32s3: an image", esp32s3, image, true},
		{"esp8266: gzip", esp8266, gzip, true},
		{"esp8266: an image", esp8266, image, true},
		{"esp8266: an .elf", esp8266, elf, false},
		{"esp8266: one byte 0x1F", esp8266, []byte{0x1F}, false},
		{"rp2040: an .elf", rp2040, elf, true},
		{"rp2040: a .zip", rp2040, zip, true},
		{"rp2040: Intel HEX", rp2040, hex, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := dbState(t, env.st)
			w := env.upload(tt.device, map[string]string{"name": tt.name}, tt.content)
			checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st)) // a stored row has its file
			if tt.ok {
				if w.Code != http.StatusCreated {
					t.Errorf("got %d, want 201: %s", w.Code, w.Body)
				}
				return
			}
			checkAnswer(t, w, http.StatusUnprocessableEntity, string(refused))
			sameState(t, "a refused upload", before, dbState(t, env.st)) // no row, no file
		})
	}
}
