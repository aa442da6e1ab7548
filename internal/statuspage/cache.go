package statuspage

import (
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
)

// cache keeps each answer (value or error) for ttl and lets concurrent
// requests for a missing or expired key share one read: however many
// requests arrive, a key costs at most one read per ttl.
type cache[T any] struct {
	ttl     time.Duration
	maxKeys int
	now     func() time.Time

	group   singleflight.Group
	mu      sync.Mutex
	entries map[string]cacheEntry[T]
}

type cacheEntry[T any] struct {
	value T
	err   error
	at    time.Time
}

func newCache[T any](ttl time.Duration, maxKeys int) *cache[T] {
	return &cache[T]{ttl: ttl, maxKeys: maxKeys, now: time.Now, entries: map[string]cacheEntry[T]{}}
}

// get returns the cached answer for key, or reads it with read, once for
// all callers waiting on the same key.
func (c *cache[T]) get(key string, read func() (T, error)) (T, error) {
	if e, ok := c.fresh(key); ok {
		return e.value, e.err
	}
	v, _, _ := c.group.Do(key, func() (any, error) {
		// Another caller may have filled the entry while this one waited.
		if e, ok := c.fresh(key); ok {
			return e, nil
		}
		value, err := read()
		e := cacheEntry[T]{value: value, err: err, at: c.now()}
		c.store(key, e)
		return e, nil
	})
	e := v.(cacheEntry[T])
	return e.value, e.err
}

func (c *cache[T]) fresh(key string) (cacheEntry[T], bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[key]
	return e, ok && c.now().Sub(e.at) < c.ttl
}

func (c *cache[T]) store(key string, e cacheEntry[T]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= c.maxKeys {
		for k, old := range c.entries {
			if c.now().Sub(old.at) >= c.ttl {
				delete(c.entries, k)
			}
		}
		if len(c.entries) >= c.maxKeys {
			clear(c.entries)
		}
	}
	c.entries[key] = e
}
