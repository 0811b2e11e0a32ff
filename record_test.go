package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
)

// recordEnv names the file that the HTTP tests append every response they
// check to, one JSON line each. .ci/openapi sets it and then validates each
// line against openapi.json (tools/openapi/validate.mjs).
const recordEnv = "DEVICEHUB_RECORD_RESPONSES"

// recordedResponse is one line of the record file. Pattern is the
// ServeMux pattern that routed the request: "/" for the catch-all, ""
// when the server answered before routing (a path not in its clean form).
type recordedResponse struct {
	Method  string            `json:"method"`
	Path    string            `json:"path"`
	Pattern string            `json:"pattern"`
	Status  int               `json:"status"`
	Headers map[string]string `json:"headers"` // lowercased names; repeated values joined by ", "
	Body    string            `json:"body"`
}

// recordResponse appends the answer w gave to req to the file named by
// DEVICEHUB_RECORD_RESPONSES, and does nothing when it is unset. Call it
// after the server's ServeHTTP returned: the mux sets req.Pattern then.
// Each record is a single write to a file opened with O_APPEND, so records
// from parallel tests (or goroutines of one test) never interleave and no
// lock is needed.
func recordResponse(tb testing.TB, req *http.Request, w *httptest.ResponseRecorder) {
	tb.Helper()
	name := os.Getenv(recordEnv)
	if name == "" {
		return
	}
	res := w.Result()
	headers := map[string]string{}
	for k, v := range res.Header {
		headers[strings.ToLower(k)] = strings.Join(v, ", ")
	}
	line, err := json.Marshal(recordedResponse{
		Method:  req.Method,
		Path:    req.URL.RequestURI(),
		Pattern: req.Pattern,
		Status:  res.StatusCode,
		Headers: headers,
		Body:    w.Body.String(),
	})
	if err != nil {
		tb.Errorf("record response: %v", err)
		return
	}
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		tb.Errorf("record response: %v", err)
		return
	}
	defer f.Close()
	if _, err := f.Write(append(line, '\n')); err != nil {
		tb.Errorf("record response: %v", err)
	}
}
