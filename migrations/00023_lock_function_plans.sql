-- +goose Up

-- The lock functions' statements are planned at each call, for the tables
-- as they are.
--
-- stock_lock's statements were planned once per session and kept: planned
-- while the stock table held its 1,000 rows in a few pages, for a batch's
-- many SKUs, they scan it whole. Nothing replans them without ANALYZE, and
-- a snapshot held open keeps every version of the stock rows (each order
-- updates some), so the table grows and every scan with it: with a
-- snapshot held 30 s at 500 orders/s, 8 to 15 ms a call, most of the
-- handler's time. Now they are planned at each call, for the table as it
-- is, and the levels come from the locking statement itself: the second
-- statement that read them again, by an array of SKUs, was still planned
-- as a scan of the table.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION stock_lock(skus text[], wait_ms integer)
RETURNS TABLE (sku text, available integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    previous text := current_setting('lock_timeout');
    got text[];
    levels integer[];
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
        SELECT array_agg(l.sku ORDER BY l.sku), array_agg(l.available ORDER BY l.sku) INTO got, levels
        FROM (SELECT s.sku, s.available FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE) AS l;
        PERFORM set_config('lock_timeout', previous, true);
    EXCEPTION WHEN lock_not_available THEN
        -- The block is rolled back: the locks it took, and lock_timeout.
        SELECT array_agg(l.sku ORDER BY l.sku), array_agg(l.available ORDER BY l.sku) INTO got, levels
        FROM (SELECT s.sku, s.available FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE SKIP LOCKED) AS l;
    END;
    -- The levels as locked: FOR UPDATE returns the last committed version.
    RETURN QUERY SELECT u.sku, u.available FROM unnest(coalesce(got, '{}'), coalesce(levels, '{}')) AS u(sku, available);
END;
$$;
-- +goose StatementEnd

-- order_lock's statements had the same plans kept, on tables that grow
-- with every order: 31,000 rows of order_confirmations read per call, once
-- the table held them.
ALTER FUNCTION order_lock(text[], integer) SET plan_cache_mode = force_custom_plan;

-- +goose Down
ALTER FUNCTION order_lock(text[], integer) RESET plan_cache_mode;
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION stock_lock(skus text[], wait_ms integer)
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
ALTER FUNCTION stock_lock(text[], integer) RESET plan_cache_mode;
