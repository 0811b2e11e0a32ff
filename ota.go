package main

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
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

// otaURL is the absolute, signed link a device downloads its target from.
func (s *server) otaURL(uid, md5sum string) string {
	exp := s.store.now().Add(otaLinkLifetime).Unix()
	q := url.Values{"exp": {strconv.FormatInt(exp, 10)}, "sig": {otaSignature(s.otaKey, uid, md5sum, exp)}}
	return s.public + "/ota/" + url.PathEscape(uid) + "/" + md5sum + ".bin?" + q.Encode()
}

// handleOTADownload serves GET /ota/{uid}/{md5}.bin?exp=…&sig=…, the link
// of an ota command, the way the ESP32 and ESP8266 HTTP updaters expect:
// 200 with Content-Length and x-MD5, 206 for a Range, 304 when the
// sketch-md5 or sketch-sha256 header says the device already runs it. The
// file is streamed from disk, and the bytes served move the device's OTA
// command to running with their progress (CONTRACT §7).
func (s *server) handleOTADownload(w http.ResponseWriter, r *http.Request) {
	uid := r.PathValue("uid")
	md5sum, _ := strings.CutSuffix(r.PathValue("file"), ".bin")
	q := r.URL.Query()
	exp, err := strconv.ParseInt(q.Get("exp"), 10, 64)
	want := otaSignature(s.otaKey, uid, md5sum, exp)
	if err != nil || !hmac.Equal([]byte(q.Get("sig")), []byte(want)) || s.store.now().Unix() >= exp {
		writeMessage(w, http.StatusForbidden, "Invalid or expired link.")
		return
	}
	f, sha, err := s.store.openFirmwareFile(r.Context(), uid, md5sum)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer f.Close()
	if runsAlready(r.Header, md5sum, sha) {
		w.Header().Del("Content-Type")
		w.WriteHeader(http.StatusNotModified)
		return
	}
	info, err := f.Stat()
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("x-MD5", md5sum)
	tracker := &otaTracker{st: s.store, log: s.log, ctx: context.WithoutCancel(r.Context()), uid: uid, md5: md5sum}
	body := &progressFile{f: f, size: info.Size(), report: tracker.report}
	// No modification time: the content of a sha256-named file never changes.
	http.ServeContent(w, r, "", time.Time{}, body)
}

// progressFile is a firmware file as http.ServeContent reads it, counting
// how far into the file the reads have come: a Range request counts from
// its offset. It reports the first read and then every new tenth of the
// file, as a percentage. Wrapping the file costs ServeContent its
// sendfile: the bytes pass through a 32 KiB user-space buffer instead.
type progressFile struct {
	f        *os.File
	size     int64
	pos      int64
	reported int64 // the last percentage reported
	started  bool  // whether anything was reported yet
	report   func(percent int64)
}

func (p *progressFile) Seek(offset int64, whence int) (int64, error) {
	n, err := p.f.Seek(offset, whence)
	if err == nil {
		p.pos = n
	}
	return n, err
}

func (p *progressFile) Read(b []byte) (int, error) {
	n, err := p.f.Read(b)
	if n > 0 && p.size > 0 {
		p.pos += int64(n)
		pct := min(p.pos*100/p.size, 100)
		if !p.started || pct/10 > p.reported/10 {
			p.started, p.reported = true, pct
			p.report(pct)
		}
	}
	return n, err
}

// otaTracker moves the OTA command of one download to running and records
// its progress; the command is looked up at the first report. A failure
// to record is logged: it must not break the download.
type otaTracker struct {
	st       *store
	log      *slog.Logger
	ctx      context.Context
	uid, md5 string
	looked   bool
	id       string // "" when the device has no unfinished OTA command for md5
}

func (t *otaTracker) report(percent int64) {
	var err error
	switch {
	case !t.looked:
		t.looked = true
		t.id, err = t.st.startOTADownload(t.ctx, t.uid, t.md5, percent)
	case t.id != "":
		err = t.st.setOTAProgress(t.ctx, t.id, percent)
	}
	if err != nil {
		t.log.Warn("record ota download progress", "uid", t.uid, "md5", t.md5, "err", err)
	}
}

// runsAlready reports whether an ESP updater's request headers say the
// device already runs the image: current arduino-esp32 cores send only
// the sha256, older ones and the ESP8266 the md5.
func runsAlready(h http.Header, md5sum, sha256sum string) bool {
	return strings.EqualFold(h.Get("x-ESP32-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP8266-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP32-sketch-sha256"), sha256sum)
}
