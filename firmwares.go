package main

// The firmware endpoints: list, upload (streamed to disk while hashed),
// edit, delete and set-target. The download devices use is in ota.go.

import (
	"crypto/md5"
	"crypto/sha256"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/hex"
	"errors"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"strings"
	"time"
)

// handleFirmwareList serves GET /v1/user/devices/{uid}/firmwares.
func (s *server) handleFirmwareList(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	list, err := s.store.FirmwaresOf(r.Context(), d)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleFirmwareUpload serves POST /v1/user/devices/{uid}/firmwares, a
// multipart form with name, version, notes and file.
func (s *server) handleFirmwareUpload(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	form, err := s.readUploadForm(w, r)
	defer form.remove()
	if err != nil {
		return err
	}
	var e fieldErrors
	nf := form.firmware(&e)
	checkUploadedFile(&e, form, d.Platform())
	if err := e.err(); err != nil {
		return err
	}
	f, err := s.store.CreateFirmware(r.Context(), d, nf, auditOf(r.Context(), func(f *model.Firmware) map[string]any {
		return map[string]any{"firmware_id": f.ID, "name": f.Name, "md5": f.MD5}
	}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, dataBody{f})
	return nil
}

// checkUploadedFile notes what is wrong with the form's file for a device
// of the platform ("" for any).
func checkUploadedFile(e *fieldErrors, form *uploadForm, platform string) {
	switch {
	case form.tmpPath == "":
		e.add("file", "is required.")
	case form.size == 0:
		e.add("file", "must not be empty.")
	case !looksLikeImage(platform, form.head):
		e.add("file", "must be an ESP application image: a .bin whose first byte is 0xE9 (on an ESP8266 also a .bin.gz).")
	}
}

// remove removes the form's temporary file, if any: still there only if
// no row took it.
func (f *uploadForm) remove() {
	if f != nil && f.tmpPath != "" {
		os.Remove(f.tmpPath)
	}
}

// firmware reads the form's name, version and notes (errors in e), with
// its file, as a new firmware.
func (f *uploadForm) firmware(e *fieldErrors) store.NewFirmware {
	return store.NewFirmware{
		Name:    e.text("name", f.fields["name"], true, 255),
		Version: emptyToNil(e.text("version", f.fields["version"], false, 255)),
		Notes:   emptyToNil(e.text("notes", f.fields["notes"], false, 2000)),
		MD5:     f.md5, SHA256: f.sha256, Size: f.size, TmpPath: f.tmpPath,
	}
}

// extendReadDeadline gives an authenticated upload uploadReadTimeout to
// send its body, instead of the short deadline every request starts with.
func (s *server) extendReadDeadline(w http.ResponseWriter, r *http.Request) {
	err := http.NewResponseController(w).SetReadDeadline(time.Now().Add(uploadReadTimeout))
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		s.log.Warn("extend upload read deadline", "path", r.URL.Path, "err", err)
	}
}

// uploadForm is a firmware upload as read from the request: its text
// fields and the file, already on disk in a temporary file.
type uploadForm struct {
	fields  map[string]*string // name, version, notes, platform
	tmpPath string             // "" when the form had no file part
	fileSums
}

// readUploadForm reads the multipart upload, given uploadReadTimeout
// (extendReadDeadline). The file is streamed to a temporary file while it
// is hashed; it is never held in memory whole. The returned form may hold
// a temporary file even with an error: the caller removes it.
func (s *server) readUploadForm(w http.ResponseWriter, r *http.Request) (*uploadForm, error) {
	s.extendReadDeadline(w, r)
	if r.ContentLength > maxUploadBody {
		return nil, errBodyTooLarge
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxUploadBody)
	mr, err := r.MultipartReader()
	if err != nil {
		return nil, fieldError("file", "is required.")
	}
	form := &uploadForm{fields: map[string]*string{}}
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			return form, nil
		}
		if err != nil {
			return form, s.uploadReadError(r, err)
		}
		if err := s.readUploadPart(r, form, part); err != nil {
			return form, err
		}
	}
}

// readUploadPart reads one part of the upload into form.
func (s *server) readUploadPart(r *http.Request, form *uploadForm, part *multipart.Part) error {
	switch name := part.FormName(); {
	case name == "file" && form.tmpPath == "":
		tmp, err := s.store.NewFirmwareTemp()
		if err != nil {
			return err
		}
		form.tmpPath = tmp.Name()
		var tooBig bool
		form.fileSums, tooBig, err = hashToTemp(tmp, part, store.MaxFirmwareSize)
		tmp.Close()
		if store.IsDiskFull(err) {
			return err
		}
		if err != nil {
			return s.uploadReadError(r, err)
		}
		if tooBig {
			// A file just over the limit is a field error; a body past
			// the request cap (read at most that far) is a 413.
			if _, err := io.Copy(io.Discard, r.Body); err != nil {
				return s.uploadReadError(r, err)
			}
			return fieldError("file", "must not be greater than %d kilobytes.", store.MaxFirmwareSize>>10)
		}
	case name == "name" || name == "version" || name == "notes" || name == "platform":
		v, err := io.ReadAll(io.LimitReader(part, maxJSONBody+1))
		if err != nil {
			return s.uploadReadError(r, err)
		}
		if len(v) > maxJSONBody {
			return errBodyTooLarge
		}
		text := string(v)
		form.fields[name] = &text
	default:
		if _, err := io.Copy(io.Discard, part); err != nil {
			return s.uploadReadError(r, err)
		}
	}
	return nil
}

