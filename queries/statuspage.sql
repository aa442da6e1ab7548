-- Named after its caller, internal/statuspage: it reads the operators' views, not one table.

-- name: StatusPageSetTimeout :exec
-- StatusPageSetTimeout sets statement_timeout for the rest of the status
-- page's read-only transaction (milliseconds, as text).
SELECT set_config('statement_timeout', sqlc.arg(timeout_ms)::text, true);

-- name: StatusPageInboxOverview :one
-- StatusPageInboxOverview reads inbox_overview, its ages in seconds.
SELECT pending,
       in_progress,
       waiting_retry,
       replays_waiting,
       dead,
       processed,
       coalesce(extract(epoch FROM oldest_pending_age), 0)::float8 AS oldest_pending_seconds,
       processed_last_minute,
       coalesce(per_second_last_5_minutes, 0)::float8               AS per_second_last_5_minutes,
       failed_attempts_last_5_minutes,
       conflicting_ids,
       last_processed_at
FROM inbox_overview;

-- name: StatusPageOutboxBacklog :one
-- StatusPageOutboxBacklog reads outbox_backlog, its oldest age in seconds.
SELECT unpublished,
       failing,
       coalesce(extract(epoch FROM oldest_age), 0)::float8 AS oldest_seconds,
       dead,
       replies_unpublished,
       replies_undeliverable
FROM outbox_backlog;

-- name: StatusPageThroughput :many
-- StatusPageThroughput returns the last 15 minutes, oldest first, one row
-- per minute even when nothing happened: the messages received (from
-- inbox.received_at) and, from inbox_throughput, the attempts processed,
-- the failed ones (retry, dead, abandoned) and those that went dead.
SELECT m.minute::timestamptz                                       AS minute,
       coalesce(r.received, 0)::bigint                             AS received,
       coalesce(t.processed, 0)::bigint                            AS processed,
       coalesce(t.retried + t.dead + t.abandoned, 0)::bigint       AS failed,
       coalesce(t.dead, 0)::bigint                                 AS dead
FROM generate_series(date_trunc('minute', now()) - interval '14 minutes',
                     date_trunc('minute', now()), interval '1 minute') AS m (minute)
LEFT JOIN inbox_throughput t ON t.minute = m.minute
LEFT JOIN (
    SELECT date_trunc('minute', received_at) AS minute, count(*) AS received
    FROM inbox
    WHERE received_at >= date_trunc('minute', now()) - interval '14 minutes'
    GROUP BY 1
) AS r ON r.minute = m.minute
ORDER BY m.minute;

-- name: StatusPageDeadByError :many
-- StatusPageDeadByError reads inbox_dead_by_error, most messages first.
SELECT last_error, messages, message_types::text[] AS message_types,
       first_died_at, last_died_at
FROM inbox_dead_by_error
LIMIT sqlc.arg(max_rows);

-- name: StatusPageFailuresByBuild :many
-- StatusPageFailuresByBuild reads inbox_failures_by_build, latest first.
SELECT build, outcome, attempts, messages,
       first_at::timestamptz AS first_at, last_at::timestamptz AS last_at
FROM inbox_failures_by_build
LIMIT sqlc.arg(max_rows);

-- name: StatusPageDead :many
-- StatusPageDead reads the newest messages of inbox_dead.
SELECT message_id, message_type, attempts, last_error, died_at, replay_count,
       coalesce(last_build, '')::text AS last_build
FROM inbox_dead
LIMIT sqlc.arg(max_rows);

-- name: StatusPageHeldBack :many
-- StatusPageHeldBack reads inbox_held_back, the longest waiting first.
SELECT order_key, blocking_message_id, blocking_message_type, blocking_status, attempts,
       last_error, next_attempt_at, held_messages,
       oldest_held_received_at::timestamptz AS oldest_held_received_at
FROM inbox_held_back
ORDER BY oldest_held_received_at
LIMIT sqlc.arg(max_rows);

-- name: StatusPageReplays :many
-- StatusPageReplays returns the latest replays, as docs/operations.md's "who
-- replayed what" statement does.
SELECT message_id, replay_count, replayed_at, replayed_by, replay_reason, status, result
FROM inbox
WHERE replay_count > 0
ORDER BY replayed_at DESC
LIMIT sqlc.arg(max_rows);

-- name: StatusPageConflicts :many
-- StatusPageConflicts returns the latest conflicting ids of inbox_conflicts,
-- without their payloads.
SELECT message_id, message_type, deliveries, first_seen_at, last_seen_at
FROM inbox_conflicts
ORDER BY last_seen_at DESC
LIMIT sqlc.arg(max_rows);

-- name: StatusPageMessage :one
-- StatusPageMessage returns one inbox row without its payload (only its size).
SELECT id, message_id, message_type, routing_key, status, attempts, last_error, result,
       received_at, next_attempt_at, claimed_at, claimed_by, claimed_build, processed_at,
       replay_requested, replay_count, replayed_at, replayed_by, replay_reason, order_key,
       length(payload)::bigint AS payload_bytes
FROM inbox
WHERE message_id = sqlc.arg(message_id);

-- name: StatusPageMessageAttempts :many
-- StatusPageMessageAttempts returns a message's attempts from inbox_attempts
-- in the order they were made.
SELECT run, attempt, outcome, error, result, process, build, started_at, finished_at
FROM inbox_attempts
WHERE inbox_id = sqlc.arg(inbox_id)
ORDER BY run, attempt;

-- name: StatusPageLockHolders :many
-- StatusPageLockHolders reads inbox_lock_holders, the longest open first.
SELECT pid::integer AS pid, coalesce(usename, '')::text AS usename, coalesce(application_name, '')::text AS application_name,
       coalesce(client_addr, '')::text AS client_addr, coalesce(state, '')::text AS state,
       xact_start::timestamptz AS xact_start, coalesce(extract(epoch FROM open_for), 0)::float8 AS open_seconds,
       tables::text[] AS tables, end_sql::text AS end_sql
FROM inbox_lock_holders
ORDER BY xact_start
LIMIT sqlc.arg(max_rows);
