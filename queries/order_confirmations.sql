-- name: OrderConfirmationInsertMany :many
-- OrderConfirmationInsertMany confirms a batch of orders, skipping every order
-- that already has a row (whatever its status), and returns the rows it
-- inserted.
INSERT INTO order_confirmations (order_id, status, user_id, email, message_id)
SELECT unnest(@order_ids::text[]),
       'confirmed',
       unnest(@user_ids::text[]),
       unnest(@emails::text[]),
       unnest(@message_ids::text[])
ON CONFLICT (order_id) DO NOTHING
RETURNING order_id, message_id;

-- name: OrderConfirmationCancel :one
-- OrderConfirmationCancel moves a confirmed order to cancelled. It returns
-- pgx.ErrNoRows when the order is not confirmed (unknown, rejected or already
-- cancelled).
UPDATE order_confirmations
SET status = 'cancelled', reason = nullif(@reason::text, ''), updated_at = now()
WHERE order_id = @order_id AND status = 'confirmed'
RETURNING order_id;

-- name: OrderConfirmationInsertCancelled :one
-- OrderConfirmationInsertCancelled records a cancellation that arrived before
-- its order, so that a later order.created for it confirms nothing. It returns
-- pgx.ErrNoRows when the order already has a row.
INSERT INTO order_confirmations (order_id, status, message_id, reason)
VALUES (@order_id, 'cancelled', @message_id, nullif(@reason::text, ''))
ON CONFLICT (order_id) DO NOTHING
RETURNING order_id;

-- name: OrderConfirmationGetStatus :one
-- OrderConfirmationGetStatus returns the status of one order.
SELECT status FROM order_confirmations WHERE order_id = @order_id;

-- name: OrderConfirmationRejectMany :exec
-- OrderConfirmationRejectMany marks orders just confirmed in this transaction
-- as rejected, each with its reason.
UPDATE order_confirmations
SET status = 'rejected', reason = u.reason, updated_at = now()
FROM (SELECT unnest(@order_ids::text[]) AS order_id, unnest(@reasons::text[]) AS reason) AS u
WHERE order_confirmations.order_id = u.order_id AND order_confirmations.status = 'confirmed';

-- name: OrderLock :exec
-- OrderLock locks the order_confirmations rows of order_ids in order id
-- order (so that batches cannot deadlock), waiting for each as
-- lock_timeout says. The handler runs it, then OrderReservationsLock,
-- with a short lock_timeout, in a savepoint (orders.LockOrders). Each
-- order's row is one probe of the key, whatever the plan: as
-- "order_id = ANY(@order_ids)", the plan kept from a table of a few
-- hundred rows without statistics read it whole, and went on doing so at
-- each cancellation once it had grown.
SELECT c.order_id
FROM (SELECT DISTINCT unnest(@order_ids::text[]) AS id ORDER BY 1) AS o
CROSS JOIN LATERAL (SELECT c.order_id FROM order_confirmations c
                    WHERE c.order_id = o.id FOR UPDATE) AS c;

-- name: OrderReservationsLock :exec
-- OrderReservationsLock locks the unreleased stock_reservations rows of
-- order_ids in key order, waiting for each as lock_timeout says. Each
-- order's rows are one probe of the primary key (see StockReservedSkus).
SELECT r.order_id
FROM (SELECT DISTINCT unnest(@order_ids::text[]) AS id ORDER BY 1) AS o
CROSS JOIN LATERAL (SELECT r.order_id FROM stock_reservations r
                    WHERE r.order_id = o.id AND r.released_at IS NULL
                    ORDER BY r.sku FOR UPDATE) AS r;

-- name: OrderLockAvailable :many
-- OrderLockAvailable locks, without waiting, the rows a cancellation of
-- each of order_ids changes that no other transaction holds (its
-- order_confirmations row and unreleased stock_reservations rows, in key
-- order), and returns the orders it could not lock whole: a row of theirs
-- exists and another session holds it. Each order's row and its
-- reservations are one probe of a key each (see OrderLock and
-- StockReservedSkus).
WITH o AS (
    SELECT DISTINCT unnest(@order_ids::text[]) AS id ORDER BY 1
), got_orders AS (
    SELECT c.order_id FROM o
    CROSS JOIN LATERAL (SELECT c.order_id FROM order_confirmations c
                        WHERE c.order_id = o.id FOR UPDATE SKIP LOCKED) AS c
), got_reservations AS (
    SELECT r.order_id, r.sku FROM o
    CROSS JOIN LATERAL (SELECT r.order_id, r.sku FROM stock_reservations r
                        WHERE r.order_id = o.id AND r.released_at IS NULL
                        ORDER BY r.sku FOR UPDATE SKIP LOCKED) AS r
)
SELECT c.order_id::text AS order_id FROM o
CROSS JOIN LATERAL (SELECT c.order_id FROM order_confirmations c
                    WHERE c.order_id = o.id OFFSET 0) AS c
WHERE c.order_id NOT IN (SELECT g.order_id FROM got_orders g)
UNION
SELECT r.order_id::text FROM o
CROSS JOIN LATERAL (SELECT r.order_id, r.sku FROM stock_reservations r
                    WHERE r.order_id = o.id AND r.released_at IS NULL OFFSET 0) AS r
WHERE (r.order_id, r.sku) NOT IN (SELECT g.order_id, g.sku FROM got_reservations g);
