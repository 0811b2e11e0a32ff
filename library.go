package main

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"errors"
	"net/http"
	"strings"
)

// The team's firmware library: every file the team holds, one entry per
// sha256, and uploads that need no device. Rollouts send any of them
// (rollouts.go); the per-device firmware routes are in firmwares.go.

// handleLibraryList serves GET /v1/user/firmwares.
func (s *server) handleLibraryList(w http.ResponseWriter, r *http.Request) error {
	list, err := s.store.LibraryFirmwares(r.Context(), authFrom(r.Context()).user.TeamID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleLibraryUpload serves POST /v1/user/firmwares, a multipart form
// like a device's upload, with an optional platform: a key starting with
// esp makes the file pass that platform's image check.
func (s *server) handleLibraryUpload(w http.ResponseWriter, r *http.Request) error {
	form, err := s.readUploadForm(w, r)
	defer form.remove()
	if err != nil {
		return err
	}
	var e fieldErrors
	nf := store.NewLibraryFirmware{
		NewFirmware: form.firmware(&e),
		Platform:    emptyToNil(e.text("platform", form.fields["platform"], false, 64)),
		UploadedBy:  authFrom(r.Context()).user.ID,
	}
	platform := ""
	if nf.Platform != nil {
		platform = strings.ToLower(*nf.Platform)
		nf.Platform = &platform
	}
	checkUploadedFile(&e, form, platform)
	if err := e.err(); err != nil {
		return err
	}
	f, err := s.store.CreateLibraryFirmware(r.Context(), authFrom(r.Context()).user.TeamID, nf, auditOf(r.Context(), libraryAudit))
	if errors.Is(err, store.ErrLibraryHasFile) {
		return fieldError("file", "is already in the firmware library.")
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, dataBody{f})
	return nil
}

// handleLibraryDelete serves DELETE /v1/user/firmwares/{sha256}: only a
// file that none of the team's devices has a firmware row of.
func (s *server) handleLibraryDelete(w http.ResponseWriter, r *http.Request) error {
	sha := strings.ToLower(r.PathValue("sha256"))
	if !store.IsSHA256(sha) {
		return store.ErrFirmwareNotFound
	}
	err := s.store.DeleteLibraryFirmware(r.Context(), authFrom(r.Context()).user.TeamID, sha, auditOf(r.Context(), libraryAudit))
	if err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Firmware deleted.")
	return nil
}

// libraryAudit is the detail of a library write's audit entry: the file
// it added or removed.
func libraryAudit(f *model.LibraryFirmware) map[string]any {
	return map[string]any{"name": f.Name, "version": f.Version, "md5": f.MD5, "sha256": f.SHA256}
}
