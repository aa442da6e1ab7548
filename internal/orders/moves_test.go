package orders_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// stockRow is what a look-up of a SKU finds: its row's version (where it
// is, and the transaction that wrote it), its level and the parts of it.
type stockRow struct {
	version                    string
	available, folded, pending int
}

func (b *handlerBundle) stockRow(t *testing.T, sku string) stockRow {
	t.Helper()
	var r stockRow
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), `
		SELECT s.ctid::text || ' ' || s.xmin::text, l.available, l.folded, l.unfolded
		FROM stock s JOIN stock_levels l USING (sku) WHERE s.sku = $1`, sku).
		Scan(&r.version, &r.available, &r.folded, &r.pending))
	return r
}

// Orders take stock, and cancellations give it back, without writing a
// version of the stock row: a snapshot held open meanwhile (pg_dump, a
// long report) keeps no version of it for every later look-up to walk.
// The level is exact all along; a fold moves it into stock.available and
// leaves it as it was.
func TestOrdersTakeStockWithoutRewritingItsRow(t *testing.T) {
	t.Parallel()
	b := setupIn(t, testenv.NewDBAlone(t))
	b.db.HoldSnapshot(t)

	before := b.stockRow(t, "SKU-2")
	for i := range 5 { // each order takes 1 of SKU-1 and 2 of SKU-2
		b.handle(t, created(fmt.Sprintf("m-%d", i), fmt.Sprintf("o-%d", i)))
	}
	b.handle(t, cancelled("m-c", "o-0"))
	after := b.stockRow(t, "SKU-2")
	require.Equal(t, before.version, after.version, "the stock row was not written")
	require.Equal(t, stockRow{version: before.version, available: 1_000_000 - 8, folded: 1_000_000, pending: -8}, after)

	n, err := orders.FoldStock(t.Context(), b.db.Pool)
	require.NoError(t, err)
	require.Equal(t, 2, n, "SKU-1 and SKU-2 had moves")
	folded := b.stockRow(t, "SKU-2")
	require.Equal(t, 1_000_000-8, folded.available, "a fold leaves the level as it was")
	require.Equal(t, 1_000_000-8, folded.folded)
	require.Zero(t, folded.pending)
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_moves"), "folded moves are gone")
	n, err = orders.FoldStock(t.Context(), b.db.Pool)
	require.NoError(t, err)
	require.Zero(t, n, "nothing left to fold")
}

// A fold holds few stock rows at a time: it folds every SKU with moves,
// the empty SKU an operator may have stocked included, in transactions of
// 50 SKUs at most, so a batch of orders that needs one of them waits for
// one small transaction, not for the whole fold. Each
// stock row a fold writes carries its transaction's id (xmin), which says
// how many rows each transaction held.
func TestAFoldHoldsFewStockRowsAtATime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const skus, mostPerTransaction = 157, 50
	_, err := b.db.Pool.Exec(t.Context(), `
		INSERT INTO stock (sku, available)
		SELECT format('FOLD-%s', lpad(i::text, 4, '0')), 10 FROM generate_series(1, $1) i
		UNION ALL SELECT '', 10`, skus)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(t.Context(), `
		INSERT INTO stock_moves (sku, quantity)
		SELECT sku, -1 FROM stock WHERE sku = '' OR sku LIKE 'FOLD-%' ORDER BY sku`)
	require.NoError(t, err)

	n, err := orders.FoldStock(t.Context(), b.db.Pool)
	require.NoError(t, err)
	require.Equal(t, skus+1, n, "every SKU with moves folded")
	var transactions, most int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), `
		SELECT count(*), max(rows) FROM (
			SELECT count(*) AS rows FROM stock WHERE sku = '' OR sku LIKE 'FOLD-%' GROUP BY xmin::text
		) t`).Scan(&transactions, &most))
	require.LessOrEqual(t, most, mostPerTransaction, "stock rows one fold transaction held")
	require.GreaterOrEqual(t, transactions, 4)
	require.Equal(t, 9, b.available(t, ""))
	require.Equal(t, 9, b.available(t, "FOLD-0157"))
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_moves WHERE sku = '' OR sku LIKE 'FOLD-%'"), "folded moves are gone")
}

