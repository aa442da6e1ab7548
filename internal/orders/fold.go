package orders

import (
	"context"
	"log/slog"
	"time"

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

// stockFoldBatch is the most SKUs one fold locks and folds in one
// transaction, and stockFoldBatches the most transactions of one FoldStock.
const (
	stockFoldBatch   = 1000
	stockFoldBatches = 100
)

// FoldStockEvery folds the stock moves (FoldStock) every interval until
// ctx ends. Each replica may run it: a fold skips the rows another holds.
func FoldStockEvery(ctx context.Context, db dbsqlc.DBTX, logger *slog.Logger, interval time.Duration) {
	for retry.Sleep(ctx, interval) {
		if _, err := FoldStock(ctx, db); err != nil && ctx.Err() == nil {
			logger.Warn("fold stock moves", slog.String("error", err.Error()))
		}
	}
}

// FoldStock folds the moves of every SKU whose stock row no other
// transaction holds into stock.available, stockFoldBatch SKUs per
// transaction, and returns how many SKUs it folded. The levels stay as
// they were. db must not be in a transaction of its own: each batch is one,
// and there are stockFoldBatches at most.
func FoldStock(ctx context.Context, db dbsqlc.DBTX) (int, error) {
	q := dbsqlc.New()
	total := 0
	// A batch that folds as many SKUs as it may leaves more to fold, but
	// moves written meanwhile may keep it full: stockFoldBatches at most.
	for range stockFoldBatches {
		n, err := q.StockFold(ctx, db, stockFoldBatch)
		if err != nil {
			return total, err
		}
		total += int(n)
		if n < stockFoldBatch {
			break
		}
	}
	return total, nil
}
