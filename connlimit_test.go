package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"
)

// dialFrom opens a connection to addr from the loopback address
// 127.0.0.<from>, so that tests can be many clients.
func dialFrom(t *testing.T, addr string, from int) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(from))}}
	c, err := d.Dial("tcp", addr)
	must(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// idleConn opens a connection from 127.0.0.<from>, makes one request on it
// and leaves it open, idle between keep-alive requests.
func idleConn(t *testing.T, addr string, from int) net.Conn {
	t.Helper()
	c := dialFrom(t, addr, from)
	io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	must(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return c
}

// healthzFrom asks for /healthz on a new connection from 127.0.0.<from>
// and says how long the answer took.
func healthzFrom(addr string, from int) (time.Duration, error) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(from))}}
	client := &http.Client{Timeout: 5 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, DialContext: d.DialContext}}
	start := time.Now()
	resp, err := client.Get("http://" + addr + "/healthz")
	if err == nil {
		resp.Body.Close()
	}
	return time.Since(start), err
}

// closedByServer reports which of conns the server has hung up on. It
// closes before it lets a newcomer in, and on loopback the close arrives at
// once: an open connection is one whose read deadline passes.
func closedByServer(conns []net.Conn) []bool {
	closed := make([]bool, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			_, err := c.Read(make([]byte, 1))
			closed[i] = !errors.Is(err, os.ErrDeadlineExceeded)
		})
	}
	wg.Wait()
	return closed
}

// TestIdleConnsGiveWay: with every one of -max-conns slots held by a
// connection doing nothing, a new client is answered within a second: the
// server closes one from the address that holds the most, oldest first.
// Before, it waited until one closed by itself (2 minutes when idle, 10 s
// for half-sent headers).
func TestIdleConnsGiveWay(t *testing.T) {
	// Not parallel: it times a new client beside the held slots (at most 1 s).
	const maxConns = 64
	tests := []struct {
		name string
		open func(t *testing.T, addr string) []net.Conn
		// victim is the index in open's connections of the one to close
		// first; -1: any.
		victim int
	}{
		{"idle, one address", func(t *testing.T, addr string) (conns []net.Conn) {
			for range maxConns {
				conns = append(conns, idleConn(t, addr, 1))
			}
			return conns
		}, 0},
		{"idle, many addresses", func(t *testing.T, addr string) (conns []net.Conn) {
			for i := range maxConns / 2 { // older, but one per address
				conns = append(conns, idleConn(t, addr, 10+i))
			}
			for range maxConns / 2 { // the address that holds the most
				conns = append(conns, idleConn(t, addr, 100))
			}
			return conns
		}, maxConns / 2},
		{"half-sent headers", func(t *testing.T, addr string) (conns []net.Conn) {
			for range maxConns {
				c := dialFrom(t, addr, 1)
				io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n") // never finished
				conns = append(conns, c)
			}
			return conns
		}, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := newTestEnv(t, nil)
			addr := startServer(t, env, requestReadTimeout, maxConns)
			conns := tt.open(t, addr)
			took, err := healthzFrom(addr, 200)
			if err != nil || took > time.Second {
				t.Fatalf("a new client beside %d connections doing nothing: %v after %v, want an answer within 1s",
					maxConns, err, took.Round(time.Millisecond))
			}
			if tt.victim < 0 {
				return
			}
			for i, got := range closedByServer(conns) {
				if want := i == tt.victim; got != want {
					t.Errorf("connection %d of %d: closed %v, want %v", i, len(conns), got, want)
				}
			}
		})
	}
}

// TestMaxConns: past -max-conns connections that each have a request in
// progress, a new client waits, and no request is cut; once one of them
// falls idle between requests, the new client gets in.
func TestMaxConns(t *testing.T) {
	// Not parallel: it times a new client once a slot is free (at most 1 s).
	env := newTestEnv(t, nil)
	const maxConns = 64
	active := make(chan struct{}, 4*maxConns)
	addr := startServerHook(t, env, requestReadTimeout, maxConns, func(_ net.Conn, state http.ConnState) {
		if state == http.StateActive {
			active <- struct{}{}
		}
	})
	conns := make([]net.Conn, maxConns)
	for i := range conns {
		conns[i] = dialFrom(t, addr, 1)
		io.WriteString(conns[i], "POST /v1/auth/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{")
	}
	for i := range maxConns {
		select {
		case <-active:
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d requests in progress after 10 s", i, maxConns)
		}
	}
	finish := func(i int) error {
		io.WriteString(conns[i], "}")
		conns[i].SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conns[i]), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 422 {
			return fmt.Errorf("status %d, want 422", resp.StatusCode)
		}
		return nil
	}

	served := make(chan error, 1)
	go func() { _, err := healthzFrom(addr, 200); served <- err }()
	select {
	case err := <-served:
		t.Fatalf("a new client beside %d requests in progress: %v, want it to wait", maxConns, err)
	case <-time.After(300 * time.Millisecond):
	}
	must(t, finish(0))
	start := time.Now()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("a new client once a connection fell idle: %v", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("a new client once a connection fell idle: answered after %v, want within 1s", took)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("a new client once a connection fell idle: no answer after 5 s")
	}
	for i := 1; i < maxConns; i++ {
		if err := finish(i); err != nil {
			t.Errorf("request %d in progress: %v, want it answered", i, err)
		}
	}
}

// TestClosedConnDropsItsRequest: a connection closed for a newcomer just
// as it read a request (net/http marks it active only after the headers)
// does not run that request for nobody.
func TestClosedConnDropsItsRequest(t *testing.T) {
	t.Parallel()
	ran := false
	srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) { ran = true })}
	server, client := net.Pipe()
	defer client.Close()
	l := limitConns(srv, nil, 1).(*connLimiter)
	reading := &limitedConn{Conn: server, l: l, state: http.StateNew}
	must(t, l.admit(reading))
	must(t, l.admit(&limitedConn{Conn: nopConn{}, l: l})) // closes reading: it looks new
	req, err := http.NewRequestWithContext(context.WithValue(context.Background(), connKey{}, net.Conn(reading)), "POST", "/v1/user/devices/x/reboot", nil)
	must(t, err)
	defer func() {
		if p := recover(); p != http.ErrAbortHandler || ran {
			t.Errorf("the request of a closed connection: panic %v, handler ran %v; want it aborted unrun", p, ran)
		}
	}()
	srv.Handler.ServeHTTP(nil, req)
}

// nopConn is a connection that does nothing.
type nopConn struct{ net.Conn }

func (nopConn) Close() error { return nil }
