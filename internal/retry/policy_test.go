package retry_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/retry"
)

// A Failures counter grows its delay with each failure in a row, within its
// policy's bounds, and starts again from the base after Reset.
func TestFailures(t *testing.T) {
	t.Parallel()
	f := retry.Failures{Policy: retry.Policy{Base: 100 * time.Millisecond, Max: 400 * time.Millisecond}}
	for n, full := range []time.Duration{100, 200, 400, 400} {
		d := f.Next()
		require.Equal(t, n+1, f.Count())
		require.GreaterOrEqual(t, d, full*time.Millisecond/2, "failure %d", n+1)
		require.LessOrEqual(t, d, full*time.Millisecond, "failure %d", n+1)
	}
	f.Reset()
	require.Zero(t, f.Count())
	require.LessOrEqual(t, f.Next(), 100*time.Millisecond)
}

// Wait sleeps and reports true while its context lives; once the context
// has ended it returns false at once and counts nothing.
func TestFailuresWait(t *testing.T) {
	t.Parallel()
	logger := slog.New(slog.DiscardHandler)
	f := retry.Failures{Policy: retry.Policy{Base: time.Millisecond, Max: time.Millisecond}}
	require.True(t, f.Wait(t.Context(), logger, "failed", errors.New("boom")))
	require.Equal(t, 1, f.Count())

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.False(t, f.Wait(ctx, logger, "failed", errors.New("boom")))
	require.Equal(t, 1, f.Count())
}

// The named policies are ordered as their doc comments say: each retry's
// first delay is below its cap.
func TestPolicies(t *testing.T) {
	t.Parallel()
	for name, p := range map[string]retry.Policy{"Session": retry.Session, "Transient": retry.Transient, "Statement": retry.Statement} {
		require.Positive(t, p.Base, name)
		require.Less(t, p.Base, p.Max, name)
	}
}
