package main

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// Acceptance: a message whose handler kills the process every time ends dead
// after the maximum attempts, across restarts of a real inboxd, and the
// other orders keep flowing.
func TestCrashLoopEndsDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const maxAttempts = 3
	env := serviceEnv(b.db, b.broker, "INBOX_MAX_ATTEMPTS=3", "INBOX_CLAIM_LEASE=300ms")

	w := loadgen.Generate(loadgen.Spec{Orders: 200, Seed: 5})
	msgs := append([]loadgen.Message{}, w.Messages[:100]...)
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))
	publishTyped(t, b.broker.URL, "poison", "test.crash", []byte(`{"orderId":"boom"}`))
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages[100:], 100))

	crashes := 0
	deadline := time.Now().Add(2 * time.Minute)
	for b.count(t, "SELECT count(*) FROM inbox WHERE message_id = 'poison' AND status = 'dead'") == 0 {
		require.True(t, time.Now().Before(deadline), "poison message never went dead after %d crashes", crashes)
		p := startBinary(t, crashingInboxdPath, env)
		require.Eventually(t, func() bool {
			return p.exited() || b.count(t, "SELECT count(*) FROM inbox WHERE message_id = 'poison' AND status = 'dead'") == 1
		}, time.Minute, 10*time.Millisecond)
		if p.exited() {
			crashes++
		} else {
			p.kill()
		}
	}
	require.Equal(t, maxAttempts, crashes, "the process died once per attempt, then the message was given up")

	var attempts int
	var lastError string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(),
		"SELECT attempts, last_error FROM inbox WHERE message_id = 'poison'").Scan(&attempts, &lastError))
	require.Equal(t, maxAttempts+1, attempts)
	require.Contains(t, lastError, "gave up after 3 attempts")

	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs+1, 60*time.Second)
	require.Equal(t, 200, b.count(t, "SELECT count(*) FROM order_confirmations"))
	require.Equal(t, 200, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"), "its batch-mates were not given up")
}

// publishTyped publishes one persistent message with an AMQP type to the
// orders exchange, routed as order.created.
func publishTyped(t *testing.T, amqpURL, messageID, msgType string, body []byte) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), inbox.ExchangeOrders, "order.created", false, false, amqp.Publishing{
		MessageId: messageID, Type: msgType, DeliveryMode: amqp.Persistent, Body: body,
	})
	require.NoError(t, err)
	ok, err := dc.WaitContext(t.Context())
	require.NoError(t, err)
	require.True(t, ok)
}
