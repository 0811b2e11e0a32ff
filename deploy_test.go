package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSystemdUnit: deploy/devicehub.service runs 'devicehub serve' as a
// user of its own, on its state directory, hardened, restarted on
// failure, logging to the journal; and systemd-analyze (where installed)
// finds nothing wrong with it.
func TestSystemdUnit(t *testing.T) {
	text, err := os.ReadFile(filepath.Join("deploy", "devicehub.service"))
	must(t, err)
	settings := map[string][]string{}
	for _, line := range strings.Split(string(text), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok && !strings.HasPrefix(line, "#") {
			settings[k] = append(settings[k], v)
		}
	}
	for key, want := range map[string]string{
		"ExecStart":               "/usr/local/bin/devicehub serve",
		"User":                    "devicehub",
		"StateDirectory":          "devicehub",
		"Environment":             "DEVICEHUB_DATA=%S/devicehub",
		"Restart":                 "on-failure",
		"StandardOutput":          "journal",
		"NoNewPrivileges":         "yes",
		"ProtectSystem":           "strict",
		"ProtectHome":             "yes",
		"PrivateTmp":              "yes",
		"PrivateDevices":          "yes",
		"RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
		"SystemCallFilter":        "@system-service",
		"CapabilityBoundingSet":   "",
		"UMask":                   "0077",
	} {
		found := false
		for _, v := range settings[key] {
			found = found || v == want
		}
		if !found {
			t.Errorf("%s=%s missing (have %q)", key, want, settings[key])
		}
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed: the unit's syntax is not checked")
	}
	// verify wants ExecStart to exist: point it at this test binary.
	self, err := os.Executable()
	must(t, err)
	unit := filepath.Join(t.TempDir(), "devicehub.service")
	os.WriteFile(unit, []byte(strings.ReplaceAll(string(text), "/usr/local/bin/devicehub", self)), 0o644)
	cmd := exec.Command(analyze, "verify", unit)
	cmd.Dir = filepath.Dir(unit)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
