package orders_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

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
	return setupIn(t, testenv.NewDB(t))
}

// setupIn is setup in db.
func setupIn(t *testing.T, db *testenv.DB) *handlerBundle {
	t.Helper()
	b := &handlerBundle{db: db, handler: orders.NewHandler(testenv.Logger(t))}
	b.setStock(t, map[string]int{"SKU-1": 1_000_000, "SKU-2": 1_000_000, "SKU-3": 1_000_000})
	return b
}

func (b *handlerBundle) setStock(t testing.TB, levels map[string]int) {
	t.Helper()
	for sku, n := range levels {
		_, err := b.db.Pool.Exec(t.Context(), `
			INSERT INTO stock (sku, available) VALUES ($1, $2)
			ON CONFLICT (sku) DO UPDATE SET available = EXCLUDED.available`, sku, n)
		require.NoError(t, err)
	}
}

func (b *handlerBundle) available(t *testing.T, sku string) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT available FROM stock_levels WHERE sku = $1", sku).Scan(&n))
	return n
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

func order(messageID, orderID string, items ...orders.Item) inbox.Message {
	body, _ := json.Marshal(orders.OrderCreated{OrderID: orderID, UserID: "u", Email: "u@example.com", Items: items})
	return inbox.Message{MessageID: messageID, Type: orders.TypeOrderCreated, Payload: body}
}

func TestHandlerReservesStock(t *testing.T) {
	t.Parallel()

	t.Run("AllOrNothing", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.setStock(t, map[string]int{"A": 5, "B": 1})
		out := b.handle(t,
			order("m-1", "o-1", orders.Item{SKU: "A", Quantity: 2}, orders.Item{SKU: "B", Quantity: 1}),
			order("m-2", "o-2", orders.Item{SKU: "A", Quantity: 2}, orders.Item{SKU: "B", Quantity: 1}), // B is gone
			order("m-3", "o-3", orders.Item{SKU: "A", Quantity: 1}, orders.Item{SKU: "NOPE", Quantity: 1}),
			order("m-4", "o-4", orders.Item{SKU: "A", Quantity: 2}, orders.Item{SKU: "A", Quantity: 1}), // 3 of A, and only 3 left
		)
		require.Equal(t, orders.ResultConfirmed, out[0].Result)
		require.Equal(t, orders.ResultRejected, out[1].Result)
		require.Equal(t, orders.ResultRejected, out[2].Result)
		require.Equal(t, orders.ResultConfirmed, out[3].Result)
		require.Equal(t, 0, b.available(t, "A"))
		require.Equal(t, 0, b.available(t, "B"))

		var status, reason string
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT status, reason FROM order_confirmations WHERE order_id = 'o-2'").Scan(&status, &reason))
		require.Equal(t, "rejected", status)
		require.Equal(t, "insufficient stock: B", reason)
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT reason FROM order_confirmations WHERE order_id = 'o-3'").Scan(&reason))
		require.Equal(t, "unknown sku: NOPE", reason)
		var reservations int
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM stock_reservations WHERE order_id IN ('o-2', 'o-3')").Scan(&reservations))
		require.Zero(t, reservations, "a rejected order reserves nothing")
		require.Contains(t, b.outboxKeys(t), "m-2:order.rejected")
		require.NotContains(t, b.outboxKeys(t), "m-2:email.requested")
	})

	t.Run("AReservationAlreadyThereTakesNoStockTwice", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.setStock(t, map[string]int{"A": 5})
		// A reservation with no order recorded: written by hand, or left by
		// an order row deleted by hand. Recording the order now must not
		// take its stock a second time: the batch fails instead.
		b.db.Exec(t, "INSERT INTO stock_reservations (order_id, sku, quantity) VALUES ('o-1', 'A', 2)")
		err := pgx.BeginFunc(t.Context(), b.db.Pool, func(tx pgx.Tx) error {
			_, err := b.handler.HandleBatch(t.Context(), tx, []inbox.Message{order("m-1", "o-1", orders.Item{SKU: "A", Quantity: 2})})
			return err
		})
		require.ErrorContains(t, err, "reserve stock")
		require.Equal(t, 5, b.available(t, "A"))
		require.Zero(t, b.orderCount(t))
	})

	t.Run("CancellationGivesStockBackOnce", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.setStock(t, map[string]int{"A": 10})
		b.handle(t, order("m-1", "o-1", orders.Item{SKU: "A", Quantity: 4}))
		require.Equal(t, 6, b.available(t, "A"))
		b.handle(t, cancelled("m-2", "o-1"))
		require.Equal(t, 10, b.available(t, "A"))
		// The same cancellation again, under its id or a new one, and the
		// order again under a new id: nothing moves.
		b.handle(t, cancelled("m-2", "o-1"), cancelled("m-3", "o-1"), order("m-4", "o-1", orders.Item{SKU: "A", Quantity: 4}))
		require.Equal(t, 10, b.available(t, "A"))
	})

	t.Run("ConcurrentBatchesNeitherOversellNorDeadlock", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.setStock(t, map[string]int{"A": 150, "B": 150, "C": 150})
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				var msgs []inbox.Message
				for i := range 50 {
					id := fmt.Sprintf("w%d-%d", w, i)
					// Items in a different order per worker, to invite deadlocks.
					items := []orders.Item{{SKU: "A", Quantity: 1}, {SKU: "B", Quantity: 1}, {SKU: "C", Quantity: 1}}
					if w%2 == 1 {
						slices.Reverse(items)
					}
					msgs = append(msgs, order("m-"+id, "o-"+id, items...))
				}
				// A batch that finds the stock rows held by another too long
				// is told to wait (inbox.Wait): its messages are handled
				// again, as the worker does, until each is decided.
				for round := 0; len(msgs) > 0; round++ {
					require.Less(t, round, 20, "still waiting: %d messages", len(msgs))
					var again []inbox.Message
					for i, o := range b.handle(t, msgs...) {
						if o.Err != nil {
							require.NotErrorIs(t, o.Err, inbox.ErrPermanent)
							again = append(again, msgs[i])
						}
					}
					msgs = again
				}
			})
		}
		wg.Wait()
		var confirmed, rejected int
		require.NoError(t, b.db.Pool.QueryRow(t.Context(),
			"SELECT count(*) FILTER (WHERE status = 'confirmed'), count(*) FILTER (WHERE status = 'rejected') FROM order_confirmations").Scan(&confirmed, &rejected))
		require.Equal(t, 150, confirmed)
		require.Equal(t, 50, rejected)
		for _, sku := range []string{"A", "B", "C"} {
			require.Zero(t, b.available(t, sku))
		}
	})
}

