package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Connection limits (docs/security.md, Bounds). A request body must keep arriving:
// minBodyRate bytes a second of the time the server waits for it, once
// bodyGrace of waiting is over (Kestrel's MinRequestBodyDataRate), so that
// a body sent a byte at a time cannot hold a connection for the whole read
// deadline. Any real link is far faster: a firmware upload over 64 kbit/s
// sends 8,000 bytes a second.
const (
	minBodyRate = 240
	bodyGrace   = 5 * time.Second
	// bodyBehind is how far behind the minimum rate a body may fall before
	// its connection gives way to a newcomer when every slot is taken: a
	// second, so that a body's first bytes, a round trip behind its
	// headers (or behind a 100 Continue), do not count against it.
	bodyBehind = time.Second
)

// connLimits are what limitConns holds connections to.
type connLimits struct {
	max       int           // connections open at once (-max-conns); 0: no limit
	bodyRate  int           // bytes a second a request body must arrive at (minBodyRate); 0: no minimum
	bodyGrace time.Duration // waiting for a body before bodyRate applies (bodyGrace)
}

// newConnLimits are the service's limits with at most max connections.
func newConnLimits(max int) connLimits {
	return connLimits{max: max, bodyRate: minBodyRate, bodyGrace: bodyGrace}
}

// earned is how long the server may have waited for a body of which bytes
// have arrived, at the minimum rate.
func (lim connLimits) earned(bytes int64) time.Duration {
	return time.Duration(float64(bytes) / float64(lim.bodyRate) * float64(time.Second))
}

// limitConns makes srv serve at most lim.max connections from ln at once,
// each request body arriving at lim.bodyRate at least, and returns the
// listener to pass to srv.Serve. It sets srv.ConnState (calling any hook
// already set), which is how it knows the connections that are doing
// nothing, rather than guessing.
//
// When all lim.max are open and a new connection arrives, it closes one
// that is doing nothing, idle between requests or still waiting for its
// first request's headers, or that is waiting for a request body arriving
// slower than the minimum rate (more than bodyBehind behind it), from the
// client address that holds the most connections (an IPv6 client counted
// by its /64), oldest first (idlest). So one client's idle, stalled or
// trickling connections cannot lock everyone out, while a busy client, or
// many behind one NAT address, may hold as many as there is room for. Any
// other request in progress is never cut: when every connection has one,
// the new connection waits until one closes, falls idle or falls behind,
// and those after it wait in the kernel's backlog.
//
// A body is held to the rate with the connection's read deadline: while a
// handler runs whose request has a body not yet read to its end, every read
// from the connection (the handler's, and net/http's own when it discards
// what the handler left) must end before the body falls below the rate,
// counting only the time spent waiting in reads, and after lim.bodyGrace of
// it. A read past that fails as a read past the deadline does: the handler
// sees its body end in an error, and net/http closes the connection.
//
// net/http marks a connection active only once it has read the request's
// headers, so a connection closed as "new" or "idle" may have just read a
// request: srv.Handler then drops that request unanswered (the client sees
// the connection close, as it would a moment earlier) instead of running
// it for nobody.
func limitConns(srv *http.Server, ln net.Listener, lim connLimits) net.Listener {
	l := &connLimiter{Listener: ln, lim: lim, conns: map[*limitedConn]struct{}{}, perAddr: map[netip.Prefix]int{}}
	l.wake.L = &l.mu
	next := srv.ConnState
	srv.ConnState = func(c net.Conn, state http.ConnState) {
		l.setState(c, state)
		if next != nil {
			next(c, state)
		}
	}
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, c)
	}
	h := srv.Handler
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, ok := r.Context().Value(connKey{}).(*limitedConn)
		if ok && c.closed.Load() {
			panic(http.ErrAbortHandler)
		}
		if ok && r.ContentLength != 0 && lim.bodyRate > 0 {
			c.bodyDue()
			// A copy: net/http reads the type of its own request's body.
			due := *r
			due.Body = &dueBody{r.Body, c}
			r = &due
		}
		h.ServeHTTP(w, r)
	})
	return l
}

// connKey is the context key of a request's connection.
type connKey struct{}

type connLimiter struct {
	net.Listener
	lim     connLimits
	mu      sync.Mutex
	wake    sync.Cond // broadcast when a connection closes, falls idle or starts waiting for its body, and on Close
	closed  bool
	conns   map[*limitedConn]struct{} // the open connections
	perAddr map[netip.Prefix]int      // how many of them each client address holds
	seq     uint64                    // the last connection's place in accept order
}

