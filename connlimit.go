package main

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
)

// limitConns makes srv serve at most n connections from ln at once (n <= 0:
// no limit) and returns the listener to pass to srv.Serve. It sets
// srv.ConnState (calling any hook already set), which is how it knows the
// connections that are doing nothing, rather than guessing.
//
// When all n are open and a new connection arrives, it closes one that is
// doing nothing, idle between requests or still waiting for its first
// request's headers, from the client address that holds the most
// connections (an IPv6 client counted by its /64), oldest first. So one
// client's idle or stalled connections cannot lock everyone out, while a
// busy client, or many behind one NAT address, may hold as many as there is
// room for. A request in progress is never cut: when every connection has
// one, the new connection waits until one closes or falls idle, and those
// after it wait in the kernel's backlog.
//
// net/http marks a connection active only once it has read the request's
// headers, so a connection closed as "new" or "idle" may have just read a
// request: srv.Handler then drops that request unanswered (the client sees
// the connection close, as it would a moment earlier) instead of running
// it for nobody.
func limitConns(srv *http.Server, ln net.Listener, n int) net.Listener {
	if n <= 0 {
		return ln
	}
	l := &connLimiter{Listener: ln, max: n, conns: map[*limitedConn]struct{}{}, perAddr: map[netip.Prefix]int{}}
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
		if c, ok := r.Context().Value(connKey{}).(*limitedConn); ok && c.closed.Load() {
			panic(http.ErrAbortHandler)
		}
		h.ServeHTTP(w, r)
	})
	return l
}

// connKey is the context key of a request's connection.
type connKey struct{}

type connLimiter struct {
	net.Listener
	max     int
	mu      sync.Mutex
	wake    sync.Cond // broadcast when a connection closes or falls idle, and on Close
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
// that idlest picks, or, when none is doing nothing, waits for a change.
func (l *connLimiter) admit(c *limitedConn) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.conns) >= l.max {
		if l.closed {
			return net.ErrClosed
		}
		if v := l.idlest(); v != nil {
			v.Conn.Close() // under the lock: if it turns active now, its handler sees it closed
			v.closed.Store(true)
			l.forget(v)
		} else {
			l.wake.Wait()
		}
	}
	l.seq++
	c.seq = l.seq
	l.conns[c] = struct{}{}
	l.perAddr[c.addr]++
	return nil
}

// idlest is the connection to close for a newcomer: one that is new or
// idle, from the address holding the most connections, the oldest; nil if
// every connection has a request in progress. A scan: it runs only when
// every slot is taken, and -max-conns is small.
func (l *connLimiter) idlest() *limitedConn {
	var v *limitedConn
	for c := range l.conns {
		if c.state != http.StateNew && c.state != http.StateIdle {
			continue
		}
		n := l.perAddr[c.addr]
		if v == nil || n > l.perAddr[v.addr] || n == l.perAddr[v.addr] && c.seq < v.seq {
			v = c
		}
	}
	return v
}

// setState is srv.ConnState: it records what each connection is doing and
// wakes an Accept that waits for one to fall idle.
func (l *connLimiter) setState(c net.Conn, state http.ConnState) {
	lc, ok := c.(*limitedConn)
	if !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	lc.state = state
	if state == http.StateIdle {
		l.wake.Broadcast()
	}
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
