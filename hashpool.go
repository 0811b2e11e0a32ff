package main

import (
	"context"
	"runtime"
	"sync"
)

// The pool of password checks: a few workers with a bounded queue, a
// share of it kept for known clients.

// hashWorkers is how many password checks run at once: a few, never every
// core, so that a burst of logins leaves CPU for the rest of the API.
func hashWorkers() int { return min(max(runtime.GOMAXPROCS(0), 2), 4) }

// hashPool runs password checks, at most workers at once, with at most
// queue more waiting; a login that finds every place open to it taken is
// refused at once. knownPlaces of the places, and one worker, are a share
// kept for known clients, at most one place of it per email at a time: so
// a flood from any number of addresses leaves a known client a place and
// a worker, and a few accounts known at many addresses, logging in
// correctly in loops, cannot take the share either.
type hashPool struct {
	mu         sync.Mutex
	newFree    int             // places left in the rest, open to all
	knownHeld  map[string]bool // the emails holding a place of the known share, one each
	workers    chan struct{}   // one per check running
	newWorkers chan struct{}   // one per check running from the rest
}

func newHashPool(workers, queue int) *hashPool {
	return &hashPool{
		newFree:    max(workers+queue-knownPlaces, 1),
		knownHeld:  map[string]bool{},
		workers:    make(chan struct{}, workers),
		newWorkers: make(chan struct{}, max(workers-1, 1)),
	}
}

// hashPlace is a place in the pool for one check, running or waiting.
type hashPlace struct {
	p     *hashPool
	known bool   // in the known share
	email string // whose place of the known share it is
}

// admit takes a place for one check for email without blocking: for a
// known client one of the known share unless its email holds one there
// already, else one of the rest; nil when every place open to the client
// is taken. release gives it back.
func (p *hashPool) admit(email string, known bool) *hashPlace {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case known && len(p.knownHeld) < knownPlaces && !p.knownHeld[email]:
		p.knownHeld[email] = true
		return &hashPlace{p: p, known: true, email: email}
	case p.newFree > 0:
		p.newFree--
		return &hashPlace{p: p}
	}
	return nil
}

// release gives the place back.
func (h *hashPlace) release() {
	p := h.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if h.known {
		delete(p.knownHeld, h.email)
	} else {
		p.newFree++
	}
}

// check reports whether password matches hash (do's rules).
func (h *hashPlace) check(ctx context.Context, hash, password string) (ok bool, err error) {
	err = h.do(ctx, func() { ok = checkPassword(hash, password) })
	return ok, err
}

// do runs fn, a password hash or check, once a worker open to the place's
// share is free: any worker for the known share, all but one for the
// rest. It returns ctx's error, fn not run, when ctx ends while it waits.
func (h *hashPlace) do(ctx context.Context, fn func()) error {
	sems := []chan struct{}{h.p.newWorkers, h.p.workers}
	if h.known {
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
