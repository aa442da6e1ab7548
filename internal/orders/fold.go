package orders

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// StockFoldIntervalDefault is how often FoldStockEvery folds the stock
// moves into stock.available by default (INBOX_STOCK_FOLD_INTERVAL): how
// far behind the moves stock.available may be (the
// levels in stock_levels and stock_overview never are). Each fold writes
// a version of every stock row it folds, which a snapshot held open keeps
// (see migrations/00005_orders.sql): the longer the interval, the fewer a long
// snapshot sees.
const StockFoldIntervalDefault = 30 * time.Second

// stockFoldBatch is the most SKUs one fold transaction locks and folds.
// Kept small: a batch of orders that needs one of these SKUs waits for the
// whole transaction (the fold, then a delete of each SKU's folded moves).
// A fold of 1,000 SKUs in one transaction held the stock rows for about
// 120 ms, and raised the p99 of the 12 s window it fell in from 26 ms to
// 86 ms at 1,000 orders/s (BENCHMARKS.md, "The ruler's mark at its
// statement, and the stock fold in small transactions").
const stockFoldBatch = 50

// foldedMovesWait is how long a fold waits for a folded move that another
// session has locked (an owner's SELECT ... FOR UPDATE) before it leaves
// that move be: it holds stock rows that batches wait for meanwhile.
const foldedMovesWait = 100 * time.Millisecond

// Beginner begins transactions: a pool or a connection.
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// FoldStockEvery folds the stock moves (FoldStock) every interval until
// ctx ends. Each replica may run it: a fold skips the rows another holds.
func FoldStockEvery(ctx context.Context, db Beginner, logger *slog.Logger, interval time.Duration) {
	for retry.Sleep(ctx, interval) {
		if _, err := FoldStock(ctx, db); err != nil && ctx.Err() == nil {
			logger.Warn("fold stock moves", slog.String("error", err.Error()))
		}
	}
}

// FoldStock folds the moves of every SKU whose stock row no other
// transaction holds into stock.available, stockFoldBatch SKUs per
// transaction in SKU order, and returns how many folds of a SKU it made
// (a SKU that ends a batch and gets a move before the next batch starts is
// folded, and counted, twice). The
// levels stay as they were. Each batch is a READ COMMITTED transaction of
// its own (a snapshot of an older start could miss a move committed
// since); it starts at the last SKU of the batch before, so a fold ends
// once it has passed the last SKU, whatever moves are written meanwhile.
func FoldStock(ctx context.Context, db Beginner) (int, error) {
	total := 0
	from := "" // no SKU sorts before it
	for {
		var locked []string
		var folded int
		err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) (err error) {
			locked, folded, err = foldBatch(ctx, tx, from)
			return err
		})
		if err != nil {
			return total, err
		}
		total += folded
		if len(locked) < stockFoldBatch {
			return total, nil
		}
		// The last SKU again: folded, it has no moves left unless one was
		// written since, and then it is folded once more.
		from = locked[len(locked)-1]
	}
}

// foldBatch folds the moves of stockFoldBatch SKUs at most, from the SKU
// from on, those with moves to fold whose rows nobody holds, in tx, and
// returns the SKUs it locked, in SKU order, and how many it folded.
//
//   - It locks their stock rows, in SKU order, skipping those another
//     session holds.
//   - After the locks, in a statement of its own (every move of these SKUs
//     is committed, and none can be added until tx ends), it adds each
//     SKU's unfolded total to stock.available and moves folded_through to
//     its newest move: the level stays as it was, and the
//     stock_moves_chain trigger numbers the next move after it.
//   - It deletes the folded moves, one SKU's range of the primary key at a
//     time: a delete that read more would read, at every fold, the folded
//     moves a held snapshot keeps. A move another session has locked is
//     waited for foldedMovesWait at most (see waitAtMost), then left where
//     it is, under folded_through, where nothing reads it.
func foldBatch(ctx context.Context, tx pgx.Tx, from string) ([]string, int, error) {
	q := dbsqlc.New()
	skus, err := q.StockFoldLock(ctx, tx, dbsqlc.StockFoldLockParams{FromSku: from, MaxSkus: stockFoldBatch})
	if err != nil || len(skus) == 0 {
		return nil, 0, err
	}
	folded, err := q.StockFoldMany(ctx, tx, skus)
	if err != nil || len(folded) == 0 {
		return skus, 0, err
	}
	deletes := func(query string) func(*pgx.Batch) {
		return func(b *pgx.Batch) {
			for _, f := range folded {
				b.Queue(query, f.Sku, f.Previous, f.Through)
			}
		}
	}
	lock := deletes(dbsqlc.StockMovesDeleteFolded)
	then := func(b *pgx.Batch, got bool) {
		if !got {
			deletes(dbsqlc.StockMovesDeleteFoldedUnlocked)(b)
		}
	}
	if err := waitAtMost(ctx, tx, foldedMovesWait, lock, then); err != nil {
		return nil, 0, err
	}
	return skus, len(folded), nil
}
