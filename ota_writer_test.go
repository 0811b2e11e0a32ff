package main

// OTA downloads never wait for the database (issue 35): the progress is
// kept in memory (otaProgress) and written when the writer is free.

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/json"
	"net/http"
	"sync"
	"testing"
	"time"
)

// holdWriter holds the store's writer, as a prune, a large batch or a
// checkpoint does: its one connection, in a write transaction, until
// release (also called when the test ends).
func holdWriter(tb testing.TB, st *store.Store) (release func()) {
	tb.Helper()
	ctx := context.Background()
	conn, err := storeWriter(st).Conn(ctx)
	must(tb, err)
	_, err = conn.ExecContext(ctx, `BEGIN IMMEDIATE`)
	must(tb, err)
	release = sync.OnceFunc(func() {
		conn.ExecContext(ctx, `ROLLBACK`)
		conn.Close()
	})
	tb.Cleanup(release)
	return release
}

// pauseMeter is where an updater writes the image, a piece of 4 KiB at a
// time: it takes each at a device's pace (pause after it) and keeps the
// longest wait for a piece, counted from last (set it when the request
// is sent), so the wait for the answer's first bytes counts too.
type pauseMeter struct {
	n       int
	pause   time.Duration
	last    time.Time
	longest time.Duration
}

func (m *pauseMeter) Write(p []byte) (int, error) {
	m.longest = max(m.longest, time.Since(m.last))
	m.n += len(p)
	time.Sleep(m.pause)
	m.last = time.Now()
	return len(p), nil
}

// otaHeldEnv is alice's device with an OTA command for a 1.5 MB image,
// and the command's download link on a server with narrow sockets (its
// bytes cannot all sit in a socket buffer while the server waits).
func otaHeldEnv(tb testing.TB) (env *testEnv, id, link string, img []byte) {
	env = newTestEnv(tb, &recordingLink{})
	img = otaFirmware(1_500_000, 80)
	otaAssign(tb, env, env.alice, "new", "2", img)
	env.setStatus(env.alice.device, string(model.StatusOnline))
	id = sendOK(tb, env, env.alice, "/ota", nil)
	c, err := env.st.CommandOf(context.Background(), env.deviceRef(env.alice), id)
	must(tb, err)
	var p otaPayload
	must(tb, json.Unmarshal(c.Payload, &p))
	return env, id, otaLocal(tb, otaServeNarrow(tb, env), p.URL), img
}

// TestOTANeverWaitsForTheWriter: a 1.5 MB download runs to its end while
// the writer is held; its progress, kept meanwhile, is written once the
// writer is free, the last of it included. Before, the download stopped at
// its first byte until the writer was released: an updater's read timeout
// then failed the update.
func TestOTANeverWaitsForTheWriter(t *testing.T) {
	t.Parallel()
	env, id, link, img := otaHeldEnv(t)
	release := holdWriter(t, env.st)
	done := make(chan error, 1)
	flash := &slowFlash{}
	go func() {
		r, err := slowUpdater().get(link, nil, flash)
		if err == nil && (r.status != http.StatusOK || flash.Len() != len(img)) {
			t.Errorf("download: %d, %d bytes; want 200 and %d", r.status, flash.Len(), len(img))
		}
		done <- err
	}()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(20 * time.Second): // a failure's bound, never reached when it works
		release()
		t.Fatal("the download did not end while the writer was held: it waited for the database")
	}
	if c := commandRecord(t, env, env.alice, id); c.State != "sent" {
		t.Errorf("command while the writer is still held: %s at %s, want sent: nothing written yet", c.State, pct(c.Progress))
	}
	release()
	waitCommand(t, env, env.alice, id, "running", 100)
}

// BenchmarkOTAWhileWriterHeld: an updater downloads a 1.5 MB image 4 KiB
// at a time, pausing 5 ms after each piece as a flash write does (about 4 s
// in all),
// while the writer is held for the first 2 s. max-pause-ms is the longest
// the updater waited for a piece, the answer's first bytes included (goal:
// at most 100 ms).
func BenchmarkOTAWhileWriterHeld(b *testing.B) {
	env, _, link, img := otaHeldEnv(b)
	var longest time.Duration
	for b.Loop() {
		release := holdWriter(b, env.st)
		held := time.AfterFunc(2*time.Second, release)
		m := &pauseMeter{pause: 5 * time.Millisecond, last: time.Now()}
		r, err := slowUpdater().get(link, nil, m)
		if err != nil || r.status != http.StatusOK || m.n != len(img) {
			b.Fatalf("download: %v %+v, %d bytes; want 200 and %d", err, r, m.n, len(img))
		}
		longest = max(longest, m.longest)
		if held.Stop() {
			release()
		}
	}
	b.ReportMetric(float64(longest.Microseconds())/1000, "max-pause-ms")
}

// TestOTAProgressWrittenAtStop: progress still in memory when the service
// stops is written before its engines return (the store closes after
// them): a download's last progress is never lost.
func TestOTAProgressWrittenAtStop(t *testing.T) {
	t.Parallel()
	env, id, _, _ := otaHeldEnv(t)
	p := newOTAProgress(env.st, env.srv.events, env.log)
	p.set(id, 40)
	p.set(id, 70) // the newer replaces it
	<-p.kick      // taken, as if a write had just begun: what is left is the stop's to write
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p.run(ctx)
	if c := commandRecord(t, env, env.alice, id); c.State != "running" || c.Progress == nil || *c.Progress != 70 {
		t.Errorf("command after the stop: %s at %s, want running at 70%%", c.State, pct(c.Progress))
	}
}
