package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/brokertest"
	"devicehub/internal/store"
)

// TestCrashSafety runs the devicehub binary under concurrent firmware
// uploads, device edits, button creations and telemetry, kills it with
// SIGKILL, starts it again on the same data directory and checks that the
// database is intact, that every write answered 2xx before the kill is
// there, and that firmware rows and files match one to one.
func TestCrashSafety(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds and runs the devicehub binary; skipped with -short")
	}
	broker := startBroker(t)
	bin := crashBuild(t)
	for _, killAfter := range []time.Duration{150 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, 1500 * time.Millisecond} {
		t.Run(fmt.Sprintf("kill after %v", killAfter), func(t *testing.T) {
			t.Parallel() // each round has its own data directory and server
			crashRound(t, bin, broker, killAfter)
		})
	}
}

// crashAcks is what the server answered 2xx before the kill: the writes
// that must survive it.
type crashAcks struct {
	mu       sync.Mutex
	uploads  map[string]string          // md5 → "uid name size" of uploads answered 201
	buttons  map[string]string          // "uid id" → label of buttons answered 201
	localIPs map[string]map[string]bool // uid → every local_ip published for it
	names    map[string]*crashNames     // uid → its PATCHes, each written by that device's one patcher
	lost     atomic.Int64               // requests that got no answer: in flight at the kill, or sent after it
}

// crashNames tracks the sequential PATCHes of one device: names are
// crashName(1), crashName(2), ... sent one at a time.
type crashNames struct {
	initial string
	sent    int // highest counter sent (answered or not)
	acked   int // highest counter answered 200
}

func crashName(k int) string { return fmt.Sprintf("name-%06d", k) }

func (a *crashAcks) add(fn func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	fn()
}

func (a *crashAcks) count() (n int) {
	a.add(func() {
		n = len(a.uploads) + len(a.buttons)
		for _, p := range a.names {
			n += p.acked
		}
	})
	return n
}