// limitedConn is a connection that holds a slot until it is closed.
type limitedConn struct {
	net.Conn
	l     *connLimiter
	addr  netip.Prefix
	seq   uint64
	state http.ConnState // under l.mu
	// closed: admit closed it for a newcomer. Set under l.mu before the
	// connection can turn active, read without it on every request.
	closed atomic.Bool
	// due: a handler runs whose request body has not been read to its
	// end. Set and cleared under l.mu, read without it on every read.
	due  atomic.Bool
	body bodyWait // under l.mu
	// readDeadline is the read deadline net/http or a handler set
	// (SetReadDeadline), under l.mu.
	readDeadline time.Time
}

// bodyWait is how a request body has arrived while its handler runs.
type bodyWait struct {
	bytes    int64         // read from the connection
	waited   time.Duration // waiting in reads that ended
	since    time.Time     // when the read in progress began; zero when none is
	deadline time.Time     // when the read in progress falls below the rate
}

// Accept accepts a connection and waits for a slot for it (admit).
func (l *connLimiter) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	lc := &limitedConn{Conn: c, l: l, addr: connAddr(c.RemoteAddr()), state: http.StateNew}
	if err := l.admit(lc); err != nil {
		c.Close()
		return nil, err
	}
	return lc, nil
}

// admit gives c a slot. While every slot is taken it closes the connection
// that idlest picks, or, when none may give way, waits for a change, or
// for the moment a body being waited for falls behind.
func (l *connLimiter) admit(c *limitedConn) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for l.lim.max > 0 && len(l.conns) >= l.lim.max {
		if l.closed {
			return net.ErrClosed
		}
		v, behind := l.idlest(time.Now())
		switch {
		case v != nil:
			v.Conn.Close() // under the lock: if it turns active now, its handler sees it closed
			v.closed.Store(true)
			l.forget(v)
		case !behind.IsZero():
			t := time.AfterFunc(time.Until(behind), func() {
				l.mu.Lock()
				defer l.mu.Unlock()
				l.wake.Broadcast()
			})
			l.wake.Wait()
			t.Stop()
		default:
			l.wake.Wait()
		}
	}
	l.seq++
	c.seq = l.seq
	l.conns[c] = struct{}{}
	l.perAddr[c.addr]++
	return nil
}

// idlest is the connection to close for a newcomer, nil if none gives
// way now, and then when to look again (zero: at the next change). It
// takes the address holding the most connections among those with one
// that gives way now or is falling behind (within bodyBehind of giving
// way), ties to the one whose such connection is the oldest; then that
// address's oldest connection that gives way now, or, when none does yet,
// waits for its first to. So an attack that opens its slow bodies again
// as fast as they are closed does not get a newcomer's own connection,
// new until its headers are read, closed in their place. A scan: it runs
// only when every slot is taken, and -max-conns is small.
func (l *connLimiter) idlest(now time.Time) (v *limitedConn, next time.Time) {
	var first *limitedConn
	for c := range l.conns {
		if _, ok := c.givesWay(now); ok && (first == nil || l.before(c, first)) {
			first = c
		}
	}
	if first == nil {
		return nil, time.Time{}
	}
	for c := range l.conns {
		at, ok := c.givesWay(now)
		switch {
		case !ok || c.addr != first.addr:
		case !at.After(now):
			if v == nil || c.seq < v.seq {
				v = c
			}
		case next.IsZero() || at.Before(next):
			next = at
		}
	}
	if v != nil {
		next = time.Time{}
	}
	return v, next
}

// before reports whether c comes before v among connections to close: its
// address holds more connections, or as many and c is older.
func (l *connLimiter) before(c, v *limitedConn) bool {
	n, m := l.perAddr[c.addr], l.perAddr[v.addr]
	return n > m || n == m && c.seq < v.seq
}

// givesWay says when c may be closed for a newcomer, and whether that is
// within bodyBehind: now when it is new or idle; when its handler waits
// for a body below the minimum rate, once it is bodyBehind behind it.
func (c *limitedConn) givesWay(now time.Time) (at time.Time, soon bool) {
	switch {
	case c.state == http.StateNew || c.state == http.StateIdle:
		return now, true
	case c.state != http.StateActive || !c.due.Load() || c.body.since.IsZero():
		return time.Time{}, false
	}
	at = c.body.since.Add(c.l.lim.earned(c.body.bytes) + bodyBehind - c.body.waited)
	return at, !at.After(now.Add(bodyBehind))
}