// A stock row another session holds (an owner's open UPDATE) is passed
// over, not waited for: the fold goes on to the SKUs after it, in the
// same batch and the batches after, and folds it at a later fold once it
// is free.
func TestAFoldPassesARowAnotherSessionHolds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const skus = 120
	_, err := b.db.Pool.Exec(t.Context(), `
		INSERT INTO stock (sku, available)
		SELECT format('PASS-%s', lpad(i::text, 4, '0')), 10 FROM generate_series(1, $1) i`, skus)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(t.Context(), `
		INSERT INTO stock_moves (sku, quantity) SELECT sku, -1 FROM stock WHERE sku LIKE 'PASS-%' ORDER BY sku`)
	require.NoError(t, err)

	holder, err := b.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(context.WithoutCancel(t.Context())) }()
	_, err = holder.Exec(t.Context(), "SELECT 1 FROM stock WHERE sku = 'PASS-0075' FOR UPDATE")
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n, err := orders.FoldStock(ctx, b.db.Pool)
	require.NoError(t, err, "the fold waited for the held row")
	require.Equal(t, skus-1, n, "every SKU but the held one folded")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM stock_moves WHERE sku LIKE 'PASS-%'"), "the held SKU's move stays")
	require.Equal(t, 9, b.available(t, "PASS-0120"))

	require.NoError(t, holder.Commit(t.Context()))
	n, err = orders.FoldStock(t.Context(), b.db.Pool)
	require.NoError(t, err)
	require.Equal(t, 1, n, "folded once free")
	require.Equal(t, 9, b.available(t, "PASS-0075"))
}

func (b *handlerBundle) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), query, args...).Scan(&n))
	return n
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// Moves stay exact whoever writes them and however they interleave:
// writers that did not lock the stock row first (the trigger waits for it
// for them), givers and takers, and folds, all at once. Every take the
// level allowed is kept, every other refused, and the level is what the
// committed moves leave.
func TestStockMovesStayExactUnderConcurrentWriters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const initial, writers, attempts = 60, 6, 40
	b.setStock(t, map[string]int{"RACE-1": initial})

	var taken, given, refused atomic.Int64
	move := func(quantity int) error {
		_, err := b.db.Pool.Exec(t.Context(), "INSERT INTO stock_moves (sku, quantity) VALUES ('RACE-1', $1)", quantity)
		return err
	}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range attempts {
				quantity := -1
				if w == 0 && i%4 == 0 {
					quantity = 1 // a cancellation gives one back
				}
				err := move(quantity)
				switch {
				case err == nil && quantity < 0:
					taken.Add(1)
				case err == nil:
					given.Add(1)
				case sqlState(err) == "23514": // check_violation: none left
					refused.Add(1)
				default:
					t.Errorf("move %d: %v", quantity, err)
					return
				}
			}
		})
	}
	folds := make(chan struct{})
	wg.Go(func() {
		defer close(folds)
		for taken.Load()+given.Load()+refused.Load() < writers*attempts && !t.Failed() {
			_, err := orders.FoldStock(t.Context(), b.db.Pool)
			require.NoError(t, err)
		}
	})
	wg.Wait()
	<-folds

	require.Positive(t, refused.Load(), "more was asked than there was")
	level := b.stockRow(t, "RACE-1").available
	require.Equal(t, initial-int(taken.Load())+int(given.Load()), level, "the level is what the moves left")
	require.Zero(t, level, "every take the level allowed was kept")
	_, err := orders.FoldStock(t.Context(), b.db.Pool)
	require.NoError(t, err)
	require.Equal(t, stockRow{version: b.stockRow(t, "RACE-1").version}, b.stockRow(t, "RACE-1"), "folded: 0 available, nothing pending")
}

