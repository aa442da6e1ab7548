package ingest_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// With partitions, every message carrying its order id in x-order-id is
// stored, from whichever queue the broker hashed it to; a message without
// the header, or with another order's id in it, may sit in another queue
// than the rest of its order: it is dead-lettered with the reason, never
// stored out of its order's sequence.
func TestPartitionedIngest(t *testing.T) {
	t.Parallel()
	b := &testBundle{db: testenv.NewDB(t), broker: testenv.NewBroker(t)}
	const partitions = 4
	require.NoError(t, broker.Declare(b.broker.URL, broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: partitions}))

	msgs := messages("p", 200)
	// The longest legal ids: a 255-byte order id hashes and stores as any.
	longest := strings.Repeat("o", 255)
	msgs = append(msgs, loadgen.Message{MessageID: longest, RoutingKey: "order.created", Body: loadgen.OrderCreatedBody(longest, 1)})
	for n := range msgs {
		msgs[n].OrderID = msgs[n].MessageID // the body's orderId
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))
	spread := 0
	for _, q := range broker.InboxQueues(partitions) {
		if b.broker.ReadyMessages(t, q) > 0 {
			spread++
		}
	}
	require.Equal(t, partitions, spread, "the orders spread over every partition")

	b.start(t, ingest.Config{Partitions: partitions, OrderingKey: orders.OrderingKey})
	require.Eventually(t, func() bool { return b.inboxCount(t) == len(msgs) }, 20*time.Second, 20*time.Millisecond)
	var keyed int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM inbox WHERE order_key = message_id").Scan(&keyed))
	require.Equal(t, len(msgs), keyed)

	bad := []loadgen.Message{
		{MessageID: "no-header", RoutingKey: orders.TypeOrderCreated, Body: loadgen.OrderCreatedBody("o-1", 1)},
		{MessageID: "wrong-header", RoutingKey: orders.TypeOrderCreated, OrderID: "o-2", Body: loadgen.OrderCreatedBody("o-3", 1)},
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, bad, 10))
	dead := b.broker.Receive(t, broker.QueueDead, 2)
	reasons := map[string]string{}
	for _, d := range dead {
		reasons[d.MessageId] = fmt.Sprint(d.Headers[broker.HeaderRejectReason])
	}
	require.Contains(t, reasons["no-header"], "no x-order-id header")
	require.Contains(t, reasons["wrong-header"], `x-order-id header "o-2" is not the message's order id "o-3"`)
	require.Equal(t, len(msgs), b.inboxCount(t), "neither is stored")
}

// A layout is never declared while another holds messages, and an idle one
// is removed, so that an order's messages are never stored from two layouts
// in no set order.
func TestAnotherLayoutIsRefusedWhileItHoldsMessages(t *testing.T) {
	t.Parallel()
	mq := testenv.NewBroker(t)
	one := broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: 1}
	six := broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: 6}
	require.NoError(t, broker.Declare(mq.URL, one))
	require.NoError(t, loadgen.Publish(t.Context(), mq.URL, messages("w", 3), 10))

	var conflict *broker.LayoutConflictError
	err := broker.Declare(mq.URL, six)
	require.ErrorAs(t, err, &conflict)
	require.Equal(t, 3, conflict.Messages)
	require.Contains(t, err.Error(), `queue order-confirmation.inbox, of INBOX_PARTITIONS=1, holds 3 messages`)
	require.Contains(t, err.Error(), `follow "Changing INBOX_PARTITIONS" in docs/ordering.md`)
	require.Equal(t, 3, mq.ReadyMessages(t, broker.QueueInbox), "the messages stay")

	// Consumed, even when empty: another replica runs on that layout.
	mq.Receive(t, broker.QueueInbox, 3)
	conn, err := amqp.Dial(mq.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.Consume(broker.QueueInbox, "other replica", false, false, false, false, nil)
	require.NoError(t, err)
	require.ErrorAs(t, broker.Declare(mq.URL, six), &conflict)
	require.Equal(t, 1, conflict.Consumers)

	// Empty and unconsumed: unbound (and left, empty), and the new layout
	// declared and bound.
	require.NoError(t, ch.Close())
	require.NoError(t, broker.Declare(mq.URL, six))
	keyed := messages("k", 1)
	keyed[0].OrderID = keyed[0].MessageID
	require.NoError(t, loadgen.Publish(t.Context(), mq.URL, keyed, 1))
	waiting := 0
	for _, q := range broker.InboxQueues(6) {
		waiting += mq.ReadyMessages(t, q)
	}
	require.Equal(t, 1, waiting, "the orders exchange routes to the new layout")
	require.Zero(t, mq.ReadyMessages(t, broker.QueueInbox), "and no longer to the old one")
}

// Drain returns only once the queue is empty with its consumer gone: a
// quorum queue takes back a closed channel's deliveries a moment after the
// close, and a drain that looked at it in between would leave them behind
// (and repartition would delete them with the queue).
func TestDrainLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	b := setup(t) // the layout of one partition
	msgs := messages("d", 3000)
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 500))
	// Storing is slow, so that the consumer holds deliveries it has not
	// stored each time the queue shows nothing ready.
	ing, err := ingest.New(b.db.Pool, &ingest.Config{
		URL: b.broker.URL, Logger: testenv.Logger(t),
		OnStored: func() { time.Sleep(100 * time.Millisecond) },
	})
	require.NoError(t, err)
	require.NoError(t, ing.Drain(t.Context(), []string{broker.QueueInbox}))
	q := b.broker.Queue(t, broker.QueueInbox)
	require.Zero(t, q.Messages, "nothing left behind")
	require.Zero(t, q.Consumers)
	require.Equal(t, len(msgs), b.inboxCount(t))
	time.Sleep(time.Second)
	require.Zero(t, b.broker.ReadyMessages(t, broker.QueueInbox), "nothing came back after Drain returned")
}
