package main

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// Acceptance: 2,000 orders with 30% duplicates, 5% re-sent under new ids and
// 10% cancelled, with inboxd killed by SIGKILL twice: every order has exactly
// one outcome, stock adds up exactly, and every event and email request is
// published, each under exactly one message id.
func TestOrderDomainAcrossSIGKILL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker, "INBOX_WORKER_BATCH_SIZE=50", "INBOX_CLAIM_LEASE=500ms", "INBOX_RELAY_LEASE=1s")
	w := loadgen.Generate(loadgen.Spec{Orders: 2000, DuplicateRate: 0.3, ResendRate: 0.05, CancelRate: 0.1, Seed: 11})
	published := publishSlowly(t, b.broker.URL, w, 20*time.Millisecond)

	for kill := 0; kill < 2; kill++ {
		p := startProcess(t, env)
		before := b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
		require.Eventually(t, func() bool {
			return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") > before+100
		}, 30*time.Second, 5*time.Millisecond)
		p.kill()
	}
	require.NoError(t, <-published)
	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs, 90*time.Second)

	require.Equal(t, w.UniqueMessageIDs, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"))
	require.Equal(t, len(w.OrderIDs), b.count(t, "SELECT count(*) FROM order_confirmations"), "one outcome per order")
	require.Equal(t, len(w.Cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
	require.Equal(t, len(w.OrderIDs)-len(w.Cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'"))
	b.requireStockAddsUp(t)
	b.requireEventsOnce(t)
	require.Equal(t, len(w.Cancelled), b.count(t, "SELECT count(*) FROM outbox WHERE routing_key = 'order.cancelled'"))
}

// Acceptance: an order whose stock is insufficient is rejected with its
// reason and reserves nothing.
func TestInsufficientStockRejects(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(t.Context(), "UPDATE stock SET available = 1 WHERE sku = 'SKU-2'")
	require.NoError(t, err)
	startProcess(t, serviceEnv(b.db, b.broker))
	msgs := []loadgen.Message{
		{MessageID: "m-1", RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-1", 2)}, // 1 of SKU-1, 2 of SKU-2
		{MessageID: "m-2", RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-2", 1)},
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 10))
	b.waitDrained(t, 2, 30*time.Second)

	var status, reason string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT status, reason FROM order_confirmations WHERE order_id = 'o-1'").Scan(&status, &reason))
	require.Equal(t, "rejected", status)
	require.Equal(t, "insufficient stock: SKU-2", reason)
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_reservations WHERE order_id = 'o-1'"))
	require.Equal(t, 1, b.count(t, "SELECT available FROM stock_levels WHERE sku = 'SKU-2'"))
	require.Equal(t, initialStock-1, b.count(t, "SELECT available FROM stock_levels WHERE sku = 'SKU-1'"), "only o-2 took SKU-1")
	require.Equal(t, "rejected", b.resultOf(t, "m-1"))
	b.requireEventsOnce(t)
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM outbox WHERE idempotency_key = 'm-1:order.rejected'"))
}

func (b *e2eBundle) resultOf(t *testing.T, messageID string) string {
	t.Helper()
	return b.inboxText(t, "result", messageID)
}

// Acceptance: created then cancelled for the same order, published back to
// back on one channel many times, always ends cancelled with its stock
// released, and in the order published (confirmed, then cancelled), with
// several workers and processes running.
func TestCreatedThenCancelledAlwaysEndsCancelled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker, "INBOX_WORKERS=4", "INBOX_WORKER_BATCH_SIZE=5")
	startProcess(t, env)
	startProcess(t, env)
	var msgs []loadgen.Message
	const n = 300
	for i := range n {
		w := loadgen.Generate(loadgen.Spec{Orders: 1, CancelRate: 1, Seed: uint64(i), Prefix: "pair" + string(rune('a'+i%26)) + time.Duration(i).String()})
		msgs = append(msgs, w.Messages...)
	}
	require.NoError(t, loadgen.PublishPaced(t.Context(), b.broker.URL, msgs, 100, 300))
	b.waitDrained(t, 2*n, 60*time.Second)
	require.Equal(t, n, b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
	// Cancelled either way; in the order published only if each order's
	// created ran first and was confirmed.
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE result = $1", orders.ResultCancelledUnseen), "a cancellation handled before its order")
	require.Equal(t, n, b.count(t, "SELECT count(*) FROM inbox WHERE result = $1", orders.ResultConfirmed), "every order confirmed before its cancellation")
	b.requireStockAddsUp(t)
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_reservations WHERE released_at IS NULL"))
	b.requireEventsOnce(t)
}

// Acceptance: a held-back order does not hold back any other order; the
// view names it; releasing it with SQL lets its later messages run.
func TestHeldBackOrderIsReleasedWithSQL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startProcess(t, serviceEnv(b.db, b.broker))
	msgs := []loadgen.Message{
		// Invalid (no userId): dead, and holding back the rest of o-held.
		{MessageID: "held-created", RoutingKey: "order.created", Body: []byte(`{"orderId":"o-held","email":"a@b","items":[{"sku":"SKU-1","quantity":1}]}`)},
		{MessageID: "held-cancelled", RoutingKey: "order.cancelled", Body: []byte(`{"orderId":"o-held","reason":"r"}`)},
		{MessageID: "free-created", RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-free", 1)},
		{MessageID: "free-cancelled", RoutingKey: "order.cancelled", Body: []byte(`{"orderId":"o-free","reason":"r"}`)},
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 10))
	b.waitDrained(t, 3, 30*time.Second)
	require.Equal(t, "dead", b.status(t, "held-created"))
	require.Equal(t, "pending", b.status(t, "held-cancelled"), "held back behind the dead message")
	require.Equal(t, "processed", b.status(t, "free-cancelled"), "other orders are not held back")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM inbox_held_back WHERE order_key = 'o-held' AND blocking_message_id = 'held-created' AND held_messages = 1"))

	// The operator skips the dead message (the docs' statement).
	_, err := b.db.Pool.Exec(t.Context(), `
		UPDATE inbox SET status = 'processed', result = 'skipped by operator', processed_at = now()
		WHERE message_id = 'held-created' AND status = 'dead'`)
	require.NoError(t, err)
	b.waitDrained(t, 4, 30*time.Second)
	require.Equal(t, "processed", b.status(t, "held-cancelled"))
	require.Equal(t, orders.ResultCancelledUnseen, b.resultOf(t, "held-cancelled"))
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox_held_back"))
}

// Replaying 100 processed and 10 dead messages with the SQL flag while new
// orders arrive: flags cleared, replays recorded, and no order effect or
// published event doubled.
func TestReplayUnderLoadDoublesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startProcess(t, serviceEnv(b.db, b.broker))
	first := loadgen.Generate(loadgen.Spec{Orders: 300, Seed: 12, Prefix: "first"})
	for i := range 10 { // dead: no userId
		first.Messages = append(first.Messages, loadgen.Message{
			MessageID: fmt.Sprintf("bad-%d", i), RoutingKey: "order.created",
			Body: []byte(fmt.Sprintf(`{"orderId":"bad-%d","email":"a@b","items":[{"sku":"SKU-1","quantity":1}]}`, i)),
		})
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, first.Messages, 200))
	b.waitDrained(t, 310, 60*time.Second)
	b.requireEventsOnce(t)
	orderRows := b.count(t, "SELECT count(*) FROM order_confirmations")
	outboxRows := b.count(t, "SELECT count(*) FROM outbox")

	second := loadgen.Generate(loadgen.Spec{Orders: 500, Seed: 13, Prefix: "second"})
	published := publishSlowly(t, b.broker.URL, second, 10*time.Millisecond)
	_, err := b.db.Pool.Exec(t.Context(), `
		UPDATE inbox SET replay_requested = true, replay_reason = 'audit'
		WHERE message_id IN (SELECT message_id FROM inbox WHERE message_id LIKE 'first-%' AND status = 'processed' ORDER BY id LIMIT 100)
		   OR message_id LIKE 'bad-%'`)
	require.NoError(t, err)
	require.NoError(t, <-published)

	b.waitDrained(t, 310+second.UniqueMessageIDs, 60*time.Second)
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox WHERE replay_requested") == 0
	}, 30*time.Second, 20*time.Millisecond, "flags cleared")
	require.Equal(t, 110, b.count(t, "SELECT count(*) FROM inbox WHERE replay_count = 1 AND replayed_by IS NOT NULL AND replay_reason = 'audit'"))
	require.Equal(t, 100, b.count(t, "SELECT count(*) FROM inbox WHERE result LIKE 'replay: %' AND status = 'processed'"))
	require.Equal(t, 10, b.count(t, "SELECT count(*) FROM inbox WHERE message_id LIKE 'bad-%' AND status = 'dead'"), "still invalid, dead again")
	// The attempt history holds both runs of every replayed message, made
	// by this build.
	require.Equal(t, 100, b.count(t, `
		SELECT count(*) FROM inbox i
		WHERE i.replay_count = 1 AND i.status = 'processed'
		  AND (SELECT array_agg(format('%s/%s %s %s', a.run, a.attempt, a.outcome, a.build) ORDER BY a.run)
		       FROM inbox_attempts a WHERE a.inbox_id = i.id) = ARRAY['0/1 processed `+testBuild+`', '1/1 processed `+testBuild+`']`))
	require.Equal(t, 10, b.count(t, `
		SELECT count(*) FROM inbox i
		WHERE i.message_id LIKE 'bad-%'
		  AND (SELECT array_agg(format('%s/%s %s', a.run, a.attempt, a.outcome) ORDER BY a.run)
		       FROM inbox_attempts a WHERE a.inbox_id = i.id) = ARRAY['0/1 dead', '1/1 dead']`))
	require.Equal(t, orderRows+len(second.OrderIDs), b.count(t, "SELECT count(*) FROM order_confirmations"), "no order recorded twice")
	require.Equal(t, outboxRows+2*len(second.OrderIDs), b.count(t, "SELECT count(*) FROM outbox"), "no effect written twice")
	b.requireStockAddsUp(t)
	b.requireEventsOnce(t)
}

