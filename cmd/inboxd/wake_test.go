package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The statements that store messages and write outbox rows wake every
// process's workers and relays: a session of the test's own, listening as
// inboxd's listener does, hears inbox_pending and outbox_pending, each
// with the schema as its payload; and with the polls a minute apart, the
// order's events arrive downstream within seconds, which only the
// outbox's wake-up makes the relay do.
func TestTheWritingStatementsWakeEveryProcess(t *testing.T) {
	t.Parallel()
	b := setupIn(t, testenv.NewDBAlone(t))
	listener := b.db.Session(t)
	for _, topic := range []string{"inbox_pending", "outbox_pending"} {
		_, err := listener.Exec(t.Context(), "LISTEN "+topic)
		require.NoError(t, err)
	}
	var schema string
	require.NoError(t, listener.QueryRow(t.Context(), "SELECT current_schema()").Scan(&schema))

	startProcess(t, serviceEnv(b.db, b.broker, "INBOX_POLL_INTERVAL=1m"))
	w := loadgen.Generate(loadgen.Spec{Orders: 1, Seed: 5})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 1))

	heard := map[string]string{}
	for len(heard) < 2 {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		n, err := listener.WaitForNotification(ctx)
		cancel()
		require.NoError(t, err, "heard %v", heard)
		heard[n.Channel] = n.Payload
	}
	require.Equal(t, map[string]string{"inbox_pending": schema, "outbox_pending": schema}, heard)
	// The relay polls once a minute: only the wake-up brings the events
	// within 10 seconds.
	b.awaitEvents(t, 2, 10*time.Second)
}
