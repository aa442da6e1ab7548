-- name: InboxInsertMany :many
-- InboxInsertMany stores a batch of messages in arrival order, skipping every
-- message whose message_id is already in the inbox (or earlier in the batch),
-- and returns the message ids it inserted. The ids it does not return were
-- duplicates.
INSERT INTO inbox (message_id, message_type, routing_key, payload)
SELECT unnest(@message_ids::text[]),
       unnest(@message_types::text[]),
       unnest(@routing_keys::text[]),
       unnest(@payloads::bytea[])
ON CONFLICT (message_id) DO NOTHING
RETURNING message_id;

-- name: InboxClaimBatch :many
-- InboxClaimBatch locks up to max_rows pending messages that are due, oldest
-- first, skipping rows another worker holds. The locks last until the calling
-- transaction ends.
SELECT id, message_id, message_type, payload, attempts, received_at, replay_requested
FROM inbox
WHERE status = 'pending'
  AND next_attempt_at <= coalesce(sqlc.narg('now')::timestamptz, now())
ORDER BY id
LIMIT @max_rows
FOR UPDATE SKIP LOCKED;

-- name: InboxCompleteMany :exec
-- InboxCompleteMany records the outcome of one handling attempt for each
-- claimed message: status processed, dead, or pending again with a retry
-- delay. It counts the attempt.
UPDATE inbox
SET status          = u.status,
    attempts        = inbox.attempts + 1,
    result          = nullif(u.result, ''),
    last_error      = nullif(u.last_error, ''),
    processed_at    = CASE WHEN u.status = 'pending' THEN NULL ELSE now() END,
    next_attempt_at = CASE WHEN u.status = 'pending'
                           THEN now() + u.retry_delay_ms * interval '1 millisecond'
                           ELSE inbox.next_attempt_at END
FROM (
    SELECT unnest(@ids::bigint[])            AS id,
           unnest(@statuses::text[])         AS status,
           unnest(@results::text[])          AS result,
           unnest(@last_errors::text[])      AS last_error,
           unnest(@retry_delays_ms::bigint[]) AS retry_delay_ms
) AS u
WHERE inbox.id = u.id;
