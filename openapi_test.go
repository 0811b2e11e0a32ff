package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

// openAPIOperations is the set of operations in openapi.json, each as
// "METHOD /path" with the doc's path template.
func openAPIOperations(tb testing.TB) map[string]bool {
	tb.Helper()
	var doc struct {
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(openAPIDoc, &doc); err != nil {
		tb.Fatalf("openapi.json: %v", err)
	}
	ops := map[string]bool{}
	for path, item := range doc.Paths {
		for key := range item {
			switch key {
			case "get", "put", "post", "delete", "options", "head", "patch", "trace":
				ops[strings.ToUpper(key)+" "+path] = true
			}
		}
	}
	return ops
}

// routeOperation is the operation a ServeMux pattern serves, in the form
// of openAPIOperations: "GET /{$}" (the root only) is "GET /", and a
// wildcard keeps its name ("{uid}"; "{rest...}" becomes "{rest}"). A
// pattern without a method, or for a subtree ("GET /static/"), is no
// single operation: ok is false.
func routeOperation(pattern string) (op string, ok bool) {
	method, path, ok := strings.Cut(pattern, " ")
	if !ok || strings.HasSuffix(path, "/") {
		return "", false
	}
	path = strings.TrimSuffix(path, "{$}")
	path = strings.ReplaceAll(path, "...}", "}")
	return method + " " + path, true
}

// routeParity compares a routing table with the documented operations:
// the routes no operation documents, and the operations no route serves.
// The catch-all "/" answers only unknown routes and is no operation; any
// other pattern routeOperation cannot name is undocumented by nature.
func routeParity(routes []route, ops map[string]bool) (undocumented, unrouted []string) {
	routed := map[string]bool{}
	for _, rt := range routes {
		if rt.pattern == "/" {
			continue
		}
		op, ok := routeOperation(rt.pattern)
		if !ok || !ops[op] {
			undocumented = append(undocumented, rt.pattern)
			continue
		}
		routed[op] = true
	}
	for op := range ops {
		if !routed[op] {
			unrouted = append(unrouted, op)
		}
	}
	slices.Sort(unrouted)
	return undocumented, unrouted
}

// TestOpenAPIRouteParity: openapi.json documents exactly the routes the
// server registers.
func TestOpenAPIRouteParity(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	undocumented, unrouted := routeParity(env.srv.routes(), openAPIOperations(t))
	t.Run("every route is documented", func(t *testing.T) {
		for _, p := range undocumented {
			t.Errorf("route %q has no operation in openapi.json", p)
		}
	})
	t.Run("every documented operation has a route", func(t *testing.T) {
		for _, op := range unrouted {
			t.Errorf("openapi.json documents %q, which no route serves", op)
		}
	})
}

// TestOpenAPIRouteParityCatchesDrift shows that the comparison above
// notices a route added without documentation, and the other way round.
func TestOpenAPIRouteParityCatchesDrift(t *testing.T) {
	t.Parallel()
	h := func(http.ResponseWriter, *http.Request) error { return nil }
	ops := map[string]bool{"GET /": true, "GET /v1/user/devices/{uid}": true, "GET /files/{path}": true}
	tests := []struct {
		name             string
		routes           []string
		wantUndocumented []string
		wantUnrouted     []string
	}{
		{"same set", []string{"/", "GET /{$}", "GET /v1/user/devices/{uid}", "GET /files/{path...}"}, nil, nil},
		{"a route without documentation", []string{"/", "GET /{$}", "GET /v1/user/devices/{uid}", "GET /files/{path...}", "DELETE /v1/user/devices/{uid}"},
			[]string{"DELETE /v1/user/devices/{uid}"}, nil},
		{"a documented operation without a route", []string{"GET /{$}", "GET /files/{path...}"},
			nil, []string{"GET /v1/user/devices/{uid}"}},
		{"a wildcard renamed", []string{"GET /{$}", "GET /v1/user/devices/{id}", "GET /files/{path...}"},
			[]string{"GET /v1/user/devices/{id}"}, []string{"GET /v1/user/devices/{uid}"}},
		{"the root as a subtree, not the dashboard", []string{"GET /", "GET /v1/user/devices/{uid}", "GET /files/{path...}"},
			[]string{"GET /"}, []string{"GET /"}},
		{"a route for every method", []string{"GET /{$}", "GET /v1/user/devices/{uid}", "GET /files/{path...}", "/v1/anything"},
			[]string{"/v1/anything"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var routes []route
			for _, p := range tt.routes {
				routes = append(routes, route{p, h})
			}
			undocumented, unrouted := routeParity(routes, ops)
			if !slices.Equal(undocumented, tt.wantUndocumented) {
				t.Errorf("undocumented: got %q, want %q", undocumented, tt.wantUndocumented)
			}
			if !slices.Equal(unrouted, tt.wantUnrouted) {
				t.Errorf("unrouted: got %q, want %q", unrouted, tt.wantUnrouted)
			}
		})
	}
}

// TestOpenAPIServed: GET /v1/openapi.json answers the embedded document
// to anyone, token or not.
func TestOpenAPIServed(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	for _, token := range []string{"", env.alice.token, "1|not-a-token"} {
		w := env.want(t, http.StatusOK, "GET", "/v1/openapi.json", token, nil)
		if !bytes.Equal(w.Body.Bytes(), openAPIDoc) {
			t.Errorf("token %q: body is not the embedded openapi.json (%d bytes, want %d)", token, w.Body.Len(), len(openAPIDoc))
		}
		if got := decode(t, w)["openapi"]; got != "3.1.0" {
			t.Errorf("openapi: got %v, want 3.1.0", got)
		}
	}
}

// TestOpenAPIDownloadAnswers sends the firmware download each answer the
// doc lists for it, so that the recorded responses (DEVICEHUB_RECORD_RESPONSES)
// hold every one of them; the updater tests in ota_test.go talk to a real
// listener, whose answers are not recorded.
func TestOpenAPIDownloadAnswers(t *testing.T) {
	t.Parallel()
	env := newTestEnv(t, nil)
	a := env.alice
	fw := append([]byte{0xE9}, bytes.Repeat([]byte("firmware"), 1000)...)
	sum, _ := otaAssign(t, env, a, "fw", "", fw)
	link := env.srv.ota.url(a.device, sum)
	tests := []struct {
		name       string
		link       string
		header     map[string]string
		wantStatus int
		wantHeader map[string]string
	}{
		{"whole file", link, nil, 200, map[string]string{"x-MD5": sum, "Content-Type": "application/octet-stream"}},
		{"the device runs it", link, map[string]string{"x-ESP32-sketch-md5": sum}, 304, nil},
		{"the device runs something else", link, map[string]string{"x-ESP8266-sketch-md5": strings.Repeat("0", 32)}, 200, map[string]string{"x-MD5": sum}},
		{"range", link, map[string]string{"Range": "bytes=10-19"}, 206, map[string]string{"Content-Range": "bytes 10-19/8001"}},
		{"range past the end", link, map[string]string{"Range": "bytes=9000-"}, 416, map[string]string{"Content-Range": "bytes */8001"}},
		{"bad signature", strings.Replace(link, "sig=", "sig=0", 1), nil, 403, map[string]string{"Content-Type": "application/json"}},
		{"no such firmware", env.srv.ota.url(a.device, strings.Repeat("0", 32)), nil, 404, map[string]string{"Content-Type": "application/json"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := httptest.NewRequest("GET", tt.link, nil)
			for k, v := range tt.header {
				req.Header.Set(k, v)
			}
			w := env.serve(t, req)
			if w.Code != tt.wantStatus {
				t.Fatalf("status: got %d, want %d: %.200q", w.Code, tt.wantStatus, w.Body)
			}
			for k, want := range tt.wantHeader {
				if got := w.Header().Get(k); got != want {
					t.Errorf("%s: got %q, want %q", k, got, want)
				}
			}
		})
	}
}
