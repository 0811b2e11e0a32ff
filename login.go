package main

// Login: the handler, the throttle that counts password checks, and the
// pool that runs them.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"time"
)

// Login limits (CONTRACT §10), and the pool's size.
const (
	loginWindow = time.Minute
	// maxFailuresPerEmail is how many password checks may fail per email
	// and client address in a window.
	maxFailuresPerEmail = 5
	// maxFailuresPerAddr is how many may fail per client address in a
	// window, whatever the email: new emails are not new chances.
	maxFailuresPerAddr = 50
	// maxChecksPerAddr is how many checks one client address may have
	// waiting or running at once, so that one address cannot fill the
	// queue and delay everyone else's login.
	maxChecksPerAddr = 2
	// hashQueue is how many checks may wait for a worker; past that a
	// login is answered 429 at once instead of waiting.
	hashQueue = 16
	// busyRetryAfter is the Retry-After of a 429 for a full queue.
	busyRetryAfter = time.Second
)

// hashWorkers is how many password checks run at once: a few, never every
// core, so that a burst of logins leaves CPU for the rest of the API.
func hashWorkers() int { return min(max(runtime.GOMAXPROCS(0), 2), 4) }

// handleLogin serves POST /v1/auth/login: email, password and token_name
// in, a new personal access token out. A malformed request is refused
// before it can use up an attempt; a well-formed one reserves its attempt
// before any hashing, so that concurrent guesses are counted as they start.
func (s *server) handleLogin(w http.ResponseWriter, r *http.Request) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	email := body.str(&e, "email", true, 255)
	password := body.str(&e, "password", true, 1024)
	tokenName := body.str(&e, "token_name", true, 255)
	if err := e.err(); err != nil {
		return err
	}
	ctx := r.Context()
	attempt, wait := s.limiter.reserve(normalizeEmail(*email), throttleAddr(s.clientIP(r)), s.store.now())
	if attempt == nil {
		return retryAfter(wait)
	}
	failed := false
	defer func() { s.limiter.finish(attempt, failed, s.store.now()) }()
	// A place in the hashing queue before the user lookup: when the queue
	// is full, the 429 costs no database read and comes at once.
	release, ok := s.hashes.admit()
	if !ok {
		return retryAfter(busyRetryAfter)
	}
	defer release()
	u, err := s.store.userByEmail(ctx, *email)
	if err != nil && !errors.Is(err, errUserNotFound) {
		return err
	}
	hash := s.dummyHash() // the same work as a real check: no user enumeration by timing
	if u != nil {
		hash = u.passwordHash
	}
	match, err := s.hashes.check(ctx, hash, *password)
	if err != nil { // the client went away while waiting
		return nil
	}
	if u == nil || !match {
		failed = true
		return &fieldErrors{fields: []string{"email"},
			msgs: map[string][]string{"email": {"The provided credentials are incorrect."}}}
	}
	_, tok, err := issueToken(ctx, s.store, u.ID, *tokenName, true)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, struct {
		TokenType string      `json:"token_type"`
		Token     string      `json:"token"`
		User      userSummary `json:"user"`
	}{"Bearer", tok, userSummary{ID: u.ID, Name: u.Name, Email: u.Email, Role: u.Role}})
	return nil
}

// clientIP is the address the login throttle counts a request under: the
// peer's, unless the peer is a trusted proxy (-trusted-proxies). Then it
// is the right-most X-Forwarded-For address that is not a trusted proxy:
// each proxy appends the address it saw, so everything to the left of that
// was sent by the client and may be made up. If that address does not
// parse, it is the last trusted hop; if every hop is trusted, the first.
func (s *server) clientIP(r *http.Request) string {
	peer := peerIP(r)
	client, err := netip.ParseAddr(peer)
	if err != nil || !s.trusted(client) {
		return peer
	}
	hops := forwardedFor(r)
	for i := len(hops) - 1; i >= 0; i-- {
		hop, ok := parseHop(hops[i])
		if !ok {
			break
		}
		client = hop
		if !s.trusted(hop) {
			break
		}
	}
	return client.String()
}

// throttleAddr is what the login limits count a client address as: the
// address itself, or for IPv6 its /64, which one host usually has whole
// and could otherwise step through to get fresh limits.
func throttleAddr(addr string) string {
	a, err := netip.ParseAddr(addr)
	if err != nil || a.Is4() {
		return addr
	}
	p, _ := a.Prefix(64)
	return p.String()
}

// trusted reports whether addr is one of the trusted proxies.
func (s *server) trusted(addr netip.Addr) bool {
	for _, p := range s.trustedProxies {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// peerIP is the address the request's connection comes from.
func peerIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	if addr, ok := parseHop(host); ok {
		return addr.String()
	}
	return host
}

// forwardedFor lists the X-Forwarded-For addresses of every such header
// line, in order.
func forwardedFor(r *http.Request) []string {
	var hops []string
	for _, line := range r.Header.Values("X-Forwarded-For") {
		for _, hop := range strings.Split(line, ",") {
			if hop = strings.TrimSpace(hop); hop != "" {
				hops = append(hops, hop)
			}
		}
	}
	return hops
}

// parseHop parses an address as proxies write it: an IP, perhaps with a
// port, an IPv6 zone or as IPv4 mapped into IPv6, all of which it drops.
func parseHop(s string) (netip.Addr, bool) {
	addr, err := netip.ParseAddr(s)
	if err != nil {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return netip.Addr{}, false
		}
		addr = ap.Addr()
	}
	return addr.Unmap().WithZone(""), true
}

