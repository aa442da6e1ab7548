-- name: SessionCurrentSchema :one
-- SessionCurrentSchema returns the schema that unqualified table names resolve to.
SELECT coalesce(current_schema(), '')::text AS schema;

-- name: SessionListenInboxPending :exec
-- SessionListenInboxPending subscribes the session to the inbox_pending
-- notifications sent by the inbox_notify trigger.
LISTEN inbox_pending;
