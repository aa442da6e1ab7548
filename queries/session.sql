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

-- name: SessionLockTimeout :one
-- SessionLockTimeout returns the session's lock_timeout as it stands in
-- the transaction.
SELECT current_setting('lock_timeout')::text AS lock_timeout;

-- name: SessionSetLockTimeoutLocal :exec
-- SessionSetLockTimeoutLocal sets lock_timeout until the transaction ends,
-- or until the savepoint it is set under is rolled back.
SELECT set_config('lock_timeout', @lock_timeout::text, true);