// Acceptance: quantities that are not whole numbers in range end dead at
// once, with a reason naming the field, and move no stock.
func TestOutOfRangeQuantitiesEndDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startProcess(t, serviceEnv(b.db, b.broker))
	quantities := []string{"0", "-1", "2147483648", "4294967297", "1.5", "1e9"}
	var msgs []loadgen.Message
	for i, q := range quantities {
		body := fmt.Sprintf(`{"orderId":"q-%d","userId":"u","email":"a@example.com","items":[{"sku":"SKU-1","quantity":%s}]}`, i, q)
		msgs = append(msgs, loadgen.Message{MessageID: fmt.Sprintf("q-%d", i), RoutingKey: orders.TypeOrderCreated, Body: []byte(body)})
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 10))
	b.waitDrained(t, len(quantities), 30*time.Second)
	for i, q := range quantities {
		id := fmt.Sprintf("q-%d", i)
		require.Equal(t, "dead", b.status(t, id), "quantity %s", q)
		require.Equal(t, 1, b.count(t, "SELECT attempts FROM inbox WHERE message_id = $1", id), "a permanent failure: one attempt")
		require.Contains(t, b.inboxText(t, "last_error", id), "items[0].quantity must be a whole number between 1 and 1000000, got "+q)
	}
	require.Zero(t, b.count(t, "SELECT count(*) FROM order_confirmations"))
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_levels WHERE available <> $1", initialStock), "stock unchanged")
}

