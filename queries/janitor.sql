-- Named after its caller, internal/janitor: it deletes from several tables, each by its own retention.

-- The janitor's statements each delete one small batch of rows past their
-- retention, oldest first. SKIP LOCKED keeps them off rows in use and lets
-- several janitors run at once, each taking different rows. The statuses
-- are literals, not parameters, so that the planner can use the partial
-- indexes whatever plan it caches.

-- name: JanitorDeleteProcessed :one
-- JanitorDeleteProcessed deletes up to max_rows processed messages
-- processed more than older_than_seconds ago, with their attempt history,
-- and returns how many messages it deleted.
WITH gone AS (
    DELETE FROM inbox
    WHERE id IN (
        SELECT id FROM inbox
        WHERE status = 'processed'
          AND processed_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
        ORDER BY processed_at
        LIMIT sqlc.arg(max_rows)
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id, message_id
), history AS (
    DELETE FROM inbox_attempts WHERE inbox_id IN (SELECT id FROM gone)
), requests AS (
    DELETE FROM inbox_reply_requests WHERE message_id IN (SELECT message_id FROM gone)
)
SELECT count(*) FROM gone;

-- name: JanitorDeleteDead :one
-- JanitorDeleteDead deletes up to max_rows dead messages that died more
-- than older_than_seconds ago and were not asked to be replayed, with their
-- attempt history, and returns how many messages it deleted. A dead
-- message that holds back later messages of its order is kept: deleting it
-- would let them run out of order; an operator replays or skips it.
WITH gone AS (
    DELETE FROM inbox
    WHERE id IN (
        SELECT d.id FROM inbox d
        WHERE d.status = 'dead'
          AND NOT d.replay_requested
          AND d.processed_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
          AND (d.order_key IS NULL OR NOT EXISTS (
              SELECT 1 FROM inbox l
              WHERE l.order_key = d.order_key AND l.id > d.id AND l.status <> 'processed'
          ))
        ORDER BY d.id
        LIMIT sqlc.arg(max_rows)
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id, message_id
), history AS (
    DELETE FROM inbox_attempts WHERE inbox_id IN (SELECT id FROM gone)
), requests AS (
    DELETE FROM inbox_reply_requests WHERE message_id IN (SELECT message_id FROM gone)
)
SELECT count(*) FROM gone;

-- name: JanitorDeletePublished :execrows
-- JanitorDeletePublished deletes up to max_rows outbox rows published more
-- than older_than_seconds ago.
DELETE FROM outbox
WHERE id IN (
    SELECT id FROM outbox
    WHERE published_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
    ORDER BY published_at
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
);

-- name: JanitorDeleteUndeliverable :execrows
-- JanitorDeleteUndeliverable deletes up to max_rows replies that ended
-- undeliverable (their requester was gone) more than older_than_seconds
-- ago. They are never published, so JanitorDeletePublished leaves them.
-- Oldest end first, in outbox_dead_at_idx's order: the pass reads the dead
-- rows' entries and no others (see outbox_dead_at_idx).
DELETE FROM outbox
WHERE id IN (
    SELECT id FROM outbox
    WHERE published_at IS NULL
      AND reply_to IS NOT NULL
      AND dead_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
    ORDER BY dead_at
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
);

-- name: JanitorDeleteReplyRequests :execrows
-- JanitorDeleteReplyRequests deletes up to max_rows reply requests received
-- more than older_than_seconds ago. Requests leave with their message; this
-- catches one stored for a message that the janitor was deleting meanwhile.
DELETE FROM inbox_reply_requests
WHERE id IN (
    SELECT id FROM inbox_reply_requests
    WHERE received_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
    ORDER BY received_at
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
);

-- name: JanitorDeleteConflicts :execrows
-- JanitorDeleteConflicts deletes up to max_rows conflict records last seen
-- more than older_than_seconds ago.
DELETE FROM inbox_conflicts
WHERE id IN (
    SELECT id FROM inbox_conflicts
    WHERE last_seen_at < now() - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
    ORDER BY last_seen_at
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
);

-- name: JanitorRotateKeys :one
-- JanitorRotateKeys opens the key ledger's next generation if the current
-- one has lasted a seventh of the dedupe window, and returns its number, or
-- 0 if none was due (see inbox_keys_rotate).
SELECT coalesce(inbox_keys_rotate(make_interval(secs => sqlc.arg(dedupe_window_seconds)::float8)), 0)::bigint AS generation;

-- name: JanitorSealKeys :one
-- JanitorSealKeys seals the key ledger's hot part writing, if it has grown
-- to an eighth of its slot and the other part is empty, and reports
-- whether it did (see inbox_keys_seal).
SELECT inbox_keys_seal()::boolean AS sealed;

-- name: JanitorMergeKeys :one
-- JanitorMergeKeys copies the next range of a sealed hot part's keys, about
-- max_bytes of them, into their slot and returns how many, or -1 if no
-- part was sealed (see inbox_keys_merge).
SELECT coalesce(inbox_keys_merge(sqlc.arg(max_bytes)::bigint), -1)::bigint AS merged;

-- name: JanitorEmptyKeys :one
-- JanitorEmptyKeys truncates a hot part whose keys were merged into their
-- slot, and reports whether it did (see inbox_keys_empty).
SELECT inbox_keys_empty()::boolean AS emptied;

-- name: JanitorAnalyzeKeys :one
-- JanitorAnalyzeKeys gives the key ledger's hot parts statistics once they
-- hold some keys, and returns how many it analyzed (see
-- inbox_keys_analyze_parts).
SELECT inbox_keys_analyze_parts()::integer AS analyzed;

-- name: JanitorKeysCoverWindow :one
-- JanitorKeysCoverWindow reports whether the key ledger has remembered
-- every id stored within the last dedupe window: it started at least that
-- long ago. Until then, rows stored before it are the only record of
-- their ids, and stay for the window.
SELECT coalesce(inbox_keys_since() <= now() - make_interval(secs => sqlc.arg(dedupe_window_seconds)::float8), false)::boolean AS covered;
