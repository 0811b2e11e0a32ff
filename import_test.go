package main

import (
	"context"
	"devicehub/internal/store"
	"io"
	"strings"
	"testing"
	"time"
)

// TestDeviceImport imports a good file, then bad ones: each names its
// line and leaves the database as it was, also when good rows came first.
func TestDeviceImport(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st := storeAt(t, dir)
	ctx := context.Background()
	_, err := st.CreateUser(ctx, "Ann", "ann@example.com", "user", "x", "")
	must(t, err)
	team := scalar(t, st, `SELECT team_id FROM users WHERE email = 'ann@example.com'`)
	importCSV := func(csv string, args ...string) (string, error) {
		out, _, err := cliRun(t, nil, csv, append([]string{"device", "import", "-data", dir, "-owner", "ann@example.com"}, args...)...)
		return out, err
	}

	out, err := importCSV("uid,name,platform,board\nesp32_kitchen01,Kitchen,esp32,devkitc\n,,esp8266,d1\n,\"Hall, left\",esp32,devkitc\n", "-mqtt-port", "8883")
	if err != nil || out != "imported 3 devices\n" {
		t.Fatalf("import: got %q, %v; want \"imported 3 devices\\n\"", out, err)
	}
	wantDB(t, st, team+" Kitchen esp32 devkitc pending {\"mqtt_port\":8883}", `SELECT d.team_id || ' ' || d.name || ' ' || p.key || ' ' || b.key
		|| ' ' || d.status || ' ' || d.meta FROM devices d JOIN platforms p ON p.id = platform_id JOIN boards b ON b.id = board_id WHERE uid = 'esp32_kitchen01'`)
	wantDB(t, st, "1", `SELECT count(*) FROM devices WHERE uid GLOB 'esp8266_*' AND name = uid AND team_id = ?`, team)
	wantDB(t, st, "1", `SELECT count(*) FROM devices WHERE uid GLOB 'esp32_*' AND name = 'Hall, left'`)
	wantDB(t, st, "esp8266", `SELECT name FROM platforms WHERE key = 'esp8266'`)

	good := "uid,name,platform,board\n,,esp32,devkitc\n,,esp32,devkitc\n"
	tests := []struct{ name, csv, want string }{
		{"empty input", "", "no header line"},
		{"wrong header", "uid,name,board,platform\n", `line 1: header "uid,name,board,platform"`},
		{"too few columns", good + ",,esp32\n", "record on line 4: wrong number of fields"},
		{"too many columns", good + ",,esp32,devkitc,x\n", "record on line 4: wrong number of fields"},
		{"bad platform key", good + ",,esp 32,devkitc\n", `line 4: platform "esp 32"`},
		{"bad board key", good + ",,esp32,\n", `line 4: board ""`},
		{"uid of another platform", good + "esp8266_abc,,esp32,devkitc\n", `line 4: uid "esp8266_abc": want empty, or esp32_`},
		{"uid with capitals", good + "esp32_ABC,,esp32,devkitc\n", `line 4: uid "esp32_ABC"`},
		{"uid too long", good + "esp32_" + strings.Repeat("a", 33) + ",,esp32,devkitc\n", "line 4: uid"},
		{"uid twice in the file", good + "esp32_twin,,esp32,devkitc\nesp32_twin,,esp32,devkitc\n", `line 5: uid "esp32_twin" is taken`},
		{"uid of an existing device", good + "esp32_kitchen01,,esp32,devkitc\n", `line 4: uid "esp32_kitchen01" is taken`},
		{"name too long", good + "," + strings.Repeat("n", 256) + ",esp32,devkitc\n", "line 4: name"},
		{"unknown owner", good, `no user with email "bob@example.com"`},
		{"broker logins on", good, "does not run with -mqtt-dynsec"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := dbState(t, st)
			var args []string
			switch tt.name {
			case "unknown owner":
				args = []string{"-owner", "bob@example.com"}
			case "broker logins on":
				args = []string{"-mqtt-dynsec"}
			}
			out, err := importCSV(tt.csv, args...)
			if err == nil || !strings.Contains(err.Error(), tt.want) || out != "" {
				t.Errorf("got %q, %v; want no output and an error with %q", out, err, tt.want)
			}
			sameState(t, "a failed import", before, dbState(t, st))
			wantDB(t, st, "3", `SELECT count(*) FROM devices`)
		})
	}
}

// writeOnRead is stdin that, when first read, writes to the database as a
// running service would: its error, nil when the write went through.
type writeOnRead struct {
	st      *store.Store
	rest    io.Reader
	written bool
	err     error
}

func (r *writeOnRead) Read(p []byte) (int, error) {
	if !r.written {
		r.written = true
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, r.err = r.st.CreateUser(ctx, "Bo", "bo@example.com", "user", "x", "")
	}
	return r.rest.Read(p)
}

// TestDeviceImportSlowStdin: the import reads its input before it takes
// the database's write lock, so that a service writing meanwhile is not
// held up by a slow stdin.
func TestDeviceImportSlowStdin(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st := storeAt(t, dir)
	_, err := st.CreateUser(context.Background(), "Ann", "ann@example.com", "user", "x", "")
	must(t, err)
	in := &writeOnRead{st: st, rest: strings.NewReader("uid,name,platform,board\n,,esp32,devkitc\n")}
	var out, errOut strings.Builder
	err = run(context.Background(), []string{"device", "import", "-data", dir, "-owner", "ann@example.com"},
		func(string) string { return "" }, in, &out, &errOut)
	if err != nil || in.err != nil {
		t.Fatalf("import: %v %s; a write while it read stdin: %v, want both to go through", err, errOut.String(), in.err)
	}
}
