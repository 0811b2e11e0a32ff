package main

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"database/sql"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	mrand "math/rand/v2"
	"mime/multipart"
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
)

// ---- crash safety: the real binary, killed with SIGKILL under load ----

// TestCrashSafety runs the devicehub binary under concurrent firmware
// uploads, device edits, button creations and telemetry, kills it with
// SIGKILL, starts it again on the same data directory and checks that the
// database is intact, that every write answered 2xx before the kill is
// there, and that firmware rows and files match one to one.
func TestCrashSafety(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the devicehub binary; skipped with -short")
	}
	broker := startBroker(t)
	bin := crashBuild(t)
	tests := []struct {
		name      string
		killAfter time.Duration // of load before the SIGKILL
	}{
		{"kill after 150ms", 150 * time.Millisecond},
		{"kill after 400ms", 400 * time.Millisecond},
		{"kill after 800ms", 800 * time.Millisecond},
		{"kill after 1500ms", 1500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			crashRound(t, bin, broker, tt.killAfter)
		})
	}
}

// crashAcks is what the server answered 2xx before the kill: the writes
// that must survive it.
type crashAcks struct {
	mu       sync.Mutex
	uploads  []crashUpload
	buttons  []crashButton
	localIPs map[string]map[string]bool // uid → every local_ip published for it
	lost     atomic.Int64               // requests that got no answer: in flight at the kill, or sent after it

	// names holds each device's PATCH progress; each entry is written by
	// that device's one patcher goroutine only (acked under mu).
	names map[string]*crashNames
}

type crashUpload struct {
	uid, name, md5 string
	size           int64
}

type crashButton struct{ uid, id, label string }

// crashNames tracks the sequential PATCHes of one device: names are
// crashName(1), crashName(2), ... sent one at a time.
type crashNames struct {
	initial string
	sent    int // highest counter sent (answered or not)
	acked   int // highest counter answered 200
}

func crashName(k int) string { return fmt.Sprintf("name-%06d", k) }

func (a *crashAcks) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := len(a.uploads) + len(a.buttons)
	for _, p := range a.names {
		n += p.acked
	}
	return n
}

// crashRound provisions a fresh data directory with the CLI, serves it,
// loads it for killAfter, kills the server, restarts it and checks.
func crashRound(t *testing.T, bin string, broker *testBroker, killAfter time.Duration) {
	began := time.Now()
	data := t.TempDir()
	const email = "crash@example.com"
	crashCLI(t, bin, "user", "add", "-data", data, "-email", email, "-name", "Crash", "-password", "crash-password")
	acks := &crashAcks{names: map[string]*crashNames{}, localIPs: map[string]map[string]bool{}}
	var devs []string
	for i := range 3 {
		name := fmt.Sprintf("dev-%d", i)
		uid := crashCLI(t, bin, "device", "add", "-data", data, "-owner", email, "-platform", "esp32", "-board", "devkit", "-name", name)
		devs = append(devs, uid)
		acks.names[uid] = &crashNames{initial: name}
		acks.localIPs[uid] = map[string]bool{}
	}
	token := crashCLI(t, bin, "token", "create", "-data", data, "-email", email, "-name", "crash")

	provisioned := time.Now()
	srv := crashStart(t, bin, data, broker.url())
	c := &crashClient{base: srv.base, token: token, hc: &http.Client{Timeout: 30 * time.Second}}
	device := testClient(t, broker, "crash-device-"+randomString(8, lowerAlnum), "")

	// Deferred in this order so that, should the test stop early, the
	// workers are cancelled first and then waited for.
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var seq atomic.Int64 // makes upload contents and button ids unique
	for range 3 {
		wg.Go(func() { crashUploader(t, ctx, c, devs, &seq, acks) })
	}
	for range 2 {
		wg.Go(func() { crashButtonMaker(t, ctx, c, devs, &seq, acks) })
	}
	for _, uid := range devs {
		wg.Go(func() { crashPatcher(t, ctx, c, uid, acks.names[uid], acks) })
	}
	wg.Go(func() {
		for k := 0; ctx.Err() == nil; k++ {
			for i, uid := range devs {
				ip := fmt.Sprintf("10.%d.%d.%d", i, k/256%256, k%256)
				acks.mu.Lock()
				acks.localIPs[uid][ip] = true
				acks.mu.Unlock()
				device.Publish("devices/"+uid+"/telemetry", 0, false,
					fmt.Sprintf(`{"local_ip":%q,"rssi":%d,"fw_version":"1.%d"}`, ip, -40-k%50, k))
			}
			time.Sleep(5 * time.Millisecond)
		}
	})

	loaded := time.Now()
	time.Sleep(killAfter)
	// On a starved machine the first answer may take longer than
	// killAfter; a kill before any answer would check nothing.
	eventually(t, 20*time.Second, "a write answered 2xx", func() bool { return acks.count() > 0 })
	srv.kill()
	cancel()
	wg.Wait()
	killed := time.Now()

	srv = crashStart(t, bin, data, broker.url())
	c.base = srv.base
	restarted := time.Now()
	crashCheckDB(t, data)
	crashCheckFiles(t, data)
	crashCheckAPI(t, c, acks)
	crashCheckAlive(t, c, device, devs[0])
	srv.stop()
	t.Logf("before the kill: %d uploads, %d buttons answered 201; %d requests unanswered", len(acks.uploads), len(acks.buttons), acks.lost.Load())
	t.Logf("took: provision %v, start %v, load %v, restart %v, check and stop %v",
		provisioned.Sub(began).Round(time.Millisecond), loaded.Sub(provisioned).Round(time.Millisecond),
		killed.Sub(loaded).Round(time.Millisecond), restarted.Sub(killed).Round(time.Millisecond),
		time.Since(restarted).Round(time.Millisecond))
}

