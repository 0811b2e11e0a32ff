package main

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// otaLinkLifetime is how long a download link in an ota command works.
const otaLinkLifetime = 24 * time.Hour

// loadOTAKey reads the link-signing key from path, creating a random one
// the first time.
func loadOTAKey(path string) ([]byte, error) {
	key, err := os.ReadFile(path)
	if err == nil && len(key) == 32 {
		return key, nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("read ota key: %w", err)
	}
	if err == nil {
		return nil, fmt.Errorf("ota key %s: want 32 bytes, have %d", path, len(key))
	}
	key = make([]byte, 32)
	rand.Read(key)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create ota key: %w", err)
	}
	if _, err := f.Write(key); err != nil {
		f.Close()
		return nil, fmt.Errorf("write ota key: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return nil, fmt.Errorf("write ota key: %w", err)
	}
	return key, f.Close()
}

// otaSignature binds a download to one device, one md5 and an expiry.
func otaSignature(key []byte, uid, md5sum string, expires int64) string {
	m := hmac.New(sha256.New, key)
	fmt.Fprintf(m, "%s\n%s\n%d", uid, md5sum, expires)
	return hex.EncodeToString(m.Sum(nil))
}

// otaLinks signs the download links of ota commands and checks them when
// a device comes to download.
type otaLinks struct {
	key     []byte // ota.key of the data directory
	baseURL string // how devices reach this server, without a trailing slash
	now     func() time.Time
}

// url is the absolute, signed link a device downloads firmware md5sum from.
func (l *otaLinks) url(uid, md5sum string) string {
	exp := l.now().Add(otaLinkLifetime).Unix()
	q := url.Values{"exp": {strconv.FormatInt(exp, 10)}, "sig": {otaSignature(l.key, uid, md5sum, exp)}}
	return l.baseURL + "/ota/" + url.PathEscape(uid) + "/" + md5sum + ".bin?" + q.Encode()
}

// valid reports whether exp and sig are those of a link url issued for
// uid and md5sum, and the link has not expired.
func (l *otaLinks) valid(uid, md5sum string, q url.Values) bool {
	exp, err := strconv.ParseInt(q.Get("exp"), 10, 64)
	want := otaSignature(l.key, uid, md5sum, exp)
	return err == nil && hmac.Equal([]byte(q.Get("sig")), []byte(want)) && l.now().Unix() < exp
}

// handleOTADownload serves GET /ota/{uid}/{md5}.bin?exp=…&sig=…, the link
// of an ota command, the way the ESP32 and ESP8266 HTTP updaters expect:
// 200 with Content-Length and x-MD5, 206 for a Range, 304 when the
// sketch-md5 or sketch-sha256 header says the device already runs it. The
// file is streamed from disk, and the bytes served move the device's OTA
// command to running with their progress, written when the writer can
// (otaProgress): the bytes never wait for it.
func (s *server) handleOTADownload(w http.ResponseWriter, r *http.Request) error {
	uid := r.PathValue("uid")
	md5sum, _ := strings.CutSuffix(r.PathValue("file"), ".bin")
	if !s.ota.valid(uid, md5sum, r.URL.Query()) {
		return errBadLink
	}
	f, sha, err := s.store.OpenFirmwareFile(r.Context(), uid, md5sum)
	if err != nil {
		return err
	}
	defer f.Close()
	if runsAlready(r.Header, md5sum, sha) {
		w.Header().Del("Content-Type")
		w.WriteHeader(http.StatusNotModified)
		return nil
	}
	info, err := f.Stat()
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("x-MD5", md5sum)
	tracker := &otaTracker{st: s.store, progress: s.otaProgress, log: s.log, ctx: context.WithoutCancel(r.Context()), uid: uid, md5: md5sum}
	pw := &progressWriter{ResponseWriter: w, f: f, size: info.Size(), report: tracker.report}
	// No modification time: the content of a sha256-named file never changes.
	http.ServeContent(pw, r, "", time.Time{}, f)
	return nil
}

// progressWriter is the ResponseWriter that http.ServeContent writes the
// firmware file f to. It hands the body on a tenth of the file at a time,
// each tenth still sent with sendfile, and tells report how far into the
// file the bytes served have come, as a percentage (a Range request
// counts from its offset): as the body starts, then at every new tenth.
type progressWriter struct {
	http.ResponseWriter
	f        *os.File
	size     int64
	status   int   // as written; a body of another status than 200 or 206 is no download
	reported int64 // the last percentage reported
	started  bool  // whether anything was reported yet
	report   func(percent int64)
}

func (p *progressWriter) WriteHeader(status int) {
	p.status = status
	p.ResponseWriter.WriteHeader(status)
}

