package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// cliFleet is a data directory with two users (ann with two devices,
// bob with one), tokens, and firmware files, one of them shared by a
// device of each user. It is made through a store, at the test work
// factor; the commands under test then run on the same directory.
type cliFleet struct {
	dir          string
	st           *store
	ann, bob     int64  // user ids
	annA, annB   string // ann's device uids
	bobA         string
	annTokens    []string
	bobToken     string
	shared, only string // sha256 of a file on annA and bobA; of a file only on annA
}

func newCLIFleet(t *testing.T) *cliFleet {
	t.Helper()
	ctx := context.Background()
	f := &cliFleet{dir: t.TempDir()}
	f.st = storeAt(t, f.dir)
	hash, err := hashPassword("old password", testIterations)
	must(t, err)
	f.ann, err = f.st.createUser(ctx, "Ann Admin", "ann@example.com", "admin", hash)
	must(t, err)
	f.bob, err = f.st.createUser(ctx, "Bob", "bob@example.com", "user", hash)
	must(t, err)
	f.annA, err = f.st.createDevice(ctx, "ann@example.com", "esp32", "devkit", "Porch light", 1883)
	must(t, err)
	f.annB, err = f.st.createDevice(ctx, "ann@example.com", "esp8266", "d1mini", "", 1883)
	must(t, err)
	f.bobA, err = f.st.createDevice(ctx, "bob@example.com", "esp32", "devkit", "", 1883)
	must(t, err)
	for _, name := range []string{"laptop", "ci"} {
		_, tok, err := issueToken(ctx, f.st, f.ann, name, false)
		must(t, err)
		f.annTokens = append(f.annTokens, tok)
	}
	_, f.bobToken, err = issueToken(ctx, f.st, f.bob, "phone", false)
	must(t, err)
	shared := []byte("\xe9 firmware both users have")
	f.shared = addFirmwareFile(t, f.st, f.annA, shared)
	addFirmwareFile(t, f.st, f.bobA, shared)
	f.only = addFirmwareFile(t, f.st, f.annA, []byte("\xe9 firmware only ann's porch light has"))
	return f
}

// run runs the program on the fleet's data directory.
func (f *cliFleet) run(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	return cliRun(t, map[string]string{"DEVICEHUB_DATA": f.dir}, stdin, args...)
}

// ok runs the program like run and returns its stdout, failing the test
// if it fails.
func (f *cliFleet) ok(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	out, stderr, err := f.run(t, stdin, args...)
	if err != nil {
		t.Fatalf("devicehub %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	return out
}

// addFirmwareFile stores content as a firmware of the device with that
// uid, the way an upload does, and returns its sha256.
func addFirmwareFile(t *testing.T, st *store, uid string, content []byte) string {
	t.Helper()
	var deviceID int64
	must(t, st.db.QueryRow(`SELECT id FROM devices WHERE uid = ?`, uid).Scan(&deviceID))
	tmp, err := st.newFirmwareTemp()
	must(t, err)
	sums, _, err := hashToTemp(tmp, bytes.NewReader(content), maxFirmwareSize)
	tmp.Close()
	must(t, err)
	name := "fw " + sums.md5[:6]
	nf := newFirmware{name: &name, md5: sums.md5, sha256: sums.sha256, size: sums.size, tmpPath: tmp.Name()}
	if _, err := st.createFirmware(context.Background(), deviceID, nf); err != nil {
		t.Fatalf("createFirmware: %v", err)
	}
	return sums.sha256
}

// fileExists reports whether path exists, failing the test on other errors.
func fileExists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return err == nil
}

// tableRows splits a command's table output into rows of cells, header first.
func tableRows(out string) [][]string {
	var rows [][]string
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		rows = append(rows, regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1))
	}
	return rows
}

