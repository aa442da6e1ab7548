-- +goose NO TRANSACTION
-- +goose Up

-- order_key names the order an effect belongs to (the orderId of its event).
-- A relay claims an effect only when no earlier effect of its order is
-- unpublished, unless it claims that one too, and publishes a batch in id
-- order: the events of one order leave in the order the handler wrote them,
-- however many relays run. NULL (rows written before this release) orders
-- the row with no other.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS order_key text;

-- The claim's check for an earlier unpublished effect of the same order.
-- Published rows leave the index, so it stays as small as the backlog. The
-- outbox may be large: built concurrently, so that inserts go on meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_order_key_unpublished_idx ON outbox (order_key, id)
WHERE published_at IS NULL AND order_key IS NOT NULL;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_order_key_unpublished_idx;
ALTER TABLE outbox DROP COLUMN IF EXISTS order_key;