// crashRound provisions a fresh data directory with the CLI, serves it,
// loads it for killAfter, kills the server, restarts it and checks.
func crashRound(t *testing.T, bin string, broker *testBroker, killAfter time.Duration) {
	data := t.TempDir()
	const email = "crash@example.com"
	crashCLI(t, bin, "user", "add", "-data", data, "-email", email, "-name", "Crash", "-password", "crash-password")
	acks := &crashAcks{uploads: map[string]string{}, buttons: map[string]string{}, names: map[string]*crashNames{}, localIPs: map[string]map[string]bool{}}
	var devs []string
	for i := range 3 {
		name := fmt.Sprintf("dev-%d", i)
		uid := crashCLI(t, bin, "device", "add", "-data", data, "-owner", email, "-platform", "esp32", "-board", "devkit", "-name", name)
		devs = append(devs, uid)
		acks.names[uid] = &crashNames{initial: name}
		acks.localIPs[uid] = map[string]bool{}
	}
	token := crashCLI(t, bin, "token", "create", "-data", data, "-email", email, "-name", "crash")

	srv := crashStart(t, bin, data, broker.URL())
	c := &liveClient{base: srv.base, token: token, hc: &http.Client{Timeout: 30 * time.Second}}
	device := testClient(t, broker, "crash-device-"+store.RandomString(8, store.LowerAlnum), "")

	// Deferred in this order so that, should the test stop early, the
	// workers are cancelled first and then waited for.
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var seq atomic.Int64 // makes upload contents and button ids unique
	// write sends writes made by next until ctx is done or one gets no
	// answer, and records those answered with want.
	write := func(want int, next func() (method, path, ct string, body []byte, ack func())) {
		for ctx.Err() == nil {
			method, path, ct, body, ack := next()
			code, resp, err := c.do(ctx, method, path, ct, body)
			if err != nil && code == 0 {
				acks.lost.Add(1)
				return
			}
			if code != want {
				t.Errorf("%s %s: got %d, want %d: %s", method, path, code, want, resp)
				return
			}
			acks.add(ack)
		}
	}
	for range 3 { // distinct random firmwares of up to 1 MiB
		wg.Go(func() {
			write(http.StatusCreated, func() (string, string, string, []byte, func()) {
				n := seq.Add(1)
				content := make([]byte, 16+mrand.IntN(1<<20-16))
				rand.Read(content)
				binary.BigEndian.PutUint64(content[1:], uint64(n)) // distinct content
				content[0] = 0xE9                                  // an ESP image
				uid, name := devs[int(n)%len(devs)], fmt.Sprintf("fw-%d", n)
				body, ct := multipartForm(map[string]string{"name": name}, content)
				return "POST", "/v1/user/devices/" + uid + "/firmwares", ct, body, func() {
					acks.uploads[md5Hex(content)] = fmt.Sprintf("%s %s %d", uid, name, len(content))
				}
			})
		})
	}
	for range 2 { // buttons with unique ids
		wg.Go(func() {
			write(http.StatusCreated, func() (string, string, string, []byte, func()) {
				n := seq.Add(1)
				uid, id := devs[int(n)%len(devs)], fmt.Sprintf("btn-%d", n)
				body, _ := json.Marshal(map[string]any{"id": id, "label": "L " + id, "payload": map[string]any{"n": n}})
				return "POST", "/v1/user/devices/" + uid + "/command-buttons", "application/json", body, func() { acks.buttons[uid+" "+id] = "L " + id }
			})
		})
	}
	for _, uid := range devs { // renames, one at a time per device
		p := acks.names[uid]
		wg.Go(func() {
			write(http.StatusOK, func() (string, string, string, []byte, func()) {
				p.sent++
				k := p.sent
				body, _ := json.Marshal(map[string]string{"name": crashName(k)})
				return "PATCH", "/v1/user/devices/" + uid, "application/json", body, func() { p.acked = k }
			})
		})
	}
	wg.Go(func() {
		for k := 0; ctx.Err() == nil; k++ {
			for i, uid := range devs {
				ip := fmt.Sprintf("10.%d.%d.%d", i, k/256%256, k%256)
				acks.add(func() { acks.localIPs[uid][ip] = true })
				device.Publish("devices/"+uid+"/telemetry", 0, false, fmt.Sprintf(`{"local_ip":%q,"rssi":%d}`, ip, -40-k%50))
			}
			time.Sleep(5 * time.Millisecond)
		}
	})

	time.Sleep(killAfter)
	// On a starved machine the first answer may take longer than
	// killAfter; a kill before any answer would check nothing.
	eventually(t, 20*time.Second, "a write answered 2xx", func() bool { return acks.count() > 0 })
	srv.kill()
	cancel()
	wg.Wait()

	srv = crashStart(t, bin, data, broker.URL())
	c.base = srv.base
	db := crashOpenDB(t, data)
	crashCheckDB(t, db)
	checkFirmwareFiles(t, db, filepath.Join(data, "firmware"))
	crashCheckWrites(t, db, acks)
	crashCheckAlive(t, c, db, device, devs[0])
	srv.stop()
	t.Logf("before the kill: %d uploads, %d buttons answered 201; %d requests unanswered", len(acks.uploads), len(acks.buttons), acks.lost.Load())
}