// TestCLIHelp: help, -h, -help and --help print every command, one line
// each, on stdout, and exit 0; so does -h after a command. Each command's
// line names every flag the command defines beyond the configuration flags.
func TestCLIHelp(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"-h"}, {"-help"}, {"--help"}} {
		out, stderr, err := cliRun(t, nil, "", args...)
		if err != nil {
			t.Errorf("%q: got %v, want success (exit 0)", args, err)
		}
		if stderr != "" {
			t.Errorf("%q: stderr %q, want nothing", args, stderr)
		}
		for _, c := range subcommands() {
			re := regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(strings.TrimSpace(c.name+" "+c.args)) + ` +` + regexp.QuoteMeta(c.help) + `$`)
			if n := len(re.FindAllString(out, -1)); n != 1 {
				t.Errorf("%q: command %q on %d lines with its help, want 1:\n%s", args, c.name, n, out)
			}
		}
	}
	noEnv := func(string) string { return "" }
	configFlags := newFlagSet("config", new(config), noEnv, io.Discard)
	for _, cmd := range subcommands() {
		args := append(strings.Fields(cmd.name), "-h")
		_, stderr, err := cliRun(t, nil, "", args...)
		if err != nil {
			t.Errorf("%q: got %v, want success (exit 0)", args, err)
		}
		if !strings.Contains(stderr, "usage: devicehub "+cmd.name) || !strings.Contains(stderr, "-data") {
			t.Errorf("%q: stderr %q, want the command's usage line and its flags", args, stderr)
		}
		c := &cli{stdin: strings.NewReader(""), stdout: io.Discard, stderr: io.Discard}
		c.fs = newFlagSet(cmd.name, &c.cfg, noEnv, io.Discard)
		if err := cmd.run(context.Background(), c, []string{"-h"}); !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%s -h: got %v, want flag.ErrHelp", cmd.name, err)
		}
		c.fs.VisitAll(func(f *flag.Flag) {
			named := regexp.MustCompile(`(^|[\s\[])-` + regexp.QuoteMeta(f.Name) + `\b`)
			if configFlags.Lookup(f.Name) == nil && !named.MatchString(cmd.args) {
				t.Errorf("help line %q for %s does not name its flag -%s", cmd.args, cmd.name, f.Name)
			}
		})
	}
}

// TestCLIUserList lists every user with their counts.
func TestCLIUserList(t *testing.T) {
	f := newCLIFleet(t)
	checkTable(t, "user list", tableRows(f.ok(t, "", "user", "list")), [][]string{
		{"ID", "EMAIL", "ROLE", "DEVICES", "TOKENS", "CREATED", "LAST_LOGIN", "NAME"},
		{"1", "ann@example.com", "admin", "2", "2", "*", "-", "Ann Admin"},
		{"2", "bob@example.com", "user", "1", "1", "*", "-", "Bob"},
	})
}

// checkTable compares rows with want, where "*" matches any cell.
func checkTable(t *testing.T, what string, rows, want [][]string) {
	t.Helper()
	if len(rows) != len(want) {
		t.Fatalf("%s: got %d rows %q, want %d", what, len(rows), rows, len(want))
	}
	for i := range want {
		if len(rows[i]) != len(want[i]) {
			t.Errorf("%s row %d: got %q, want %q", what, i, rows[i], want[i])
			continue
		}
		for j := range want[i] {
			if want[i][j] != "*" && rows[i][j] != want[i][j] {
				t.Errorf("%s row %d: got %q, want %q", what, i, rows[i], want[i])
				break
			}
		}
	}
}

