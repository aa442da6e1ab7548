-- +goose Up

-- stock_lock locks the stock rows of skus in SKU order (so that batches
-- cannot deadlock), waiting at most wait_ms for a row another session
-- holds; when that runs out, it locks, without waiting, the rows nobody
-- holds. It returns the rows it locked with their levels, which hold until
-- the transaction ends: the order handler decides on them. The caller's
-- lock_timeout is back as it was for the rest of the transaction. One
-- statement does what a savepoint, two settings, the lock and a second try
-- would take five round trips for.
-- +goose StatementBegin
CREATE FUNCTION stock_lock(skus text[], wait_ms integer)
RETURNS TABLE (sku text, available integer)
LANGUAGE plpgsql AS $$
DECLARE
    previous text := current_setting('lock_timeout');
    got text[];
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
        SELECT array_agg(l.sku) INTO got
        FROM (SELECT s.sku FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE) AS l;
        PERFORM set_config('lock_timeout', previous, true);
    EXCEPTION WHEN lock_not_available THEN
        -- The block is rolled back: the locks it took, and lock_timeout.
        SELECT array_agg(l.sku) INTO got
        FROM (SELECT s.sku FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE SKIP LOCKED) AS l;
    END;
    RETURN QUERY SELECT s.sku, s.available FROM stock s WHERE s.sku = ANY(coalesce(got, '{}'));
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION stock_lock(text[], integer);
