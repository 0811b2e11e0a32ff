package main

import (
	"crypto/sha256"
	"encoding/base64"
	"regexp"
	"strings"
	"testing"
)

// cspDirectives splits a Content-Security-Policy into its directives.
func cspDirectives(t *testing.T, csp string) map[string][]string {
	t.Helper()
	d := map[string][]string{}
	for _, part := range strings.Split(csp, ";") {
		fields := strings.Fields(part)
		if len(fields) == 0 {
			continue
		}
		if _, dup := d[fields[0]]; dup {
			t.Errorf("CSP names %s twice: %s", fields[0], csp)
		}
		d[fields[0]] = fields[1:]
	}
	return d
}

// TestDashboardServedWithStrictHeaders: the page is served with headers
// and a CSP that allow nothing but its own hashed inline blocks.
func TestDashboardServedWithStrictHeaders(t *testing.T) {
	env := newTestEnv(t, nil) // the dashboard is on by default
	w := env.want(t, 200, "GET", "/", "", nil)
	if got := w.Body.String(); got != string(dashboardHTML) {
		t.Errorf("body is not the embedded dashboard.html (%d bytes, want %d)", len(got), len(dashboardHTML))
	}
	for header, want := range map[string]string{
		"Content-Type":           "text/html; charset=utf-8",
		"X-Frame-Options":        "DENY",
		"Referrer-Policy":        "no-referrer",
		"X-Content-Type-Options": "nosniff",
	} {
		if got := w.Header().Get(header); got != want {
			t.Errorf("%s: got %q, want %q", header, got, want)
		}
	}
	csp := w.Header().Get("Content-Security-Policy")
	d := cspDirectives(t, csp)
	for directive, want := range map[string]string{
		"default-src":     "'none'",
		"connect-src":     "'self'",
		"img-src":         "data:",
		"frame-ancestors": "'none'",
		"base-uri":        "'none'",
		"form-action":     "'none'",
	} {
		if got := strings.Join(d[directive], " "); got != want {
			t.Errorf("CSP %s: got %q, want %q (CSP %s)", directive, got, want, csp)
		}
	}
	for _, directive := range []string{"script-src", "style-src"} {
		if len(d[directive]) == 0 {
			t.Errorf("CSP has no %s (CSP %s)", directive, csp)
		}
		for _, source := range d[directive] {
			if !strings.HasPrefix(source, "'sha256-") {
				t.Errorf("CSP %s allows %s; want only hashes of the page's own blocks", directive, source)
			}
		}
	}
	if h := env.request("HEAD", "/", "", nil); h.Code != 200 || h.Body.Len() != 0 || h.Header().Get("Content-Security-Policy") != csp {
		t.Errorf("HEAD /: got %d with %d body bytes and CSP %q, want 200, no body, the same CSP", h.Code, h.Body.Len(), h.Header().Get("Content-Security-Policy"))
	}

	// The browser runs an inline block only when its hash is in the CSP,
	// so a block without one is a dead page. Inline event handlers and
	// style attributes would be blocked the same way, and nothing may be
	// loaded from another origin.
	page := w.Body.String()
	for _, tag := range []string{"script", "style"} {
		opening := regexp.MustCompile(`(?i)<`+tag+`\b[^>]*>`).FindAllString(page, -1)
		blocks := regexp.MustCompile(`(?s)<`+tag+`>(.*?)</`+tag+`>`).FindAllStringSubmatch(page, -1)
		if len(blocks) == 0 {
			t.Errorf("no inline <%s> block found", tag)
		}
		if len(opening) != len(blocks) {
			t.Errorf("%d <%s> tags but %d plain inline blocks: a tag with attributes (src=, type=) is not hashed: %q", len(opening), tag, len(blocks), opening)
		}
		var want []string
		for _, b := range blocks {
			sum := sha256.Sum256([]byte(b[1]))
			want = append(want, "'sha256-"+base64.StdEncoding.EncodeToString(sum[:])+"'")
		}
		if got := d[tag+"-src"]; strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("CSP %s-src: got %q, want the hashes of the page's blocks %q", tag, got, want)
		}
	}
	markup := inlineBlock.ReplaceAllString(page, "")
	script := strings.Join(regexp.MustCompile(`(?s)<script>(.*?)</script>`).FindAllString(page, -1), "\n")
	for _, c := range []struct{ what, text, pattern string }{
		{"an inline event handler", markup, `(?i)<[^>]+\son[a-z]+\s*=`},
		{"a style attribute", markup, `(?i)<[^>]+\sstyle\s*=`},
		{"a URL of another origin", markup, `(?i)(src|href|action)\s*=\s*["']?([a-z]+:)?//`},
		{"a javascript: URL", page, `(?i)javascript:`},
		{"innerHTML set from code", script, `\.(inner|outer)HTML\s*=[^=]|insertAdjacentHTML|document\.write`},
		{"code run from a string", script, `\b(eval|Function)\(`},
		{"a request to an absolute URL", script, `(fetch|open)\([^)]*['"][a-z]+://`},
	} {
		if m := regexp.MustCompile(c.pattern).FindString(c.text); m != "" {
			t.Errorf("the page has %s, which the CSP forbids or which would defeat it: %q", c.what, m)
		}
	}
}