// TestCLIUserPasswd sets a new password from stdin and revokes every
// token of that user, and no one else's.
func TestCLIUserPasswd(t *testing.T) {
	f := newCLIFleet(t)
	ctx := context.Background()
	out := f.ok(t, "new password\n", "user", "passwd", "-email", "ANN@example.com")
	if want := "password of \"ann@example.com\" changed; 2 tokens revoked\n"; out != want {
		t.Errorf("user passwd printed %q, want %q", out, want)
	}
	u, err := f.st.userByEmail(ctx, "ann@example.com")
	must(t, err)
	if !checkPassword(u.passwordHash, "new password") || checkPassword(u.passwordHash, "old password") {
		t.Error("after user passwd: the new password does not check, or the old one still does")
	}
	for _, tok := range f.annTokens {
		if _, err := authenticate(ctx, f.st, tok); !errors.Is(err, errTokenNotFound) {
			t.Errorf("ann's token after user passwd: got %v, want errTokenNotFound", err)
		}
	}
	if _, err := authenticate(ctx, f.st, f.bobToken); err != nil {
		t.Errorf("bob's token after ann's user passwd: %v, want it valid", err)
	}

	// Failures change nothing.
	bob, _ := f.st.userByEmail(ctx, "bob@example.com")
	for _, tt := range []struct {
		stdin string
		args  []string
		want  string
	}{
		{"x\n", []string{"user", "passwd", "-email", "nobody@example.com"}, `no user with email "nobody@example.com"`},
		{"", []string{"user", "passwd", "-email", "bob@example.com"}, "no password on stdin"},
		{"\n", []string{"user", "passwd", "-email", "bob@example.com"}, "empty password"},
		{"x\n", []string{"user", "passwd"}, "-email is required"},
	} {
		if _, _, err := f.run(t, tt.stdin, tt.args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q with stdin %q: got %v, want an error saying %s", tt.args, tt.stdin, err, tt.want)
		}
	}
	if after, _ := f.st.userByEmail(ctx, "bob@example.com"); after.passwordHash != bob.passwordHash {
		t.Error("a failed user passwd changed bob's password")
	}
	if _, err := authenticate(ctx, f.st, f.bobToken); err != nil {
		t.Errorf("bob's token after failed user passwd: %v", err)
	}
}

// TestCLIUserRemove: a user who owns devices is removed only with
// -with-devices, which also deletes the firmware files no one else needs.
func TestCLIUserRemove(t *testing.T) {
	f := newCLIFleet(t)
	_, _, err := f.run(t, "", "user", "remove", "-email", "ann@example.com")
	if err == nil || !strings.Contains(err.Error(), `user "ann@example.com" owns 2 devices`) {
		t.Fatalf("user remove of a user with devices: got %v, want a refusal naming 2 devices", err)
	}
	wantDB(t, f.st, "1", `SELECT count(*) FROM users WHERE id = ?`, f.ann) // the refused remove kept ann
	out := f.ok(t, "", "user", "remove", "-email", "ann@example.com", "-with-devices")
	if want := "removed user \"ann@example.com\" with 2 devices; 1 firmware files deleted\n"; out != want {
		t.Errorf("user remove printed %q, want %q", out, want)
	}
	// None of ann's users, devices, tokens or firmwares rows is left; bob's 3 are.
	wantDB(t, f.st, "0", `SELECT (SELECT count(*) FROM users WHERE id = ?1) + (SELECT count(*) FROM devices WHERE owner_id = ?1) +
		(SELECT count(*) FROM tokens WHERE user_id = ?1) + (SELECT count(*) FROM firmwares WHERE device_id NOT IN (SELECT id FROM devices))`, f.ann)
	wantDB(t, f.st, "3", `SELECT (SELECT count(*) FROM devices) + (SELECT count(*) FROM tokens) + (SELECT count(*) FROM firmwares)`)
	if fileExists(t, f.st.firmwarePath(f.only)) {
		t.Error("the file only ann's device needed is still there")
	}
	if !fileExists(t, f.st.firmwarePath(f.shared)) {
		t.Error("the file bob's device also needs was deleted")
	}

	// bob has a device: without -with-devices he stays; unknown emails fail.
	if _, _, err := f.run(t, "", "user", "remove", "-email", "bob@example.com"); err == nil {
		t.Error("user remove of bob (one device): got success, want a refusal")
	}
	if _, _, err := f.run(t, "", "user", "remove", "-email", "ann@example.com"); err == nil || !strings.Contains(err.Error(), `no user with email "ann@example.com"`) {
		t.Errorf("user remove of a removed user: got %v, want no user", err)
	}
}

