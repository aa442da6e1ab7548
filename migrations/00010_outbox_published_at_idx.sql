-- +goose NO TRANSACTION
-- +goose Up

-- Retention deletes published outbox rows by age. The outbox was never
-- pruned before this release and may be large: the index is built
-- concurrently, so that the workers' outbox inserts go on meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_published_at_idx ON outbox (published_at)
WHERE published_at IS NOT NULL;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_published_at_idx;
