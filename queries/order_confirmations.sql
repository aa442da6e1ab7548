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

-- name: OrderLock :many
-- OrderLock locks the rows the cancellations of order_ids change, waiting
-- at most wait_ms (see order_lock), and returns the orders another session
-- holds a row of.
SELECT o.order_id::text AS order_id FROM order_lock(@order_ids::text[], @wait_ms::integer) AS o;
