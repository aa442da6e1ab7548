package orders_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// lockingSession opens a session with a lock_timeout of 0 (wait for ever),
// as an operator's psql may have, and a statement_timeout that ends a wait
// that should not have lasted, and begins a transaction on it.
func lockingSession(t *testing.T, db *testenv.DB) (*pgx.Conn, pgx.Tx) {
	t.Helper()
	conn := db.Session(t)
	_, err := conn.Exec(t.Context(), "SET lock_timeout = 0; SET statement_timeout = '10s'")
	require.NoError(t, err)
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(t.Context())) })
	return conn, tx
}

// holdRows begins a transaction on a session of its own that locks what
// each of the queries selects FOR UPDATE, as an owner's open transaction
// would, and returns it.
func holdRows(t *testing.T, db *testenv.DB, queries ...string) pgx.Tx {
	t.Helper()
	tx, err := db.Session(t).Begin(t.Context())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(t.Context())) })
	for _, q := range queries {
		_, err := tx.Exec(t.Context(), q)
		require.NoError(t, err)
	}
	return tx
}

// A row another session holds is waited for as long as the lock's wait
// says, and no longer, whatever the session's lock_timeout (here 0: for
// ever), for every table the handler locks: LockStock and LockOrders then
// take what nobody holds and name the rest. A row let go within the wait
// is taken. Either way the session's lock_timeout is its own again
// afterwards, and the transaction goes on.
func TestTheLocksWaitABoundedTime(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	db.Exec(t, `
		INSERT INTO stock (sku, available) VALUES ('BW-1', 5), ('BW-2', 5), ('BW-3', 5);
		INSERT INTO order_confirmations (order_id, status, message_id) VALUES ('bw-o1', 'confirmed', 'bw-m1'), ('bw-o2', 'confirmed', 'bw-m2');
		INSERT INTO stock_reservations (order_id, sku, quantity) VALUES ('bw-o1', 'BW-2', 1), ('bw-o2', 'BW-2', 1)`)
	holdRows(t, db,
		"SELECT 1 FROM stock WHERE sku = 'BW-1' FOR UPDATE",
		"SELECT 1 FROM stock_reservations WHERE order_id = 'bw-o1' FOR UPDATE")

	_, tx := lockingSession(t, db)
	lockTimeout := func() string {
		var s string
		require.NoError(t, tx.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&s))
		return s
	}
	const wait = 300 * time.Millisecond
	waited := func(started time.Time) {
		t.Helper()
		took := time.Since(started)
		require.GreaterOrEqual(t, took, wait, "the held row was waited for")
		require.Less(t, took, wait+2*time.Second, "the held row was waited for no longer than the wait")
	}

	started := time.Now()
	levels, held, err := orders.LockStock(ctx, tx, []string{"BW-1", "BW-2"}, wait)
	require.NoError(t, err)
	waited(started)
	require.Equal(t, map[string]int32{"BW-2": 5}, levels, "the row nobody holds is locked, with its level")
	require.Equal(t, map[string]bool{"BW-1": true}, held)
	require.Equal(t, "0", lockTimeout(), "the session's lock_timeout is back")

	started = time.Now()
	heldOrders, err := orders.LockOrders(ctx, tx, []string{"bw-o1", "bw-o2"}, wait)
	require.NoError(t, err)
	waited(started)
	require.Equal(t, []string{"bw-o1"}, heldOrders, "an order whose reservation is held")
	require.Equal(t, "0", lockTimeout(), "the session's lock_timeout is back")

	// A row let go within the wait is taken.
	owner := holdRows(t, db, "SELECT 1 FROM stock WHERE sku = 'BW-3' FOR UPDATE")
	released := make(chan error, 1)
	go func() {
		time.Sleep(100 * time.Millisecond)
		released <- owner.Rollback(context.WithoutCancel(ctx))
	}()
	levels, held, err = orders.LockStock(ctx, tx, []string{"BW-3"}, 5*time.Second)
	require.NoError(t, <-released)
	require.NoError(t, err)
	require.Equal(t, map[string]int32{"BW-3": 5}, levels, "the row let go within the wait")
	require.Empty(t, held)
	require.Equal(t, "0", lockTimeout(), "the session's lock_timeout is back")

	require.NoError(t, tx.Commit(ctx), "the transaction went on")
}

// Rows are locked in key order, whatever order they are asked for in and
// lie in on disk, so that two batches that want the same rows cannot each
// hold one the other waits for: while a lock waits for a row, it holds none
// after it in key order.
func TestTheLocksTakeRowsInKeyOrder(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	// On disk in the reverse of key order.
	db.Exec(t, `
		INSERT INTO stock (sku, available) VALUES ('KO-3', 5), ('KO-2', 5), ('KO-1', 5);
		INSERT INTO order_confirmations (order_id, status, message_id) VALUES ('ko-3', 'confirmed', 'ko-m3'), ('ko-2', 'confirmed', 'ko-m2'), ('ko-1', 'confirmed', 'ko-m1')`)
	for _, c := range []struct {
		name, hold, free string
		lock             func(tx pgx.Tx) (int, error) // how many rows it locked
	}{
		{
			name: "LockStock", hold: "SELECT 1 FROM stock WHERE sku = 'KO-1' FOR UPDATE",
			free: "SELECT 1 FROM stock WHERE sku IN ('KO-2', 'KO-3') FOR UPDATE NOWAIT",
			lock: func(tx pgx.Tx) (int, error) {
				levels, _, err := orders.LockStock(ctx, tx, []string{"KO-3", "KO-2", "KO-1"}, 5*time.Second)
				return len(levels), err
			},
		},
		{
			name: "LockOrders", hold: "SELECT 1 FROM order_confirmations WHERE order_id = 'ko-1' FOR UPDATE",
			free: "SELECT 1 FROM order_confirmations WHERE order_id IN ('ko-2', 'ko-3') FOR UPDATE NOWAIT",
			lock: func(tx pgx.Tx) (int, error) {
				held, err := orders.LockOrders(ctx, tx, []string{"ko-3", "ko-2", "ko-1"}, 5*time.Second)
				return 3 - len(held), err
			},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			owner := holdRows(t, db, c.hold)
			conn, tx := lockingSession(t, db)
			type result struct {
				n   int
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := c.lock(tx)
				done <- result{n, err}
			}()
			pid := conn.PgConn().PID()
			require.Eventually(t, func() bool {
				return db.Int(t, "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", pid) > 0
			}, 5*time.Second, 10*time.Millisecond, "the lock waits for the first row")

			other, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			_, free := other.Exec(ctx, c.free)
			require.NoError(t, other.Rollback(ctx))

			require.NoError(t, owner.Rollback(ctx))
			r := <-done
			require.NoError(t, free, "the rows after the one waited for are not held")
			require.NoError(t, r.err)
			require.Equal(t, 3, r.n, "every row locked once the first was let go")
			require.NoError(t, tx.Rollback(ctx))
		})
	}
}
