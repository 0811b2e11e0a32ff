package main

import "sync"

// keyedLocks is a lock per key (a device's uid, a rollout's id), made
// when someone takes it and forgotten when nobody holds or waits for it,
// so the map stays as small as the work under way. The zero value is
// ready to use.
type keyedLocks[K comparable] struct {
	mu   sync.Mutex
	held map[K]*keyedLock
}

// keyedLock is one key's lock and how many hold it or wait for it.
type keyedLock struct {
	sync.Mutex
	n int
}

// lock locks key and returns its unlock.
func (l *keyedLocks[K]) lock(key K) (unlock func()) {
	l.mu.Lock()
	if l.held == nil {
		l.held = map[K]*keyedLock{}
	}
	e := l.held[key]
	if e == nil {
		e = &keyedLock{}
		l.held[key] = e
	}
	e.n++
	l.mu.Unlock()
	e.Lock()
	return func() {
		e.Unlock()
		l.mu.Lock()
		if e.n--; e.n == 0 {
			delete(l.held, key)
		}
		l.mu.Unlock()
	}
}
