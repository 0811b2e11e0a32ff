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
	"slices"
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
	// knownFor is how long a correct password makes its email known at
	// its client address (OWASP's device cookies against lockout): a known
	// client keeps a share of the pool however many addresses flood it.
	knownFor = 30 * 24 * time.Hour
	// maxKnownPerEmail is how many client addresses are remembered per
	// email, the most recent.
	maxKnownPerEmail = 8
	// knownPlaces is how many of the pool's places, one worker's among
	// them, only known clients may take.
	knownPlaces = 1 + hashQueue/4
)

// blockLimits bound the checks waiting or running per larger block of
// client addresses too, beside maxChecksPerAddr: one host or one customer
// often holds a whole IPv6 /56 or /48, and IPv4 addresses of one /24 are
// cheap to rent, so that no block can take the pool by stepping through
// its addresses. Known clients are not counted in them.
var blockLimits = []struct {
	ipv4      bool
	bits, max int
}{{true, 24, 4}, {false, 56, 4}, {false, 48, 8}}

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
	attempt, wait := s.limiter.reserve(normalizeEmail(*email), s.clientIP(r), s.store.now())
	if attempt == nil {
		return tooManyAttempts(wait)
	}
	outcome := checkNotRun
	defer func() { s.limiter.finish(attempt, outcome, s.store.now()) }()
	// A place in the hashing queue before the user lookup: when the queue
	// is full, the 429 costs no database read and comes at once.
	release, ok := s.hashes.admit(attempt.known)
	if !ok {
		outcome = checkRefused
		return tooManyAttempts(busyRetryAfter)
	}
	defer release()
	u, err := s.store.userByEmail(ctx, *email)
	if err != nil && !errors.Is(err, errUserNotFound) {
		return err
	}
	if u != nil && u.passwordHash == "" {
		u = nil // invited, no password set yet: an unknown email's answer, after the same work
	}
	hash := s.dummyHash() // the same work as a real check: no user enumeration by timing
	if u != nil {
		hash = u.passwordHash
	}
	match, err := s.hashes.check(ctx, attempt.known, hash, *password)
	if err != nil { // the client went away while waiting
		return nil
	}
	if u == nil || !match {
		outcome = checkFailed
		return &fieldErrors{fields: []string{"email"},
			msgs: map[string][]string{"email": {"The provided credentials are incorrect."}}}
	}
	outcome = checkPassed
	if err := s.store.rememberClient(ctx, u.ID, attempt.addr); err != nil {
		s.log.Warn("remember a known client", "err", err)
	}
	return s.answerLogin(w, r, u, *tokenName)
}

