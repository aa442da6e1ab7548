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
SELECT sku, available FROM stock WHERE sku = ANY(@skus::text[]) ORDER BY sku FOR UPDATE SKIP LOCKED;

-- name: StockGetMany :many
-- StockGetMany returns the stock of skus, locked or not.
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