// crashUploader uploads distinct random firmwares of random sizes up to
// 1 MiB, round robin over devs, until ctx is done or the server is gone.
func crashUploader(t *testing.T, ctx context.Context, c *crashClient, devs []string, seq *atomic.Int64, acks *crashAcks) {
	for ctx.Err() == nil {
		n := seq.Add(1)
		content := make([]byte, 16+mrand.IntN(1<<20-16))
		rand.Read(content)
		binary.BigEndian.PutUint64(content[1:], uint64(n)) // distinct content
		content[0] = 0xE9                                  // an ESP image
		uid := devs[int(n)%len(devs)]
		name := fmt.Sprintf("fw-%d", n)
		body, ctype := crashMultipart(map[string]string{"name": name, "version": fmt.Sprintf("1.0.%d", n)}, content)
		code, resp, err := c.do(ctx, "POST", "/v1/user/devices/"+uid+"/firmwares", ctype, body)
		if err != nil && code == 0 {
			acks.lost.Add(1)
			return
		}
		want := crashMD5(content)
		if code != http.StatusCreated {
			t.Errorf("upload %s: got %d, want %d: %s", name, code, http.StatusCreated, resp)
			return
		}
		acks.mu.Lock()
		acks.uploads = append(acks.uploads, crashUpload{uid: uid, name: name, md5: want, size: int64(len(content))})
		acks.mu.Unlock()
		var got struct {
			Data struct {
				MD5  string `json:"md5"`
				Size int64  `json:"size"`
			} `json:"data"`
		}
		if err == nil && json.Unmarshal(resp, &got) == nil {
			if got.Data.MD5 != want || got.Data.Size != int64(len(content)) {
				t.Errorf("upload %s: answered md5 %s size %d, want %s size %d", name, got.Data.MD5, got.Data.Size, want, len(content))
			}
		}
	}
}