// crashOpenDB opens the data directory's database read-only, beside the
// running server.
func crashOpenDB(t *testing.T, data string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(data, "devicehub.db")+"?mode=ro&_pragma=busy_timeout(10000)")
	must(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

// crashCheckDB checks the database file itself.
func crashCheckDB(t *testing.T, db *sql.DB) {
	t.Helper()
	var report string
	var violations int
	if err := db.QueryRow("PRAGMA integrity_check").Scan(&report); err != nil || report != "ok" {
		t.Errorf("PRAGMA integrity_check: got %q (%v), want ok", report, err)
	}
	if err := db.QueryRow("SELECT count(*) FROM pragma_foreign_key_check").Scan(&violations); err != nil || violations != 0 {
		t.Errorf("PRAGMA foreign_key_check: got %d violations (%v), want 0", violations, err)
	}
}

// crashCheckWrites checks that every write answered 2xx before the kill
// is in the database, and that no name or address was made up.
func crashCheckWrites(t *testing.T, db *sql.DB, acks *crashAcks) {
	t.Helper()
	uploads := queryMap(t, db, `SELECT f.md5, d.uid || ' ' || f.name || ' ' || f.size FROM firmwares f JOIN devices d ON d.id = f.device_id`)
	for sum, want := range acks.uploads {
		if got := uploads[sum]; got != want {
			t.Errorf("upload %s answered 201: got %q, want %q", sum, got, want)
		}
	}
	buttons := queryMap(t, db, `SELECT d.uid || ' ' || b.id, b.label FROM command_buttons b JOIN devices d ON d.id = b.device_id`)
	for key, want := range acks.buttons {
		if got := buttons[key]; got != want {
			t.Errorf("button %s answered 201: got label %q, want %q", key, got, want)
		}
	}
	for uid, p := range acks.names {
		got := queryMap(t, db, `SELECT name, COALESCE(local_ip, '') FROM devices WHERE uid = ?`, uid)
		for name, ip := range got {
			k, err := strconv.Atoi(strings.TrimPrefix(name, "name-"))
			switch {
			case name == p.initial && p.acked > 0, name != p.initial && (err != nil || k < max(p.acked, 1) || k > p.sent):
				t.Errorf("device %s: got name %q, want %s..%s (answered 200 .. sent)", uid, name, crashName(p.acked), crashName(p.sent))
			}
			if ip != "" && !acks.localIPs[uid][ip] {
				t.Errorf("device %s: got local_ip %q, never published", uid, ip)
			}
		}
	}
}

// crashCheckAlive checks that the restarted server takes writes and
// device reports as usual.
func crashCheckAlive(t *testing.T, c *liveClient, db *sql.DB, device mqtt.Client, uid string) {
	t.Helper()
	c.want(t, http.StatusOK, "PATCH", "/v1/user/devices/"+uid, "application/json", []byte(`{"name":"after-restart"}`))
	form, ct := multipartForm(map[string]string{"name": "after-restart"}, []byte("\xe9uploaded after the restart "+store.RandomString(16, store.Alnum)))
	c.want(t, http.StatusCreated, "POST", "/v1/user/devices/"+uid+"/firmwares", ct, form)
	c.want(t, http.StatusCreated, "POST", "/v1/user/devices/"+uid+"/command-buttons", "application/json",
		[]byte(`{"id":"after-restart","label":"After","payload":{"cmd":"x"}}`))
	publishWait(t, device, "devices/"+uid+"/telemetry", false, `{"local_ip":"192.0.2.1"}`)
	eventually(t, 10*time.Second, "telemetry applied after the restart", func() bool {
		return queryMap(t, db, `SELECT uid, COALESCE(local_ip, '') FROM devices WHERE uid = ?`, uid)[uid] == "192.0.2.1"
	})
}

// crashBuild builds the devicehub binary as it ships (CGO_ENABLED=0).
func crashBuild(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "devicehub")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// crashEnv is the test's environment without DEVICEHUB_* variables, so
// that only the flags configure the binary.
func crashEnv() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "DEVICEHUB_") })
}

// crashCLI runs an admin command and returns its trimmed stdout.
func crashCLI(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = crashEnv()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("devicehub %s: %v", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out))
}

// crashServer is one running `devicehub serve`.
type crashServer struct {
	t    *testing.T
	base string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has been waited for
	err  error         // of cmd.Wait; read after done
}

