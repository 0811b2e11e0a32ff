package main

import (
	_ "embed"
	"net/http"
	"strconv"
)

// openAPIDoc is the OpenAPI 3.1 description of every route in routes().
// It is written by hand; TestOpenAPIRouteParity keeps its operations and
// the routes the same set, and .ci/openapi lints it and validates what the
// HTTP tests record against it.
//
//go:embed openapi.json
var openAPIDoc []byte

// handleOpenAPI serves GET /v1/openapi.json, without a token: integrators
// generate clients from it before they have one.
func (s *server) handleOpenAPI(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(openAPIDoc)))
	w.WriteHeader(http.StatusOK)
	w.Write(openAPIDoc)
	return nil
}