// crashButtonMaker creates command buttons with unique ids, round robin
// over devs, until ctx is done or the server is gone.
func crashButtonMaker(t *testing.T, ctx context.Context, c *crashClient, devs []string, seq *atomic.Int64, acks *crashAcks) {
	for ctx.Err() == nil {
		n := seq.Add(1)
		uid := devs[int(n)%len(devs)]
		b := crashButton{uid: uid, id: fmt.Sprintf("btn-%d", n), label: fmt.Sprintf("Button %d", n)}
		body, _ := json.Marshal(map[string]any{"id": b.id, "label": b.label, "payload": map[string]any{"cmd": "custom", "n": n}})
		code, resp, err := c.do(ctx, "POST", "/v1/user/devices/"+uid+"/command-buttons", "application/json", body)
		if err != nil && code == 0 {
			acks.lost.Add(1)
			return
		}
		if code != http.StatusCreated {
			t.Errorf("create button %s: got %d, want %d: %s", b.id, code, http.StatusCreated, resp)
			return
		}
		acks.mu.Lock()
		acks.buttons = append(acks.buttons, b)
		acks.mu.Unlock()
	}
}

// crashPatcher renames one device again and again, one PATCH at a time,
// so that the order of its writes is known.
func crashPatcher(t *testing.T, ctx context.Context, c *crashClient, uid string, p *crashNames, acks *crashAcks) {
	for ctx.Err() == nil {
		p.sent++
		body, _ := json.Marshal(map[string]string{"name": crashName(p.sent)})
		code, resp, err := c.do(ctx, "PATCH", "/v1/user/devices/"+uid, "application/json", body)
		if err != nil && code == 0 {
			acks.lost.Add(1)
			return
		}
		if code != http.StatusOK {
			t.Errorf("PATCH %s name %s: got %d, want %d: %s", uid, crashName(p.sent), code, http.StatusOK, resp)
			return
		}
		acks.mu.Lock()
		p.acked = p.sent
		acks.mu.Unlock()
	}
}

// crashCheckDB checks the database file itself, beside the running server.
func crashCheckDB(t *testing.T, data string) {
	t.Helper()
	db := crashOpenDB(t, data)
	rows, err := db.Query("PRAGMA integrity_check")
	if err != nil {
		t.Fatalf("integrity_check: %v", err)
	}
	defer rows.Close()
	var report []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatalf("integrity_check: %v", err)
		}
		report = append(report, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("integrity_check: %v", err)
	}
	if !slices.Equal(report, []string{"ok"}) {
		t.Errorf("PRAGMA integrity_check: got %q, want [ok]", report)
	}
	var violations int
	if err := db.QueryRow("SELECT count(*) FROM pragma_foreign_key_check").Scan(&violations); err != nil {
		t.Fatalf("foreign_key_check: %v", err)
	}
	if violations != 0 {
		t.Errorf("PRAGMA foreign_key_check: got %d violations, want 0", violations)
	}
}

