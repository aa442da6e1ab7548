package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: with no queue bound to order-confirmation.events, 200 orders'
// 400 events all wait in order-confirmation.unroutable, the metric counts
// them, and once a queue is bound `inboxd redeliver-unroutable` delivers
// each under its original message id.
func TestUnroutableEventsWaitAndAreRedelivered(t *testing.T) {
	t.Parallel()
	b := &e2eBundle{db: testenv.NewDB(t), broker: testenv.NewBroker(t)}
	require.NoError(t, loadgen.DeclareTopology(b.broker.URL, broker.QueueTypeQuorum))
	_, err := b.db.Pool.Exec(t.Context(), "INSERT INTO stock (sku, available) VALUES ('SKU-1', $1), ('SKU-2', $1), ('SKU-3', $1)", initialStock)
	require.NoError(t, err)
	addr := testenv.FreeAddr(t)
	env := append(serviceEnv(b.db, b.broker), "HTTP_ADDR="+addr)
	startProcess(t, env)

	w := loadgen.Generate(loadgen.Spec{Orders: 200, Seed: 12})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 100))
	b.waitDrained(t, 200, time.Minute)
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
	}, time.Minute, 20*time.Millisecond, "the relay published every event")
	require.Equal(t, 400, b.count(t, "SELECT count(*) FROM outbox"))
	require.Eventually(t, func() bool { return b.broker.ReadyMessages(t, broker.QueueUnroutable) == 400 },
		10*time.Second, 20*time.Millisecond, "every event waits in the unroutable queue")
	require.Eventually(t, func() bool { return scrape(t, addr)["inboxd_events_unroutable"] == 400 },
		10*time.Second, 50*time.Millisecond, "the metric counts them")

	// A downstream service binds its queue late, then the docs' step.
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare("late", true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind("late", "#", broker.ExchangeEvents, false, nil))
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, inboxdPath, "redeliver-unroutable")
	cmd.Env = env
	out, err := combinedOutput(t, cmd)
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "redelivered 400 events from order-confirmation.unroutable; 0 wait there still")

	want := map[string]bool{}
	for _, k := range b.db.Strings(t, "SELECT idempotency_key FROM outbox") {
		want[k] = true
	}
	got := map[string]bool{}
	for _, d := range b.broker.Receive(t, "late", 400) {
		require.True(t, want[d.MessageId], "unexpected id %q", d.MessageId)
		require.True(t, strings.HasPrefix(d.MessageId, d.RoutingKey) || strings.HasSuffix(d.MessageId, ":"+d.RoutingKey), "routing key kept: %s %s", d.MessageId, d.RoutingKey)
		got[d.MessageId] = true
	}
	require.Len(t, got, 400, "each event once, under its original id")
	require.Zero(t, b.broker.ReadyMessages(t, broker.QueueUnroutable))
}

// Acceptance: with order-confirmation.dead deleted, a delivery without a
// message id is not acked until a queue holds its dead letter: the service
// declares the queue again and dead-letters it there.
func TestDeadLetterWaitsForItsQueue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker))
	// Ingest has declared the topology: nothing declares it again unless
	// a dead letter comes back.
	require.Eventually(t, func() bool { return p.logContains(`"msg":"connected to broker"`) }, 30*time.Second, 10*time.Millisecond)
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(broker.QueueDead, false, false, false)
	require.NoError(t, err)

	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
		{RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-noid", 1)},
	}, 1))
	require.Eventually(t, func() bool {
		c, err := conn.Channel()
		if err != nil {
			return false
		}
		defer c.Close()
		q, err := c.QueueDeclarePassive(broker.QueueDead, true, false, false, false, nil)
		return err == nil && q.Messages == 1
	}, 30*time.Second, 50*time.Millisecond, "the service declared the dead-letter queue again and dead-lettered into it")
	dead := b.broker.Receive(t, broker.QueueDead, 1)
	require.Equal(t, "missing message_id", dead[0].Headers[broker.HeaderRejectReason])
	require.True(t, p.logContains("dead letters returned unroutable"), "the first dead letter came back")
}