// A stock row another session holds (an owner's open UPDATE, say) makes
// only the orders that need it wait, with the reason; the other orders of
// the batch are confirmed, and their stock taken, in the same batch.
func TestHandlerWaitsOnlyForHeldStockRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setStock(t, map[string]int{"HELD-1": 10, "FREE-1": 10})
	owner, err := b.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = owner.Rollback(context.WithoutCancel(t.Context())) }()
	_, err = owner.Exec(t.Context(), "SELECT * FROM stock WHERE sku = 'HELD-1' FOR UPDATE")
	require.NoError(t, err)

	order := func(messageID, orderID, sku string) inbox.Message {
		body, err := json.Marshal(orders.OrderCreated{OrderID: orderID, UserID: "u", Email: "u@example.com",
			Items: []orders.Item{{SKU: sku, Quantity: 1}}})
		require.NoError(t, err)
		return inbox.Message{MessageID: messageID, Type: orders.TypeOrderCreated, Payload: body}
	}
	out := b.handle(t, order("m-1", "o-1", "HELD-1"), order("m-2", "o-2", "FREE-1"))
	require.ErrorContains(t, out[0].Err, "stock row HELD-1 locked by another session")
	require.NoError(t, out[1].Err)
	require.Equal(t, orders.ResultConfirmed, out[1].Result)
	require.Equal(t, 9, b.available(t, "FREE-1"))
	require.Equal(t, 1, b.orderCount(t), "o-1 waits: not recorded")

	require.NoError(t, owner.Rollback(t.Context()))
	out = b.handle(t, order("m-1", "o-1", "HELD-1"))
	require.Equal(t, orders.ResultConfirmed, out[0].Result)
	require.Equal(t, 9, b.available(t, "HELD-1"))
}

// Acceptance: an order_confirmations or stock_reservations row that another
// session holds (an owner's open UPDATE or FOR UPDATE) makes only the
// cancellation that needs it wait, at once and with its reason; the rest of
// the batch goes on, and the cancellation runs once the lock ends.
func TestHandlerWaitsOnlyForHeldOrderRows(t *testing.T) {
	t.Parallel()
	for name, lock := range map[string]string{
		"OrderConfirmations": "SELECT * FROM order_confirmations WHERE order_id = 'o-held' FOR UPDATE",
		"StockReservations":  "SELECT * FROM stock_reservations WHERE order_id = 'o-held' AND sku = 'SKU-2' FOR UPDATE",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.handle(t, created("c-held", "o-held"), created("c-free", "o-free"))
			owner, err := b.db.Pool.Begin(t.Context())
			require.NoError(t, err)
			defer func() { _ = owner.Rollback(context.WithoutCancel(t.Context())) }()
			_, err = owner.Exec(t.Context(), lock)
			require.NoError(t, err)

			started := time.Now()
			out := b.handle(t, cancelled("x-held", "o-held"), cancelled("x-free", "o-free"), created("c-new", "o-new"))
			require.Less(t, time.Since(started), orders.OrderLockWait+2*time.Second, "no lock_timeout was waited out")
			require.ErrorContains(t, out[0].Err, "order o-held: its order_confirmations or stock_reservations rows are locked by another session")
			require.Equal(t, orders.ResultCancelled, out[1].Result)
			require.Equal(t, orders.ResultConfirmed, out[2].Result)
			status, _ := b.order(t, "o-held")
			require.Equal(t, "confirmed", status)

			require.NoError(t, owner.Rollback(t.Context()))
			out = b.handle(t, cancelled("x-held", "o-held"))
			require.Equal(t, orders.ResultCancelled, out[0].Result)
		})
	}
}
