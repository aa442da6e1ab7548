package retry_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/retry"
)

func TestBackoff(t *testing.T) {
	t.Parallel()
	base, max := 100*time.Millisecond, time.Second
	for attempt, full := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 3: 400 * time.Millisecond, 4: 800 * time.Millisecond, 5: time.Second, 40: time.Second} {
		for range 100 {
			d := retry.Backoff(attempt, base, max)
			require.GreaterOrEqual(t, d, full/2, "attempt %d", attempt)
			require.LessOrEqual(t, d, full, "attempt %d", attempt)
		}
	}
}

func TestSleepStopsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.False(t, retry.Sleep(ctx, time.Hour))
	require.True(t, retry.Sleep(t.Context(), time.Millisecond))
}
