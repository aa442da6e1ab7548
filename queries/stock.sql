-- name: StockLock :many
-- StockLock locks the stock rows of skus in SKU order, waiting at most
-- wait_ms for each, then locking only those nobody holds (see the
-- stock_lock function), and returns the rows it locked with their levels.
SELECT l.sku::text AS sku, l.available::integer AS available
FROM stock_lock(@skus::text[], @wait_ms::integer) AS l;

-- name: StockLockAvailable :many
-- StockLockAvailable locks, in SKU order, the stock rows of skus that no
-- other transaction holds, and returns them with their levels. It never
-- waits: the handler probes rows it found held a moment ago with it.
SELECT l.sku::text AS sku, l.available::integer AS available
FROM stock_lock(@skus::text[], 0) AS l;

-- name: StockGetMany :many
-- StockGetMany returns the levels of skus, locked or not.
SELECT sku::text AS sku, available::integer AS available FROM stock_levels WHERE sku = ANY(@skus::text[]);

-- name: StockTakeMany :execrows
-- StockTakeMany takes quantities from stock, one move per SKU, and returns
-- the number of moves it wrote. The stock_moves_chain trigger refuses a
-- take that would leave a level below zero (check_violation): the handler
-- decided on stale levels.
INSERT INTO stock_moves (sku, quantity)
SELECT t.sku, -t.quantity
FROM (SELECT unnest(@skus::text[]) AS sku, unnest(@quantities::integer[]) AS quantity) AS t;

-- name: StockReservationInsertMany :many
-- StockReservationInsertMany records reservations, skipping any (order, sku)
-- already reserved, and returns the order ids of the rows it inserted.
INSERT INTO stock_reservations (order_id, sku, quantity)
SELECT unnest(@order_ids::text[]), unnest(@skus::text[]), unnest(@quantities::integer[])
ON CONFLICT (order_id, sku) DO NOTHING
RETURNING order_id;

-- name: StockRelease :one
-- StockRelease gives back the stock an order reserved, once: it marks the
-- reservations released, writes a move giving each SKU's quantity back,
-- and returns how many SKUs it gave back to.
WITH released AS (
    UPDATE stock_reservations
    SET released_at = now()
    WHERE order_id = @order_id AND released_at IS NULL
    RETURNING sku, quantity
), given AS (
    INSERT INTO stock_moves (sku, quantity)
    SELECT released.sku, sum(released.quantity)::integer
    FROM released
    GROUP BY released.sku
    ORDER BY released.sku
    RETURNING sku
)
SELECT count(*)::integer FROM given;

-- name: StockFold :one
-- StockFold folds the moves of every SKU whose row nobody holds into
-- stock.available, max_skus at most, and returns how many SKUs it folded.
SELECT stock_fold(NULL, @max_skus::integer)::integer AS folded;

-- name: StockReservedSkus :many
-- StockReservedSkus returns the SKUs that each of the orders holds
-- reservations on.
SELECT DISTINCT order_id, sku FROM stock_reservations
WHERE order_id = ANY(@order_ids::text[]) AND released_at IS NULL;