// crashStart starts `devicehub serve` on a free port, with extra flags
// after the test's own, and waits until it answers /healthz with the
// broker connected.
func crashStart(t *testing.T, bin, data, mqttURL string, extra ...string) *crashServer {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", brokertest.FreePort(t))
	s := &crashServer{t: t, base: "http://" + addr, done: make(chan struct{})}
	// No quotas: the load uploads and creates more than the defaults allow.
	s.cmd = exec.Command(bin, append([]string{"serve", "-addr", addr, "-data", data, "-mqtt", mqttURL, "-public-url", s.base,
		"-max-firmwares", "0", "-max-buttons", "0", "-max-firmware-mib", "0"}, extra...)...)
	s.cmd.Env = crashEnv()
	log := &syncBuffer{}
	s.cmd.Stdout, s.cmd.Stderr = log, log
	must(t, s.cmd.Start())
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	t.Cleanup(func() {
		s.cmd.Process.Kill()
		<-s.done
		if t.Failed() {
			t.Logf("devicehub serve on %s logged:\n%s", addr, log)
		}
	})
	hc := &http.Client{Timeout: time.Second}
	eventually(t, 30*time.Second, "devicehub serve ready with the broker connected", func() bool {
		select {
		case <-s.done:
			t.Fatalf("devicehub serve exited at start: %v", s.err)
		default:
		}
		resp, err := hc.Get(s.base + "/healthz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var health struct{ MQTT string }
		return json.NewDecoder(resp.Body).Decode(&health) == nil && health.MQTT == "connected"
	})
	return s
}

// kill sends SIGKILL and checks that the process was running until then.
func (s *crashServer) kill() {
	s.t.Helper()
	s.cmd.Process.Kill()
	<-s.done
	var ee *exec.ExitError
	if !errors.As(s.err, &ee) {
		s.t.Fatalf("devicehub serve: got %v, want killed by SIGKILL", s.err)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		s.t.Fatalf("devicehub serve ended by itself before the kill: %v", s.err)
	}
}

// stop sends SIGTERM and checks for a clean exit.
func (s *crashServer) stop() {
	s.t.Helper()
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		s.t.Fatalf("devicehub serve still running 15s after SIGTERM")
	}
	if s.err != nil {
		s.t.Errorf("devicehub serve after SIGTERM: got %v, want exit status 0", s.err)
	}
}

// cwDevice is one device the concurrent writers act on, and what the
// server answered about it.
type cwDevice struct {
	u testUser

	mu         sync.Mutex
	names      map[string]bool  // PATCH names answered 200
	created    map[string]int   // button id → creates answered 201
	deleted    map[string]int   // button id → deletes answered 200
	contested  map[string]bool  // button ids with racing creates or deletes: exactly one may win
	firmwares  map[string]int64 // md5 → size, uploads answered 201
	sharedWins int              // uploads of the shared content answered 201
	targets    map[string]bool  // md5s whose set-target was answered 200
}

func (d *cwDevice) record(fn func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	fn()
}

