package ingest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

type testBundle struct {
	db     *testenv.DB
	broker *testenv.Broker
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	b := &testBundle{db: testenv.NewDB(t), broker: testenv.NewBroker(t)}
	require.NoError(t, loadgen.DeclareTopology(b.broker.URL, broker.QueueTypeQuorum))
	return b
}

// start runs a consumer until the test ends (or until the returned stop).
func (b *testBundle) start(t *testing.T, cfg ingest.Config) (stop func()) {
	t.Helper()
	cfg.URL = b.broker.URL
	cfg.Logger = testenv.Logger(t)
	c, err := ingest.New(b.db.Pool, &cfg)
	require.NoError(t, err)
	require.NoError(t, c.Start(t.Context()))
	require.Eventually(t, c.Consuming, 10*time.Second, 10*time.Millisecond)
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 10*time.Second)
			defer cancel()
			c.Stop(ctx)
		}
	}
	t.Cleanup(stop)
	return stop
}

func (b *testBundle) inboxCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.WithoutCancel(t.Context()), "SELECT count(*) FROM inbox").Scan(&n))
	return n
}

func messages(prefix string, n int) []loadgen.Message {
	msgs := make([]loadgen.Message, n)
	for i := range msgs {
		id := fmt.Sprintf("%s-%d", prefix, i)
		msgs[i] = loadgen.Message{MessageID: id, RoutingKey: "order.created", Body: loadgen.OrderCreatedBody(id, 1)}
	}
	return msgs
}

