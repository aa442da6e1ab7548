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

// Reconnect runs the session again after each failure, and returns once
// the context ends.
func TestReconnect(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	calls := 0
	retry.Reconnect(ctx, retry.ReconnectConfig{
		Policy: retry.Policy{Base: time.Millisecond, Max: time.Millisecond},
		Logger: slog.New(slog.DiscardHandler), Message: "session ended",
	}, func(context.Context) error {
		calls++
		if calls == 3 {
			cancel()
			return nil
		}
		return errors.New("connection lost")
	})
	require.Equal(t, 3, calls)
}