// TestCLIDeviceList lists all devices, or one owner's.
func TestCLIDeviceList(t *testing.T) {
	f := newCLIFleet(t)
	out := f.ok(t, "", "device", "list")
	header := []string{"UID", "OWNER", "STATUS", "PLATFORM", "BOARD", "LAST_SEEN", "NAME"}
	checkTable(t, "device list", tableRows(out), [][]string{header,
		{f.annA, "ann@example.com", "pending", "esp32", "devkit", "-", "Porch light"},
		{f.annB, "ann@example.com", "pending", "esp8266", "d1mini", "-", f.annB},
		{f.bobA, "bob@example.com", "pending", "esp32", "devkit", "-", f.bobA},
	})
	checkTable(t, "device list -owner", tableRows(f.ok(t, "", "device", "list", "-owner", "Bob@Example.com")), [][]string{header,
		{f.bobA, "bob@example.com", "pending", "esp32", "devkit", "-", f.bobA}})
	if _, _, err := f.run(t, "", "device", "list", "-owner", "nobody@example.com"); err == nil || !strings.Contains(err.Error(), `no user with email "nobody@example.com"`) {
		t.Errorf("device list -owner unknown: got %v, want no user", err)
	}
}

// TestCLIDeviceRemove deletes a device's rows and the firmware files that no
// other device needs, and keeps the shared one until its last row goes.
func TestCLIDeviceRemove(t *testing.T) {
	f := newCLIFleet(t)
	mustExec(t, f.st, `UPDATE devices SET target_firmware_id = (SELECT id FROM firmwares WHERE sha256 = ? AND device_id = devices.id) WHERE uid = ?`, f.only, f.annA)
	mustExec(t, f.st, `INSERT INTO command_buttons (device_id, id, label, payload) SELECT id, 'b', 'B', '{}' FROM devices WHERE uid = ?`, f.annA)
	out := f.ok(t, "", "device", "remove", f.annA)
	if want := "removed device \"" + f.annA + "\"; 1 firmware files deleted\n"; out != want {
		t.Errorf("device remove printed %q, want %q", out, want)
	}
	// Only bob's firmware is left of the device, firmwares and buttons.
	wantDB(t, f.st, "1", `SELECT (SELECT count(*) FROM devices WHERE uid = ?) + (SELECT count(*) FROM firmwares) + (SELECT count(*) FROM command_buttons)`, f.annA)
	if fileExists(t, f.st.firmwarePath(f.only)) || !fileExists(t, f.st.firmwarePath(f.shared)) {
		t.Error("after removing ann's device: want its own file gone and the one bob's device shares kept")
	}
	// Flags may come after the uid; the last row of the shared file goes.
	cliOK(t, "", "device", "remove", f.bobA, "-data", f.dir)
	if fileExists(t, f.st.firmwarePath(f.shared)) {
		t.Error("the shared file is still there after its last device was removed")
	}
	wantDB(t, f.st, "1", `SELECT count(*) FROM devices`) // ann's other one
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"device", "remove", f.annA}, `no device with uid "` + f.annA + `"`},
		{[]string{"device", "remove"}, "device remove: UID is required"},
		{[]string{"device", "remove", f.annB, "extra"}, `unexpected argument "extra"`},
	} {
		if _, _, err := f.run(t, "", tt.args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: got %v, want an error saying %s", tt.args, err, tt.want)
		}
	}
}