// crashOpenDB opens the data directory's database read-only.
func crashOpenDB(t *testing.T, data string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(data, "devicehub.db")+"?mode=ro&_pragma=busy_timeout(10000)")
	if err != nil {
		t.Fatalf("open db: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// crashCheckFiles checks, once start-up has run, that every firmware row
// has its file with the right md5 and size, that every file has a row,
// and that no unfinished upload is left.
func crashCheckFiles(t *testing.T, data string) {
	t.Helper()
	rows := crashFirmwareRows(t, crashOpenDB(t, data))
	crashCheckFirmwareDir(t, filepath.Join(data, "firmware"), rows)
}

// crashFileRow is what the firmware rows say about one stored file.
type crashFileRow struct {
	md5  string
	size int64
}

// crashFirmwareRows returns the md5 and size of every firmware row's
// sha256 in the database.
func crashFirmwareRows(t *testing.T, db *sql.DB) map[string]crashFileRow {
	t.Helper()
	rows, err := db.Query("SELECT sha256, md5, size FROM firmwares")
	if err != nil {
		t.Fatalf("list firmware rows: %v", err)
	}
	defer rows.Close()
	files := map[string]crashFileRow{}
	for rows.Next() {
		var sha string
		var r crashFileRow
		if err := rows.Scan(&sha, &r.md5, &r.size); err != nil {
			t.Fatalf("list firmware rows: %v", err)
		}
		if old, ok := files[sha]; ok && old != r {
			t.Errorf("firmware rows with sha256 %s: %+v and %+v", sha, old, r)
		}
		files[sha] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("list firmware rows: %v", err)
	}
	return files
}

// crashCheckFirmwareDir checks the firmware directory against the rows'
// sha256s, md5s and sizes: one <sha256>.bin with those bytes per sha256,
// nothing else, and an empty tmp directory.
func crashCheckFirmwareDir(t *testing.T, dir string, rows map[string]crashFileRow) {
	t.Helper()
	for sha, r := range rows {
		b, err := os.ReadFile(filepath.Join(dir, sha+".bin"))
		if err != nil {
			t.Errorf("firmware row %s: %v", sha, err)
			continue
		}
		if got := sha256Hex(b); got != sha {
			t.Errorf("file %s.bin: got sha256 %s, want %s", sha, got, sha)
		}
		if got := crashMD5(b); got != r.md5 {
			t.Errorf("file %s.bin: got md5 %s, want %s", sha, got, r.md5)
		}
		if int64(len(b)) != r.size {
			t.Errorf("file %s.bin: got %d bytes, want %d", sha, len(b), r.size)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read firmware dir: %v", err)
	}
	for _, e := range entries {
		sha, isBin := strings.CutSuffix(e.Name(), ".bin")
		if _, ok := rows[sha]; isBin && !ok {
			t.Errorf("file %s has no firmware row", e.Name())
		}
	}
	tmp, err := os.ReadDir(filepath.Join(dir, "tmp"))
	if err != nil {
		t.Fatalf("read firmware tmp dir: %v", err)
	}
	for _, e := range tmp {
		t.Errorf("firmware/tmp/%s left behind, want firmware/tmp empty", e.Name())
	}
}

// crashCheckAPI checks through the restarted server's API that every
// acknowledged write is there.
func crashCheckAPI(t *testing.T, c *crashClient, acks *crashAcks) {
	t.Helper()
	type fwItem struct {
		Name string `json:"name"`
		MD5  string `json:"md5"`
		Size int64  `json:"size"`
	}
	type buttonItem struct {
		ID    string `json:"id"`
		Label string `json:"label"`
	}
	firmwares := map[string]map[string]fwItem{}   // uid → md5 → item
	buttons := map[string]map[string]buttonItem{} // uid → id → item
	for uid, p := range acks.names {
		var dev struct {
			Data struct {
				Name    string  `json:"name"`
				LocalIP *string `json:"local_ip"`
			} `json:"data"`
		}
		c.getJSON(t, "/v1/user/devices/"+uid, &dev)
		got := dev.Data.Name
		k, err := strconv.Atoi(strings.TrimPrefix(got, "name-"))
		switch {
		case got == p.initial:
			if p.acked > 0 {
				t.Errorf("device %s: got name %q, want %s or later (answered 200)", uid, got, crashName(p.acked))
			}
		case !strings.HasPrefix(got, "name-") || err != nil || k < 1 || k > p.sent:
			t.Errorf("device %s: got name %q, never sent (sent %s..%s)", uid, got, crashName(1), crashName(p.sent))
		case k < p.acked:
			t.Errorf("device %s: got name %q, want %s or later (answered 200)", uid, got, crashName(p.acked))
		}
		if ip := dev.Data.LocalIP; ip != nil && !acks.localIPs[uid][*ip] {
			t.Errorf("device %s: got local_ip %q, never published", uid, *ip)
		}

		var fws struct{ Data []fwItem }
		c.getJSON(t, "/v1/user/devices/"+uid+"/firmwares", &fws)
		firmwares[uid] = map[string]fwItem{}
		for _, f := range fws.Data {
			firmwares[uid][f.MD5] = f
		}
		var bs struct{ Data []buttonItem }
		c.getJSON(t, "/v1/user/devices/"+uid+"/command-buttons", &bs)
		buttons[uid] = map[string]buttonItem{}
		for _, b := range bs.Data {
			buttons[uid][b.ID] = b
		}
	}
	for _, u := range acks.uploads {
		f, ok := firmwares[u.uid][u.md5]
		if !ok {
			t.Errorf("upload %s (md5 %s) answered 201 is missing after the restart", u.name, u.md5)
			continue
		}
		if f.Size != u.size || f.Name != u.name {
			t.Errorf("upload %s: got name %q size %d, want %q size %d", u.md5, f.Name, f.Size, u.name, u.size)
		}
	}
	for _, b := range acks.buttons {
		got, ok := buttons[b.uid][b.id]
		if !ok {
			t.Errorf("button %s of %s answered 201 is missing after the restart", b.id, b.uid)
			continue
		}
		if got.Label != b.label {
			t.Errorf("button %s: got label %q, want %q", b.id, got.Label, b.label)
		}
	}
}

// crashCheckAlive checks that the restarted server takes writes and
// device reports as usual.
func crashCheckAlive(t *testing.T, c *crashClient, device mqtt.Client, uid string) {
	t.Helper()
	ctx := context.Background()
	body, _ := json.Marshal(map[string]string{"name": "after-restart"})
	if code, resp, err := c.do(ctx, "PATCH", "/v1/user/devices/"+uid, "application/json", body); err != nil || code != http.StatusOK {
		t.Errorf("PATCH after restart: got %d (%v), want %d: %s", code, err, http.StatusOK, resp)
	}
	content := []byte("\xe9firmware uploaded after the restart " + randomString(16, alnum))
	form, ctype := crashMultipart(map[string]string{"name": "after-restart"}, content)
	if code, resp, err := c.do(ctx, "POST", "/v1/user/devices/"+uid+"/firmwares", ctype, form); err != nil || code != http.StatusCreated {
		t.Errorf("upload after restart: got %d (%v), want %d: %s", code, err, http.StatusCreated, resp)
	}
	body, _ = json.Marshal(map[string]any{"id": "after-restart", "label": "After", "payload": map[string]string{"cmd": "x"}})
	if code, resp, err := c.do(ctx, "POST", "/v1/user/devices/"+uid+"/command-buttons", "application/json", body); err != nil || code != http.StatusCreated {
		t.Errorf("create button after restart: got %d (%v), want %d: %s", code, err, http.StatusCreated, resp)
	}
	device.Publish("devices/"+uid+"/telemetry", 1, false, `{"local_ip":"192.0.2.1"}`).WaitTimeout(5 * time.Second)
	eventually(t, 10*time.Second, "telemetry applied after the restart", func() bool {
		var dev struct {
			Data struct {
				LocalIP *string `json:"local_ip"`
			} `json:"data"`
		}
		c.getJSON(t, "/v1/user/devices/"+uid, &dev)
		return dev.Data.LocalIP != nil && *dev.Data.LocalIP == "192.0.2.1"
	})
}

// ---- the binary and its processes ----

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
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DEVICEHUB_") {
			env = append(env, kv)
		}
	}
	return env
}

