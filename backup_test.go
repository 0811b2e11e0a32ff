package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// backupWriter keeps a service busy through its API: uploads to devices
// and to the library, deletes, targets, new devices and tokens, until
// stopped.
type backupWriter struct {
	env    *testEnv
	writes atomic.Int64
	stop   chan struct{}
	done   sync.WaitGroup
}

func startBackupWriter(t *testing.T, env *testEnv) *backupWriter {
	w := &backupWriter{env: env, stop: make(chan struct{})}
	w.done.Add(1)
	go w.loop(t)
	t.Cleanup(w.halt)
	return w
}

func (w *backupWriter) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.done.Wait()
}

func (w *backupWriter) loop(t *testing.T) {
	defer w.done.Done()
	ctx := context.Background()
	a := w.env.alice
	devices := []string{a.device}
	uploaded := map[string][]string{} // device -> md5s, oldest first
	target := map[string]string{}     // device -> md5 of its target
	var library []string              // sha256s, oldest first
	pad := bytes.Repeat([]byte("firmware bytes "), 4<<10)
	for i := 0; ; i++ {
		select {
		case <-w.stop:
			return
		default:
		}
		uid := devices[i%len(devices)]
		content := append([]byte(fmt.Sprintf("\xe9 image %d ", i)), pad...)
		if r := w.env.upload(testUser{device: uid, token: a.token}, map[string]string{"name": "fw " + strconv.Itoa(i)}, content); r.Code != 201 {
			t.Errorf("upload %d: %d %s", i, r.Code, r.Body)
			return
		}
		sum := md5Hex(content)
		uploaded[uid] = append(uploaded[uid], sum)
		if i%4 == 0 {
			if r := w.env.request("POST", "/v1/user/devices/"+uid+"/firmwares/set-target", a.token, map[string]string{"md5": sum}); r.Code != 200 {
				t.Errorf("set-target %d: %d %s", i, r.Code, r.Body)
			}
			target[uid] = sum
		}
		if list := uploaded[uid]; len(list) > 4 {
			old := 0
			if list[0] == target[uid] {
				old = 1 // a target cannot be deleted
			}
			if r := w.env.request("DELETE", "/v1/user/devices/"+uid+"/firmwares/"+list[old], a.token, nil); r.Code != 200 {
				t.Errorf("delete %s: %d %s", list[old], r.Code, r.Body)
			}
			uploaded[uid] = append(list[:old:old], list[old+1:]...)
		}
		if i%3 == 1 {
			image := append([]byte(fmt.Sprintf("\xe9 library image %d ", i)), pad...)
			if r := w.env.uploadToLibrary(a, map[string]string{"name": "lib " + strconv.Itoa(i)}, image); r.Code != 201 {
				t.Errorf("library upload %d: %d %s", i, r.Code, r.Body)
				return
			}
			if library = append(library, sha256Hex(image)); len(library) > 3 {
				if r := w.env.request("DELETE", "/v1/user/firmwares/"+library[0], a.token, nil); r.Code != 200 {
					t.Errorf("library delete %s: %d %s", library[0], r.Code, r.Body)
				}
				library = library[1:]
			}
		}
		if i%5 == 0 {
			uid, err := createDeviceOf(ctx, w.env.st, a.email, "esp32", "devkit", "")
			if err != nil {
				t.Errorf("createDevice: %v", err)
				return
			}
			devices = append(devices, uid)
		}
		if i%3 == 0 {
			if _, _, err := issueToken(ctx, w.env.st, a.id, "writer", nil, nil); err != nil {
				t.Errorf("issueToken: %v", err)
			}
		}
		w.writes.Add(1)
	}
}

// TestBackupDuringWrites takes backups while a service writes, restores
// each into a fresh data directory, and checks that the rows and files
// agree there and that a service started on it works: login, lists, and
// an OTA download signed with the original key.
func TestBackupDuringWrites(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	data := filepath.Dir(firmwareDir(env.st))
	key, err := loadOTAKey(filepath.Join(data, "ota.key"))
	must(t, err)
	w := startBackupWriter(t, env)
	eventually(t, 30*time.Second, "some writes before the first backup", func() bool { return w.writes.Load() >= 10 })

	var backups []string
	var during int64
	for i := 0; i < 3; i++ {
		dir := filepath.Join(t.TempDir(), "backup")
		before := w.writes.Load()
		out := cliOK(t, "", "backup", "-data", data, "-to", dir)
		during += w.writes.Load() - before
		if !strings.HasPrefix(out, "backed up the database and ") {
			t.Errorf("backup printed %q", out)
		}
		backups = append(backups, dir)
	}
	w.halt()
	if t.Failed() {
		return
	}
	if during == 0 {
		t.Fatal("no write happened while a backup ran: the test did not test backing up during writes")
	}
	t.Logf("%d writes in all, %d while a backup ran", w.writes.Load(), during)

	for i, dir := range backups {
		checkOwnerOnly(t, dir, "backup")
		restored := filepath.Join(t.TempDir(), "data")
		// As the README restores one.
		if out, err := exec.Command("cp", "-a", dir, restored).CombinedOutput(); err != nil {
			t.Fatalf("cp -a: %v\n%s", err, out)
		}
		rows := checkRowsAndFiles(t, restored)
		if got, err := os.ReadFile(filepath.Join(restored, "ota.key")); err != nil || !bytes.Equal(got, key) {
			t.Errorf("backup %d: ota.key %x, %v; want the service's key", i, got, err)
		}
		if len(rows) == 0 {
			t.Fatalf("backup %d has no firmware", i)
		}
		checkRestoredService(t, restored, env.alice, key, rows)
	}
}