// TestConcurrentWriters sends 200 writes at once (device patches, button
// creates and deletes, uploads, set-target), on the same device and on
// different devices of two users, and checks that none fails with a 5xx or
// "database is locked" and that the final state is what the answers said.
func TestConcurrentWriters(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	devs := []*cwDevice{{u: env.alice}, {u: addDevice(t, env, env.alice, "esp32")}, {u: addDevice(t, env, env.alice, "esp32")}, {u: env.bob}}

	// answered fails the test on a 5xx, a "locked" body or a status not in
	// want; on want[0] it records the write with ack and reports true.
	answered := func(d *cwDevice, what string, w *httptest.ResponseRecorder, ack func(), want ...int) bool {
		if w.Code >= 500 || strings.Contains(strings.ToLower(w.Body.String()), "locked") || !slices.Contains(want, w.Code) {
			t.Errorf("%s on %s: got %d %s, want %v", what, d.u.device, w.Code, w.Body, want)
		}
		if w.Code == want[0] {
			d.record(ack)
		}
		return w.Code == want[0]
	}
	path := func(d *cwDevice, p string) string { return "/v1/user/devices/" + d.u.device + p }
	upload := func(d *cwDevice, content []byte, want ...int) (string, bool) {
		sum := md5Hex(content)
		w := env.upload(d.u, map[string]string{"name": "fw"}, content)
		return sum, answered(d, "upload "+sum, w, func() { d.firmwares[sum] = int64(len(content)) }, want...)
	}
	setTarget := func(d *cwDevice, sum string) {
		w := env.request("POST", path(d, "/firmwares/set-target"), d.u.token, map[string]string{"md5": sum})
		answered(d, "set-target "+sum, w, func() { d.targets[sum] = true }, http.StatusOK)
	}
	createButton := func(d *cwDevice, id string, want ...int) bool {
		w := env.request("POST", path(d, "/command-buttons"), d.u.token, map[string]any{"id": id, "label": "L " + id, "payload": map[string]string{"cmd": id}})
		return answered(d, "create button "+id, w, func() { d.created[id]++ }, want...)
	}
	deleteButton := func(d *cwDevice, id string, want ...int) {
		answered(d, "delete button "+id, env.request("DELETE", path(d, "/command-buttons/"+id), d.u.token, nil), func() { d.deleted[id]++ }, want...)
	}

	// Before the burst: buttons to delete and firmwares to target.
	const preButtons, preFirmwares = 4, 3
	preMD5 := map[*cwDevice][]string{}
	for _, d := range devs {
		d.names, d.created, d.deleted = map[string]bool{}, map[string]int{}, map[string]int{}
		d.contested, d.firmwares, d.targets = map[string]bool{}, map[string]int64{}, map[string]bool{}
		for k := range preButtons {
			createButton(d, fmt.Sprintf("pre-%d", k), http.StatusCreated)
		}
		for k := range preFirmwares {
			sum, _ := upload(d, []byte(fmt.Sprintf("\xe9pre-firmware %d of %s", k, d.u.device)), http.StatusCreated)
			preMD5[d] = append(preMD5[d], sum)
		}
	}
	shared := []byte("\xe9the same firmware, uploaded by many at once")

	const writers = 200
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range writers {
		j := i / 8 // 0..24: spreads each kind of write over the devices
		d := devs[j%len(devs)]
		round := j / len(devs)
		wg.Go(func() {
			<-start
			switch i % 8 {
			case 0: // rename, a few times in a row
				for k := range 4 {
					name := fmt.Sprintf("name-%d-%d", i, k)
					w := env.request("PATCH", path(d, ""), d.u.token, map[string]string{"name": name})
					if !answered(d, "rename to "+name, w, func() { d.names[name] = true }, http.StatusOK) {
						continue
					}
					// The answer is "the updated device": this PATCH's name,
					// not that of a PATCH that committed after it.
					var resp struct{ Data struct{ Name string } }
					if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Data.Name != name {
						t.Errorf("PATCH %s name %s: answered name %q", d.u.device, name, resp.Data.Name)
					}
				}
			case 1: // a new button
				createButton(d, fmt.Sprintf("c-%d", i), http.StatusCreated)
			case 2: // a new button, deleted at once
				if id := fmt.Sprintf("cd-%d", i); createButton(d, id, http.StatusCreated) {
					deleteButton(d, id, http.StatusOK)
				}
			case 3: // the same new button id from several writers
				d.record(func() { d.contested["dup"] = true })
				createButton(d, "dup", http.StatusCreated, http.StatusUnprocessableEntity)
			case 4: // delete a button that existed before; some twice at once
				id := fmt.Sprintf("pre-%d", round%preButtons)
				d.record(func() { d.contested[id] = true })
				deleteButton(d, id, http.StatusOK, http.StatusNotFound)
			case 5: // a new firmware
				content := make([]byte, 1+mrand.IntN(64<<10))
				rand.Read(content)
				content[0] = 0xE9 // an ESP image
				upload(d, content, http.StatusCreated)
			case 6: // the same firmware from several writers, on every device, then targeted
				sum, ok := upload(d, shared, http.StatusCreated, http.StatusUnprocessableEntity)
				if ok {
					d.record(func() { d.sharedWins++ })
				}
				// 201 or 422 "already uploaded": the device has it now. Other
				// devices have rows with the same md5: the target must be this one's.
				setTarget(d, sum)
			case 7: // set-target: an older firmware, or one uploaded now
				if round%2 == 0 {
					setTarget(d, preMD5[d][round/2%preFirmwares])
				} else if sum, ok := upload(d, []byte(fmt.Sprintf("\xe9target %d %s", i, store.RandomString(8, store.Alnum))), http.StatusCreated); ok {
					setTarget(d, sum)
				}
			}
		})
	}
	close(start)
	wg.Wait()

	checkFirmwareFiles(t, storeReader(env.st), firmwareDir(env.st))
	for _, d := range devs {
		cwCheckDevice(t, env, d)
	}
}