// answerLogin issues a login token for u and answers with it.
func (s *server) answerLogin(w http.ResponseWriter, r *http.Request, u *user, tokenName string) error {
	_, tok, err := issueToken(r.Context(), s.store, u.ID, tokenName, true)
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
// client address and per client address alone, and the checks pending per
// block of addresses. An attempt is counted when it is reserved, under the
// lock and before any hashing, so that requests sent at once cannot all
// pass a check made before any of them failed. It also remembers where
// each email logged in (known).
type loginLimiter struct {
	mu        sync.Mutex
	entries   map[string]*loginCount
	nextSweep time.Time
	// known lists, per email, the client addresses (throttleAddr) it
	// logged in from with its password, oldest first. Only a correct
	// password adds to it, at most maxKnownPerEmail per email, so it
	// grows with the users table, never with a flood.
	known map[string][]knownAddr
}

type knownAddr struct {
	addr string
	at   time.Time
}

// loginCount is one key's checks: failed ones in the current window and
// ones reserved and not yet finished.
type loginCount struct {
	failures int
	pending  int
	reset    time.Time // the end of the current window
}

// loginAttempt is a reserved password check, under its keys.
type loginAttempt struct {
	email, addr       string
	emailKey, addrKey string
	blocks            []blockKey // none for a known client
	// known: email logged in from addr within knownFor. It only chooses
	// the pool's share the check runs in; the password is checked all the
	// same.
	known bool
}

// blockKey is the key of one of a client's larger blocks of addresses,
// and how many checks it may have pending.
type blockKey struct {
	key string
	max int
}

// checkOutcome is how a reserved check ended (finish).
type checkOutcome int

const (
	checkNotRun  checkOutcome = iota // the client left, or the server failed
	checkRefused                     // the pool was full: counted against the address
	checkFailed                      // a wrong password or an unknown email
	checkPassed
)

// maxLimiterEntries is how many keys the limiter holds before it sweeps
// out those whose window is over.
const maxLimiterEntries = 10_000

func newLoginLimiter() *loginLimiter {
	return &loginLimiter{entries: map[string]*loginCount{}, known: map[string][]knownAddr{}}
}

// reserve counts a password check for email from the client address ip,
// or refuses it and says how long to wait: 5 failed or pending checks per
// email and address or 50 per address in the window, or too many pending
// for the address or, unless the client is known, for one of its blocks.
// That last refusal counts against the address, so that sending again at
// once is not free.
func (l *loginLimiter) reserve(email, ip string, now time.Time) (*loginAttempt, time.Duration) {
	addr := throttleAddr(ip)
	a := &loginAttempt{email: email, addr: addr, emailKey: "email:" + email + "|" + addr, addrKey: "addr:" + addr}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sweep(now)
	if a.known = l.isKnown(email, addr, now); !a.known {
		a.blocks = blockKeys(ip)
	}
	byEmail, byAddr := l.count(a.emailKey, now), l.count(a.addrKey, now)
	switch {
	case byEmail.failures+byEmail.pending >= maxFailuresPerEmail:
		return nil, byEmail.reset.Sub(now)
	case byAddr.failures+byAddr.pending >= maxFailuresPerAddr:
		return nil, byAddr.reset.Sub(now)
	case byAddr.pending >= maxChecksPerAddr || l.blockFull(a.blocks, now):
		l.entry(a.addrKey, now).failures++
		return nil, busyRetryAfter
	}
	for _, key := range a.keys() {
		l.entry(key, now).pending++
	}
	return a, 0
}

// keys are all of a's keys, each holding one pending check.
func (a *loginAttempt) keys() []string {
	keys := []string{a.emailKey, a.addrKey}
	for _, b := range a.blocks {
		keys = append(keys, b.key)
	}
	return keys
}

// blockFull reports whether one of blocks has all the checks it may have.
func (l *loginLimiter) blockFull(blocks []blockKey, now time.Time) bool {
	return slices.ContainsFunc(blocks, func(b blockKey) bool { return l.count(b.key, now).pending >= b.max })
}

// blockKeys are the keys of the blocks that hold the address ip
// (blockLimits); none when ip is not an address.
func blockKeys(ip string) []blockKey {
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return nil
	}
	a = a.Unmap()
	var keys []blockKey
	for _, b := range blockLimits {
		if b.ipv4 == a.Is4() {
			p, _ := a.Prefix(b.bits)
			keys = append(keys, blockKey{"block:" + p.String(), b.max})
		}
	}
	return keys
}

// count is key's count now, with a window that is over counted as empty.
// It does not add the key.
func (l *loginLimiter) count(key string, now time.Time) loginCount {
	if l.entries[key] == nil {
		return loginCount{reset: now.Add(loginWindow)}
	}
	return *l.entry(key, now)
}

// entry is key's count, added if missing, with a window that is over
// begun anew.
func (l *loginLimiter) entry(key string, now time.Time) *loginCount {
	c := l.entries[key]
	if c == nil {
		c = &loginCount{reset: now.Add(loginWindow)}
		l.entries[key] = c
	} else if !now.Before(c.reset) {
		c.failures, c.reset = 0, now.Add(loginWindow)
	}
	return c
}