// checkRowsAndFiles opens a data directory and checks that it is a sound
// database (crashCheckDB) whose firmware rows and files match one to one
// (checkFirmwareFiles); it returns the rows, md5 → uid (the writer's
// uploads are all different).
func checkRowsAndFiles(t *testing.T, dir string) map[string]string {
	t.Helper()
	db := crashOpenDB(t, dir)
	crashCheckDB(t, db)
	must(t, os.MkdirAll(filepath.Join(dir, "firmware", "tmp"), 0o700)) // as serve makes it; a backup need not hold it
	checkFirmwareFiles(t, db, filepath.Join(dir, "firmware"))
	return queryMap(t, db, `SELECT f.md5, d.uid FROM firmwares f JOIN devices d ON d.id = f.device_id`)
}

// checkRestoredService serves the restored data directory and checks
// that it answers like the original: alice logs in, sees her devices and
// their firmwares as the rows say, and a firmware downloads through a
// link signed with the original key.
func checkRestoredService(t *testing.T, dir string, alice testUser, key []byte, rows map[string]string) {
	t.Helper()
	base, _, _ := serveInProcess(t, nil, "-data", dir)
	// The token made before the backup works.
	(&liveClient{base: base, token: alice.token, hc: http.DefaultClient}).want(t, 200, "GET", "/v1/auth/me", "", nil)
	c := &liveClient{base: base, hc: http.DefaultClient}
	var login struct{ Token string }
	json.Unmarshal(c.want(t, 200, "POST", "/v1/auth/login", "application/json",
		[]byte(`{"email":"alice@example.com","password":"alice-password","token_name":"restored"}`)), &login)
	c.token = login.Token
	perDevice := map[string]int{}
	var md5sum, uid string // any one firmware, to download
	for md5sum, uid = range rows {
		perDevice[uid]++
	}
	for uid, n := range perDevice {
		var list struct{ Data []json.RawMessage }
		if json.Unmarshal(c.want(t, 200, "GET", "/v1/user/devices/"+uid+"/firmwares", "", nil), &list); len(list.Data) != n {
			t.Errorf("firmwares of %s on the restored service: %d items; want %d", uid, len(list.Data), n)
		}
	}
	exp := time.Now().Add(time.Hour).Unix()
	path := fmt.Sprintf("/ota/%s/%s.bin?exp=%d&sig=%s", uid, md5sum, exp, otaSignature(key, uid, md5sum, exp))
	if body := c.want(t, 200, "GET", path, "", nil); md5Hex(body) != md5sum {
		t.Errorf("OTA download on the restored service: md5 %s; want %s", md5Hex(body), md5sum)
	}
}

// TestBackupRefuses: a backup goes only into a new or empty directory,
// and needs -to.
func TestBackupRefuses(t *testing.T) {
	t.Parallel()
	data := t.TempDir()
	busy := t.TempDir()
	os.WriteFile(filepath.Join(busy, "notes.txt"), []byte("mine"), 0o644)
	if _, _, err := cliRun(t, nil, "", "backup", "-data", data, "-to", busy); err == nil || !strings.Contains(err.Error(), strconv.Quote(busy)+": the directory is not empty") {
		t.Errorf("backup into a non-empty directory: got %v, want a refusal", err)
	}
	if b, err := os.ReadFile(filepath.Join(busy, "notes.txt")); err != nil || string(b) != "mine" {
		t.Errorf("the refused backup touched the directory's file: %q, %v", b, err)
	}
	if _, _, err := cliRun(t, nil, "", "backup", "-data", data); err == nil || !strings.Contains(err.Error(), "-to is required") {
		t.Errorf("backup without -to: got %v, want a usage error", err)
	}
	// An empty existing directory is fine, and becomes owner-only.
	empty := t.TempDir()
	os.Chmod(empty, 0o755)
	cliOK(t, "", "backup", "-data", data, "-to", empty)
	checkOwnerOnly(t, empty, "backup into an empty directory")
	checkRowsAndFiles(t, empty)
}

// TestFirmwareRemovalWaitsForBackup: a firmware file deleted while a
// backup holds the backup lock stays where the backup finds it (a backup
// of the database taken before the delete needs it), and is removed when
// the backup ends; a command line waits for that.
func TestFirmwareRemovalWaitsForBackup(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	image := []byte("\xe9 an image deleted during a backup")
	_, md5sum := env.uploadOK(env.alice, map[string]string{"name": "doomed"}, image)
	sum := sha256Hex(image)

	unlock, _, err := env.st.LockFirmwareFiles(true, true) // as a backup holds it
	must(t, err)
	t.Cleanup(unlock) // before the store's Close, which waits for the removal
	env.want(t, 200, "DELETE", "/v1/user/devices/"+env.alice.device+"/firmwares/"+md5sum, env.alice.token, nil)
	if _, err := os.Stat(firmwarePath(env.st, sum)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the deleted firmware's file is still in its place: %v", err)
	}
	f, err := env.st.OpenKeptFirmware(sum)
	if err != nil {
		t.Fatalf("a backup running when the firmware was deleted cannot find its file: %v", err)
	}
	kept, err := io.ReadAll(f)
	f.Close()
	if err != nil || !bytes.Equal(kept, image) {
		t.Errorf("the kept file holds %q, %v; want the image", kept, err)
	}

	// A command line waits for the removal before it exits, saying so.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	said := false
	if err := env.st.WaitAsideFiles(ctx, func() { said = true }); err == nil || !said {
		t.Errorf("waiting while the backup runs: %v, said so: %v; want it said, then given up with ctx", err, said)
	}
	unlock()
	must(t, env.st.WaitAsideFiles(context.Background(), func() {}))
	if _, err := env.st.OpenKeptFirmware(sum); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the backup ended and the wait returned, and the file is still kept: %v", err)
	}
}
