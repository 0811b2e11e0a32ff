package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
)

// The read cache: hot reads (tokens, rendered device pages) kept until
// the database changes, and the version checks that tell.

// readCache keeps hot reads (tokens, and the device pages and lists the
// handlers rendered) until the database changes. Before every use it reads PRAGMA
// data_version on a connection of its own, which changes whenever any
// other connection commits, ours or another process's (the CLI, a sqlite3
// shell); a change empties the cache. So a logout, a revoked token or a
// renamed device shows on the very next request.
type readCache struct {
	conn   *sql.Conn
	check  *sql.Stmt // PRAGMA data_version, prepared on conn
	checks versionChecks

	mu      sync.Mutex
	version int64 // the data version of what the maps hold
	tokens  map[int64]*TokenRow
	pages   map[PageKey][]byte
}

// PageKey names a rendered device page of a team; uid "" is its list.
type PageKey struct {
	TeamID int64
	UID    string
}

// maxCacheEntries bounds each map of the cache between two commits.
const maxCacheEntries = 10_000

func newReadCache(ctx context.Context, db *sql.DB) (*readCache, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("open cache connection: %w", err)
	}
	check, err := conn.PrepareContext(ctx, "PRAGMA data_version")
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("prepare cache check: %w", err)
	}
	c := &readCache{conn: conn, check: check, version: -1,
		tokens: map[int64]*TokenRow{}, pages: map[PageKey][]byte{}}
	c.checks.finished.L = &c.checks.mu
	return c, nil
}

// close closes the cache's connection.
func (c *readCache) close() error { return errors.Join(c.check.Close(), c.conn.Close()) }

// token returns the token with that id as kept since the last commit,
// or loads and keeps it.
func (c *readCache) token(ctx context.Context, id int64, load func() (*TokenRow, error)) (*TokenRow, error) {
	return cached(ctx, c, c.checks.mark(), c.tokens, id, load)
}

// dataVersion reads PRAGMA data_version, which changes whenever another
// connection has committed, or takes it from a read that began after
// mark (versionChecks.mark).
func (c *readCache) dataVersion(ctx context.Context, mark int64) (int64, error) {
	return c.checks.read(mark, func() (v int64, err error) {
		return v, c.check.QueryRowContext(pointRead(ctx)).Scan(&v)
	})
}

// pointRead is ctx for a read of one row by key on the hot path (the
// cache's check, a token, a device): such a read ends before a cancel
// could matter, and a context that can be cancelled costs each query two
// goroutines (database/sql's and the driver's, which watch for it) and
// their setup, as much as the read itself.
func pointRead(ctx context.Context) context.Context { return context.WithoutCancel(ctx) }

// versionChecks shares reads of the data version: a caller takes the
// newest read that began after its mark, or waits for the next one to
// begin, with every caller that asked while the read before was running.
// Such a read sees every commit the caller could have seen, and a burst
// of requests pays for one read (a read transaction, with its locks)
// instead of one or two each.
type versionChecks struct {
	mu       sync.Mutex
	finished sync.Cond // a read ended; on mu
	running  bool      // a read is under way
	next     *versionRead
	begun    int64       // how many reads have begun
	newest   versionRead // the newest read that succeeded
}

// versionRead is one read of the data version and the callers waiting for it.
type versionRead struct {
	n       int64 // the read's place among those begun
	version int64
	err     error
	done    bool
}

// mark returns how many reads have begun: any read numbered above it
// begins after mark was called.
func (v *versionChecks) mark() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.begun
}

// read returns the version of the newest read that began after mark, or
// of a read of query that begins after read was called; the caller that
// finds no read under way runs it.
func (v *versionChecks) read(mark int64, query func() (int64, error)) (int64, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.newest.n > mark {
		return v.newest.version, nil
	}
	if v.next == nil {
		v.next = &versionRead{}
	}
	r := v.next
	for v.running && v.next == r {
		v.finished.Wait()
	}
	if v.next == r { // not begun: this caller runs it
		v.begun++
		r.n, v.next, v.running = v.begun, nil, true
		v.mu.Unlock()
		r.version, r.err = query()
		v.mu.Lock()
		r.done, v.running = true, false
		if r.err == nil && r.n > v.newest.n {
			v.newest = *r
		}
		v.finished.Broadcast()
	}
	for !r.done {
		v.finished.Wait()
	}
	return r.version, r.err
}

