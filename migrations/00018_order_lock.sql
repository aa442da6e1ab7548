-- +goose Up

-- order_lock locks the rows a cancellation of each of order_ids changes:
-- the order's order_confirmations row and its unreleased stock_reservations
-- rows, in order id order (so that batches cannot deadlock), waiting at
-- most wait_ms for a row another session holds; when that runs out, it
-- locks, without waiting, the rows nobody holds. It returns the orders it
-- could not lock whole: a row of theirs exists and another session holds
-- it (an operator's open UPDATE, a SELECT … FOR UPDATE in psql). The
-- handler holds those cancellations back, and every other message of the
-- batch goes on; lock_timeout is back as it was for the rest of the
-- transaction. The stock rows are stock_lock's.
-- +goose StatementBegin
CREATE FUNCTION order_lock(order_ids text[], wait_ms integer)
RETURNS TABLE (order_id text)
LANGUAGE plpgsql AS $$
DECLARE
    previous text := current_setting('lock_timeout');
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
        PERFORM 1 FROM (SELECT c.order_id FROM order_confirmations c
                        WHERE c.order_id = ANY(order_ids) ORDER BY c.order_id FOR UPDATE) AS l;
        PERFORM 1 FROM (SELECT r.order_id FROM stock_reservations r
                        WHERE r.order_id = ANY(order_ids) AND r.released_at IS NULL
                        ORDER BY r.order_id, r.sku FOR UPDATE) AS l;
        PERFORM set_config('lock_timeout', previous, true);
        RETURN;
    EXCEPTION WHEN lock_not_available THEN
        -- The block is rolled back: the locks it took, and lock_timeout.
        NULL;
    END;
    RETURN QUERY
    WITH got_orders AS (
        SELECT c.order_id FROM order_confirmations c
        WHERE c.order_id = ANY(order_ids) ORDER BY c.order_id FOR UPDATE SKIP LOCKED
    ), got_reservations AS (
        SELECT r.order_id, r.sku FROM stock_reservations r
        WHERE r.order_id = ANY(order_ids) AND r.released_at IS NULL
        ORDER BY r.order_id, r.sku FOR UPDATE SKIP LOCKED
    )
    SELECT c.order_id FROM order_confirmations c
    WHERE c.order_id = ANY(order_ids) AND c.order_id NOT IN (SELECT g.order_id FROM got_orders g)
    UNION
    SELECT r.order_id FROM stock_reservations r
    WHERE r.order_id = ANY(order_ids) AND r.released_at IS NULL
      AND (r.order_id, r.sku) NOT IN (SELECT g.order_id, g.sku FROM got_reservations g);
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION order_lock(text[], integer);