// stock.available may still be changed directly, by an owner or by an
// earlier inboxd during a rolling upgrade (which takes from it), but not
// below what the moves not folded yet leave; a level is set by folding it
// in the same update, with the row locked first (docs/operations.md).
func TestStockAvailableCannotGoBelowTheMoves(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.setStock(t, map[string]int{"OWN-1": 10})
	_, err := b.db.Pool.Exec(t.Context(), "INSERT INTO stock_moves (sku, quantity) VALUES ('OWN-1', -8)")
	require.NoError(t, err)

	_, err = b.db.Pool.Exec(t.Context(), "UPDATE stock SET available = available - 5 WHERE sku = 'OWN-1'")
	require.Equal(t, "23514", sqlState(err), "an owner taking 5 of the 2 left: %v", err)
	_, err = b.db.Pool.Exec(t.Context(),
		"UPDATE stock SET available = stock.available - 3 FROM (SELECT 'OWN-1' AS sku) t WHERE stock.sku = t.sku AND stock.available >= 3")
	require.Equal(t, "23514", sqlState(err), "an earlier inboxd's take, on the folded level: %v", err)
	_, err = b.db.Pool.Exec(t.Context(), "INSERT INTO stock_moves (sku, quantity) VALUES ('OWN-1', -3)")
	require.Equal(t, "23514", sqlState(err), "a move taking 3 of the 2 left: %v", err)
	require.ErrorContains(t, err, "stock of sku OWN-1 would go below zero: 2 available, 3 asked")

	_, err = b.db.Pool.Exec(t.Context(), "UPDATE stock SET available = available + 5 WHERE sku = 'OWN-1'")
	require.NoError(t, err, "adding stock")
	require.Equal(t, 7, b.stockRow(t, "OWN-1").available)

	err = pgx.BeginTxFunc(t.Context(), b.db.Pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		_, err := tx.Exec(t.Context(), "INSERT INTO stock_moves (sku, quantity) VALUES ('OWN-1', -1)")
		return err
	})
	require.Equal(t, "0A000", sqlState(err), "its snapshot may miss a move committed since: %v", err)

	err = pgx.BeginFunc(t.Context(), b.db.Pool, func(tx pgx.Tx) error {
		// The owner's recipe, as docs/operations.md gives it.
		if _, err := tx.Exec(t.Context(), "SELECT sku FROM stock WHERE sku = 'OWN-1' FOR UPDATE"); err != nil {
			return err
		}
		if _, err := tx.Exec(t.Context(), `
			UPDATE stock s SET available = 4, folded_through = l.last_move, updated_at = now()
			FROM stock_levels l WHERE l.sku = s.sku AND s.sku = 'OWN-1'`); err != nil {
			return err
		}
		_, err := tx.Exec(t.Context(), `
			DELETE FROM stock_moves m USING stock s
			WHERE s.sku = 'OWN-1' AND m.sku = s.sku AND m.id <= s.folded_through`)
		return err
	})
	require.NoError(t, err)
	require.Equal(t, stockRow{version: b.stockRow(t, "OWN-1").version, available: 4, folded: 4}, b.stockRow(t, "OWN-1"),
		"set after a fold: the level is what was set")
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_moves WHERE sku = 'OWN-1'"), "the folded moves are gone")
}

// A fold does not wait for a move another session has locked (an owner's
// SELECT … FOR UPDATE left open) while it holds the stock rows that
// batches wait for: it folds every SKU, leaves that one move under the
// fold where nothing reads it, and orders go on.
func TestAFoldDoesNotWaitForALockedMove(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.handle(t, created("m-1", "o-1"), created("m-2", "o-2")) // moves of SKU-1 and SKU-2
	owner, err := b.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = owner.Rollback(context.WithoutCancel(t.Context())) }()
	_, err = owner.Exec(t.Context(), "SELECT * FROM stock_moves WHERE sku = 'SKU-1' FOR UPDATE")
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n, err := orders.FoldStock(ctx, b.db.Pool)
	require.NoError(t, err, "the fold went on past the locked move")
	require.Equal(t, 2, n)
	require.Equal(t, stockRow{version: b.stockRow(t, "SKU-1").version, available: 1_000_000 - 2, folded: 1_000_000 - 2}, b.stockRow(t, "SKU-1"))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM stock_moves"), "only the locked move is left")

	out := b.handle(t, created("m-3", "o-3"))
	require.Equal(t, orders.ResultConfirmed, out[0].Result)
	require.Equal(t, 1_000_000-3, b.stockRow(t, "SKU-1").available)
}