// cwCheckDevice checks one device after the burst against what the
// writers were answered.
func cwCheckDevice(t *testing.T, env *testEnv, d *cwDevice) {
	t.Helper()
	ctx := context.Background()
	dev, err := env.st.Device(ctx, d.u.id, d.u.device)
	if err != nil {
		t.Fatalf("deviceIn(%s): %v", d.u.device, err)
	}
	if !d.names[dev.Name] {
		t.Errorf("device %s: got name %q, want one of the PATCHes answered 200 %v", d.u.device, dev.Name, slices.Sorted(maps.Keys(d.names)))
	}

	// Buttons: each id is there exactly when its 201s outnumber its 200 deletes.
	buttons, err := env.st.ButtonsOf(ctx, deviceRefByID(t, env.st, dev.ID))
	must(t, err)
	have := map[string]bool{}
	for _, b := range buttons {
		have[b.ID] = true
		if d.created[b.ID] == 0 {
			t.Errorf("button %s on %s exists, but no create was answered 201", b.ID, d.u.device)
		}
	}
	for id, n := range d.created {
		if live := n - d.deleted[id]; live < 0 || live > 1 || have[id] != (live == 1) {
			t.Errorf("button %s on %s: created %d times (201), deleted %d times (200), exists %v", id, d.u.device, n, d.deleted[id], have[id])
		}
	}
	for id := range d.contested {
		n := map[bool]int{true: d.created[id], false: d.deleted[id]}[id == "dup"]
		if n != 1 {
			t.Errorf("button %s on %s: got %d winning answers among racing writers, want 1", id, d.u.device, n)
		}
	}

	// Firmwares: exactly those answered 201.
	fws, err := env.st.FirmwaresOf(ctx, deviceRefByID(t, env.st, dev.ID))
	must(t, err)
	got := map[string]int64{}
	for _, f := range fws {
		got[*f.MD5] = *f.Size
	}
	if !maps.Equal(got, d.firmwares) {
		t.Errorf("firmwares of %s: got %v, want those answered 201 %v", d.u.device, got, d.firmwares)
	}
	if d.sharedWins != 1 {
		t.Errorf("shared firmware on %s: got %d uploads answered 201, want 1", d.u.device, d.sharedWins)
	}

	// Target: a firmware of this device whose set-target was answered 200.
	if tf := dev.TargetFirmware; tf == nil || !d.targets[*tf.MD5] ||
		scalar(t, env.st, `SELECT device_id FROM firmwares WHERE id = ?`, *tf.ID) != strconv.FormatInt(dev.ID, 10) {
		t.Errorf("device %s: got target %s, want one of its own answered 200 %v", d.u.device, apiJSON(tf), slices.Sorted(maps.Keys(d.targets)))
	}
}
