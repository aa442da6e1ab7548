-- +goose NO TRANSACTION
-- +goose Up

-- The relay's look-up of an earlier dead row of an order. Dead rows are
-- few and stay until replayed; their own index keeps the look-up off
-- outbox_unpublished_idx, which a snapshot held open fills with the
-- entries of every row published since, and which the planner, once
-- ANALYZE has seen few unpublished rows, took for the cheaper (with a
-- snapshot held 60 s at 500 orders/s, a claim read 919,689 buffers).
-- The outbox may be large: built concurrently, so that inserts go on
-- meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_dead_order_key_idx ON outbox (order_key, id)
WHERE dead_at IS NOT NULL;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_dead_order_key_idx;
