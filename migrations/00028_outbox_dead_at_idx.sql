-- +goose NO TRANSACTION
-- +goose Up

-- The outbox's dead rows, by the time they ended: the janitor's pass over
-- undeliverable replies, and the counts of dead rows (migration 00029).
--
-- Both read them through outbox_unpublished_idx, the pass in its id order
-- to spare a sort: every entry there that is not such a row was read and
-- its row visited, and a snapshot held open keeps there the entry of every
-- row published since it began (with the snapshot held at 1,000 orders/s:
-- 111,472 buffers and 4.8 s a pass of the janitor, with nothing to
-- delete). Dead rows are few and stay only until replayed or past their
-- retention; here a statement reads them and no others. A range on dead_at
-- is a condition only this index serves, so that the planner takes it
-- even without statistics (which rate "dead_at IS NOT NULL" at 99.5 % of
-- the rows, and "published_at IS NULL" at 0.5 %). The outbox may be large:
-- built concurrently, so that inserts go on meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_dead_at_idx ON outbox (dead_at)
WHERE published_at IS NULL AND dead_at IS NOT NULL;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_dead_at_idx;
