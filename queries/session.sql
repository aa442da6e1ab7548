-- Named after what it works on, the database session (its schema, LISTEN), not a table.

-- name: SessionCurrentSchema :one
-- SessionCurrentSchema returns the schema that unqualified table names resolve to.
SELECT coalesce(current_schema(), '')::text AS schema;

-- name: SessionListenInboxPending :exec
-- SessionListenInboxPending subscribes the session to the inbox_pending
-- notifications sent by the inbox_notify trigger.
LISTEN inbox_pending;

-- name: SessionListenOutboxPending :exec
-- SessionListenOutboxPending subscribes the session to the outbox_pending
-- notifications sent by the outbox_notify trigger.
LISTEN outbox_pending;
