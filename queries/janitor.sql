-- Named after its caller, internal/janitor: it deletes from several tables, each by its own retention.

-- The janitor's statements each delete one small batch of rows past their
-- retention, oldest first. SKIP LOCKED keeps them off rows in use and lets
-- several janitors run at once, each taking different rows. The statuses
-- are literals, not parameters, so that the planner can use the partial
-- indexes whatever plan it caches. Each reads the clock as now, or
-- as now() when now is NULL (the service passes none; a test sets it
-- forward instead of backdating rows).

-- name: JanitorDeleteProcessed :one
-- JanitorDeleteProcessed deletes up to max_rows processed messages
-- processed more than older_than_seconds ago, with their attempt history,
-- and returns how many messages it deleted.
WITH gone AS (
    DELETE FROM inbox
    WHERE id IN (
        SELECT id FROM inbox
        WHERE status = 'processed'
          AND processed_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
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
          AND d.processed_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
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
    WHERE published_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
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
      AND dead_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
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
    WHERE received_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
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
    WHERE last_seen_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(older_than_seconds)::float8)
    ORDER BY last_seen_at
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
);

-- The key ledger's state machine (internal/janitor/keys.go): each step is
-- a transaction of the statements below, in the order keys.go gives, under
-- the locks migrations/00004_inbox_keys.sql describes. A partition's name
-- cannot be a parameter: the TRUNCATE of a slot or a part is built in Go.
-- Sizes are read from the tables' files, a partition found by its name
-- through the session's search_path.

-- name: JanitorKeysLockWait :exec
-- JanitorKeysLockWait bounds every lock wait of the rest of the
-- transaction to lock_wait_ms (its lock_timeout).
SELECT set_config('lock_timeout', sqlc.arg(lock_wait_ms)::bigint::text, true);

-- name: JanitorKeysLockGenerations :exec
-- JanitorKeysLockGenerations takes the generations' SHARE ROW EXCLUSIVE
-- lock: one seal or rotation at a time.
LOCK TABLE inbox_key_generations IN SHARE ROW EXCLUSIVE MODE;

-- name: JanitorKeysLockRemembering :exec
-- JanitorKeysLockRemembering takes the remembering lock exclusively (the
-- hot parts' SHARE lock): it waits for the transactions writing keys
-- (inbox_keys_remember holds its ROW EXCLUSIVE lock) and holds up new ones.
LOCK TABLE inbox_key_hot_parts IN SHARE MODE;

-- name: JanitorKeysCurrent :one
-- JanitorKeysCurrent reads the current generation, whether it has lasted
-- a seventh of the dedupe window, whether a hot part is empty (to write
-- for the next generation), and whether the next slot's last generation
-- closed at least a window ago (a longer window than before may still
-- hold its keys), or never wrote it. The slots go round in order, so the
-- next slot was last written seven generations ago. The clock is now, or
-- clock_timestamp() when NULL (the service passes none; a test sets it
-- forward).
SELECT g.generation, g.slot,
       coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())
           >= g.opened_at + make_interval(secs => sqlc.arg(dedupe_window_seconds)::float8 / 7) AS due,
       EXISTS (SELECT 1 FROM inbox_key_hot_parts h WHERE h.state = 'empty') AS part_empty,
       NOT EXISTS (SELECT 1 FROM (SELECT r.closed_at FROM inbox_key_generations r
                                  WHERE r.generation >= g.generation - 7 AND r.slot = (g.slot + 1) % 8
                                  ORDER BY r.generation DESC LIMIT 1) last
                   WHERE last.closed_at > coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())
                                          - make_interval(secs => sqlc.arg(dedupe_window_seconds)::float8)) AS slot_free
FROM inbox_key_generations g
WHERE g.closed_at IS NULL;

-- name: JanitorKeysClose :execrows
-- JanitorKeysClose closes the current generation: every key of it has
-- been committed by now. The clock is JanitorKeysCurrent's.
UPDATE inbox_key_generations SET closed_at = coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())
WHERE generation = sqlc.arg(generation)::bigint AND closed_at IS NULL;

-- name: JanitorKeysOpen :exec
-- JanitorKeysOpen opens a generation, which writes slot. The clock is
-- JanitorKeysCurrent's.
INSERT INTO inbox_key_generations (generation, slot, opened_at)
VALUES (sqlc.arg(generation)::bigint, sqlc.arg(slot)::smallint, coalesce(sqlc.narg('now')::timestamptz, clock_timestamp()));

-- name: JanitorKeysSealWriting :exec
-- JanitorKeysSealWriting seals the hot part writing, for the slot its
-- keys belong to.
UPDATE inbox_key_hot_parts SET state = 'sealed', slot = sqlc.arg(slot)::smallint, since = clock_timestamp()
WHERE state = 'writing';

