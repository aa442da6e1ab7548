package orders

import (
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// The savepoint a bounded lock wait runs under (waitAtMost), and what
// ends it when a wait ran out: one statement string, sent by the simple
// protocol (pgx's Exec without arguments), which an aborted transaction
// takes.
const (
	lockWaitSavepoint = "SAVEPOINT orders_lock_wait"
	lockWaitRelease   = "RELEASE SAVEPOINT orders_lock_wait"
	lockWaitUndo      = "ROLLBACK TO SAVEPOINT orders_lock_wait; RELEASE SAVEPOINT orders_lock_wait"
)

// waitAtMost is the bounded lock wait of every row the handler and the
// fold lock (stock rows, an order's rows, folded moves): the statements
// lock queues, which lock rows in key order, run with lock_timeout set to
// wait, in a savepoint; then the statements then queues run, told whether
// lock's locks were all taken (got).
//
//   - With wait > 0, one round trip sends the savepoint, lock_timeout set
//     to wait (the caller's kept aside), lock's statements, the caller's
//     lock_timeout set back, the savepoint's release and then's statements
//     (got true): the locks are held while the statements that follow
//     them run, so the path where no row is held by another session costs
//     a single round trip. If a lock wait runs out (SQLSTATE 55P03), the
//     statements after it do not run; the savepoint is rolled back (the
//     locks lock took, and lock_timeout with them) and released in a round
//     trip of its own (pgx prepares a batch's new statements before it
//     sends them, which an aborted transaction refuses), then then's
//     statements are sent again (got false).
//   - With wait 0, nothing is waited for (a lock_timeout of 0 would wait for
//     ever): then's statements run alone (got false), in one round trip.
//
// Any other error is returned as it is: tx is then aborted, as it would be
// by a failed statement.
func waitAtMost(ctx context.Context, tx pgx.Tx, wait time.Duration, lock func(*pgx.Batch), then func(b *pgx.Batch, got bool)) error {
	if wait > 0 {
		b := &pgx.Batch{}
		b.Queue(lockWaitSavepoint)
		// At least a millisecond: 0 would be no limit.
		b.Queue(dbsqlc.SessionLockTimeoutPush, strconv.FormatInt(max(wait.Milliseconds(), 1), 10))
		lock(b)
		b.Queue(dbsqlc.SessionLockTimeoutPop)
		b.Queue(lockWaitRelease)
		then(b, true)
		err := tx.SendBatch(ctx, b).Close()
		if !inbox.IsLockNotAvailable(err) {
			return err
		}
		if _, err := tx.Exec(ctx, lockWaitUndo); err != nil {
			return err
		}
	}
	b := &pgx.Batch{}
	then(b, false)
	if b.Len() == 0 {
		return nil
	}
	return tx.SendBatch(ctx, b).Close()
}

// LockStock locks the stock rows of skus in SKU order (so that batches
// cannot deadlock), waiting at most wait for a row another session holds;
// when that runs out, or with wait 0, it locks, without waiting, the rows
// nobody holds (see waitAtMost). It returns the levels of the rows it
// locked, which hold until tx ends, and the SKUs of the rows that exist
// but another session holds; a SKU in neither has no stock row. The levels
// are read after the locks, in a statement of their own, so the moves of
// whoever held a row before are committed and counted. The caller's
// lock_timeout is as it was for the rest of tx.
func LockStock(ctx context.Context, tx pgx.Tx, skus []string, wait time.Duration) (map[string]int32, map[string]bool, error) {
	var locked []string
	var rows []dbsqlc.StockGetManyRow
	collectLocked := func(r pgx.Rows) (err error) {
		locked, err = pgx.CollectRows(r, pgx.RowTo[string])
		return err
	}
	lock := func(b *pgx.Batch) { b.Queue(dbsqlc.StockLock, skus).Query(collectLocked) }
	then := func(b *pgx.Batch, got bool) {
		if !got {
			b.Queue(dbsqlc.StockLockAvailable, skus).Query(collectLocked)
		}
		b.Queue(dbsqlc.StockGetMany, skus).Query(func(r pgx.Rows) (err error) {
			rows, err = pgx.CollectRows(r, pgx.RowToStructByPos[dbsqlc.StockGetManyRow])
			return err
		})
	}
	if err := waitAtMost(ctx, tx, wait, lock, then); err != nil {
		return nil, nil, err
	}
	levels, held := map[string]int32{}, map[string]bool{}
	for _, r := range rows {
		if slices.Contains(locked, r.Sku) {
			levels[r.Sku] = r.Available
		} else {
			held[r.Sku] = true
		}
	}
	return levels, held, nil
}

// LockOrders locks the rows a cancellation of each of orderIDs changes:
// the order's order_confirmations row and its unreleased
// stock_reservations rows, in key order (so that batches cannot deadlock),
// waiting at most wait for a row another session holds; when that runs
// out, or with wait 0, it locks, without waiting, the rows nobody holds
// (see waitAtMost). It returns the orders it could not lock whole: a row of
// theirs exists and another session holds it (an operator's open UPDATE, a
// SELECT ... FOR UPDATE in psql). The caller's lock_timeout is as it was
// for the rest of tx. The stock rows are LockStock's.
func LockOrders(ctx context.Context, tx pgx.Tx, orderIDs []string, wait time.Duration) ([]string, error) {
	var held []string
	lock := func(b *pgx.Batch) {
		b.Queue(dbsqlc.OrderLock, orderIDs)
		b.Queue(dbsqlc.OrderReservationsLock, orderIDs)
	}
	then := func(b *pgx.Batch, got bool) {
		if !got {
			b.Queue(dbsqlc.OrderLockAvailable, orderIDs).Query(func(r pgx.Rows) (err error) {
				held, err = pgx.CollectRows(r, pgx.RowTo[string])
				return err
			})
		}
	}
	if err := waitAtMost(ctx, tx, wait, lock, then); err != nil {
		return nil, err
	}
	return held, nil
}