// TestCLITokens lists tokens without their secrets and revokes one by id.
func TestCLITokens(t *testing.T) {
	f := newCLIFleet(t)
	out := f.ok(t, "", "token", "list")
	header := []string{"ID", "EMAIL", "CREATED", "LAST_USED", "NAME"}
	checkTable(t, "token list", tableRows(out), [][]string{header,
		{"1", "ann@example.com", "*", "-", "laptop"},
		{"2", "ann@example.com", "*", "-", "ci"},
		{"3", "bob@example.com", "*", "-", "phone"},
	})
	for _, tok := range append(f.annTokens, f.bobToken) {
		_, secret, _ := strings.Cut(tok, "|")
		if strings.Contains(out, secret) {
			t.Errorf("token list shows a secret: %q", out)
		}
	}
	checkTable(t, "token list -email", tableRows(f.ok(t, "", "token", "list", "-email", "bob@example.com")), [][]string{header, {"3", "bob@example.com", "*", "-", "phone"}})

	ctx := context.Background()
	if out := f.ok(t, "", "token", "revoke", "1"); out != "revoked token 1\n" {
		t.Fatalf("token revoke 1: got %q", out)
	}
	if _, err := authenticate(ctx, f.st, f.annTokens[0]); !errors.Is(err, errTokenNotFound) {
		t.Errorf("revoked token: got %v, want errTokenNotFound", err)
	}
	if _, err := authenticate(ctx, f.st, f.annTokens[1]); err != nil {
		t.Errorf("ann's other token after revoking one: %v", err)
	}
	for _, tt := range []struct {
		arg, want string
	}{
		{"1", `no token with id "1"`},
		{"99", `no token with id "99"`},
		{f.annTokens[1], strconv.Quote(f.annTokens[1]) + " is not a token id"},
		{"0", `"0" is not a token id`},
	} {
		if _, _, err := f.run(t, "", "token", "revoke", tt.arg); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("token revoke %q: got %v, want an error saying %s", tt.arg, err, tt.want)
		}
	}
	wantDB(t, f.st, "2", `SELECT count(*) FROM tokens`)
}

// TestCLIErrorsQuoteInput: every message that repeats what the user typed
// quotes it the same way, as Go's %q does.
func TestCLIErrorsQuoteInput(t *testing.T) {
	f := newCLIFleet(t)
	odd := "no one@example.com"
	for _, args := range [][]string{
		{"user", "passwd", "-email", odd},
		{"user", "remove", "-email", odd},
		{"device", "list", "-owner", odd},
		{"device", "add", "-owner", odd, "-platform", "esp32", "-board", "devkit"},
		{"token", "create", "-email", odd, "-name", "t"},
		{"token", "list", "-email", odd},
		{"user", "add", "-email", odd, "-name", "N"},
		{"device", "remove", odd},
		{"token", "revoke", odd},
		{"device", "add", "-owner", "ann@example.com", "-platform", odd, "-board", "devkit"},
	} {
		_, _, err := f.run(t, "pw\n", args...)
		if err == nil || !strings.Contains(err.Error(), strconv.Quote(odd)) {
			t.Errorf("%q: got %v, want an error quoting %s", args, err, strconv.Quote(odd))
		}
	}
}

// TestCLILeavesServiceFilesAlone: an admin command run beside the service
// does not sweep the firmware directory. An upload in progress and a file
// the service has just moved into place (its row not yet committed) look
// unused from outside; deleting them broke uploads.
func TestCLILeavesServiceFilesAlone(t *testing.T) {
	f := newCLIFleet(t)
	upload, err := f.st.newFirmwareTemp()
	must(t, err)
	upload.WriteString("\xe9 half an upload")
	upload.Close()
	placed := f.st.firmwarePath(sha256Hex([]byte("\xe9 a file whose row is being committed")))
	must(t, os.WriteFile(placed, []byte("\xe9 a file whose row is being committed"), 0o600))
	for _, args := range [][]string{{"user", "list"}, {"device", "list"}, {"token", "list"}, {"device", "remove", f.annB}} {
		if _, _, err := f.run(t, "", args...); err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		if !fileExists(t, upload.Name()) || !fileExists(t, placed) {
			t.Fatalf("after %q: the upload in progress or the file just placed is gone", args)
		}
	}
}
