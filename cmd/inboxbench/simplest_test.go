package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// TestSimplestInboxHandlesEveryOrderExactlyOnce runs the ruler on traffic
// with duplicates, orders re-sent under new ids and cancellations, against
// the real servers: a ruler that is wrong makes every ratio to it wrong.
func TestSimplestInboxHandlesEveryOrderExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := context.WithoutCancel(t.Context())
	db := testenv.NewEmptyDB(t)
	b := testenv.NewBroker(t)
	require.NoError(t, createSimplest(ctx, db.Pool, b.URL))
	const skus, stocked = 20, 100_000
	var names []string
	for i := range skus {
		names = append(names, loadgen.SKUName(i))
	}
	db.Exec(t, "INSERT INTO stock (sku, available) SELECT unnest($1::text[]), $2", names, stocked)
	w := loadgen.Generate(loadgen.Spec{Orders: 200, DuplicateRate: 0.3, ResendRate: 0.1, CancelRate: 0.1, Seed: 7, SKUs: skus})
	require.Greater(t, len(w.Messages), w.UniqueMessageIDs, "the traffic has duplicates")

	s, err := startSimplest(ctx, db.URL, b.URL)
	require.NoError(t, err)
	require.NoError(t, loadgen.PublishParallel(ctx, b.URL, w.Messages, 2, 100))
	deadline := time.Now().Add(time.Minute)
	for s.ctx.Err() == nil && time.Now().Before(deadline) &&
		(db.Int(t, countSimplestProcessed) < w.UniqueMessageIDs || db.Int(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL") > 0) {
		time.Sleep(50 * time.Millisecond)
	}
	require.NoError(t, s.stop())

	t.Run("DuplicatesDropped", func(t *testing.T) {
		require.EqualValues(t, len(w.Messages), s.delivered.Load(), "every delivery stored or dropped as a duplicate, and acked")
		require.Equal(t, w.UniqueMessageIDs, db.Int(t, "SELECT count(*) FROM inbox"))
		require.Equal(t, w.UniqueMessageIDs, db.Int(t, countSimplestProcessed))
	})
	want := expectOrders(t, w)
	t.Run("EveryOrderOnce", func(t *testing.T) {
		status := map[string]string{}
		rows, err := db.Pool.Query(ctx, "SELECT order_id, status FROM order_confirmations")
		require.NoError(t, err)
		for rows.Next() {
			var id, st string
			require.NoError(t, rows.Scan(&id, &st))
			status[id] = st
		}
		require.NoError(t, rows.Err())
		require.Len(t, status, len(w.OrderIDs))
		for _, id := range w.OrderIDs {
			require.Equal(t, map[bool]string{false: "confirmed", true: "cancelled"}[w.Cancelled[id]], status[id], id)
		}
	})
	t.Run("StockTakenExactly", func(t *testing.T) {
		for _, sku := range names {
			require.Equal(t, stocked-want.taken[sku], db.Int(t, "SELECT available FROM stock WHERE sku = $1", sku), sku)
		}
		require.Equal(t, len(want.reserved), db.Int(t, `SELECT count(*) FROM reservations r JOIN order_confirmations o USING (order_id)
			WHERE o.status = 'confirmed'`))
		for key, qty := range want.reserved {
			require.Equal(t, qty, db.Int(t, "SELECT quantity FROM reservations WHERE order_id = $1 AND sku = $2", key[0], key[1]), key)
		}
	})
	t.Run("EventsOncePublished", func(t *testing.T) {
		events := map[string]map[string]int{} // by order, then routing key
		rows, err := db.Pool.Query(ctx, "SELECT payload->>'orderId', routing_key FROM outbox")
		require.NoError(t, err)
		for rows.Next() {
			var order, key string
			require.NoError(t, rows.Scan(&order, &key))
			if events[order] == nil {
				events[order] = map[string]int{}
			}
			events[order][key]++
		}
		require.NoError(t, rows.Err())
		require.Len(t, events, len(w.OrderIDs))
		confirmedFirst := 0
		for _, id := range w.OrderIDs {
			got := events[id]
			if !w.Cancelled[id] {
				require.Equal(t, map[string]int{orders.EventOrderConfirmed: 1, orders.EventEmailRequested: 1}, got, id)
				continue
			}
			// Cancelled before or after it was confirmed: both are right
			// without ordering per order.
			require.Equal(t, 1, got[orders.EventOrderCancelled], id)
			require.Equal(t, got[orders.EventOrderConfirmed], got[orders.EventEmailRequested], id)
			require.LessOrEqual(t, got[orders.EventOrderConfirmed], 1, id)
			confirmedFirst += got[orders.EventOrderConfirmed]
		}
		t.Logf("%d orders cancelled, %d of them after they were confirmed", len(w.Cancelled), confirmedFirst)
		total := db.Int(t, "SELECT count(*) FROM outbox")
		require.Zero(t, db.Int(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL"))
		require.Equal(t, total, b.Queue(t, simplestUnroutable).Messages, "every event reached the broker once")
	})
}

// expectedOrders is what the traffic's orders should leave: the stock taken
// from each SKU, and each reservation (order, SKU), by the orders that are
// not cancelled.
type expectedOrders struct {
	taken    map[string]int
	reserved map[[2]string]int
}

func expectOrders(t *testing.T, w *loadgen.Workload) expectedOrders {
	want := expectedOrders{taken: map[string]int{}, reserved: map[[2]string]int{}}
	for _, m := range w.Messages {
		if m.RoutingKey != orders.TypeOrderCreated {
			continue
		}
		var o orders.OrderCreated
		require.NoError(t, json.Unmarshal(m.Body, &o))
		if w.Cancelled[o.OrderID] {
			continue
		}
		for _, it := range o.Items {
			if _, seen := want.reserved[[2]string{o.OrderID, it.SKU}]; !seen {
				want.taken[it.SKU] += it.Quantity
				want.reserved[[2]string{o.OrderID, it.SKU}] = it.Quantity
			}
		}
	}
	return want
}

// TestSimplestInboxAcksOnlyWhatItStored has the inbox refuse every insert:
// the ruler stops with the database's error, and every message is still in
// its queue, none acknowledged.
func TestSimplestInboxAcksOnlyWhatItStored(t *testing.T) {
	t.Parallel()
	ctx := context.WithoutCancel(t.Context())
	db := testenv.NewEmptyDB(t)
	b := testenv.NewBroker(t)
	require.NoError(t, createSimplest(ctx, db.Pool, b.URL))
	db.Exec(t, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON inbox FOR EACH ROW EXECUTE FUNCTION refuse()`)
	w := loadgen.Generate(loadgen.Spec{Orders: 50, Seed: 7, SKUs: 5})
	require.NoError(t, loadgen.Publish(ctx, b.URL, w.Messages, 100))

	s, err := startSimplest(ctx, db.URL, b.URL)
	require.NoError(t, err)
	select {
	case <-s.ctx.Done():
	case <-time.After(time.Minute):
	}
	require.ErrorContains(t, s.stop(), "refused")
	require.Zero(t, s.delivered.Load())
	// The broker returns a closed consumer's unacknowledged messages to a
	// quorum queue a moment after the close.
	back := 0
	for deadline := time.Now().Add(10 * time.Second); back < len(w.Messages) && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		back = b.Queue(t, simplestQueue).Messages
	}
	require.Equal(t, len(w.Messages), back, "every message back in the queue")
}