// finish ends a reserved check: a failure stays counted in its window, and
// a refusal for a full pool against the address; anything else gives its
// reservation back. A passed check makes its email known at its address.
func (l *loginLimiter) finish(a *loginAttempt, outcome checkOutcome, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, key := range a.keys() {
		c := l.entry(key, now)
		c.pending--
		if outcome == checkFailed && (key == a.emailKey || key == a.addrKey) ||
			outcome == checkRefused && key == a.addrKey {
			c.failures++
		}
		if c.failures == 0 && c.pending == 0 {
			delete(l.entries, key)
		}
	}
	if outcome == checkPassed {
		l.remember(a.email, a.addr, now)
	}
}

// loadKnownClients fills the limiter's memory of known clients from the
// store, as the service starts.
func (s *server) loadKnownClients(ctx context.Context) error {
	now := s.store.now()
	known, err := s.store.knownClients(ctx, now.Add(-knownFor))
	if err != nil {
		return err
	}
	s.limiter.mu.Lock()
	defer s.limiter.mu.Unlock()
	for _, k := range known {
		at, err := time.Parse(timeFormat, k[2])
		if err != nil {
			return err
		}
		s.limiter.remember(k[0], k[1], at)
	}
	return nil
}

// isKnown reports whether email logged in from addr within knownFor.
func (l *loginLimiter) isKnown(email, addr string, now time.Time) bool {
	return slices.ContainsFunc(l.known[email], func(k knownAddr) bool {
		return k.addr == addr && now.Sub(k.at) < knownFor
	})
}

// remember records that email logged in from addr, keeping the most recent
// maxKnownPerEmail addresses of the last knownFor.
func (l *loginLimiter) remember(email, addr string, now time.Time) {
	list := slices.DeleteFunc(l.known[email], func(k knownAddr) bool {
		return k.addr == addr || now.Sub(k.at) >= knownFor
	})
	list = append(list, knownAddr{addr, now})
	l.known[email] = slices.Delete(list, 0, max(len(list)-maxKnownPerEmail, 0))
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
// once. A share is kept for known clients: others may take neither the
// last knownPlaces places nor the last worker, so that a flood from any
// number of addresses leaves a known client a place and a worker.
type hashPool struct {
	places, newPlaces   chan struct{} // one per check running or waiting; of new clients
	workers, newWorkers chan struct{} // one per check running; of new clients
}

func newHashPool(workers, queue int) *hashPool {
	return &hashPool{
		places:     make(chan struct{}, workers+queue),
		newPlaces:  make(chan struct{}, max(workers+queue-knownPlaces, 1)),
		workers:    make(chan struct{}, workers),
		newWorkers: make(chan struct{}, max(workers-1, 1)),
	}
}

// admit takes a place for one check, running or waiting, without
// blocking: ok is false when every place open to the client is taken.
// release gives it back.
func (p *hashPool) admit(known bool) (release func(), ok bool) {
	sems := []chan struct{}{p.newPlaces, p.places}
	if known {
		sems = sems[1:]
	}
	for i, sem := range sems {
		select {
		case sem <- struct{}{}:
		default:
			releaseAll(sems[:i])
			return nil, false
		}
	}
	return func() { releaseAll(sems) }, true
}

// check reports whether password matches hash (do's rules).
func (p *hashPool) check(ctx context.Context, known bool, hash, password string) (ok bool, err error) {
	err = p.do(ctx, known, func() { ok = checkPassword(hash, password) })
	return ok, err
}

// do runs fn, a password hash or check, once a worker open to the client
// is free; the caller holds a place from admit. It returns ctx's error,
// fn not run, when ctx ends while it waits.
func (p *hashPool) do(ctx context.Context, known bool, fn func()) error {
	sems := []chan struct{}{p.newWorkers, p.workers}
	if known {
		sems = sems[1:]
	}
	for i, sem := range sems {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			releaseAll(sems[:i])
			return ctx.Err()
		}
	}
	defer releaseAll(sems)
	fn()
	return nil
}

// releaseAll gives back one place in each of sems.
func releaseAll(sems []chan struct{}) {
	for _, sem := range sems {
		<-sem
	}
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
