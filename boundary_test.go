package main

import (
	"go/ast"
	"go/parser"
	gotoken "go/token"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// sqlText matches a string literal that holds SQL, written as the
// store writes it: keywords in capitals.
var sqlText = regexp.MustCompile(`(?s)\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+(TABLE|INDEX)|PRAGMA\s)`)

// ours is the module's import path: "devicehub" and its packages.
func ours(path string) bool { return path == "devicehub" || strings.HasPrefix(path, "devicehub/") }

// oursAllowed are, for each package but the server, the packages of ours
// its product files may import: the simulator only the device protocol,
// the history the device protocol, the MQTT link the device protocol and
// the history's shapes and rules (it folds a device's readings with
// them), the shapes the history's and the device protocol's, the store
// the shapes and what it stores (history, the MQTT link's reports, the
// device protocol), and the device protocol nothing.
var oursAllowed = map[string][]string{
	"sim":               {"devicehub/internal/wire"},
	"internal/wire":     nil,
	"internal/history":  {"devicehub/internal/wire"},
	"internal/mqttlink": {"devicehub/internal/wire", "devicehub/internal/history"},
	"internal/model":    {"devicehub/internal/wire", "devicehub/internal/history"},
	"internal/store": {"devicehub/internal/model", "devicehub/internal/history",
		"devicehub/internal/mqttlink", "devicehub/internal/wire"},
}

// sqlHomes are the packages whose product files hold SQL and reach the
// database: the store (internal/store) and the history, which keeps its
// own tables (internal/history). The server imports neither database/sql
// nor the SQLite driver: the compiler holds that line for the store's
// rows; this check holds it for SQL written as a string.
var sqlHomes = []string{"internal/store", "internal/history"}

// boundaryViolations returns what the Go source src, the file name in the
// package dir ("." for the server, or a key of oursAllowed), does across
// the lines the packages keep: SQL, database/sql and the SQLite driver
// only in sqlHomes (the MQTT link reaches the database only through its
// Sink, the server only through the store's methods);
// no net/http in the internal packages (the MQTT link, the history, the
// store, the shapes), which know nothing of HTTP; the simulator only in
// simulate.go, which runs it; and oursAllowed.
func boundaryViolations(dir, name string, src []byte) ([]string, error) {
	f, err := parser.ParseFile(gotoken.NewFileSet(), name, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	inStore := slices.Contains(sqlHomes, dir)
	var found []string
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		switch {
		case path == "database/sql" && !inStore:
			found = append(found, "imports database/sql")
		case strings.HasPrefix(path, "modernc.org/sqlite") && !inStore:
			found = append(found, "imports the SQLite driver")
		case path == "net/http" && dir != "." && dir != "sim":
			found = append(found, "imports net/http")
		case dir == "." && path == "devicehub/sim" && name != "simulate.go":
			found = append(found, "imports the simulator (devicehub/sim)")
		case dir != "." && ours(path) && !slices.Contains(oursAllowed[dir], path):
			found = append(found, "imports the server ("+path+")")
		}
	}
	if !inStore {
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == gotoken.STRING && sqlText.MatchString(lit.Value) {
				found = append(found, "holds SQL: "+lit.Value)
			}
			return true
		})
	}
	return found, nil
}

// TestBoundaries holds the product's files to the lines that
// boundaryViolations keeps.
func TestBoundaries(t *testing.T) {
	t.Parallel()
	for _, dir := range append([]string{"."}, slices.Sorted(maps.Keys(oursAllowed))...) {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		must(t, err)
		for _, path := range files {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			src, err := os.ReadFile(path)
			must(t, err)
			found, err := boundaryViolations(dir, filepath.Base(path), src)
			must(t, err)
			for _, v := range found {
				t.Errorf("%s %s", path, v)
			}
		}
	}
}