// uploadReadError names a failure to read the upload: past the size cap,
// or a malformed form.
func (s *server) uploadReadError(r *http.Request, err error) error {
	// The multipart reader may not wrap the cap's error; the body, read
	// once more, says whether it was the cause.
	_, again := r.Body.Read(make([]byte, 1))
	if isTooBig(err) || isTooBig(again) {
		return errBodyTooLarge
	}
	s.log.Debug("bad upload", "err", err)
	return fieldError("file", "could not be read as multipart form data.")
}

// looksLikeImage reports whether a file that starts with head could be an
// application image for the platform: an ESP updater refuses anything
// else, but only after the download. Other platforms take
// any file.
func looksLikeImage(platform string, head [2]byte) bool {
	switch {
	case platform == "esp8266" && head == [2]byte{0x1f, 0x8b}: // gzip
		return true
	case strings.HasPrefix(platform, "esp"):
		return head[0] == 0xe9
	}
	return true
}

func emptyToNil(s *string) *string {
	if s == nil || *s == "" {
		return nil
	}
	return s
}

// handleFirmwareUpdate serves PATCH /v1/user/devices/{uid}/firmwares/{firmware_id}:
// name, version and notes; null or "" clears version and notes.
func (s *server) handleFirmwareUpdate(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	var u store.FirmwareUpdate
	if body.has("name") {
		u.Name = body.str(&e, "name", true, 255)
	}
	u.Version = body.clearable(&e, "version", 255)
	u.Notes = body.clearable(&e, "notes", 2000)
	if err := e.err(); err != nil {
		return err
	}
	f, err := s.store.UpdateFirmware(r.Context(), d, r.PathValue("firmware_id"), u, auditOf(r.Context(), func(f *model.Firmware) map[string]any {
		return map[string]any{"firmware_id": f.ID, "name": f.Name}
	}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{f})
	return nil
}

// handleFirmwareDelete serves DELETE /v1/user/devices/{uid}/firmwares/{firmware_id}.
func (s *server) handleFirmwareDelete(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	audit := auditOf(r.Context(), func(id string) map[string]any { return map[string]any{"firmware_id": id} })
	if err := s.store.DeleteFirmware(r.Context(), d, r.PathValue("firmware_id"), audit); err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Firmware deleted.")
	return nil
}

// handleFirmwareSetTarget serves POST /v1/user/devices/{uid}/firmwares/set-target.
func (s *server) handleFirmwareSetTarget(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	sum, err := decodeField(w, r, "md5")
	if err != nil {
		return err
	}
	md5sum := strings.ToLower(strings.TrimSpace(sum))
	if !store.IsMD5(md5sum) {
		return store.ErrTargetNotFound
	}
	audit := auditOf(r.Context(), func(md5sum string) map[string]any { return map[string]any{"md5": md5sum} })
	if err := s.store.SetTarget(r.Context(), d, md5sum, audit); err != nil {
		return err
	}
	s.events.deviceUpdated(r.Context(), d.TeamID(), d.UID(), "target_firmware")
	writeJSON(w, http.StatusOK, struct {
		Message   string `json:"message"`
		DeviceUID string `json:"device_uid"`
		MD5       string `json:"md5"`
	}{"Firmware assigned to device.", d.UID(), md5sum})
	return nil
}

// fileSums are what hashToTemp learns of a file.
type fileSums struct {
	md5, sha256 string
	size        int64
	head        [2]byte // the first bytes: an image's magic number
}

// hashToTemp streams r (at most limit bytes) into f while computing its
// md5 and sha256, then fsyncs f. tooBig reports that r had more than limit
// bytes.
func hashToTemp(f *os.File, r io.Reader, limit int64) (sums fileSums, tooBig bool, err error) {
	m, sh := md5.New(), sha256.New()
	head := &headWriter{b: sums.head[:0]}
	sums.size, err = io.Copy(io.MultiWriter(f, m, sh, head), io.LimitReader(r, limit+1))
	if err != nil {
		return sums, false, err
	}
	if sums.size > limit {
		return sums, true, nil
	}
	if err := f.Sync(); err != nil {
		return sums, false, err
	}
	sums.md5, sums.sha256 = hex.EncodeToString(m.Sum(nil)), hex.EncodeToString(sh.Sum(nil))
	return sums, false, nil
}

// headWriter keeps the first cap(b) bytes written to it, in b's array.
type headWriter struct{ b []byte }

func (w *headWriter) Write(p []byte) (int, error) {
	n := min(cap(w.b)-len(w.b), len(p))
	w.b = append(w.b, p[:n]...)
	return len(p), nil
}
