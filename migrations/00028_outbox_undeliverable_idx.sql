-- +goose NO TRANSACTION
-- +goose Up

-- The janitor's pass over undeliverable replies (JanitorDeleteUndeliverable).
-- It read them, oldest id first, through outbox_unpublished_idx, whose id
-- order spared a sort: every entry of that index that is not such a reply
-- was read and its row visited, and a snapshot held open keeps there the
-- entry of every row published since it began (with the snapshot held at
-- 1,000 orders/s: 111,472 buffers and 4.8 s a pass, with nothing to
-- delete). Undeliverable replies are few and stay only their retention;
-- in an index of their own, by the time they ended, the pass reads the
-- rows it deletes and no others. The outbox may be large: built
-- concurrently, so that inserts go on meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_undeliverable_idx ON outbox (dead_at)
WHERE published_at IS NULL AND reply_to IS NOT NULL AND dead_at IS NOT NULL;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_undeliverable_idx;
