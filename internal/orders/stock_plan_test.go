package orders_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The locks (LockStock, LockOrders) run statements that PostgreSQL may plan
// once per session and keep. Planned while a table is a few pages, for
// a batch's many keys, a scan of the table is the cheaper plan; kept, it
// reads the whole table at every call once the table is large. Tables grow
// by rows (orders, reservations) and by row versions: a snapshot held open
// keeps every version of the stock rows, which every order updates. A
// session that has locked many times while a table was small must still
// lock through an index once it is large.
func TestTheLocksReadAnIndexOnceTheTableHasGrown(t *testing.T) {
	t.Parallel()
	var keys []string
	for i := range 100 {
		keys = append(keys, fmt.Sprintf("K-%d", 1+i*10))
	}
	for _, c := range []struct {
		name, table string
		fill, grow  string // SQL: 1,000 rows (or orders), then 30,000 rows or versions more
		holdOpen    bool   // a snapshot held open while it grows
		lock        func(ctx context.Context, tx pgx.Tx) error
	}{
		{
			name: "StockLock", table: "stock", holdOpen: true,
			fill: "INSERT INTO stock (sku, available) SELECT 'K-' || g, 1000000 FROM generate_series(1, 1000) g",
			grow: "UPDATE stock SET available = available - 1, updated_at = now()",
			lock: func(ctx context.Context, tx pgx.Tx) error {
				rows, _, err := orders.LockStock(ctx, tx, keys, orders.StockLockWait)
				if err == nil && len(rows) != len(keys) {
					err = fmt.Errorf("locked %d stock rows of %d", len(rows), len(keys))
				}
				return err
			},
		},
		{
			name: "OrderLock", table: "order_confirmations",
			fill: `INSERT INTO order_confirmations (order_id, status, message_id)
			       SELECT 'K-' || g, 'confirmed', 'm-' || g FROM generate_series(1, 1000) g`,
			grow: `INSERT INTO order_confirmations (order_id, status, message_id)
			       SELECT 'G-' || g || '-' || random(), 'confirmed', 'g-' || g || '-' || random() FROM generate_series(1, 1000) g`,
			lock: func(ctx context.Context, tx pgx.Tx) error {
				held, err := orders.LockOrders(ctx, tx, keys, orders.OrderLockWait)
				if err == nil && len(held) > 0 {
					err = fmt.Errorf("orders held by another session: %v", held)
				}
				return err
			},
		},
		{
			// A batch's cancellations look up their orders' reservations
			// (StockReservedSkus), then lock them (LockOrders). order_id
			// alone is not unique, so without statistics the planner takes
			// each id to match 1 in 200 rows: as "order_id = ANY(...)", a
			// hundred ids read the table whole, whatever its size.
			name: "Reservations", table: "stock_reservations",
			fill: `INSERT INTO stock (sku, available) SELECT 'S-' || g, 1000000 FROM generate_series(1, 3) g;
			       INSERT INTO order_confirmations (order_id, status, message_id)
			       SELECT 'K-' || g, 'confirmed', 'm-' || g FROM generate_series(1, 1000) g;
			       INSERT INTO stock_reservations (order_id, sku, quantity)
			       SELECT 'K-' || g, 'S-' || s, 1 FROM generate_series(1, 1000) g, generate_series(1, 3) s`,
			grow: `INSERT INTO stock_reservations (order_id, sku, quantity)
			       SELECT 'G-' || g || '-' || random(), 'S-' || s, 1 FROM generate_series(1, 1000) g, generate_series(1, 3) s`,
			lock: func(ctx context.Context, tx pgx.Tx) error {
				reserved, err := dbsqlc.New().StockReservedSkus(ctx, tx, keys)
				if err == nil && len(reserved) != 3*len(keys) {
					err = fmt.Errorf("read %d reservations of %d", len(reserved), 3*len(keys))
				}
				if err != nil {
					return err
				}
				held, err := orders.LockOrders(ctx, tx, keys, orders.OrderLockWait)
				if err == nil && len(held) > 0 {
					err = fmt.Errorf("orders held by another session: %v", held)
				}
				return err
			},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			newDB := testenv.NewDB
			if c.holdOpen {
				newDB = testenv.NewDBAlone
			}
			db := newDB(t)
			ctx := t.Context()
			_, err := db.Pool.Exec(ctx, c.fill)
			require.NoError(t, err)

			// A session as the service opens it, that has locked before.
			conn := db.SessionWith(t, pipeline.ConfigureSession)
			for range 10 {
				require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return c.lock(ctx, tx) }))
			}

			if c.holdOpen {
				db.HoldSnapshot(t)
			}
			for range 30 {
				_, err = db.Pool.Exec(ctx, c.grow)
				require.NoError(t, err)
			}

			tx, err := conn.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			// The session's counts not yet reported to the statistics are
			// in the view too: the lock's are the difference.
			scanned := func() int {
				var n int
				require.NoError(t, tx.QueryRow(ctx, "SELECT seq_tup_read FROM pg_stat_xact_user_tables WHERE relid = $1::regclass", c.table).Scan(&n))
				return n
			}
			before := scanned()
			require.NoError(t, c.lock(ctx, tx))
			require.Zero(t, scanned()-before, "rows of %s read by scanning the table, once it grew by 30,000", c.table)
		})
	}
}