// crashCLI runs an admin command and returns its trimmed stdout.
func crashCLI(t *testing.T, bin string, args ...string) string {
	t.Helper()
	var stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Env = crashEnv()
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("devicehub %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return strings.TrimSpace(string(out))
}

// crashServer is one running `devicehub serve`.
type crashServer struct {
	t    *testing.T
	base string
	cmd  *exec.Cmd
	log  *syncBuffer
	done chan struct{} // closed when the process has been waited for
	err  error         // of cmd.Wait; read after done
}

// crashStart starts `devicehub serve` on a free port, with extra flags
// after the test's own, and waits until it answers /healthz with the
// broker connected.
func crashStart(t *testing.T, bin, data, mqttURL string, extra ...string) *crashServer {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	s := &crashServer{t: t, base: "http://" + addr, log: &syncBuffer{}, done: make(chan struct{})}
	// No quotas: the load uploads and creates more than the defaults allow.
	args := append([]string{"serve", "-addr", addr, "-data", data, "-mqtt", mqttURL, "-public-url", s.base,
		"-max-firmwares", "0", "-max-buttons", "0", "-max-firmware-mib", "0"}, extra...)
	s.cmd = exec.Command(bin, args...)
	s.cmd.Env = crashEnv()
	s.cmd.Stdout = s.log
	s.cmd.Stderr = s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start devicehub: %v", err)
	}
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	t.Cleanup(func() {
		select {
		case <-s.done:
		default:
			s.cmd.Process.Kill()
			<-s.done
		}
		if t.Failed() {
			t.Logf("devicehub serve on %s logged:\n%s", addr, s.log)
		}
	})
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-s.done:
			t.Fatalf("devicehub serve exited at start: %v", s.err)
		default:
		}
		var health struct{ Status, MQTT string }
		if resp, err := hc.Get(s.base + "/healthz"); err == nil {
			err = json.NewDecoder(resp.Body).Decode(&health)
			resp.Body.Close()
			if err == nil && resp.StatusCode == http.StatusOK && health.MQTT == "connected" {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("devicehub serve not ready after 30s (healthz %+v)", health)
		}
		time.Sleep(20 * time.Millisecond)
	}
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