// TestDashboardHashFollowsTheBlock proves the guard above: a page whose
// script changed gets a CSP that no longer allows the old script.
func TestDashboardHashFollowsTheBlock(t *testing.T) {
	a := newDashboardPage([]byte("<style>p{}</style><script>let a = 1</script>"))
	b := newDashboardPage([]byte("<style>p{}</style><script>let a = 2</script>"))
	da, db := cspDirectives(t, a.csp), cspDirectives(t, b.csp)
	if strings.Join(da["script-src"], " ") == strings.Join(db["script-src"], " ") {
		t.Errorf("two different scripts got the same script-src: %v", da["script-src"])
	}
	if strings.Join(da["style-src"], " ") != strings.Join(db["style-src"], " ") {
		t.Errorf("the same style got different style-src: %v, %v", da["style-src"], db["style-src"])
	}
	if none := cspDirectives(t, newDashboardPage([]byte("<p>plain</p>")).csp); none["script-src"][0] != "'none'" {
		t.Errorf("a page without scripts: script-src %v, want 'none'", none["script-src"])
	}
}

func TestDashboardRouting(t *testing.T) {
	const notFound = `{"message":"Not found."}`
	env := newTestEnv(t, nil) // the dashboard is on by default
	t.Run("on: other methods on / are a JSON 405", func(t *testing.T) {
		w := env.request("POST", "/", "", nil)
		checkAnswer(t, w, 405, `{"message":"Method not allowed."}`)
		if got := w.Header().Get("Allow"); got != "GET" {
			t.Errorf("Allow: got %q, want GET", got)
		}
	})
	t.Run("on: only / is the page, the API is unchanged", func(t *testing.T) {
		checkAnswer(t, env.request("GET", "/index.html", "", nil), 404, notFound)
		checkAnswer(t, env.request("GET", "/v1/nope", "", nil), 404, notFound)
		checkAnswer(t, env.request("GET", "/healthz", "", nil), 200, `{"status":"ok","mqtt":"disconnected"}`)
		checkAnswer(t, env.request("GET", "/v1/auth/me", "", nil), 401, `{"message":"Unauthenticated."}`)
		w := env.request("GET", "/v1/user/devices", env.alice.token, nil)
		checkAnswer(t, w, 200, "")
		if !strings.Contains(w.Body.String(), env.alice.device) {
			t.Errorf("device list without alice's device: %s", w.Body)
		}
	})
	t.Run("switched off again: / is a JSON 404", func(t *testing.T) {
		env := newTestEnv(t, nil, func(_ *testEnv, o *serverOptions) { o.dashboard = false }) // -dashboard=false
		w := env.request("GET", "/", "", nil)
		checkAnswer(t, w, 404, notFound)
		if csp := w.Header().Get("Content-Security-Policy"); csp != "" {
			t.Errorf("the 404 carries the page's CSP %q", csp)
		}
	})
}
