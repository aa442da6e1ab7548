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
