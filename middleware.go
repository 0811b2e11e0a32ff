package main

import (
	"io"
	"log/slog"
	"net/http"
	"time"
)

// accessLog wraps h to log one info line per request: method, route
// pattern, status, duration and bytes written. It logs the pattern the
// mux matched, never the URL (an OTA link carries its signature in the
// query) nor any header (the token).
func accessLog(h http.Handler, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &recordingWriter{ResponseWriter: w}
		h.ServeHTTP(rec, r)
		route := r.Pattern // set on r by the mux while routing
		if route == "" {
			route = "(none)"
		}
		log.Info("request", "method", r.Method, "route", route, "status", rec.statusOr200(),
			"duration", time.Since(start), "bytes", rec.bytes)
	})
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
