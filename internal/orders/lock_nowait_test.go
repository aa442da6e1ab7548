package orders_test

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// LockOrders and LockStock with a wait of 0 take what nobody holds and wait
// for nothing, whatever the session's lock_timeout (here 0: wait for ever):
// an owner's open transaction holds an order's confirmation and a stock
// row, and a session of an operator's asks for both without waiting. It
// gets the held order named, and the free SKU locked, at once.
func TestTheLocksWithoutAWaitWaitForNothing(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO stock (sku, available) VALUES ('NW-1', 5), ('NW-2', 5);
		INSERT INTO order_confirmations (order_id, status, message_id) VALUES ('nw-o1', 'confirmed', 'nw-m1')`)
	require.NoError(t, err)

	owner := db.Session(t)
	tx, err := owner.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "SELECT 1 FROM order_confirmations WHERE order_id = 'nw-o1' FOR UPDATE")
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT 1 FROM stock WHERE sku = 'NW-1' FOR UPDATE")
	require.NoError(t, err)

	op := db.Session(t)
	// lock_timeout 0 waits for ever; statement_timeout ends a wait that
	// should not have begun.
	_, err = op.Exec(ctx, "SET lock_timeout = 0; SET statement_timeout = '5s'")
	require.NoError(t, err)
	otx, err := op.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = otx.Rollback(context.WithoutCancel(ctx)) }()
	held, err := orders.LockOrders(ctx, otx, []string{"nw-o1"}, 0)
	require.NoError(t, err, "LockOrders with a wait of 0 waits for nothing")
	require.Equal(t, []string{"nw-o1"}, held)
	locked, _, err := orders.LockStock(ctx, otx, []string{"NW-1", "NW-2"}, 0)
	require.NoError(t, err, "LockStock with a wait of 0 waits for nothing")
	require.Equal(t, []string{"NW-2"}, slices.Sorted(maps.Keys(locked)))
}