// ReadFrom is how ServeContent sends the body: from an *io.LimitedReader
// on f, or, for a multi-range answer, from a pipe, which goes through
// Write.
func (p *progressWriter) ReadFrom(src io.Reader) (int64, error) {
	lr, onFile := src.(*io.LimitedReader)
	rf, canSend := p.ResponseWriter.(io.ReaderFrom)
	if !onFile || lr.R != io.Reader(p.f) || !canSend {
		return io.Copy(writerOnly{p}, src)
	}
	step := max((p.size+9)/10, 1) // a tenth, rounded up: each step reaches the next tenth
	var sent int64
	p.served() // the download starts
	for lr.N > 0 {
		n, err := rf.ReadFrom(&io.LimitedReader{R: p.f, N: min(lr.N, step)})
		sent += n
		lr.N -= n
		p.served()
		if err != nil || n == 0 {
			return sent, err
		}
	}
	return sent, nil
}

func (p *progressWriter) Write(b []byte) (int, error) {
	n, err := p.ResponseWriter.Write(b)
	if n > 0 {
		p.served()
	}
	return n, err
}

// served reports the position in f, where the bytes served so far end.
func (p *progressWriter) served() {
	if p.status != 0 && p.status != http.StatusOK && p.status != http.StatusPartialContent {
		return
	}
	pos, err := p.f.Seek(0, io.SeekCurrent)
	if err != nil || p.size <= 0 {
		return
	}
	pct := min(pos*100/p.size, 100)
	if !p.started || pct/10 > p.reported/10 {
		p.started, p.reported = true, pct
		p.report(pct)
	}
}

// writerOnly hides a writer's ReadFrom from io.Copy.
type writerOnly struct{ io.Writer }

// otaTracker moves the OTA command of one download to running and hands
// its progress to otaProgress, which writes it; the command is looked up
// at the first report, on a reader. A failure to look it up is logged:
// it must not break the download.
type otaTracker struct {
	st       otaCommandStore
	progress *otaProgress
	log      *slog.Logger
	ctx      context.Context
	uid, md5 string
	looked   bool
	id       string // "" when the device has no unfinished OTA command for md5
}

// otaCommandStore is what an otaTracker uses of the store: the download's
// command.
type otaCommandStore interface {
	UnfinishedOTAID(ctx context.Context, uid, md5sum string) (string, error)
}

func (t *otaTracker) report(percent int64) {
	if !t.looked {
		t.looked = true
		var err error
		if t.id, err = t.st.UnfinishedOTAID(t.ctx, t.uid, t.md5); err != nil {
			t.log.Warn("find the ota command of a download", "uid", t.uid, "md5", t.md5, "err", err)
		}
	}
	if t.id != "" {
		t.progress.set(t.id, percent)
	}
}

// otaProgress holds the progress of OTA downloads until the writer takes
// it, so that a download never waits for the database: a prune, a large
// batch or a checkpoint may hold the writer for seconds, and an updater's
// read timeout would then fail the update. run writes the newest progress
// of each command, all in one transaction, as soon as the writer is free,
// and what is left when it stops: a download's last progress is always
// written.
type otaProgress struct {
	st     otaProgressStore
	events *eventHub
	log    *slog.Logger
	kick   chan struct{} // a progress is pending

	mu      sync.Mutex
	pending map[string]int64 // the newest progress not yet written, by command id
}

// otaProgressStore is what otaProgress uses of the store.
type otaProgressStore interface {
	SetOTAProgress(ctx context.Context, progress map[string]int64) ([]string, error)
}

func newOTAProgress(st otaProgressStore, events *eventHub, log *slog.Logger) *otaProgress {
	return &otaProgress{st: st, events: events, log: log, kick: make(chan struct{}, 1), pending: map[string]int64{}}
}

// set records command id's download progress, replacing one not yet
// written; it never waits for the writer.
func (p *otaProgress) set(id string, percent int64) {
	p.mu.Lock()
	p.pending[id] = percent
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// run writes what set records until ctx is done, and then what is left.
func (p *otaProgress) run(ctx context.Context) {
	writeCtx := context.WithoutCancel(ctx) // a write cut short would lose its progress
	for {
		select {
		case <-p.kick:
			p.write(writeCtx)
		case <-ctx.Done():
			p.write(writeCtx)
			return
		}
	}
}

// write writes the pending progress in one transaction, and tells the
// event stream of the commands it changed. A failure is logged: that
// progress is lost, the download goes on, and the next one is written.
func (p *otaProgress) write(ctx context.Context) {
	p.mu.Lock()
	progress := p.pending
	p.pending = map[string]int64{}
	p.mu.Unlock()
	if len(progress) == 0 {
		return
	}
	changed, err := p.st.SetOTAProgress(ctx, progress)
	if err != nil {
		p.log.Warn("record ota download progress", "commands", len(progress), "err", err)
		return
	}
	p.events.CommandsChanged(ctx, changed)
}

// runsAlready reports whether an ESP updater's request headers say the
// device already runs the image: current arduino-esp32 cores send only
// the sha256, older ones and the ESP8266 the md5.
func runsAlready(h http.Header, md5sum, sha256sum string) bool {
	return strings.EqualFold(h.Get("x-ESP32-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP8266-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP32-sketch-sha256"), sha256sum)
}
