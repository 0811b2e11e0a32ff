package main

import (
	"net"
	"sync"
)

// limitListener returns ln accepting at most n connections at once (n <= 0:
// no limit). Past n, Accept waits until one closes; new connections wait
// in the kernel's backlog meanwhile, so slow clients cannot make the
// server hold an unbounded number of sockets and goroutines.
func limitListener(ln net.Listener, n int) net.Listener {
	if n <= 0 {
		return ln
	}
	return &connLimiter{Listener: ln, slots: make(chan struct{}, n), closed: make(chan struct{})}
}

type connLimiter struct {
	net.Listener
	slots     chan struct{} // one per open connection
	closed    chan struct{} // closed by Close: a waiting Accept returns
	closeOnce sync.Once
}

// Accept waits for a free slot, then accepts a connection that gives its
// slot back when it is closed.
func (l *connLimiter) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &limitedConn{Conn: c, release: sync.OnceFunc(func() { <-l.slots })}, nil
}

// Close closes the listener and ends an Accept that waits for a slot.
func (l *connLimiter) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// limitedConn is a connection that holds a slot until it is closed.
type limitedConn struct {
	net.Conn
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}

// releaseSlot gives c's slot back while it stays open: an event stream
// (events.go) is no request in flight, and is bounded per user instead.
func (c *limitedConn) releaseSlot() { c.release() }