// Acceptance: producer text that would mislead downstream (a header
// injection in an email, a spoofed address, a terminal escape in an order
// id or a SKU) ends dead with its reason, from a separate producer, and
// nothing of it is passed on; the good order beside it is confirmed.
func TestTextThatWouldMisleadDownstreamEndsDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startProcess(t, serviceEnv(b.db, b.broker))
	created := func(orderID, email, sku string) []byte {
		body, err := json.Marshal(map[string]any{"orderId": orderID, "userId": "u", "email": email,
			"items": []map[string]any{{"sku": sku, "quantity": 1}}})
		require.NoError(t, err)
		return body
	}
	bad := map[string]struct {
		routingKey string
		body       []byte
		reason     string
	}{
		"crlf-email":    {orders.TypeOrderCreated, created("o-crlf", "a@example.com\r\nBcc: all@example.com", "SKU-1"), "email holds the control character U+000D"},
		"rlo-email":     {orders.TypeOrderCreated, created("o-rlo", "a@\u202emoc.elpmaxe", "SKU-1"), "email holds the bidirectional formatting character U+202E"},
		"escape-order":  {orders.TypeOrderCreated, created("o-\x1b[31mred", "a@example.com", "SKU-1"), "orderId holds the control character U+001B"},
		"escape-sku":    {orders.TypeOrderCreated, created("o-sku", "a@example.com", "SKU-1\x1b]0;x\x07"), "items[0].sku holds the control character U+001B"},
		"escape-cancel": {orders.TypeOrderCancelled, []byte(`{"orderId":"o-\u009bcancel","reason":"r"}`), "orderId holds the control character U+009B"},
	}
	msgs := []loadgen.Message{{MessageID: "good", RoutingKey: orders.TypeOrderCreated, Body: loadgen.OrderCreatedBody("o-good", 1)}}
	for id, m := range bad {
		msgs = append(msgs, loadgen.Message{MessageID: id, RoutingKey: m.routingKey, Body: m.body})
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 10))
	b.waitDrained(t, len(msgs), 30*time.Second)
	require.Equal(t, "processed", b.status(t, "good"))
	for id, m := range bad {
		require.Equal(t, "dead", b.status(t, id), id)
		require.Contains(t, b.inboxText(t, "last_error", id), m.reason, id)
	}
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM order_confirmations"), "the good order only")
	require.Zero(t, b.count(t, "SELECT count(*) FROM outbox WHERE payload::text !~ 'o-good'"), "no event of the misleading ones")
}
