-- Named after what it works on, the database session (its schema, LISTEN), not a table.

-- name: SessionCurrentSchema :one
-- SessionCurrentSchema returns the schema that unqualified table names resolve to.
SELECT coalesce(current_schema(), '')::text AS schema;

-- name: SessionListenInboxPending :exec
-- SessionListenInboxPending subscribes the session to the inbox_pending
-- notifications sent by the statement that stores messages (InboxInsertMany).
LISTEN inbox_pending;

-- name: SessionListenOutboxPending :exec
-- SessionListenOutboxPending subscribes the session to the outbox_pending
-- notifications sent by the statements that write outbox rows
-- (OutboxInsertMany, and the replies of InboxReplyAnswer).
LISTEN outbox_pending;

-- name: SessionLockTimeoutPush :exec
-- SessionLockTimeoutPush sets lock_timeout until the transaction ends, or
-- until the savepoint it is set under is rolled back, and keeps the value
-- it replaces (in inboxd.lock_timeout_before) for SessionLockTimeoutPop:
-- so a statement sent in the same round trip, before the replaced value
-- could be read back, can set it again.
SELECT set_config('inboxd.lock_timeout_before', current_setting('lock_timeout'), true),
       set_config('lock_timeout', @lock_timeout::text, true);

-- name: SessionLockTimeoutPop :exec
-- SessionLockTimeoutPop sets lock_timeout back to the value the last
-- SessionLockTimeoutPush replaced, until the transaction ends.
SELECT set_config('lock_timeout', current_setting('inboxd.lock_timeout_before'), true);