// setState is srv.ConnState: it records what each connection is doing and
// wakes an Accept that waits for one to fall idle. A connection that is no
// longer active has no body due.
func (l *connLimiter) setState(c net.Conn, state http.ConnState) {
	lc, ok := c.(*limitedConn)
	if !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	lc.state = state
	if state != http.StateActive {
		lc.due.Store(false)
	}
	if state == http.StateIdle {
		l.wake.Broadcast()
	}
}

// bodyDue notes that a handler starts whose request has a body: from now
// on reads from c are held to the minimum rate, until dueBody reads the
// body's end or the request ends.
func (c *limitedConn) bodyDue() {
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	c.body = bodyWait{}
	c.due.Store(true)
}

// dueBody is a request body that tells its connection when it has been
// read to its end: reads after that (net/http's, to see the client go
// away) wait for no body. A body that net/http discards itself, unread by
// a handler that then runs on, is never seen to end: such a handler's
// connection stays held to the rate, which only a client that sends a
// body nobody asked for (a GET of a stream with one) can notice.
type dueBody struct {
	io.ReadCloser
	c *limitedConn
}

func (b *dueBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.c.l.mu.Lock()
		b.c.due.Store(false)
		b.c.Conn.SetReadDeadline(b.c.readDeadline)
		b.c.l.mu.Unlock()
	}
	return n, err
}

// Read reads from the connection; while a body is due, a read must end
// before the body falls below the minimum rate (see limitConns).
func (c *limitedConn) Read(p []byte) (int, error) {
	if !c.due.Load() || !c.beginRead() {
		return c.Conn.Read(p)
	}
	n, err := c.Conn.Read(p)
	c.endRead(n)
	return n, err
}

// beginRead starts a read while a body is due: its deadline is the earlier
// of the one set and the moment the body falls below the rate, past
// lim.bodyGrace of waiting. It wakes an admit that waits, for this read
// may fall behind. false: no body is due after all.
func (c *limitedConn) beginRead() bool {
	l := c.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if !c.due.Load() {
		return false
	}
	b := &c.body
	b.since = time.Now()
	b.deadline = b.since.Add(max(l.lim.bodyGrace, l.lim.earned(b.bytes)) - b.waited)
	c.Conn.SetReadDeadline(earliest(c.readDeadline, b.deadline))
	l.wake.Broadcast()
	return true
}

// endRead counts a read that beginRead began.
func (c *limitedConn) endRead(n int) {
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	b := &c.body
	b.bytes += int64(n)
	b.waited += time.Since(b.since)
	b.since = time.Time{}
}

// SetReadDeadline sets the read deadline, the earlier of t and the rate's
// while a read for a due body is in progress.
func (c *limitedConn) SetReadDeadline(t time.Time) error {
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	c.readDeadline = t
	if c.due.Load() && !c.body.since.IsZero() {
		t = earliest(t, c.body.deadline)
	}
	return c.Conn.SetReadDeadline(t)
}

// earliest is the earlier of two deadlines, zero being none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || !b.IsZero() && b.Before(a) {
		return b
	}
	return a
}

// forget frees c's slot, once.
func (l *connLimiter) forget(c *limitedConn) {
	if _, ok := l.conns[c]; !ok {
		return
	}
	delete(l.conns, c)
	if l.perAddr[c.addr]--; l.perAddr[c.addr] == 0 {
		delete(l.perAddr, c.addr)
	}
	l.wake.Broadcast()
}

// Close closes the listener and ends an Accept that waits for a slot.
func (l *connLimiter) Close() error {
	l.mu.Lock()
	l.closed = true
	l.wake.Broadcast()
	l.mu.Unlock()
	return l.Listener.Close()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.l.mu.Lock()
	c.l.forget(c)
	c.l.mu.Unlock()
	return err
}

// connAddr is the client address a connection counts under: its peer's
// address, or for IPv6 the peer's /64, which one host usually has whole.
func connAddr(a net.Addr) netip.Prefix {
	tcp, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.Prefix{}
	}
	ip := tcp.AddrPort().Addr().Unmap()
	bits := 64
	if ip.Is4() {
		bits = 32
	}
	p, _ := ip.Prefix(bits)
	return p
}

// releaseConnSlot gives the slot of the request's connection back while it
// stays open: an event stream (events.go) is no request in flight, and is
// bounded per user instead. Nothing when connections are not limited.
func releaseConnSlot(ctx context.Context) {
	if c, ok := ctx.Value(connKey{}).(*limitedConn); ok {
		c.releaseSlot()
	}
}

func (c *limitedConn) releaseSlot() {
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	c.l.forget(c)
}
