-- name: OutboxInsertMany :exec
-- OutboxInsertMany records effects to publish, skipping every one whose
-- idempotency key is already in the outbox. The rows take their ids in the
-- order of the arrays, which is the order the relay publishes them in. An
-- empty traceparent or tracestate is stored as NULL; when the arrays are left
-- out, no row has one.
--
-- When it inserts any, it wakes the relays of every inboxd process
-- (LISTEN outbox_pending) at commit, with the schema as the payload, so
-- that a process ignores wake-ups meant for another schema of the
-- database. Rows written otherwise (an operator's INSERT, a replay) are
-- found by the relays' polling (INBOX_POLL_INTERVAL).
WITH inserted AS (
    INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, order_key, traceparent, tracestate)
    SELECT e.idempotency_key, e.routing_key, e.payload::jsonb, e.message_id, nullif(e.order_key, ''),
           nullif(e.traceparent, ''), nullif(e.tracestate, '')
    FROM ROWS FROM (unnest(@idempotency_keys::text[]), unnest(@routing_keys::text[]), unnest(@payloads::text[]),
                   unnest(@message_ids::text[]), unnest(@order_keys::text[]),
                   unnest(@traceparents::text[]), unnest(@tracestates::text[]))
         WITH ORDINALITY AS e (idempotency_key, routing_key, payload, message_id, order_key, traceparent, tracestate, n)
    ORDER BY e.n
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING 1
)
SELECT pg_notify('outbox_pending', current_schema()) FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted;

-- name: OutboxClaimBatch :many
-- OutboxClaimBatch takes up to max_rows unpublished rows that are due,
-- oldest first, skipping rows another relay is locking, and marks them
-- published, counting an attempt for each. The relay runs it in a
-- transaction that it commits only once the broker has confirmed the
-- rows: until then they stay locked, and every other session sees them
-- unpublished. A relay that dies (or loses its connection) before the
-- commit leaves nothing behind: the rows are unlocked, unmarked, and
-- published again, under the same ids, by the next claim. Each row is
-- written once by the relay, not claimed and then marked.
--
-- A row is taken only when every earlier unpublished row of its order is
-- taken with it: one locked by another relay, waiting for a retry, or dead,
-- holds back the order's later rows. With the batch published in id order,
-- the events of one order leave in the order they were written, whatever
-- the number of relays. RETURNING's order is not the id order: the caller
-- sorts.
--
-- The rows held back by an earlier row that cannot be taken now (waiting
-- for a retry, dead, or under a lease) are left out before the LIMIT, so
-- that however many of them sit at the head of the outbox, a batch is
-- filled with rows that can go; the rows held back by one another relay is
-- publishing are left out after it, and are at most that relay's batch.
--
-- The scan starts at the claim floor (internal/claimfloor keeps it): under it
-- every row is published or dead. It does not read the index of open rows
-- from its start: a snapshot held open fills it with the entries of every
-- row published since (and with statistics the planner took that for
-- cheap: 0.9 s a claim after 60 s held at 500 orders/s).
--
-- The look-ups of an order's earlier rows do not start at the floor: they
-- read that order's rows alone (outbox_order_key_unpublished_idx, which
-- holds its dead rows too), a handful of entries. The
-- floor lives in a sequence, which no snapshot holds still: keepers raise
-- it while a claim runs, past rows that are open in the claim's snapshot
-- and have ended since (published, or dead). Bounded by the floor, a
-- look-up missed such a row: an order's later rows went out ahead of an
-- earlier one that died meanwhile and was replayed, and, with the floor
-- read at each look-up, ahead of one another relay had claimed. The hold
-- back reads the snapshot alone.
--
-- claimed_at is set only by releases before this one, which claimed rows in
-- a transaction of their own; such a claim is respected for lease_ms. The
-- lease and the retry delays (next_attempt_at) are measured against now,
-- or now() when NULL (a test sets it forward).
WITH candidate AS (
    SELECT o.id, o.order_key
    FROM outbox o
    WHERE o.published_at IS NULL
      AND o.dead_at IS NULL
      AND o.id >= outbox_claim_floor()
      AND (o.claimed_at IS NULL OR o.claimed_at < coalesce(sqlc.narg('now')::timestamptz, now()) - sqlc.arg(lease_ms)::bigint * interval '1 millisecond')
      AND o.next_attempt_at <= coalesce(sqlc.narg('now')::timestamptz, now())
      -- An earlier row of the order that is dead, waiting for a retry or
      -- under a lease. Dead rows are never published, so the order's
      -- unpublished rows hold them too: one look-up of that order's rows.
      -- The bound is written on (order_key, id) together, which
      -- outbox_order_key_unpublished_idx serves, and on nothing else: with
      -- a bound on id, the planner took a range of the open rows' index, or
      -- of the primary key, and read every other order's row before this
      -- one, for each candidate (90,000 entries for a claim of 300 orders).
      -- The dead_at condition sits in the OR, so the open rows' index
      -- (outbox_open_idx) cannot serve it.
      AND (o.order_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM outbox w
          WHERE w.order_key = o.order_key
            AND (w.order_key, w.id) < (o.order_key, o.id)
            AND w.published_at IS NULL
            AND (w.dead_at IS NOT NULL
                 OR w.next_attempt_at > coalesce(sqlc.narg('now')::timestamptz, now())
                 OR w.claimed_at >= coalesce(sqlc.narg('now')::timestamptz, now()) - sqlc.arg(lease_ms)::bigint * interval '1 millisecond')
      ))
    ORDER BY o.id
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE outbox
SET attempts = outbox.attempts + 1,
    published_at = statement_timestamp(),
    claimed_at = NULL,
    last_error = NULL
FROM candidate c
WHERE outbox.id = c.id
  AND (c.order_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM outbox e
      WHERE e.order_key = c.order_key
        AND (e.order_key, e.id) < (c.order_key, c.id)
        AND e.published_at IS NULL
        AND e.id NOT IN (SELECT id FROM candidate)
  ))
RETURNING outbox.id, outbox.idempotency_key, outbox.routing_key, outbox.payload::text AS payload, outbox.created_at, outbox.attempts,
          coalesce(outbox.traceparent, '') AS traceparent, coalesce(outbox.tracestate, '') AS tracestate,
          coalesce(outbox.order_key, '') AS order_key,
          coalesce(outbox.reply_to, '') AS reply_to, coalesce(outbox.correlation_id, '') AS correlation_id;

-- name: OutboxRelease :exec
-- OutboxRelease gives rows of the claiming transaction back after a failed
-- publish, unpublished, to be retried after retry_delay_ms. When refused
-- (the broker or the client refused the publish for a reason that retrying
-- will not change), a row that has had max_attempts attempts ends dead
-- instead: it is not claimed again until an operator replays it.
UPDATE outbox
SET published_at = NULL,
    last_error = @last_error::text,
    next_attempt_at = now() + sqlc.arg(retry_delay_ms)::bigint * interval '1 millisecond',
    dead_at = CASE WHEN @refused::boolean AND attempts >= @max_attempts::integer THEN statement_timestamp() END
WHERE id = ANY(@ids::bigint[]);
