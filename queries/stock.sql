-- name: StockLockMany :exec
-- StockLockMany locks the stock rows of skus in SKU order, so that
-- transactions reserving overlapping SKUs take their locks in the same order
-- and cannot deadlock.
SELECT sku FROM stock WHERE sku = ANY(@skus::text[]) ORDER BY sku FOR UPDATE;

-- name: StockLockAvailable :many
-- StockLockAvailable locks, in SKU order, the stock rows of skus that no
-- other transaction holds, and returns their SKUs. It never waits: the
-- handler runs it after StockLockMany gave up on a lock, to find the SKUs
-- that another session holds.
SELECT sku FROM stock WHERE sku = ANY(@skus::text[]) ORDER BY sku FOR UPDATE SKIP LOCKED;

-- name: StockGetMany :many
-- StockGetMany returns the stock of skus. The handler reads it after locking
-- the rows (StockLockMany), so the values hold until its transaction ends.
SELECT sku, available FROM stock WHERE sku = ANY(@skus::text[]);

-- name: StockTakeMany :execrows
-- StockTakeMany takes quantities from stock, one row per SKU, each only if
-- that much is available, and returns the number of SKUs it took from: fewer
-- than asked means the handler decided on stale levels. The check constraint
-- (available >= 0) backs it.
UPDATE stock
SET available = stock.available - t.quantity, updated_at = now()
FROM (SELECT unnest(@skus::text[]) AS sku, unnest(@quantities::integer[]) AS quantity) AS t
WHERE stock.sku = t.sku AND stock.available >= t.quantity;

-- name: StockReservationInsertMany :many
-- StockReservationInsertMany records reservations, skipping any (order, sku)
-- already reserved, and returns the order ids of the rows it inserted.
INSERT INTO stock_reservations (order_id, sku, quantity)
SELECT unnest(@order_ids::text[]), unnest(@skus::text[]), unnest(@quantities::integer[])
ON CONFLICT (order_id, sku) DO NOTHING
RETURNING order_id;

-- name: StockRelease :one
-- StockRelease gives back the stock an order reserved, once: it marks the
-- reservations released and returns how many it released.
WITH released AS (
    UPDATE stock_reservations
    SET released_at = now()
    WHERE order_id = @order_id AND released_at IS NULL
    RETURNING sku, quantity
), given AS (
    UPDATE stock
    SET available = stock.available + released.quantity, updated_at = now()
    FROM released
    WHERE stock.sku = released.sku
    RETURNING stock.sku
)
SELECT count(*)::integer FROM given;

-- name: StockReservedSkus :many
-- StockReservedSkus returns the SKUs that each of the orders holds
-- reservations on.
SELECT DISTINCT order_id, sku FROM stock_reservations
WHERE order_id = ANY(@order_ids::text[]) AND released_at IS NULL;
