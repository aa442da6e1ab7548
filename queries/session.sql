-- Named after what it works on, the database session (its schema, LISTEN, lock_timeout), not a table.

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

-- name: SessionSetLockTimeout :one
-- SessionSetLockTimeout sets lock_timeout for the rest of the transaction
-- (or until a rollback to an earlier savepoint) and returns the value it
-- had, to set back.
SELECT current_setting('lock_timeout')::text AS previous,
       set_config('lock_timeout', @lock_timeout::text, true)::text AS lock_timeout;