// parseTrustedProxies parses -trusted-proxies: comma-separated CIDRs or
// single addresses; "" is none.
func parseTrustedProxies(s string) ([]netip.Prefix, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var list []netip.Prefix
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		p, err := netip.ParsePrefix(item)
		if err != nil {
			addr, aerr := netip.ParseAddr(item)
			if aerr != nil {
				return nil, fmt.Errorf("trusted proxy %q is not a CIDR or an IP address", item)
			}
			p = netip.PrefixFrom(addr, addr.BitLen())
		}
		list = append(list, p.Masked())
	}
	return list, nil
}

// loginLimiter counts password checks in fixed windows, per email and
// client address and per client address alone. An attempt is counted when
// it is reserved, under the lock and before any hashing, so that requests
// sent at once cannot all pass a check made before any of them failed.
type loginLimiter struct {
	mu        sync.Mutex
	entries   map[string]*loginCount
	nextSweep time.Time
}

// loginCount is one key's checks: failed ones in the current window and
// ones reserved and not yet finished.
type loginCount struct {
	failures int
	pending  int
	reset    time.Time // the end of the current window
}

// loginAttempt is a reserved password check, under its two keys.
type loginAttempt struct {
	emailKey, addrKey string
}

// maxLimiterEntries is how many keys the limiter holds before it sweeps
// out those whose window is over.
const maxLimiterEntries = 10_000

func newLoginLimiter() *loginLimiter {
	return &loginLimiter{entries: map[string]*loginCount{}}
}

// reserve counts a password check for email from addr, or refuses it and
// says how long to wait: 5 failed or pending checks per email and address
// or 50 per address in the window, or maxChecksPerAddr running at once.
func (l *loginLimiter) reserve(email, addr string, now time.Time) (*loginAttempt, time.Duration) {
	a := &loginAttempt{emailKey: "email:" + email + "|" + addr, addrKey: "addr:" + addr}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sweep(now)
	byEmail, byAddr := l.count(a.emailKey, now), l.count(a.addrKey, now)
	switch {
	case byEmail.failures+byEmail.pending >= maxFailuresPerEmail:
		return nil, byEmail.reset.Sub(now)
	case byAddr.failures+byAddr.pending >= maxFailuresPerAddr:
		return nil, byAddr.reset.Sub(now)
	case byAddr.pending >= maxChecksPerAddr:
		return nil, busyRetryAfter
	}
	for _, key := range []string{a.emailKey, a.addrKey} {
		c := l.entries[key]
		if c == nil {
			c = &loginCount{reset: now.Add(loginWindow)}
			l.entries[key] = c
		}
		c.pending++
	}
	return a, 0
}

// count is key's count now, with a window that is over counted as empty.
// It does not add the key.
func (l *loginLimiter) count(key string, now time.Time) loginCount {
	c := l.entries[key]
	if c == nil {
		return loginCount{reset: now.Add(loginWindow)}
	}
	if !now.Before(c.reset) {
		c.failures, c.reset = 0, now.Add(loginWindow)
	}
	return *c
}

// finish ends a reserved check: a failure stays counted in its window; a
// success or a check that never ran gives its reservation back.
func (l *loginLimiter) finish(a *loginAttempt, failed bool, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, key := range []string{a.emailKey, a.addrKey} {
		c := l.entries[key]
		c.pending--
		if !now.Before(c.reset) {
			c.failures, c.reset = 0, now.Add(loginWindow)
		}
		if failed {
			c.failures++
		}
		if c.failures == 0 && c.pending == 0 {
			delete(l.entries, key)
		}
	}
}

// sweep drops keys whose window is over and that have nothing pending,
// when there are many, at most once a second.
func (l *loginLimiter) sweep(now time.Time) {
	if len(l.entries) <= maxLimiterEntries || now.Before(l.nextSweep) {
		return
	}
	l.nextSweep = now.Add(time.Second)
	for k, c := range l.entries {
		if c.pending == 0 && !now.Before(c.reset) {
			delete(l.entries, k)
		}
	}
}

// hashPool runs password checks, at most workers at once, with at most
// queue more waiting; a login that finds every place taken is refused at
// once.
type hashPool struct {
	admitted chan struct{} // one per check running or waiting
	running  chan struct{} // one per check running
}

func newHashPool(workers, queue int) *hashPool {
	return &hashPool{admitted: make(chan struct{}, workers+queue), running: make(chan struct{}, workers)}
}

// admit takes a place for one check, running or waiting, without
// blocking: ok is false when every place is taken. release gives it back.
func (p *hashPool) admit() (release func(), ok bool) {
	select {
	case p.admitted <- struct{}{}:
		return func() { <-p.admitted }, true
	default:
		return nil, false
	}
}

// check reports whether password matches hash, once a worker is free; the
// caller holds a place from admit. It returns ctx's error when ctx ends
// while it waits.
func (p *hashPool) check(ctx context.Context, hash, password string) (bool, error) {
	select {
	case p.running <- struct{}{}:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	defer func() { <-p.running }()
	return checkPassword(hash, password), nil
}

// handleMe serves GET /v1/auth/me.
func (s *server) handleMe(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, dataBody{authFrom(r.Context()).user})
	return nil
}

// handleLogout serves POST /v1/auth/logout: it deletes the presented token only.
func (s *server) handleLogout(w http.ResponseWriter, r *http.Request) error {
	a := authFrom(r.Context())
	// A token revoked meanwhile is logged out all the same.
	if err := s.store.deleteUserToken(r.Context(), a.user.ID, a.tokenID); err != nil && !errors.Is(err, errTokenNotFound) {
		return err
	}
	writeMessage(w, http.StatusOK, "Logged out.")
	return nil
}