// TestBoundaryViolations: the check finds each kind of crossing, and lets
// the allowed ones be.
func TestBoundaryViolations(t *testing.T) {
	t.Parallel()
	tests := []struct {
		dir, name, src string
		want           []string
	}{
		{"internal/store", "store_devices.go", "import \"database/sql\"\nvar q = `SELECT uid FROM devices`", nil},
		{".", "store_devices.go", "import \"database/sql\"\nvar q = `SELECT uid FROM devices`", []string{"imports database/sql", "holds SQL: `SELECT uid FROM devices`"}},
		{".", "main.go", `import _ "modernc.org/sqlite"`, []string{"imports the SQLite driver"}},
		{"internal/store", "store.go", `import _ "modernc.org/sqlite"`, nil},
		{"internal/store", "store.go", `import "net/http"`, []string{"imports net/http"}},
		{"internal/model", "types.go", `import "devicehub/internal/store"`, []string{"imports the server (devicehub/internal/store)"}},
		{".", "devices.go", "import \"database/sql\"", []string{"imports database/sql"}},
		{".", "devices.go", "var q = `SELECT uid FROM devices WHERE id = ?`", []string{"holds SQL: `SELECT uid FROM devices WHERE id = ?`"}},
		{".", "admin.go", `var q = "DELETE FROM tokens"`, []string{`holds SQL: "DELETE FROM tokens"`}},
		{".", "admin.go", "var q = `SELECT id,\n\tname FROM tokens`", []string{"holds SQL: `SELECT id,\n\tname FROM tokens`"}},
		{".", "devices.go", `var m = "Select a device from the list."`, nil},
		{".", "devices.go", `var m = "Device not found."`, nil},
		{"internal/mqttlink", "link.go", `import "net/http"`, []string{"imports net/http"}},
		{"internal/mqttlink", "link.go", `import "database/sql"`, []string{"imports database/sql"}},
		{"internal/mqttlink", "link.go", "var q = `UPDATE devices SET status = ?`", []string{"holds SQL: `UPDATE devices SET status = ?`"}},
		{"internal/mqttlink", "link.go", `import "devicehub/internal/wire"`, nil},
		{"internal/mqttlink", "link.go", `import "devicehub/sim"`, []string{"imports the server (devicehub/sim)"}},
		{".", "ota.go", `import "net/http"`, nil},
		{"sim", "sim.go", `import "devicehub"`, []string{"imports the server (devicehub)"}},
		{"sim", "sim.go", `import "net/http"`, nil},
		{"sim", "sim.go", `import "devicehub/internal/wire"`, nil},
		{"sim", "sim.go", `import "devicehub/internal/mqttlink"`, []string{"imports the server (devicehub/internal/mqttlink)"}},
		{".", "commander.go", `import "devicehub/sim"`, []string{"imports the simulator (devicehub/sim)"}},
		{".", "simulate.go", `import "devicehub/sim"`, nil},
		{".", "commander.go", `import "devicehub/internal/wire"`, nil},
		{"internal/wire", "wire.go", `import "devicehub/sim"`, []string{"imports the server (devicehub/sim)"}},
		{"internal/mqttlink", "link.go", `import "devicehub/internal/history"`, nil},
		{"internal/history", "store.go", "import \"database/sql\"\nvar q = `SELECT at FROM boots`", nil},
		{"internal/history", "store.go", `import "devicehub/internal/mqttlink"`, []string{"imports the server (devicehub/internal/mqttlink)"}},
		{"internal/history", "store.go", `import "net/http"`, []string{"imports net/http"}},
		{"internal/wire", "wire.go", `import "encoding/json"`, nil},
		{"sim", "store.go", "var q = `INSERT INTO devices (uid) VALUES (?)`", []string{"holds SQL: `INSERT INTO devices (uid) VALUES (?)`"}},
	}
	for _, tt := range tests {
		got, err := boundaryViolations(tt.dir, tt.name, []byte("package p\n"+tt.src+"\n"))
		must(t, err)
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s/%s %q: got %q, want %q", tt.dir, tt.name, tt.src, got, tt.want)
		}
	}
}

