-- name: StockLockMany :exec
-- StockLockMany locks the stock rows of skus in SKU order, so that
-- transactions reserving overlapping SKUs take their locks in the same order
-- and cannot deadlock.
SELECT sku FROM stock WHERE sku = ANY(@skus::text[]) ORDER BY sku FOR UPDATE;

-- name: StockReserve :batchone
-- StockReserve reserves every item of one order, or nothing: it returns the
-- SKUs that are unknown and those without enough stock (comma-separated, both
-- empty when the reservation was made). Taking stock is a conditional update
-- on rows it locks; the reservation's key (order_id, sku) makes a second
-- reservation of the same order a no-op.
WITH req AS (
    SELECT r.sku, sum(r.quantity)::integer AS quantity
    FROM (SELECT unnest(@skus::text[]) AS sku, unnest(@quantities::integer[]) AS quantity) AS r
    GROUP BY r.sku
), locked AS (
    SELECT s.sku, s.available
    FROM stock s
    WHERE s.sku IN (SELECT sku FROM req)
    ORDER BY s.sku
    FOR UPDATE
), verdict AS (
    SELECT coalesce((SELECT string_agg(req.sku, ',' ORDER BY req.sku)
                     FROM req WHERE req.sku NOT IN (SELECT sku FROM locked)), '')::text AS unknown,
           coalesce((SELECT string_agg(req.sku, ',' ORDER BY req.sku)
                     FROM req JOIN locked ON locked.sku = req.sku
                     WHERE locked.available < req.quantity), '')::text AS short
), reserved AS (
    INSERT INTO stock_reservations (order_id, sku, quantity)
    SELECT @order_id::text, req.sku, req.quantity
    FROM req, verdict
    WHERE verdict.unknown = '' AND verdict.short = ''
    ON CONFLICT (order_id, sku) DO NOTHING
    RETURNING sku, quantity
), taken AS (
    UPDATE stock
    SET available = stock.available - reserved.quantity, updated_at = now()
    FROM reserved
    WHERE stock.sku = reserved.sku
    RETURNING stock.sku
)
SELECT verdict.unknown, verdict.short, (SELECT count(*) FROM taken)::integer AS taken
FROM verdict;

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
-- StockReservedSkus returns the SKUs that the orders hold reservations on.
SELECT DISTINCT sku FROM stock_reservations
WHERE order_id = ANY(@order_ids::text[]) AND released_at IS NULL;
