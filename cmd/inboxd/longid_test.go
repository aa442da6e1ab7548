package main

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/msgid"
)

// Acceptance: 200 orders whose message ids are 250 bytes (in 1- and 3-byte
// characters), then 300 ordinary ones, through a real inboxd: every order's
// events reach a downstream queue, each under an id that fits an AMQP short
// string, and the relay's connection is never lost to one of them.
func TestLongestMessageIDsStopNoEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker))

	var msgs []loadgen.Message
	for i := range 200 {
		id := fmt.Sprintf("L%03d-", i)
		if i%2 == 0 {
			id += strings.Repeat("x", 250-len(id))
		} else {
			id += strings.Repeat("€", (250-len(id))/3) // 249 bytes
		}
		require.NoError(t, msgid.Check(id))
		msgs = append(msgs, loadgen.Message{MessageID: id, RoutingKey: "order.created", Body: loadgen.OrderCreatedBody(fmt.Sprintf("o-long-%d", i), 1)})
	}
	for i := range 300 {
		msgs = append(msgs, loadgen.Message{MessageID: fmt.Sprintf("short-%d", i), RoutingKey: "order.created", Body: loadgen.OrderCreatedBody(fmt.Sprintf("o-short-%d", i), 1)})
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))
	b.waitDrained(t, 500, time.Minute)
	b.requireEventsOnce(t)
	require.Len(t, b.seen, 1000, "two events for each of the 500 orders")
	for id := range b.seen {
		require.LessOrEqual(t, len(id), msgid.MaxBytes, id)
	}
	logs, err := os.ReadFile(p.logs)
	require.NoError(t, err)
	require.Equal(t, 1, bytes.Count(logs, []byte("relay connected to broker")), "the relay's connection was never reopened")
	require.False(t, p.logContains("relay session ended"))
}
