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

// A snapshot held open keeps every version of the stock rows, which every
// order updates, so the stock table grows by a version a row per batch. A
// session that has locked stock many times while the table was small must
// still lock a row through the primary key once the table is large, not
// read all its versions.
func TestStockLockReadsThePrimaryKeyOnceTheTableHasGrown(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	q := dbsqlc.New()
	_, err := db.Pool.Exec(ctx, "INSERT INTO stock (sku, available) SELECT 'SKU-' || g, 1000000 FROM generate_series(1, 1000) g")
	require.NoError(t, err)

	// A session as the service opens it, that has locked stock before.
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	pipeline.ConfigureSession(cc)
	conn, err := pgx.ConnectConfig(ctx, cc)
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	// A batch's SKUs: so many, on a table of a few pages, that a scan of
	// the table is the cheaper plan, and is kept as the generic one.
	var skus []string
	for i := range 100 {
		skus = append(skus, fmt.Sprintf("SKU-%d", 1+i*10))
	}
	lock := func(tx pgx.Tx) {
		rows, err := q.StockLock(ctx, tx, dbsqlc.StockLockParams{Skus: skus, WaitMs: int32(orders.StockLockWait.Milliseconds())})
		require.NoError(t, err)
		require.Len(t, rows, len(skus))
	}
	for range 10 {
		require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { lock(tx); return nil }))
	}

	holder, err := db.Session(t).BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	var n int
	require.NoError(t, holder.QueryRow(ctx, "SELECT count(*) FROM stock").Scan(&n))
	for range 30 {
		_, err = db.Pool.Exec(ctx, "UPDATE stock SET available = available - 1, updated_at = now()")
		require.NoError(t, err)
	}

	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The session's counts not yet reported to the statistics are in the
	// view too: the lock's are the difference.
	scanned := func() int {
		var n int
		require.NoError(t, tx.QueryRow(ctx, "SELECT seq_tup_read FROM pg_stat_xact_user_tables WHERE relid = 'stock'::regclass").Scan(&n))
		return n
	}
	before := scanned()
	lock(tx)
	require.Zero(t, scanned()-before, "stock rows read by scanning the table, with 30,000 versions kept by a held snapshot")
}
