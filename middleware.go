package main

import (
	"cmp"
	"io"
	"log/slog"
	"net/http"
	"time"
)

// requestDone is what a request came to, as observe reports it.
type requestDone struct {
	route  string // the pattern the mux matched (never the URL), or "(none)"
	status int
	took   time.Duration
	bytes  int64
}

// observe wraps h to tell each watcher what every request came to once it
// is answered: one recording writer and one clock for the access log and
// the metrics alike.
func observe(h http.Handler, watchers ...func(*http.Request, requestDone)) http.Handler {
	if len(watchers) == 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &recordingWriter{ResponseWriter: w}
		h.ServeHTTP(rec, r)
		done := requestDone{route: cmp.Or(r.Pattern, "(none)"), status: rec.statusOr200(), took: time.Since(start), bytes: rec.bytes}
		for _, watch := range watchers {
			watch(r, done)
		}
	})
}

// logRequest is the access log, a watcher of observe: one info line per
// request with its method, route pattern, status, duration and bytes. It
// never logs the URL (an OTA link carries its signature in the query) nor
// any header (the token).
func logRequest(log *slog.Logger) func(*http.Request, requestDone) {
	return func(r *http.Request, d requestDone) {
		log.Info("request", "method", r.Method, "route", d.route, "status", d.status, "duration", d.took, "bytes", d.bytes)
	}
}

// recordingWriter notes the status and body size of a response. Unwrap
// lets http.ResponseController reach the connection's deadlines and
// flushing through it.
type recordingWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (w *recordingWriter) WriteHeader(status int) {
	if w.status == 0 && status >= 200 { // 1xx are interim answers
		w.status = status
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *recordingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.bytes += int64(n)
	return n, err
}

// ReadFrom keeps the connection's sendfile path for firmware downloads.
func (w *recordingWriter) ReadFrom(r io.Reader) (int64, error) {
	n, err := io.Copy(w.ResponseWriter, r)
	w.bytes += n
	return n, err
}

func (w *recordingWriter) Flush() { http.NewResponseController(w.ResponseWriter).Flush() }

func (w *recordingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *recordingWriter) statusOr200() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}
