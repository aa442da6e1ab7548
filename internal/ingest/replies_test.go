package ingest_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/ingest"
)

// A copy asking for a reply that arrives once its message has ended is
// answered by the transaction that stores it, before its delivery is
// acked, with no worker running: one reply with the stored result for a
// message processed or dead, one saying the result is no longer kept for a
// message whose row has left while the key ledger remembers its id, and
// none yet for a message still pending. The relays are woken.
func TestACopyOfAnEndedMessageIsAnsweredWhereItIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.WithoutCancel(t.Context())
	q := dbsqlc.New()
	ids := []string{"m-processed", "m-dead", "m-forgotten", "m-pending"}
	p := dbsqlc.InboxInsertManyParams{}
	for _, id := range ids {
		p.MessageIds, p.MessageTypes, p.RoutingKeys = append(p.MessageIds, id), append(p.MessageTypes, "order.created"), append(p.RoutingKeys, "order.created")
		p.Payloads, p.OrderKeys = append(p.Payloads, []byte(`{}`)), append(p.OrderKeys, "o-"+id)
	}
	_, err := q.InboxInsertMany(ctx, b.db.Pool, p)
	require.NoError(t, err)
	b.db.Exec(t, `UPDATE inbox SET status = 'processed', result = 'confirmed', reply = '{"outcome":"confirmed"}'
		WHERE message_id = 'm-processed'`)
	b.db.Exec(t, `UPDATE inbox SET status = 'dead', last_error = 'boom' WHERE message_id = 'm-dead'`)
	b.db.Exec(t, `DELETE FROM inbox WHERE message_id = 'm-forgotten'`) // as retention does; the ledger remembers it

	listener := b.db.Session(t)
	_, err = listener.Exec(ctx, "LISTEN outbox_pending")
	require.NoError(t, err)

	b.start(t, ingest.Config{ReplyPolicy: broker.ReplyPolicy{QueuePrefixes: []string{"requester"}}})
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	for _, id := range ids {
		require.NoError(t, ch.PublishWithContext(ctx, broker.ExchangeOrders, "order.created", false, false, amqp.Publishing{
			MessageId: id, CorrelationId: "c-" + id, ReplyTo: "requester", Body: []byte(`{}`),
		}))
	}
	require.Eventually(t, func() bool { return b.db.Int(t, "SELECT count(*) FROM inbox_reply_requests") == len(ids) },
		20*time.Second, 20*time.Millisecond)

	// Stored, so answered: the reply commits with the request.
	require.Equal(t, []string{
		`c-m-dead reply:0 {"run": 0, "error": "boom", "status": "dead", "orderId": "o-m-dead", "outcome": "dead", "messageId": "m-dead"}`,
		`c-m-forgotten reply:0 {"run": 0, "error": "the message was stored before and has ended; its result is no longer kept (INBOX_RETENTION)", "status": "unknown", "outcome": "forgotten", "messageId": "m-forgotten"}`,
		`c-m-processed reply:0 {"run": 0, "status": "processed", "orderId": "o-m-processed", "outcome": "confirmed", "messageId": "m-processed"}`,
	}, b.db.Strings(t, `
		SELECT format('%s %s %s', o.correlation_id, replace(o.idempotency_key, r.id::text || ':', ''), o.payload)
		FROM outbox o JOIN inbox_reply_requests r ON o.idempotency_key LIKE 'reply:' || r.id || ':%'
		WHERE o.reply_to = 'requester' ORDER BY 1`))
	require.Equal(t, []string{"m-dead 0", "m-forgotten 0", "m-pending -", "m-processed 0"},
		b.db.Strings(t, "SELECT message_id || ' ' || coalesce(answered_run::text, '-') FROM inbox_reply_requests ORDER BY 1"))

	// The relays hear of it (no relay runs here: nothing else writes the
	// outbox).
	var schema string
	require.NoError(t, listener.QueryRow(ctx, "SELECT current_schema()").Scan(&schema))
	for {
		waitCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := listener.WaitForNotification(waitCtx)
		cancel()
		require.NoError(t, err, "the relays were not woken")
		if n.Payload == schema { // the database's other schemas are other tests'
			break
		}
	}

	// Answered once: asked again, the statement queues nothing.
	var requests []int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, "SELECT array(SELECT id FROM inbox_reply_requests)").Scan(&requests))
	queued, err := q.InboxReplyAnswer(ctx, b.db.Pool, requests)
	require.NoError(t, err)
	require.Zero(t, queued)
	require.Equal(t, 3, b.db.Int(t, "SELECT count(*) FROM outbox"))
}
