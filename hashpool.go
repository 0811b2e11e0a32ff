package main

import (
	"context"
	"runtime"
)

// The pool of password checks: a few workers with a bounded queue, a
// share of it kept for known clients.

// hashWorkers is how many password checks run at once: a few, never every
// core, so that a burst of logins leaves CPU for the rest of the API.
func hashWorkers() int { return min(max(runtime.GOMAXPROCS(0), 2), 4) }

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
