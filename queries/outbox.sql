-- name: OutboxInsertMany :exec
-- OutboxInsertMany records effects to publish, skipping every one whose
-- idempotency key is already in the outbox. The rows take their ids in the
-- order of the arrays, which is the order the relay publishes them in. An
-- empty traceparent or tracestate is stored as NULL; when the arrays are left
-- out, no row has one.
INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, order_key, traceparent, tracestate)
SELECT e.idempotency_key, e.routing_key, e.payload::jsonb, e.message_id, nullif(e.order_key, ''),
       nullif(e.traceparent, ''), nullif(e.tracestate, '')
FROM ROWS FROM (unnest(@idempotency_keys::text[]), unnest(@routing_keys::text[]), unnest(@payloads::text[]),
               unnest(@message_ids::text[]), unnest(@order_keys::text[]),
               unnest(@traceparents::text[]), unnest(@tracestates::text[]))
     WITH ORDINALITY AS e (idempotency_key, routing_key, payload, message_id, order_key, traceparent, tracestate, n)
ORDER BY e.n
ON CONFLICT (idempotency_key) DO NOTHING;

-- name: OutboxClaimBatch :many
-- OutboxClaimBatch claims up to max_rows unpublished, unclaimed rows that are
-- due, oldest first, skipping rows another relay is locking, and counts an
-- attempt for each. It commits at once: the relay publishes outside any
-- transaction, then marks the rows published.
--
-- A row is claimed only when every earlier unpublished row of its order is
-- claimed with it: one claimed by another relay, or waiting for a retry,
-- holds back the order's later rows. With the batch published in id order,
-- the events of one order leave in the order they were written, whatever
-- the number of relays. RETURNING's order is not the id order: the caller
-- sorts.
WITH candidate AS (
    SELECT id, order_key
    FROM outbox
    WHERE published_at IS NULL
      AND claimed_at IS NULL
      AND next_attempt_at <= now()
    ORDER BY id
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox
SET attempts = outbox.attempts + 1,
    claimed_at = now()
FROM candidate c
WHERE outbox.id = c.id
  AND (c.order_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM outbox e
      WHERE e.order_key = c.order_key
        AND e.id < c.id
        AND e.published_at IS NULL
        AND e.id NOT IN (SELECT id FROM candidate)
  ))
RETURNING outbox.id, outbox.idempotency_key, outbox.routing_key, outbox.payload::text AS payload, outbox.created_at, outbox.attempts,
          coalesce(outbox.traceparent, '') AS traceparent, coalesce(outbox.tracestate, '') AS tracestate,
          coalesce(outbox.order_key, '') AS order_key;

-- name: OutboxReleaseExpired :execrows
-- OutboxReleaseExpired ends the claims older than lease_seconds, those of
-- relays that died between publishing and marking, so that the rows are
-- claimed, and published under the same ids, again. It returns how many.
UPDATE outbox
SET claimed_at = NULL
WHERE published_at IS NULL
  AND claimed_at < now() - make_interval(secs => sqlc.arg(lease_seconds)::float8);

-- name: OutboxMarkPublished :exec
-- OutboxMarkPublished records that the broker confirmed these rows.
UPDATE outbox
SET published_at = now(), claimed_at = NULL, last_error = NULL
WHERE id = ANY(@ids::bigint[]);

-- name: OutboxRelease :exec
-- OutboxRelease gives claimed rows back after a failed publish, to be
-- retried after retry_delay_ms.
UPDATE outbox
SET claimed_at = NULL,
    last_error = @last_error::text,
    next_attempt_at = now() + sqlc.arg(retry_delay_ms)::bigint * interval '1 millisecond'
WHERE id = ANY(@ids::bigint[]) AND published_at IS NULL;