// storeScopeViolations returns the exported methods of *Store in the Go
// source src (a file of internal/store), and what they do against the
// store's rule of team scoping (docs/security.md, "Team scoping in the
// store"): each takes the team it reads or writes (a parameter teamID),
// the user whose own tokens and clients it reads or writes (userID), or a
// *DeviceRef, which only a team-scoped read makes; none takes a bare
// deviceID, rolloutID or webhookID. storeUnscoped are the exceptions,
// each with its reason.
func storeScopeViolations(name string, src []byte) (methods, found []string, err error) {
	f, err := parser.ParseFile(gotoken.NewFileSet(), name, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, nil, err
	}
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Recv == nil || !fn.Name.IsExported() || !isStore(fn.Recv.List[0].Type) {
			continue
		}
		method := fn.Name.Name
		methods = append(methods, method)
		scoped := storeUnscoped[method] != ""
		for _, p := range fn.Type.Params.List {
			for _, n := range p.Names {
				switch {
				case isIdent(p.Type, "int64") && slices.Contains([]string{"deviceID", "rolloutID", "webhookID"}, n.Name):
					found = append(found, method+" takes a bare "+n.Name)
				case isIdent(p.Type, "int64") && (n.Name == "teamID" || n.Name == "userID"), isPointerTo(p.Type, "DeviceRef"):
					scoped = true
				}
			}
		}
		if !scoped {
			found = append(found, method+" takes no team, user or DeviceRef")
		}
	}
	return methods, found, nil
}

// isStore reports whether a method's receiver is Store or *Store.
func isStore(recv ast.Expr) bool { return isIdent(recv, "Store") || isPointerTo(recv, "Store") }

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

func isPointerTo(e ast.Expr, name string) bool {
	star, ok := e.(*ast.StarExpr)
	return ok && isIdent(star.X, name)
}

// The reasons a method of the store takes no team, user or DeviceRef
// (docs/security.md, "Team scoping in the store").
const (
	whyPlumbing = "the store's own working, no team's rows"
	whyFiles    = "firmware files on disk, named by their sha256, for a backup or a shutdown"
	whyCLI      = "the operator's CLI (admin.go, backup.go, simulate.go), trusted with every team: by email or uid"
	whyAuth     = "authentication, before any team is known: by a secret's hash, a token id or an email"
	whyDevice   = "the device's own path (MQTT ingest, OTA download), named by its uid, which the broker or the download authenticated"
	whyEngine   = "a background pass over every team's rows (time-outs, retention, the rollout and webhook engines, the event streams)"
	whyInValue  = "the team is a field of the value it takes (TeamID)"
)

// storeUnscoped are the methods that take no team, user or DeviceRef, and
// why.
var storeUnscoped = map[string]string{
	"Checkpoint": whyPlumbing, "Close": whyPlumbing, "CommandsChanged": whyPlumbing, "CommitInserts": whyPlumbing,
	"PrepareCommandWriter": whyPlumbing, "Kept": whyPlumbing, "MarkRequest": whyPlumbing, "Now": whyPlumbing,
	"Timestamp": whyPlumbing, "FleetCounts": "the fleet's totals for /metrics, no team's rows",

	"LockFirmwareFiles": whyFiles, "NewFirmwareTemp": whyFiles, "OpenKeptFirmware": whyFiles,
	"WaitAsideFiles": whyFiles,

	"CreateUser": whyCLI, "DeleteUser": whyCLI, "SetPassword": whyCLI, "ListUsers": whyCLI, "ListTokens": whyCLI,
	"DeleteToken": whyCLI, "ListDevices": whyCLI, "DeviceUIDsAfter": whyCLI,
	"DeviceUIDsOwnedBy": whyCLI, "RunningImagesOf": whyCLI, "VacuumInto": whyCLI,
	"DeviceTeam": whyCLI,

	"TokenByHash": whyAuth, "TokenByID": whyAuth, "TouchToken": whyAuth, "UserByEmail": whyAuth,
	"KnownClients": whyAuth, "InviteInfo": whyAuth, "ResetInfo": whyAuth, "RedeemInvite": whyAuth, "RedeemReset": whyAuth,

	"ApplyDeviceMessages": whyDevice, "OpenFirmwareFile": whyDevice, "UnfinishedOTAID": whyDevice, "SetOTAProgress": whyDevice,

	"ExpireCommands": whyEngine, "MarkSilentOffline": whyEngine, "RetentionStep": whyEngine, "PruneAudit": whyEngine,
	"PruneInvites": whyEngine, "ActiveRollouts": whyEngine, "CommandEvent": whyEngine, "EnabledWebhooks": whyEngine,
	"EnqueueWebhookEvents": whyEngine, "FinishDelivery": whyEngine, "DisableWebhook": whyEngine,
	"SetOfflineChecked": whyEngine,

	"AddAudit": whyInValue, "AuditLog": whyInValue, "CachedPage": whyInValue, "CreateWebhook": whyInValue,
}

