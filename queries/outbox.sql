-- name: OutboxInsertMany :exec
-- OutboxInsertMany records effects to publish, skipping every one whose
-- idempotency key is already in the outbox. An empty traceparent or
-- tracestate is stored as NULL; when the arrays are left out, no row has one.
INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, traceparent, tracestate)
SELECT unnest(@idempotency_keys::text[]),
       unnest(@routing_keys::text[]),
       unnest(@payloads::text[])::jsonb,
       unnest(@message_ids::text[]),
       nullif(unnest(@traceparents::text[]), ''),
       nullif(unnest(@tracestates::text[]), '')
ON CONFLICT (idempotency_key) DO NOTHING;

-- name: OutboxClaimBatch :many
-- OutboxClaimBatch claims up to max_rows unpublished, unclaimed rows that are
-- due, oldest first, skipping rows another relay is locking, and counts an
-- attempt for each. It commits at once: the relay publishes outside any
-- transaction, then marks the rows published.
UPDATE outbox
SET attempts = outbox.attempts + 1,
    claimed_at = now()
WHERE outbox.id IN (
    SELECT id
    FROM outbox
    WHERE published_at IS NULL
      AND claimed_at IS NULL
      AND next_attempt_at <= now()
    ORDER BY id
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
)
RETURNING outbox.id, outbox.idempotency_key, outbox.routing_key, outbox.payload::text AS payload, outbox.created_at, outbox.attempts,
          coalesce(outbox.traceparent, '') AS traceparent, coalesce(outbox.tracestate, '') AS tracestate;

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
    next_attempt_at = now() + make_interval(secs => sqlc.arg(retry_delay_ms)::float8 / 1000)
WHERE id = ANY(@ids::bigint[]) AND published_at IS NULL;
