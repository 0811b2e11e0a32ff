package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// The device list: every device of the team, streamed, or, with any of
// listParams, a page of those that match.

const (
	// defaultPageSize is a page's length without ?limit=.
	defaultPageSize = 100
	maxPageSize     = 1000
)

// filterFields select devices, as the list's parameters and as a
// rollout's "select"; listParams are the parameters that ask for a page.
var (
	filterFields = []string{"status", "platform", "board", "q"}
	listParams   = append([]string{"limit", "after"}, filterFields...)
)

// handleDeviceList serves GET /v1/user/devices: every device of the team,
// or, with any of listParams, a page of those that match.
func (s *server) handleDeviceList(w http.ResponseWriter, r *http.Request) error {
	teamID := authFrom(r.Context()).user.TeamID
	query := r.URL.Query()
	if !slices.ContainsFunc(listParams, query.Has) {
		return s.writeDeviceList(r.Context(), w, teamID)
	}
	f, err := readDeviceFilter(query)
	if err != nil {
		return err
	}
	return s.writeDevicePage(r.Context(), w, teamID, f)
}

// readDeviceFilter reads a page's parameters. Each one given must have a
// valid value, and be given once.
func readDeviceFilter(query url.Values) (store.DeviceFilter, error) {
	var e fieldErrors
	values := map[string]string{}
	for _, p := range listParams {
		switch v := query[p]; {
		case len(v) > 1:
			e.add(p, "must be given only once.")
		case len(v) == 1 && v[0] == "":
			e.add(p, "must not be empty.")
		case len(v) == 1:
			values[p] = v[0]
		}
	}
	if e.err() != nil {
		return store.DeviceFilter{}, e.err()
	}
	f := readFilter(&e, "", values)
	f.Limit = defaultPageSize
	if v, ok := values["limit"]; ok {
		f.Limit = intField(&e, "limit", v, 1, maxPageSize)
	}
	if v, ok := values["after"]; ok {
		if f.After, ok = parseCursor(v); !ok {
			e.add("after", "must be the meta.next of a previous page.")
		}
	}
	return f, e.err()
}

// readFilter reads the filterFields that values holds, none of them
// empty, into a filter; errors name each field with prefix.
func readFilter(e *fieldErrors, prefix string, values map[string]string) store.DeviceFilter {
	var f store.DeviceFilter
	if v, ok := values["status"]; ok {
		for _, st := range strings.Split(v, ",") {
			f.Statuses = append(f.Statuses, model.DeviceStatus(st))
		}
		for _, st := range f.Statuses {
			if !slices.Contains(model.DeviceStatuses, st) {
				e.add(prefix+"status", "must be a comma-separated list of %s.", model.JoinStates(model.DeviceStatuses))
				break
			}
		}
	}
	for _, key := range []struct {
		field string
		to    *string
	}{{"platform", &f.Platform}, {"board", &f.Board}} {
		if *key.to = values[key.field]; *key.to != "" && !validID(*key.to) {
			e.add(prefix+key.field, "must be a key: letters, digits, dots, underscores and dashes.")
		}
	}
	if v, ok := values["q"]; ok && e.text(prefix+"q", &v, false, 255) != nil {
		f.Q = v
	}
	return f
}

// A page's cursor is its last device's row id, in an opaque form: a
// client keeps it as it is.
func pageCursor(id int64) string {
	return base64.RawURLEncoding.EncodeToString(binary.BigEndian.AppendUint64(nil, uint64(id)))
}

func parseCursor(s string) (int64, bool) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil || len(b) != 8 {
		return 0, false
	}
	id := int64(binary.BigEndian.Uint64(b))
	return id, id > 0
}

// writeDevicePage answers with a page of the team's devices that match f:
// {"data": [Device summary], "meta": {"total", "next"}}.
func (s *server) writeDevicePage(ctx context.Context, w http.ResponseWriter, teamID int64, f store.DeviceFilter) error {
	total, err := s.store.CountDevices(ctx, teamID, f)
	if err != nil {
		return err
	}
	pageSize := f.Limit
	f.Limit++ // one more tells whether a next page exists
	list := []*model.DeviceSummary{}
	err = s.store.EachDevice(ctx, teamID, f, func(d *model.DeviceSummary) error {
		list = append(list, d)
		return nil
	})
	if err != nil {
		return err
	}
	var next *string
	if len(list) > pageSize {
		list = list[:pageSize]
		next = new(string)
		*next = pageCursor(list[pageSize-1].ID)
	}
	type meta struct {
		Total int     `json:"total"`
		Next  *string `json:"next"`
	}
	writeJSON(w, http.StatusOK, struct {
		Data []*model.DeviceSummary `json:"data"`
		Meta meta                   `json:"meta"`
	}{list, meta{total, next}})
	return nil
}

// writeDeviceList answers with every device of the team, {"data": [Device
// summary]}, encoded as each is read (dataWriter). A list of up to
// maxHeldAnswer bytes is kept in the read cache until the next commit.
func (s *server) writeDeviceList(ctx context.Context, w http.ResponseWriter, teamID int64) error {
	dw := newDataWriter(w, http.StatusOK)
	page, err := s.store.CachedPage(ctx, store.PageKey{TeamID: teamID}, func() ([]byte, error) {
		if err := s.store.EachDevice(ctx, teamID, store.DeviceFilter{}, func(d *model.DeviceSummary) error { return dw.add(d) }); err != nil {
			return nil, err
		}
		return dw.end()
	})
	if written, err := s.finish(dw, err); written || err != nil {
		return err
	}
	writeData(w, http.StatusOK, page)
	return nil
}
