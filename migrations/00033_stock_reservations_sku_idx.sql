-- +goose NO TRANSACTION
-- +goose Up

-- The index of stock_reservations by SKU covers every reservation, not
-- only those not released.
--
-- The handler looks up an order's open reservations by "order_id = … AND
-- released_at IS NULL" (StockRelease, StockReservedSkus, order_lock). The
-- partial index on sku WHERE released_at IS NULL matched the second
-- condition, and without statistics the planner takes "IS NULL" to hold
-- for one row in 200: the partial index looked half the primary key's cost,
-- and every cancellation read it from end to end, filtering on the order
-- (7.1 million entries for 30 cancellations over 100,000 open
-- reservations; TestStatementsReadIndexesOnceTheTablesHaveGrown). An index
-- of every row names no condition a look-up can match, so the look-ups
-- read the primary key, their order's rows only. It also serves the
-- foreign key's check when a stock row is deleted (which names no
-- released_at), and a release no longer changes an indexed column, so it
-- can be a heap-only update. stock_overview joins every reservation of a
-- SKU either way.
--
-- Built and dropped concurrently, so that reservations go on.
CREATE INDEX CONCURRENTLY IF NOT EXISTS stock_reservations_by_sku_idx ON stock_reservations (sku);

DROP INDEX CONCURRENTLY IF EXISTS stock_reservations_sku_idx;

-- +goose Down
CREATE INDEX CONCURRENTLY IF NOT EXISTS stock_reservations_sku_idx ON stock_reservations (sku)
WHERE released_at IS NULL;

DROP INDEX CONCURRENTLY IF EXISTS stock_reservations_by_sku_idx;