// The move trigger's look-ups keep their plans for the session, as PL/pgSQL
// keeps them. A plan made while stock_moves looked empty to the planner (a
// vacuum of a new table, or autovacuum after a fold that deleted every
// move) was a sequential scan, kept until the next vacuum: each move then
// read every move since the fold (110 ms for a transaction of 100 moves,
// against 4.5 ms). Counted, not timed: the rows that sequential scans of
// stock_moves read while 300 moves are written in one session, after a
// vacuum of the empty table. (Rows, not scans: a scan of the empty table
// by the migrations' session may be reported late, and reads none.)
func TestMoveLookUpsStayByIndexAfterAVacuumOfAnEmptyTable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(t.Context(), "VACUUM stock_moves")
	require.NoError(t, err)
	conn := b.db.Session(t)
	seqRead := func() int {
		return testenv.SessionStat(t, conn, `
			SELECT coalesce(seq_tup_read, 0)::int FROM pg_stat_user_tables
			WHERE schemaname = current_schema() AND relname = 'stock_moves'`)
	}
	before := seqRead()
	for range 300 {
		_, err := conn.Exec(t.Context(), "INSERT INTO stock_moves (sku, quantity) VALUES ('SKU-1', -1)")
		require.NoError(t, err)
	}
	require.Zero(t, seqRead()-before, "the moves' look-ups scanned stock_moves")
	require.Equal(t, 1_000_000-300, b.available(t, "SKU-1"))
}

// A fold reads the moves it folds, not the folded moves a held snapshot
// keeps: each fold deletes its moves, but while the snapshot is open their
// index entries stay, and a statement that read past them would read more
// at every fold. With the plans a pool's session keeps (pipeline.KeepPlans),
// made while stock_moves was small, a fold of 5 moves reads about 5
// entries once 3,000 folded moves are kept. Counted, not timed: entries
// returned by scans of stock_moves' indexes, and its sequential scans.
func TestAFoldUnderAHeldSnapshotReadsTheMovesItFolds(t *testing.T) {
	t.Parallel()
	b := setupIn(t, testenv.NewDBAlone(t))
	ctx := t.Context()
	// A session as a KeepPlans pool's: statements prepared, plans kept.
	conn := b.db.SessionWith(t, func(cc *pgx.ConnConfig) {
		pipeline.ConfigureSession(cc)
		cc.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	})
	move := func(n int) {
		_, err := conn.Exec(ctx, "INSERT INTO stock_moves (sku, quantity) SELECT 'SKU-1', -1 FROM generate_series(1, $1)", n)
		require.NoError(t, err)
	}
	fold := func() {
		n, err := orders.FoldStock(ctx, conn)
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	for range 10 { // plans made while stock_moves is small
		move(1)
		fold()
	}
	b.db.HoldSnapshot(t)
	for range 3 {
		move(1000)
		fold()
	}
	move(5)

	reads := func() (entries, scans int) {
		entries = testenv.SessionStat(t, conn, `
			SELECT coalesce(sum(idx_tup_read), 0)::int FROM pg_stat_user_indexes
			WHERE schemaname = current_schema() AND relname = 'stock_moves'`)
		scans = testenv.SessionStat(t, conn, `
			SELECT coalesce(seq_scan, 0)::int FROM pg_stat_user_tables
			WHERE schemaname = current_schema() AND relname = 'stock_moves'`)
		return entries, scans
	}
	entries, scans := reads()
	fold()
	entriesAfter, scansAfter := reads()
	t.Logf("a fold of 5 moves with 3,000 folded moves kept: %d index entries, %d sequential scans", entriesAfter-entries, scansAfter-scans)
	require.Less(t, entriesAfter-entries, 50, "index entries of stock_moves read by a fold of 5 moves")
	require.Zero(t, scansAfter-scans, "sequential scans of stock_moves by a fold")
	require.Equal(t, 1_000_000-3015, b.available(t, "SKU-1"))
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_moves"), "folded moves are gone")
}
