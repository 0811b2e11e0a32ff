package main

// The device history routes (docs/api.md, "History and release
// health"): a device's series, a series' points, its presence and its
// boots.

import (
	"bytes"
	"errors"
	"math"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/store"
)

const (
	// defaultPoints and maxPoints bound the points of one history answer.
	defaultPoints, maxPoints = 300, 1000
	// defaultBoots and maxBootsPage bound a page of boots.
	defaultBoots, maxBootsPage = 25, 100
	// maxPresencePage bounds a page of presence intervals, and is its
	// default.
	maxPresencePage = 1000
	// defaultRange is a history read's span without from and to.
	defaultRange = 24 * time.Hour
)

// seriesName is what a series is called.
var seriesName = regexp.MustCompile(`^(rssi|heap_free|metrics\.[a-z0-9_]{1,32})$`)

// handleSeriesList serves GET /v1/user/devices/{uid}/series.
func (s *server) handleSeriesList(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	list, err := s.store.SeriesOf(r.Context(), d)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleHistory serves GET /v1/user/devices/{uid}/history: a series'
// buckets in [from, to), merged so that there are at most points, as
// JSON or (format=csv) CSV.
func (s *server) handleHistory(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	q := r.URL.Query()
	var e fieldErrors
	name := history.SeriesName(q.Get("series"))
	if !seriesName.MatchString(string(name)) {
		e.add("series", "must be rssi, heap_free or metrics.<key>.")
	}
	from, to := s.readRange(&e, q)
	points := queryInt(&e, q, "points", defaultPoints, 1, maxPoints)
	csv := q.Get("format") == "csv"
	if f := q.Get("format"); f != "" && f != "csv" && f != "json" {
		e.add("format", "must be json or csv.")
	}
	if err := e.err(); err != nil {
		return err
	}
	start := history.BucketStart(from)
	buckets, err := s.store.BucketsOf(r.Context(), d, name, start, to.Unix())
	if errors.Is(err, history.ErrSeriesNotFound) {
		return fieldError("series", "is not a series of this device.")
	}
	if err != nil {
		return err
	}
	h := history.Merge(name, buckets, start, to.Unix(), points)
	if !csv {
		writeJSON(w, http.StatusOK, dataBody{h})
		return nil
	}
	var b bytes.Buffer
	b.WriteString("t,min,max,mean,last,count\n")
	num := func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
	for _, p := range h.Points {
		b.WriteString(p.T + "," + num(p.Min) + "," + num(p.Max) + "," + num(p.Mean) + "," + num(p.Last) + "," +
			strconv.FormatInt(p.Count, 10) + "\n")
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(b.Len()))
	w.WriteHeader(http.StatusOK)
	w.Write(b.Bytes())
	return nil
}

// readRange reads from and to (RFC 3339); without them, the last 24 h
// up to now.
func (s *server) readRange(e *fieldErrors, q url.Values) (from, to time.Time) {
	to = s.store.Now()
	read := func(field string, t *time.Time) {
		if v := q.Get(field); v != "" {
			p, err := time.Parse(time.RFC3339, v)
			if err != nil {
				e.add(field, "must be an RFC 3339 time.")
				return
			}
			*t = p
		}
	}
	read("to", &to)
	from = to.Add(-defaultRange)
	read("from", &from)
	if !from.Before(to) {
		e.add("from", "must be before to.")
	}
	return from, to
}

// handlePresence serves GET /v1/user/devices/{uid}/presence: the
// oldest limit intervals that overlap [from, to]; the next page is from
// the last one's end.
func (s *server) handlePresence(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	var e fieldErrors
	from, to := s.readRange(&e, r.URL.Query())
	limit := queryInt(&e, r.URL.Query(), "limit", maxPresencePage, 1, maxPresencePage)
	if err := e.err(); err != nil {
		return err
	}
	list, err := s.store.PresenceOf(r.Context(), d, from, to, limit)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleBoots serves GET /v1/user/devices/{uid}/boots: newest first,
// a page of limit before the boot with id before.
func (s *server) handleBoots(w http.ResponseWriter, r *http.Request, d *store.DeviceRef) error {
	q := r.URL.Query()
	var e fieldErrors
	limit := queryInt(&e, q, "limit", defaultBoots, 1, maxBootsPage)
	before := queryInt(&e, q, "before", 0, 1, math.MaxInt)
	if err := e.err(); err != nil {
		return err
	}
	list, err := s.store.BootsOf(r.Context(), d, int64(before), limit)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleFirmwareHealth serves GET /v1/user/firmware-health: the team's
// firmwares compared over the last hours.
func (s *server) handleFirmwareHealth(w http.ResponseWriter, r *http.Request) error {
	var e fieldErrors
	hours := queryInt(&e, r.URL.Query(), "hours", 24, 1, 720)
	if err := e.err(); err != nil {
		return err
	}
	to := s.store.Now()
	list, err := s.store.FirmwareHealth(r.Context(), authFrom(r.Context()).user.TeamID, to.Add(-time.Duration(hours)*time.Hour), to)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}
