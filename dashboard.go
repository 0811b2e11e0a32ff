package main

import (
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"net/http"
	"regexp"
	"strconv"
	"strings"
)

// dashboardHTML is the dashboard: one page, its CSS
// and JavaScript inline, that does everything through the public JSON API
// with the user's token, as any other client would.
//
//go:embed dashboard.html
var dashboardHTML []byte

// inlineBlock finds the inline <script> and <style> blocks of a page; the
// page has no attributes on those tags, so the CSP can hash their text.
var inlineBlock = regexp.MustCompile(`(?s)<(script|style)>(.*?)</(?:script|style)>`)

// dashboardPage is the page and the Content-Security-Policy that allows
// exactly its inline blocks, computed once.
type dashboardPage struct {
	body []byte
	csp  string
}

// newDashboardPage hashes every inline script and style of html into a
// CSP that allows nothing else: no other origin, no framing, no eval, no
// inline code that was not shipped with the binary.
func newDashboardPage(html []byte) dashboardPage {
	hashes := map[string][]string{}
	for _, m := range inlineBlock.FindAllSubmatch(html, -1) {
		sum := sha256.Sum256(m[2])
		tag := string(m[1])
		hashes[tag] = append(hashes[tag], "'sha256-"+base64.StdEncoding.EncodeToString(sum[:])+"'")
	}
	csp := strings.Join([]string{
		"default-src 'none'",
		"script-src " + sourceList(hashes["script"]),
		"style-src " + sourceList(hashes["style"]),
		"connect-src 'self'",
		"img-src data:", // the page's icon is an empty data: URL, so the browser asks for no /favicon.ico
		"frame-ancestors 'none'",
		"base-uri 'none'",
		"form-action 'none'", // every form is sent by script; a form the script missed must not put a password in a URL
	}, "; ")
	return dashboardPage{body: html, csp: csp}
}

// sourceList is a CSP source list; with no sources it is 'none'.
func sourceList(sources []string) string {
	if len(sources) == 0 {
		return "'none'"
	}
	return strings.Join(sources, " ")
}

// ServeHTTP serves GET / : the page, with headers that keep it from being
// framed, from leaking its URL and from running anything it did not ship.
func (p dashboardPage) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8") // replaces the JSON type ServeHTTP set
	h.Set("Content-Security-Policy", p.csp)
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-cache")
	h.Set("Content-Length", strconv.Itoa(len(p.body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(p.body)
	}
}

// handleDashboard serves GET /: the dashboard, or with -dashboard=false
// the JSON 404 of any unknown route.
func (s *server) handleDashboard(w http.ResponseWriter, r *http.Request) error {
	if s.dashboard == nil {
		return errNoRoute
	}
	s.dashboard.ServeHTTP(w, r)
	return nil
}
