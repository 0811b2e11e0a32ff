package main

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
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
// sketch-md5 header says the device already runs it. The file is streamed
// from disk.
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
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("x-MD5", md5sum)
	// No modification time: the content of an md5-named file never changes.
	http.ServeContent(w, r, "", time.Time{}, f)
}

// runsAlready reports whether an ESP updater's request headers say the
// device already runs the image: current arduino-esp32 cores send only
// the sha256, older ones and the ESP8266 the md5.
func runsAlready(h http.Header, md5sum, sha256sum string) bool {
	return strings.EqualFold(h.Get("x-ESP32-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP8266-sketch-md5"), md5sum) ||
		strings.EqualFold(h.Get("x-ESP32-sketch-sha256"), sha256sum)
}
