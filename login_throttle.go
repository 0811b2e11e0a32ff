package main

import (
	"context"
	"devicehub/internal/store"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// The login throttle: it counts password checks per email and address,
// per email, per address and per block of addresses, and remembers known
// clients.

// Login limits (docs/security.md, Bounds), and the pool's size.
const (
	loginWindow = time.Minute
	// maxFailuresPerEmail is how many password checks may fail per email
	// and client address in a window.
	maxFailuresPerEmail = 5
	// maxSuccessesPerEmail is how many may pass per email in a window,
	// from any address: correct passwords in a loop take the pool's places
	// as surely as guesses do.
	maxSuccessesPerEmail = 20
	// maxAttemptsPerAddr is how many may fail or pass per client address
	// in a window, whatever the email (new emails are not new chances),
	// refusals for a busy pool counted too.
	maxAttemptsPerAddr = 50
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
	// knownPlaces is how many of the pool's places, one worker's among
	// them, only known clients may take.
	knownPlaces = 1 + hashQueue/4
)

// blockLimits bound the checks waiting or running per larger block of
// client addresses too, beside maxChecksPerAddr: one host or one customer
// often holds a whole IPv6 /56 or /48, and IPv4 addresses of one /24 are
// cheap to rent, so that no block can take the pool by stepping through
// its addresses. Known clients are counted in them too: accounts of one's
// own, logged in from each address of a block, make every address known.
var blockLimits = []struct {
	ipv4      bool
	bits, max int
}{{true, 24, 4}, {false, 56, 4}, {false, 48, 8}}

// loginLimiter counts password checks in fixed windows, per email and
// client address (failed), per email (passed) and per client address
// (both), and the checks pending per block of addresses. An attempt is
// counted when it is reserved, under the lock and before any hashing, so
// that requests sent at once cannot all pass a check made before any of
// them failed. It also remembers where each email logged in (known).
type loginLimiter struct {
	mu        sync.Mutex
	entries   map[string]*loginCount
	nextSweep time.Time
	// known lists, per email, the client addresses (throttleAddr) it
	// logged in from with its password, oldest first. Only a correct
	// password adds to it, at most store.MaxKnownPerEmail per email, so it
	// grows with the users table, never with a flood.
	known map[string][]knownAddr
}

type knownAddr struct {
	addr string
	at   time.Time
}

// loginCount is one key's checks: those that count against it in the
// current window (counts) and those reserved and not yet finished.
type loginCount struct {
	counted int
	pending int
	reset   time.Time // the end of the current window
}

// loginAttempt is a reserved password check, under its keys.
type loginAttempt struct {
	email, addr       string
	emailKey, addrKey string
	// successKey counts the email's passed checks; none for an invite,
	// which its success uses up.
	successKey string
	blocks     []blockKey
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

// reserve counts a password check for a login to email from the client
// address ip, or refuses it and says how long to wait (take).
func (l *loginLimiter) reserve(email, ip string, now time.Time) (*loginAttempt, time.Duration) {
	a := newAttempt(email, ip)
	a.successKey = "ok:" + email
	return l.take(a, now)
}

// reserveInvite counts the password hash of a link's redemption (an
// invite or a password reset) from the client address ip as a login to
// the email "invite" (take), its success counted nowhere: it uses the
// link up.
func (l *loginLimiter) reserveInvite(ip string, now time.Time) (*loginAttempt, time.Duration) {
	return l.take(newAttempt("invite", ip), now)
}

func newAttempt(email, ip string) *loginAttempt {
	addr := throttleAddr(ip)
	return &loginAttempt{email: email, addr: addr, emailKey: "email:" + email + "|" + addr, addrKey: "addr:" + addr, blocks: blockKeys(ip)}
}

// take reserves a's check, or refuses it and says how long to wait: 5
// failed or pending checks per email and address, 20 passed or pending
// per email, or 50 spent or pending per address in the window, or too
// many pending for the address or for one of its blocks. That last
// refusal counts against the address, so that sending again at once is
// not free.
func (l *loginLimiter) take(a *loginAttempt, now time.Time) (*loginAttempt, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sweep(now)
	a.known = a.successKey != "" && l.isKnown(a.email, a.addr, now)
	byEmail, byAddr := l.count(a.emailKey, now), l.count(a.addrKey, now)
	bySuccess := l.count(a.successKey, now)
	switch {
	case byEmail.counted+byEmail.pending >= maxFailuresPerEmail:
		return nil, byEmail.reset.Sub(now)
	case bySuccess.counted+bySuccess.pending >= maxSuccessesPerEmail:
		return nil, bySuccess.reset.Sub(now)
	case byAddr.counted+byAddr.pending >= maxAttemptsPerAddr:
		return nil, byAddr.reset.Sub(now)
	case byAddr.pending >= maxChecksPerAddr || l.blockFull(a.blocks, now):
		l.entry(a.addrKey, now).counted++
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
	if a.successKey != "" {
		keys = append(keys, a.successKey)
	}
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
		c.counted, c.reset = 0, now.Add(loginWindow)
	}
	return c
}

// finish ends a reserved check: its outcome counts against the keys it
// counts against (counts), and every key gives its reservation back. A
// login's passed check makes its email known at its address.
func (l *loginLimiter) finish(a *loginAttempt, outcome checkOutcome, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, key := range a.keys() {
		c := l.entry(key, now)
		c.pending--
		if a.counts(key, outcome) {
			c.counted++
		}
		if c.counted == 0 && c.pending == 0 {
			delete(l.entries, key)
		}
	}
	if outcome == checkPassed && a.successKey != "" {
		l.remember(a.email, a.addr, now)
	}
}

// counts reports whether outcome counts against key of a's: a failure
// against the email at the address and the address, a success against
// the email and the address, a refusal for a busy pool against the
// address.
func (a *loginAttempt) counts(key string, outcome checkOutcome) bool {
	switch outcome {
	case checkFailed:
		return key == a.emailKey || key == a.addrKey
	case checkPassed:
		return key == a.successKey || key == a.addrKey
	case checkRefused:
		return key == a.addrKey
	}
	return false
}

// loginCheck is a reserved password check with its place in the pool.
type loginCheck struct {
	s       *server
	attempt *loginAttempt
	place   *hashPlace
}

// admitCheck takes a place in the pool for the check that reserve or
// reserveInvite reserved, or answers 429: when they refused it, or at once
// when every place open to the client is taken (before any user lookup,
// so that the refusal costs no database read), which counts against the
// address. end ends the check.
func (s *server) admitCheck(attempt *loginAttempt, wait time.Duration) (*loginCheck, error) {
	if attempt == nil {
		return nil, tooManyAttempts(wait)
	}
	place := s.hashes.admit(attempt.email, attempt.known)
	if place == nil {
		s.limiter.finish(attempt, checkRefused, s.store.Now())
		return nil, tooManyAttempts(busyRetryAfter)
	}
	return &loginCheck{s, attempt, place}, nil
}

// end gives the check's place back and counts its outcome.
func (c *loginCheck) end(outcome checkOutcome) {
	c.place.release()
	c.s.limiter.finish(c.attempt, outcome, c.s.store.Now())
}

// loadKnownClients fills the limiter's memory of known clients from the
// store, as the service starts.
func (s *server) loadKnownClients(ctx context.Context) error {
	now := s.store.Now()
	known, err := s.store.KnownClients(ctx, now.Add(-knownFor))
	if err != nil {
		return err
	}
	s.limiter.mu.Lock()
	defer s.limiter.mu.Unlock()
	for _, k := range known {
		at, err := time.Parse(store.TimeFormat, k[2])
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
// store.MaxKnownPerEmail addresses of the last knownFor.
func (l *loginLimiter) remember(email, addr string, now time.Time) {
	list := slices.DeleteFunc(l.known[email], func(k knownAddr) bool {
		return k.addr == addr || now.Sub(k.at) >= knownFor
	})
	list = append(list, knownAddr{addr, now})
	l.known[email] = slices.Delete(list, 0, max(len(list)-store.MaxKnownPerEmail, 0))
}

// forget drops where email logged in from: its password changed.
func (l *loginLimiter) forget(email string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.known, email)
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
