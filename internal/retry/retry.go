// Package retry holds the backoff the services share: its arithmetic, and
// the loop that reconnects a session after it failed.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Defaults of the delay between two attempts of a message (the inbox
// worker) or of an outbox row (the relay): INBOX_RETRY_BASE and
// INBOX_RETRY_MAX.
const (
	BaseDefault = time.Second
	MaxDefault  = 5 * time.Minute
)

// Backoff returns the delay before retry number attempt (1-based): base
// doubled per attempt and capped at max, then jittered to a random point
// between half of that and all of it, so that retries of many callers
// spread out.
func Backoff(attempt int, base, max time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	half := d / 2
	return half + rand.N(half+1)
}

// Sleep waits for d or until ctx ends, and reports whether it waited in full.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