// crashClient calls the API of a crashServer with a token.
type crashClient struct {
	base, token string
	hc          *http.Client
}

// do sends one request. code is the status when an answer arrived (even
// if reading its body then failed), 0 when none did.
func (c *crashClient) do(ctx context.Context, method, path, contentType string, body []byte) (code int, resp []byte, err error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Authorization", "Bearer "+c.token)
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

// getJSON GETs path, wants 200 and decodes the body into v.
func (c *crashClient) getJSON(t *testing.T, path string, v any) {
	t.Helper()
	code, resp, err := c.do(context.Background(), "GET", path, "", nil)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	if code != http.StatusOK {
		t.Fatalf("GET %s: got %d, want %d: %s", path, code, http.StatusOK, resp)
	}
	if err := json.Unmarshal(resp, v); err != nil {
		t.Fatalf("GET %s: %v: %s", path, err, resp)
	}
}

// crashMultipart encodes a firmware upload form.
func crashMultipart(fields map[string]string, content []byte) ([]byte, string) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for k, v := range fields {
		mw.WriteField(k, v)
	}
	fw, _ := mw.CreateFormFile("file", "firmware.bin")
	fw.Write(content)
	mw.Close()
	return buf.Bytes(), mw.FormDataContentType()
}

func crashMD5(b []byte) string {
	h := md5.Sum(b)
	return hex.EncodeToString(h[:])
}

// ---- concurrency: 200 writers at once, in process ----

