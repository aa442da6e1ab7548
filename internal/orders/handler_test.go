package orders_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

type handlerBundle struct {
	db      *testenv.DB
	handler *orders.Handler
}

func setup(t *testing.T) *handlerBundle {
	t.Helper()
	return &handlerBundle{db: testenv.NewDB(t), handler: orders.NewHandler(testenv.Logger(t))}
}

// handle runs one batch through the handler in a transaction and commits it.
func (b *handlerBundle) handle(t *testing.T, msgs ...inbox.Message) []inbox.Outcome {
	t.Helper()
	var outcomes []inbox.Outcome
	err := pgx.BeginFunc(t.Context(), b.db.Pool, func(tx pgx.Tx) error {
		var err error
		outcomes, err = b.handler.HandleBatch(t.Context(), tx, msgs)
		return err
	})
	require.NoError(t, err)
	require.Len(t, outcomes, len(msgs))
	return outcomes
}

func (b *handlerBundle) order(t *testing.T, orderID string) (status, messageID string) {
	t.Helper()
	err := b.db.Pool.QueryRow(t.Context(),
		"SELECT status, message_id FROM order_confirmations WHERE order_id = $1", orderID).Scan(&status, &messageID)
	require.NoError(t, err)
	return status, messageID
}

func (b *handlerBundle) orderCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.WithoutCancel(t.Context()), "SELECT count(*) FROM order_confirmations").Scan(&n))
	return n
}

func created(messageID, orderID string) inbox.Message {
	return inbox.Message{MessageID: messageID, Type: orders.TypeOrderCreated, Payload: loadgen.OrderCreatedBody(orderID, 2)}
}

func cancelled(messageID, orderID string) inbox.Message {
	body, _ := json.Marshal(orders.OrderCancelled{OrderID: orderID, Reason: "customer request"})
	return inbox.Message{MessageID: messageID, Type: orders.TypeOrderCancelled, Payload: body}
}

func TestHandler(t *testing.T) {
	t.Parallel()

	t.Run("ConfirmsAnOrderOnceWhateverItsMessageID", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		out := b.handle(t, created("m-1", "o-1"), created("m-2", "o-1"), created("m-3", "o-2"))
		require.Equal(t, orders.ResultConfirmed, out[0].Result)
		require.Equal(t, orders.ResultAlreadyRecorded, out[1].Result, "same order, new message id")
		require.Equal(t, orders.ResultConfirmed, out[2].Result)

		out = b.handle(t, created("m-4", "o-1")) // a later batch
		require.Equal(t, orders.ResultAlreadyRecorded, out[0].Result)
		require.Equal(t, 2, b.orderCount(t))
		status, by := b.order(t, "o-1")
		require.Equal(t, "confirmed", status)
		require.Equal(t, "m-1", by)
	})

	t.Run("BadPayloadsArePermanentFailures", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		out := b.handle(t,
			inbox.Message{MessageID: "m-1", Type: orders.TypeOrderCreated, Payload: []byte("{not json")},
			inbox.Message{MessageID: "m-2", Type: orders.TypeOrderCreated, Payload: []byte(`{"orderId":"o-1"}`)},
			inbox.Message{MessageID: "m-3", Type: "order.teleported", Payload: []byte(`{}`)},
			created("m-4", "o-4"),
		)
		for i, want := range []string{"not a JSON object", "userId is missing", `unknown message type "order.teleported"`} {
			require.ErrorIs(t, out[i].Err, inbox.ErrPermanent)
			require.ErrorContains(t, out[i].Err, want)
		}
		require.NoError(t, out[3].Err)
		require.Equal(t, 1, b.orderCount(t), "the good message in the batch still confirms its order")
	})

	t.Run("CancelsAConfirmedOrder", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		out := b.handle(t, created("m-1", "o-1"), cancelled("m-2", "o-1"), cancelled("m-3", "o-1"))
		require.Equal(t, orders.ResultConfirmed, out[0].Result)
		require.Equal(t, orders.ResultCancelled, out[1].Result, "a cancellation after its order, in the same batch")
		require.Equal(t, orders.ResultNotCancelledPrefix+"cancelled", out[2].Result)
		status, _ := b.order(t, "o-1")
		require.Equal(t, "cancelled", status)
	})

	t.Run("ACancellationBeforeItsOrderWins", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		out := b.handle(t, cancelled("m-1", "o-1"))
		require.Equal(t, orders.ResultCancelledUnseen, out[0].Result)
		out = b.handle(t, created("m-2", "o-1"))
		require.Equal(t, orders.ResultAlreadyRecorded, out[0].Result)
		status, by := b.order(t, "o-1")
		require.Equal(t, "cancelled", status)
		require.Equal(t, "m-1", by)
	})

	t.Run("LargeBatch", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		var msgs []inbox.Message
		for i := range 500 {
			msgs = append(msgs, created(fmt.Sprintf("m-%d", i), fmt.Sprintf("o-%d", i%400)))
		}
		out := b.handle(t, msgs...)
		confirmed := 0
		for _, o := range out {
			require.NoError(t, o.Err)
			if o.Result == orders.ResultConfirmed {
				confirmed++
			}
		}
		require.Equal(t, 400, confirmed)
		require.Equal(t, 400, b.orderCount(t))
	})
}

func (b *handlerBundle) outboxKeys(t *testing.T) []string {
	t.Helper()
	rows, err := b.db.Pool.Query(t.Context(), "SELECT idempotency_key FROM outbox ORDER BY id")
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

func TestHandlerWritesEffectsToTheOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.handle(t, created("m-1", "o-1"), created("m-2", "o-1"), cancelled("m-3", "o-9"))
	require.Equal(t, []string{"m-1:order.confirmed", "m-1:email.requested", "m-3:order.cancelled"}, b.outboxKeys(t),
		"the confirming message's effects; none for the same order under a new id")

	// Handling the same messages again (a replay, or a batch retried after
	// an unknown commit outcome) adds no effect.
	b.handle(t, created("m-1", "o-1"), cancelled("m-3", "o-9"))
	require.Len(t, b.outboxKeys(t), 3)

	b.handle(t, cancelled("m-4", "o-1"))
	require.Equal(t, "m-4:order.cancelled", b.outboxKeys(t)[3])

	var payload string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(),
		"SELECT payload::text FROM outbox WHERE idempotency_key = 'm-1:email.requested'").Scan(&payload))
	require.JSONEq(t, `{"eventType":"email.requested","template":"order-confirmation","orderId":"o-1","to":"o-1@example.com","messageId":"m-1"}`, payload)
}
