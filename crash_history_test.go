package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"
)

// TestCrashKeepsHistory: devices report boots (reset_reason, boot_count)
// and status changes over a real Mosquitto; once the API serves all of
// them, the devicehub binary is killed with SIGKILL and started again on
// the same data directory, and each device's boots, presence intervals
// and status are what the API served before the kill. A kill may lose
// only the open 5-minute bucket of readings (docs/operations.md), which
// this test does not read. Statuses are published without the retained
// flag, so that after the restart only the database can tell them.
func TestCrashKeepsHistory(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds and runs the devicehub binary; skipped with -short")
	}
	broker := startBroker(t)
	bin := crashBuild(t)
	data := t.TempDir()
	const email = "history@example.com"
	crashCLI(t, bin, "user", "add", "-data", data, "-email", email, "-name", "History", "-password", "history-password")
	const devices, bootsEach = 12, 3
	var uids []string
	for i := range devices {
		uids = append(uids, crashCLI(t, bin, "device", "add", "-data", data, "-owner", email, "-platform", "esp32", "-board", "devkit", "-name", fmt.Sprintf("dev-%d", i)))
	}
	token := crashCLI(t, bin, "token", "create", "-data", data, "-email", email, "-name", "history")
	srv := crashStart(t, bin, data, broker.URL())
	c := &liveClient{base: srv.base, token: token, hc: &http.Client{Timeout: 30 * time.Second}}
	device := testClient(t, broker, "history-device", "")

	want := map[string]string{} // uid → the status it ends with
	reasons := []string{"poweron", "panic", "sw"}
	for i, uid := range uids {
		publishWait(t, device, "devices/"+uid+"/status", false, "online")
		for k := range bootsEach {
			publishWait(t, device, "devices/"+uid+"/telemetry", false, fmt.Sprintf(
				`{"rssi":%d,"heap_free":%d,"uptime_s":%d.25,"reset_reason":%q,"boot_count":%d,"metrics":{"temp_c":21.5}}`,
				-50-k, 150000+i, 2+k, reasons[k], 10*i+k+1))
		}
		want[uid] = "online"
		if i%2 == 1 {
			publishWait(t, device, "devices/"+uid+"/status", false, "offline")
			want[uid] = "offline"
		}
	}
	var before map[string]crashHistory
	eventually(t, 20*time.Second, "every boot and status served by the API", func() bool {
		before = crashHistoryOf(t, c, uids)
		for uid, h := range before {
			if len(h.Boots) != bootsEach || h.Status != want[uid] || len(h.Presence) == 0 {
				return false
			}
		}
		return true
	})
	srv.kill()

	srv = crashStart(t, bin, data, broker.URL())
	c.base = srv.base
	crashCheckDB(t, crashOpenDB(t, data))
	after := crashHistoryOf(t, c, uids)
	for _, uid := range uids {
		if b, a := before[uid], after[uid]; !b.equal(a) {
			t.Errorf("device %s after the kill:\n got %+v\nwant %+v (served before the kill)", uid, a, b)
		}
	}
	srv.stop()
}

// crashHistory is what the API serves of a device's history: its status,
// and its boots and presence intervals, each as its JSON.
type crashHistory struct {
	Status          string
	Boots, Presence []string
}

func (h crashHistory) equal(o crashHistory) bool {
	return h.Status == o.Status && slices.Equal(h.Boots, o.Boots) && slices.Equal(h.Presence, o.Presence)
}

// crashHistoryOf reads each device's history through the API.
func crashHistoryOf(t *testing.T, c *liveClient, uids []string) map[string]crashHistory {
	t.Helper()
	read := func(path string, into any) {
		t.Helper()
		body := c.want(t, http.StatusOK, "GET", path, "", nil)
		if err := json.Unmarshal(body, &struct{ Data any }{into}); err != nil {
			t.Fatalf("GET %s: %v: %s", path, err, body)
		}
	}
	texts := func(list []json.RawMessage) []string {
		var s []string
		for _, r := range list {
			s = append(s, string(r))
		}
		return s
	}
	m := map[string]crashHistory{}
	for _, uid := range uids {
		var dev struct{ Status string }
		var boots, presence []json.RawMessage
		read("/v1/user/devices/"+uid, &dev)
		read("/v1/user/devices/"+uid+"/boots?limit=100", &boots)
		read("/v1/user/devices/"+uid+"/presence", &presence)
		m[uid] = crashHistory{dev.Status, texts(boots), texts(presence)}
	}
	return m
}