-- name: JanitorKeysStartWriting :execrows
-- JanitorKeysStartWriting makes the empty hot part write for slot.
UPDATE inbox_key_hot_parts SET state = 'writing', slot = sqlc.arg(slot)::smallint, since = clock_timestamp()
WHERE state = 'empty';

-- name: JanitorKeysWriting :one
-- JanitorKeysWriting reads the hot part writing, the slot it writes for
-- and their sizes, whether the other part holds keys (sealed or merged,
-- not yet emptied), and the current generation's slot.
SELECT w.part, w.slot::smallint AS slot,
       EXISTS (SELECT 1 FROM inbox_key_hot_parts o WHERE o.state <> 'empty' AND o.part <> w.part) AS other_held,
       pg_relation_size(format('inbox_keys_%s', w.part)::regclass) AS part_bytes,
       pg_relation_size(format('inbox_keys_%s', w.slot)::regclass) AS slot_bytes,
       (SELECT g.slot FROM inbox_key_generations g WHERE g.closed_at IS NULL)::smallint AS current_slot
FROM inbox_key_hot_parts w
WHERE w.state = 'writing';

-- name: JanitorKeysTakeSealed :one
-- JanitorKeysTakeSealed locks the sealed hot part, unless another session
-- is merging it, and reads how far its merge has gone, its heap's size and
-- its slot's index's pages.
SELECT p.part, p.slot::smallint AS slot, p.merge_mask, p.merged_buckets,
       pg_relation_size(format('inbox_keys_%s', p.part)::regclass) AS part_bytes,
       (pg_indexes_size(format('inbox_keys_%s', p.slot)::regclass) / current_setting('block_size')::bigint)::bigint AS slot_index_pages
FROM inbox_key_hot_parts p
WHERE p.state = 'sealed'
FOR UPDATE OF p SKIP LOCKED;

-- name: JanitorKeysMergeMemory :exec
-- JanitorKeysMergeMemory lets the rest of the transaction sort a range
-- (about max_bytes of keys) in memory.
SELECT set_config('work_mem', '64MB', true);

-- name: JanitorKeysMergeRange :execrows
-- JanitorKeysMergeRange copies the keys of a hot part whose buckets
-- (hashtext(message_id) & mask) are in [lo, hi) into their slot, in
-- bucket order, through the parent (the service may write only there).
INSERT INTO inbox_keys (slot, message_id)
SELECT sqlc.arg(slot)::smallint, k.message_id FROM inbox_keys k
WHERE k.slot = sqlc.arg(part)::smallint
  AND (hashtext(k.message_id) & sqlc.arg(mask)::integer) >= sqlc.arg(lo)::bigint
  AND (hashtext(k.message_id) & sqlc.arg(mask)::integer) < sqlc.arg(hi)::bigint
ORDER BY hashtext(k.message_id) & sqlc.arg(mask)::integer;

-- name: JanitorKeysMerged :exec
-- JanitorKeysMerged records that the part's buckets below merged_buckets
-- are in their slot, merged by mask.
UPDATE inbox_key_hot_parts SET merge_mask = sqlc.arg(mask)::integer, merged_buckets = sqlc.arg(merged_buckets)::integer
WHERE part = sqlc.arg(part)::smallint AND state = 'sealed';

-- name: JanitorKeysMergedAll :exec
-- JanitorKeysMergedAll marks the part merged: every key of it is in its
-- slot.
UPDATE inbox_key_hot_parts SET state = 'merged', since = clock_timestamp(), merge_mask = NULL, merged_buckets = 0
WHERE part = sqlc.arg(part)::smallint AND state = 'sealed';

-- name: JanitorKeysEmptyMerged :one
-- JanitorKeysEmptyMerged marks a merged hot part empty, unless another
-- session is emptying it, and returns it (its TRUNCATE follows in the same
-- transaction).
UPDATE inbox_key_hot_parts SET state = 'empty', slot = NULL, since = clock_timestamp()
WHERE part = (SELECT m.part FROM inbox_key_hot_parts m WHERE m.state = 'merged' LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING part;

-- name: JanitorAnalyzeKeys :one
-- JanitorAnalyzeKeys gives the key ledger's hot parts statistics once they
-- hold some keys, and returns how many it analyzed (see
-- inbox_keys_analyze_parts).
SELECT inbox_keys_analyze_parts()::integer AS analyzed;

-- name: JanitorKeysCoverWindow :one
-- JanitorKeysCoverWindow reports whether the key ledger has remembered
-- every id stored within the last dedupe window: it started at least that
-- long ago. Until then, rows stored before it are the only record of
-- their ids, and stay for the window. It started when its first generation
-- opened (read by the primary key). The clock is now, or now() when NULL.
SELECT coalesce((SELECT g.opened_at FROM inbox_key_generations g ORDER BY g.generation LIMIT 1)
                <= coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(dedupe_window_seconds)::float8), false)::boolean AS covered;