func TestIngest(t *testing.T) {
	t.Parallel()

	t.Run("StoresEachMessageOnceAndAcksIt", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		stop := b.start(t, ingest.Config{BatchSize: 50})
		msgs := messages("m", 300)
		msgs = append(msgs, msgs[:90]...) // redeliveries under the same ids
		msgs = append(msgs, messages("last", 1)...)
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))

		// Once the last message is stored, every delivery before it was received.
		require.Eventually(t, func() bool { return b.inboxCount(t) == 301 }, 20*time.Second, 20*time.Millisecond)
		stop() // unacknowledged deliveries return to the queue now
		// Once the broker has removed the consumer, it has requeued what
		// that consumer held.
		require.Eventually(t, func() bool { return b.broker.Queue(t, broker.QueueInbox).Consumers == 0 },
			10*time.Second, 10*time.Millisecond, "the broker dropped the stopped consumer")
		require.Zero(t, b.broker.ReadyMessages(t, broker.QueueInbox), "every delivery was acknowledged")
		require.Equal(t, 301, b.inboxCount(t))

		var want []string
		for _, m := range msgs[:300] {
			want = append(want, m.MessageID)
		}
		want = append(want, "last-0")
		require.Equal(t, want, b.db.Strings(t, "SELECT message_id FROM inbox ORDER BY id"), "ids follow the order of delivery")
	})

	t.Run("RecordsConflictingDuplicatesAndKeepsTheFirstPayload", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var mu sync.Mutex
		var total ingest.Stats
		b.start(t, ingest.Config{BatchSize: 50, Observe: func(s ingest.Stats) {
			mu.Lock()
			defer mu.Unlock()
			total.Duplicates += s.Duplicates
			total.Conflicts += s.Conflicts
		}})
		first := []byte(`{"orderId":"o-1","v":1}`)
		second := []byte(`{"orderId":"o-1","v":2}`)
		third := []byte(`{"orderId":"o-1","v":3}`)
		msg := func(id string, body []byte) loadgen.Message {
			return loadgen.Message{MessageID: id, RoutingKey: "order.created", Body: body}
		}
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
			msg("c-1", first), msg("same", first),
		}, 10))
		require.Eventually(t, func() bool { return b.inboxCount(t) == 2 }, 20*time.Second, 20*time.Millisecond)
		// Later: c-1 twice more with a second payload, once with a third,
		// once with the first again (a plain duplicate); same with its own
		// payload. Then a new id that conflicts within its own batch.
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
			msg("c-1", second), msg("c-1", second), msg("c-1", third), msg("c-1", first), msg("same", first),
			msg("c-2", first), msg("c-2", second),
		}, 10))
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return total.Duplicates == 6
		}, 20*time.Second, 20*time.Millisecond)
		mu.Lock()
		require.Equal(t, 4, total.Conflicts, "three conflicting deliveries of c-1, one of c-2")
		mu.Unlock()

		var payload []byte
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT payload FROM inbox WHERE message_id = 'c-1'").Scan(&payload))
		require.Equal(t, first, payload, "the first payload stays the one handled")

		recorded := b.db.Strings(t, `
			SELECT format('%s %s %s %s', message_id, stored_sha256 = encode(sha256($1::bytea), 'hex'),
			              conflicting_sha256 = encode(sha256(conflicting_payload), 'hex'), deliveries)
			FROM inbox_conflicts ORDER BY message_id, deliveries DESC`, first)
		require.Equal(t, []string{"c-1 t t 2", "c-1 t t 1", "c-2 t t 1"}, recorded)
	})

	t.Run("DeadLettersWhatCannotBeStored", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.start(t, ingest.Config{MaxMessageBytes: 1024})

		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
			{RoutingKey: "order.created", Body: []byte(`{"orderId":"no-id"}`)},
			{MessageID: "too-big", RoutingKey: "order.created", Body: []byte(strings.Repeat("x", 1025))},
			{MessageID: "bad-\xff-id", RoutingKey: "order.created", Body: []byte(`{}`)},
			{MessageID: "nul-\x00-id", RoutingKey: "order.created", Body: []byte(`{}`)},
			{MessageID: "fine", RoutingKey: "order.created", Body: []byte(`{}`)},
		}, 10))

		reasons := map[string]string{}
		for _, d := range b.broker.Receive(t, broker.QueueDead, 4) {
			reason, _ := d.Headers[broker.HeaderRejectReason].(string)
			reasons[d.MessageId] = reason
			require.Equal(t, broker.ExchangeOrders, d.Headers[broker.HeaderOriginalExchange])
			require.Equal(t, "order.created", d.Headers[broker.HeaderOriginalRoutingKey])
			if d.MessageId == "too-big" {
				require.Len(t, d.Body, 1025, "the body is kept")
			}
		}
		require.Equal(t, "missing message_id", reasons[""])
		require.Contains(t, reasons["too-big"], "message too large: 1025 bytes")
		require.Contains(t, reasons["bad-\xff-id"], "not valid UTF-8")
		require.Contains(t, reasons["nul-\x00-id"], "not valid UTF-8")
		require.Eventually(t, func() bool { return b.inboxCount(t) == 1 }, 10*time.Second, 20*time.Millisecond,
			"ingest keeps storing after dead-lettering")
	})

	t.Run("DerivesAMissingMessageIDWhenAskedTo", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.start(t, ingest.Config{DeriveMissingMessageID: true})
		msgs := []loadgen.Message{
			{RoutingKey: "order.created", Body: []byte(`{"orderId":"a"}`)},
			{RoutingKey: "order.created", Body: []byte(`{"orderId":"a"}`)},
			{RoutingKey: "order.created", Body: []byte(`{"orderId":"b"}`)},
		}
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 10))
		require.Eventually(t, func() bool { return b.inboxCount(t) == 2 }, 10*time.Second, 20*time.Millisecond)
		var id string
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT message_id FROM inbox ORDER BY id LIMIT 1").Scan(&id))
		require.True(t, strings.HasPrefix(id, "sha256:"), id)
	})

	t.Run("NeverAcksAFailedInsert", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		// Every insert fails while the table is renamed away.
		_, err := b.db.Pool.Exec(t.Context(), "ALTER TABLE inbox RENAME TO inbox_away")
		require.NoError(t, err)
		stop := b.start(t, ingest.Config{BatchSize: 10, Prefetch: 50})
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, messages("m", 50), 50))
		require.Eventually(t, func() bool { return b.broker.ReadyMessages(t, broker.QueueInbox) == 0 }, 10*time.Second, 20*time.Millisecond,
			"the consumer took the deliveries")
		time.Sleep(200 * time.Millisecond) // let it fail and retry a few times
		stop()
		// The broker requeues a closed channel's unacknowledged deliveries
		// asynchronously.
		require.Eventually(t, func() bool { return b.broker.ReadyMessages(t, broker.QueueInbox) == 50 }, 10*time.Second, 20*time.Millisecond,
			"nothing was acknowledged")

		_, err = b.db.Pool.Exec(t.Context(), "ALTER TABLE inbox_away RENAME TO inbox")
		require.NoError(t, err)
		stop = b.start(t, ingest.Config{})
		require.Eventually(t, func() bool { return b.inboxCount(t) == 50 }, 20*time.Second, 20*time.Millisecond)
		stop()
		require.Zero(t, b.broker.ReadyMessages(t, broker.QueueInbox))
	})

	t.Run("ReconnectsWhenTheBrokerClosesTheConnection", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.start(t, ingest.Config{})
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, messages("a", 100), 100))
		require.Eventually(t, func() bool { return b.inboxCount(t) == 100 }, 20*time.Second, 20*time.Millisecond)
		require.Positive(t, b.broker.CloseConnections(t, "inboxd ingest"))
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, messages("b", 100), 100))
		require.Eventually(t, func() bool { return b.inboxCount(t) == 200 }, 30*time.Second, 20*time.Millisecond)
	})
}

func TestIngestNoticesItsQueueDeleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.start(t, ingest.Config{})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, messages("a", 50), 50))
	require.Eventually(t, func() bool { return b.inboxCount(t) == 50 }, 20*time.Second, 20*time.Millisecond)

	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(broker.QueueInbox, false, false, false)
	require.NoError(t, err)

	// The broker cancels the consumer; ingest reconnects and declares the
	// queue again. Publish until the new queue is bound and consumed.
	require.Eventually(t, func() bool {
		_ = loadgen.Publish(t.Context(), b.broker.URL, messages("b", 10), 10)
		return b.inboxCount(t) == 60
	}, 30*time.Second, 500*time.Millisecond)
}

// Acceptance: a dead letter keeps every property and header of its
// delivery. The two a dead letter cannot carry as they are stay in headers
// of their own: an expiration (the broker would drop the dead letter unseen)
// and a user id (the broker refuses a publish whose user_id is not the
// publishing connection's).
func TestDeadLetterKeepsEveryProperty(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.start(t, ingest.Config{})
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	sent := amqp.Publishing{
		Headers:         amqp.Table{"x-tenant": "t-1", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		ContentType:     "application/json",
		ContentEncoding: "identity",
		DeliveryMode:    amqp.Persistent,
		Priority:        7,
		CorrelationId:   "corr-1",
		ReplyTo:         "amq.rabbitmq.reply-to.g1h2AA",
		Expiration:      "600000",
		Timestamp:       time.Unix(1_700_000_000, 0),
		Type:            "order.created",
		UserId:          "guest",
		AppId:           "checkout",
		Body:            []byte(`{"orderId":"o-1"}`), // no message_id: dead-lettered
	}
	require.NoError(t, ch.PublishWithContext(t.Context(), broker.ExchangeOrders, "order.created", false, false, sent))

	d := b.broker.Receive(t, broker.QueueDead, 1)[0]
	require.Equal(t, "missing message_id", d.Headers[broker.HeaderRejectReason])
	require.Equal(t, "t-1", d.Headers["x-tenant"])
	require.Equal(t, sent.Headers["traceparent"], d.Headers["traceparent"])
	require.Equal(t, sent.ContentType, d.ContentType)
	require.Equal(t, sent.ContentEncoding, d.ContentEncoding)
	require.Equal(t, sent.Priority, d.Priority)
	require.Equal(t, sent.CorrelationId, d.CorrelationId)
	require.Equal(t, sent.ReplyTo, d.ReplyTo)
	require.Equal(t, sent.Timestamp.Unix(), d.Timestamp.Unix())
	require.Equal(t, sent.Type, d.Type)
	require.Equal(t, sent.AppId, d.AppId)
	require.Equal(t, sent.Body, d.Body)
	require.Empty(t, d.Expiration, "a dead letter never expires")
	require.Equal(t, "600000", d.Headers[broker.HeaderOriginalExpiration])
	require.Equal(t, "guest", d.Headers[broker.HeaderOriginalUserID])
}