type requestMarkKey struct{}

// MarkRequest notes in ctx when a request began (versionChecks.mark):
// its page lookups may then use a check of the data version that began
// since, the one that checked its token for one. Only page lookups do,
// which happen as a request begins; a token is always checked anew (an
// event stream checks its token again and again on its request's ctx).
func (s *Store) MarkRequest(ctx context.Context) context.Context {
	return context.WithValue(ctx, requestMarkKey{}, s.cache.checks.mark())
}

// CachedPage returns the page kept for key since the last commit, or
// calls render and keeps what it returns.
func (s *Store) CachedPage(ctx context.Context, key PageKey, render func() ([]byte, error)) ([]byte, error) {
	mark, ok := ctx.Value(requestMarkKey{}).(int64)
	if !ok {
		mark = s.cache.checks.mark()
	}
	return cached(ctx, s.cache, mark, s.cache.pages, key, render)
}

// cached returns m[key] as kept since the last commit seen by a check of
// the data version that began after mark, or loads, keeps and returns it.
// m is one of c's maps. Errors are not kept.
func cached[K comparable, V any](ctx context.Context, c *readCache, mark int64, m map[K]V, key K, load func() (V, error)) (V, error) {
	version, err := c.dataVersion(ctx, mark)
	if err != nil {
		return load()
	}
	c.mu.Lock()
	if version > c.version { // data_version only grows on one connection
		clear(c.tokens)
		clear(c.pages)
		c.version = version
	}
	// A read that finished before another one's, already applied, finds
	// the maps newer than it needs: as good.
	v, ok := m[key]
	c.mu.Unlock()
	if ok {
		return v, nil
	}
	// Loaded after the version was read: at least as new as that version.
	val, err := load()
	if err != nil {
		return val, err
	}
	c.mu.Lock()
	if c.version == version && len(m) < maxCacheEntries {
		m[key] = val
	}
	c.mu.Unlock()
	return val, nil
}

// stmtCache runs queries on db through statements prepared once and kept:
// preparing a query costs SQLite more than running a point lookup.
type stmtCache struct {
	DB    *sql.DB
	stmts sync.Map // query text -> *sql.Stmt
}

func (c *stmtCache) prepare(ctx context.Context, query string) (*sql.Stmt, error) {
	if st, ok := c.stmts.Load(query); ok {
		return st.(*sql.Stmt), nil
	}
	st, err := c.DB.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	if prev, loaded := c.stmts.LoadOrStore(query, st); loaded {
		st.Close()
		return prev.(*sql.Stmt), nil
	}
	return st, nil
}

// QueryContext is db.QueryContext through a prepared statement.
func (c *stmtCache) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	st, err := c.prepare(ctx, query)
	if err != nil {
		return nil, err
	}
	return st.QueryContext(ctx, args...)
}

// QueryRowContext is db.QueryRowContext through a prepared statement.
func (c *stmtCache) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	st, err := c.prepare(ctx, query)
	if err != nil {
		return c.DB.QueryRowContext(ctx, query, args...) // carries the same error
	}
	return st.QueryRowContext(ctx, args...)
}

// Conn is a connection of the pool's own, for a read transaction.
func (c *stmtCache) Conn(ctx context.Context) (*sql.Conn, error) { return c.DB.Conn(ctx) }

// close closes the statements and the pool.
func (c *stmtCache) close() error {
	var errs []error
	c.stmts.Range(func(_, st any) bool {
		errs = append(errs, st.(*sql.Stmt).Close())
		return true
	})
	return errors.Join(append(errs, c.DB.Close())...)
}