// TestStoreScope holds internal/store's exported methods to the rule
// storeScopeViolations checks; every exception names a method that exists.
func TestStoreScope(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob(filepath.Join("internal", "store", "*.go"))
	must(t, err)
	var all []string
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		src, err := os.ReadFile(path)
		must(t, err)
		methods, found, err := storeScopeViolations(filepath.Base(path), src)
		must(t, err)
		all = append(all, methods...)
		for _, v := range found {
			t.Errorf("%s: %s", path, v)
		}
	}
	for method := range storeUnscoped {
		if !slices.Contains(all, method) {
			t.Errorf("%s is listed as an exception but is no method of *store.Store", method)
		}
	}
}

// TestStoreScopeViolations: the check refuses a method that takes a bare
// id of a device, rollout or webhook, or no team at all, and lets the
// scoped ones and the listed exceptions be.
func TestStoreScopeViolations(t *testing.T) {
	t.Parallel()
	tests := []struct {
		src  string
		want []string
	}{
		{"func (s *Store) SeriesOfID(ctx context.Context, deviceID int64) error", []string{"SeriesOfID takes a bare deviceID", "SeriesOfID takes no team, user or DeviceRef"}},
		{"func (s *Store) BootsOf(ctx context.Context, deviceID, before int64) error", []string{"BootsOf takes a bare deviceID", "BootsOf takes no team, user or DeviceRef"}},
		{"func (s *Store) RolloutFailures(ctx context.Context, teamID, rolloutID int64) error", []string{"RolloutFailures takes a bare rolloutID"}},
		{"func (s *Store) NextQueued(ctx context.Context, teamID int64, webhookID int64) error", []string{"NextQueued takes a bare webhookID"}},
		{"func (s Store) CommandOf(deviceID int64, id string) error", []string{"CommandOf takes a bare deviceID", "CommandOf takes no team, user or DeviceRef"}},
		{"func (s *Store) Lookup(ctx context.Context, id int64) error", []string{"Lookup takes no team, user or DeviceRef"}},
		{"func (s *Store) CommandOf(ctx context.Context, d *DeviceRef, id string) error", nil},
		{"func (s *Store) RolloutFailures(ctx context.Context, teamID, id int64) error", nil},
		{"func (s *Store) TokensOf(ctx context.Context, userID int64) error", nil},
		{"func (s *Store) ButtonsOf(ctx context.Context, deviceID int64) error", []string{"ButtonsOf takes a bare deviceID", "ButtonsOf takes no team, user or DeviceRef"}},
		{"func (s *Store) ExpireCommands(ctx context.Context, now time.Time) error", nil},
		{"func (s *Store) firmwareQuery(deviceID int64) error", nil},
		{"func (w *commandWriter) Write(deviceID int64) error", nil},
		{"func Lookup(deviceID int64) error", nil},
	}
	for _, tt := range tests {
		_, got, err := storeScopeViolations("store.go", []byte("package store\n"+tt.src+" { return nil }\n"))
		must(t, err)
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: got %q, want %q", tt.src, got, tt.want)
		}
	}
}