// cwDevice is one device the concurrent writers act on, and what the
// server answered about it.
type cwDevice struct {
	uid, token string
	userID     int64

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
	env := newTestEnv(t, nil)
	ctx := context.Background()
	devs := []*cwDevice{{uid: env.alice.device, token: env.alice.token, userID: env.alice.id}}
	for i := 1; i <= 2; i++ {
		uid, err := env.st.createDevice(ctx, env.alice.email, "esp32", "devkit", fmt.Sprintf("extra-%d", i), 1883)
		if err != nil {
			t.Fatalf("createDevice: %v", err)
		}
		devs = append(devs, &cwDevice{uid: uid, token: env.alice.token, userID: env.alice.id})
	}
	devs = append(devs, &cwDevice{uid: env.bob.device, token: env.bob.token, userID: env.bob.id})

	// Before the burst: buttons to delete and firmwares to target.
	const preButtons, preFirmwares = 4, 3
	preMD5 := map[string][]string{} // uid → md5s
	for _, d := range devs {
		d.names, d.created, d.deleted = map[string]bool{}, map[string]int{}, map[string]int{}
		d.contested, d.firmwares, d.targets = map[string]bool{}, map[string]int64{}, map[string]bool{}
		for k := range preButtons {
			id := fmt.Sprintf("pre-%d", k)
			w := env.request("POST", "/v1/user/devices/"+d.uid+"/command-buttons", d.token,
				map[string]any{"id": id, "label": id, "payload": map[string]string{"cmd": id}})
			if w.Code != http.StatusCreated {
				t.Fatalf("create %s: got %d, want %d: %s", id, w.Code, http.StatusCreated, w.Body)
			}
			d.created[id]++
		}
		for k := range preFirmwares {
			content := []byte(fmt.Sprintf("\xe9pre-firmware %d of %s", k, d.uid))
			w := env.upload(d.uid, d.token, map[string]string{"name": "pre"}, content)
			if w.Code != http.StatusCreated {
				t.Fatalf("upload pre-firmware: got %d, want %d: %s", w.Code, http.StatusCreated, w.Body)
			}
			d.firmwares[crashMD5(content)] = int64(len(content))
			preMD5[d.uid] = append(preMD5[d.uid], crashMD5(content))
		}
	}
	shared := []byte("\xe9the same firmware, uploaded by many at once")

	// answer fails the test on a 5xx, a "locked" body or a status not in
	// want, and reports whether the status was want[0].
	answer := func(what string, w *httptest.ResponseRecorder, want ...int) bool {
		body := w.Body.String()
		switch {
		case w.Code >= 500:
			t.Errorf("%s: got %d, want %v: %s", what, w.Code, want, body)
		case strings.Contains(strings.ToLower(body), "locked"):
			t.Errorf("%s: got %d %s, want no \"locked\"", what, w.Code, body)
		case !slices.Contains(want, w.Code):
			t.Errorf("%s: got %d, want %v: %s", what, w.Code, want, body)
		}
		return w.Code == want[0]
	}
	upload := func(d *cwDevice, content []byte, want ...int) (string, bool) {
		sum := crashMD5(content)
		w := env.upload(d.uid, d.token, map[string]string{"name": "fw", "version": "1"}, content)
		ok := answer("upload "+sum+" to "+d.uid, w, want...)
		if ok {
			d.record(func() { d.firmwares[sum] = int64(len(content)) })
		}
		return sum, ok
	}
	setTarget := func(d *cwDevice, sum string) {
		w := env.request("POST", "/v1/user/devices/"+d.uid+"/firmwares/set-target", d.token, map[string]string{"md5": sum})
		if answer("set-target "+sum+" on "+d.uid, w, http.StatusOK) {
			d.record(func() { d.targets[sum] = true })
		}
	}
	createButton := func(d *cwDevice, id string, want ...int) bool {
		w := env.request("POST", "/v1/user/devices/"+d.uid+"/command-buttons", d.token,
			map[string]any{"id": id, "label": "L " + id, "payload": map[string]string{"cmd": id}})
		ok := answer("create button "+id+" on "+d.uid, w, want...)
		if ok {
			d.record(func() { d.created[id]++ })
		}
		return ok
	}
	deleteButton := func(d *cwDevice, id string, want ...int) {
		w := env.request("DELETE", "/v1/user/devices/"+d.uid+"/command-buttons/"+id, d.token, nil)
		if answer("delete button "+id+" on "+d.uid, w, want...) {
			d.record(func() { d.deleted[id]++ })
		}
	}

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
					w := env.request("PATCH", "/v1/user/devices/"+d.uid, d.token, map[string]string{"name": name})
					if !answer("PATCH "+d.uid+" name "+name, w, http.StatusOK) {
						continue
					}
					d.record(func() { d.names[name] = true })
					// The answer is "the updated device": this PATCH's name,
					// not that of a PATCH that committed after it.
					var resp struct{ Data struct{ Name string } }
					if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || resp.Data.Name != name {
						t.Errorf("PATCH %s name %s: answered name %q, want %q", d.uid, name, resp.Data.Name, name)
					}
				}
			case 1: // a new button
				createButton(d, fmt.Sprintf("c-%d", i), http.StatusCreated)
			case 2: // a new button, deleted at once
				id := fmt.Sprintf("cd-%d", i)
				if createButton(d, id, http.StatusCreated) {
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
				content[0] = 0xE9
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
					setTarget(d, preMD5[d.uid][round/2%preFirmwares])
				} else if sum, ok := upload(d, []byte(fmt.Sprintf("\xe9target %d %s", i, randomString(8, alnum))), http.StatusCreated); ok {
					setTarget(d, sum)
				}
			}
		})
	}
	close(start)
	wg.Wait()

	allRows := crashFirmwareRows(t, env.st.db)
	crashCheckFirmwareDir(t, env.st.fwDir, allRows)
	for _, d := range devs {
		dev, err := deviceIn(ctx, env.st.read, d.userID, d.uid)
		if err != nil {
			t.Fatalf("deviceOf(%s): %v", d.uid, err)
		}
		if !d.names[dev.Name] {
			t.Errorf("device %s: got name %q, want one of the PATCHes answered 200 %v", d.uid, dev.Name, slices.Sorted(maps.Keys(d.names)))
		}

		// Buttons: each id is there exactly when its 201s outnumber its 200 deletes.
		buttons, err := env.st.buttonsOf(ctx, dev.id)
		if err != nil {
			t.Fatalf("buttonsOf(%s): %v", d.uid, err)
		}
		have := map[string]bool{}
		for _, b := range buttons {
			have[b.ID] = true
		}
		ids := map[string]bool{}
		for id := range d.created {
			ids[id] = true
		}
		for id := range have {
			ids[id] = true
		}
		for id := range ids {
			live := d.created[id] - d.deleted[id]
			if live < 0 || live > 1 {
				t.Errorf("button %s on %s: created %d times (201) and deleted %d times (200), want at most one of each in order", id, d.uid, d.created[id], d.deleted[id])
			}
			if have[id] != (live == 1) {
				t.Errorf("button %s on %s: got exists=%v, want %v (created %d, deleted %d)", id, d.uid, have[id], live == 1, d.created[id], d.deleted[id])
			}
		}
		for id := range d.contested {
			n := d.deleted[id]
			if id == "dup" {
				n = d.created[id]
			}
			if n != 1 {
				t.Errorf("button %s on %s: got %d winning answers among racing writers, want 1", id, d.uid, n)
			}
		}

		// Firmwares: exactly those answered 201, with their files.
		fws, err := env.st.firmwaresOf(ctx, dev.id)
		if err != nil {
			t.Fatalf("firmwaresOf(%s): %v", d.uid, err)
		}
		got := map[string]int64{}
		for _, f := range fws {
			got[f.MD5] = *f.Size
		}
		for sum, size := range d.firmwares {
			if g, ok := got[sum]; !ok || g != size {
				t.Errorf("firmware %s on %s answered 201 (size %d): got in db=%v size %d", sum, d.uid, size, ok, g)
			}
		}
		for sum := range got {
			if _, ok := d.firmwares[sum]; !ok {
				t.Errorf("firmware %s on %s is in the db, but no upload of it was answered 201", sum, d.uid)
			}
		}
		if d.sharedWins != 1 {
			t.Errorf("shared firmware on %s: got %d uploads answered 201, want 1", d.uid, d.sharedWins)
		}

		// Target: a firmware of this device whose set-target was answered 200.
		if len(d.targets) == 0 {
			t.Errorf("device %s: no set-target was answered 200; the test checks nothing", d.uid)
			continue
		}
		var owner int64
		var sum string
		err = env.st.db.QueryRow(`SELECT f.device_id, f.md5 FROM devices d JOIN firmwares f ON f.id = d.target_firmware_id
			WHERE d.uid = ?`, d.uid).Scan(&owner, &sum)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			t.Errorf("device %s: got no target firmware, want one of %v", d.uid, slices.Sorted(maps.Keys(d.targets)))
		case err != nil:
			t.Fatalf("read target of %s: %v", d.uid, err)
		case owner != dev.id:
			t.Errorf("device %s: target firmware belongs to device id %d, want %d", d.uid, owner, dev.id)
		case !d.targets[sum]:
			t.Errorf("device %s: got target %s, want one of %v", d.uid, sum, slices.Sorted(maps.Keys(d.targets)))
		}
	}
}
