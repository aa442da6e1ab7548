-- +goose NO TRANSACTION
-- +goose Up

-- A relay writes each outbox row three times: the insert, the claim
-- (attempts, claimed_at) and the mark (published_at). With claimed_at in
-- no index, the claim is a heap-only update: it adds no index entry, and
-- the page prunes the old version by itself, without VACUUM. The claim
-- finds its rows through outbox_unpublished_idx instead; the rows it skips
-- there (claimed by a relay right now) are at most a batch per relay.
-- Free space on each page leaves the claim's new version room beside the
-- old one; it applies to pages written from now on.
DROP INDEX CONCURRENTLY IF EXISTS outbox_claimable_idx;
ALTER TABLE outbox SET (fillfactor = 50);

-- +goose Down
ALTER TABLE outbox RESET (fillfactor);
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_claimable_idx ON outbox (id)
WHERE published_at IS NULL AND claimed_at IS NULL;
