package testenv

import (
	"sync/atomic"
	"time"
)

// Clock is a clock a test sets ahead of the real one, for the components'
// Now settings (inbox.WorkerConfig.Now, outbox.RelayConfig.Now,
// janitor.Config.Now): a test moves it past a lease, a retry delay or a
// retention instead of sleeping. The zero value runs with the real clock.
// It is safe for concurrent use.
type Clock struct {
	ahead atomic.Int64
}

// Now returns the real time plus how far the clock is set ahead.
func (c *Clock) Now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

// SetAhead sets the clock d ahead of the real one.
func (c *Clock) SetAhead(d time.Duration) { c.ahead.Store(int64(d)) }
