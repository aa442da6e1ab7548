-- The claim floors' keeper (internal/claimfloor, which has the argument for
-- why each raise is safe). tbl is 'inbox' or 'outbox', seq its floor's
-- sequence; the scans, which differ by what an open row is, are each
-- table's own.

-- name: ClaimFloorState :one
-- ClaimFloorState returns the floor kept in seq and the last id tbl's id
-- sequence handed out (0 for none).
SELECT coalesce(pg_sequence_last_value(sqlc.arg(seq)::text::regclass), 0)::bigint AS floor,
       coalesce(pg_sequence_last_value(pg_get_serial_sequence(sqlc.arg(tbl)::text, 'id')::regclass), 0)::bigint AS last_id;

-- name: ClaimFloorWriters :one
-- ClaimFloorWriters returns the transactions (virtual ids) that write tbl
-- now: those holding its ROW EXCLUSIVE lock in this database.
SELECT coalesce(array_agg(l.virtualtransaction), '{}')::text[] AS writers
FROM pg_catalog.pg_locks l
WHERE l.locktype = 'relation' AND l.relation = sqlc.arg(tbl)::text::regclass
  AND l.mode = 'RowExclusiveLock' AND l.granted
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database());

-- name: ClaimFloorTake :one
-- ClaimFloorTake takes the floor lock of tbl, held until the transaction
-- ends, once none of the noted writers still writes it, and says whether
-- it did: false while one of them runs, or while a replay or another
-- keeper holds the lock (it does not wait).
SELECT CASE WHEN EXISTS (
           SELECT 1 FROM pg_catalog.pg_locks l
           WHERE l.locktype = 'relation' AND l.relation = sqlc.arg(tbl)::text::regclass
             AND l.mode = 'RowExclusiveLock' AND l.granted
             AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
             AND l.virtualtransaction = ANY(sqlc.arg(noted_writers)::text[]))
       THEN false
       ELSE claim_floor_lock(sqlc.arg(tbl)::text::regclass, true)
       END::boolean AS taken;

-- name: ClaimFloorLockWait :exec
-- ClaimFloorLockWait takes the floor lock of tbl, held until the transaction
-- ends, waiting for it.
SELECT claim_floor_lock(sqlc.arg(tbl)::text::regclass, false);

-- name: ClaimFloorLower :exec
-- ClaimFloorLower lowers the floor of tbl to id, if it is above.
SELECT claim_floor_lower(sqlc.arg(tbl)::text, sqlc.arg(id)::bigint);

-- name: InboxClaimFloorRaise :one
-- InboxClaimFloorRaise sets the inbox's floor to the oldest pending
-- message from from_id to noted_last, or past noted_last when there is
-- none, and returns it.
SELECT setval('inbox_claim_floor_seq', coalesce(min(id), sqlc.arg(noted_last)::bigint + 1), true)::bigint AS floor
FROM inbox
WHERE status = 'pending' AND id >= sqlc.arg(from_id)::bigint AND id <= sqlc.arg(noted_last)::bigint;

-- name: OutboxClaimFloorRaise :one
-- OutboxClaimFloorRaise does for the outbox what InboxClaimFloorRaise does
-- for the inbox: its open rows are those neither published nor dead.
SELECT setval('outbox_claim_floor_seq', coalesce(min(id), sqlc.arg(noted_last)::bigint + 1), true)::bigint AS floor
FROM outbox
WHERE published_at IS NULL AND dead_at IS NULL AND id >= sqlc.arg(from_id)::bigint AND id <= sqlc.arg(noted_last)::bigint;

-- name: InboxClaimFloorStranded :one
-- InboxClaimFloorStranded returns the oldest pending message under floor,
-- or 0 for none.
SELECT coalesce(min(id), 0)::bigint AS stranded
FROM inbox
WHERE status = 'pending' AND id < sqlc.arg(floor)::bigint;

-- name: OutboxClaimFloorStranded :one
-- OutboxClaimFloorStranded returns the oldest outbox row neither published
-- nor dead under floor, or 0 for none.
SELECT coalesce(min(id), 0)::bigint AS stranded
FROM outbox
WHERE published_at IS NULL AND dead_at IS NULL AND id < sqlc.arg(floor)::bigint;

-- name: InboxClaimFloorStillStranded :one
-- InboxClaimFloorStillStranded says whether message id is pending and
-- under the inbox's floor.
SELECT (EXISTS (SELECT 1 FROM inbox WHERE id = sqlc.arg(id)::bigint AND status = 'pending')
        AND sqlc.arg(id)::bigint < inbox_claim_floor())::boolean AS still;

-- name: OutboxClaimFloorStillStranded :one
-- OutboxClaimFloorStillStranded says whether outbox row id is neither
-- published nor dead, and under the outbox's floor.
SELECT (EXISTS (SELECT 1 FROM outbox WHERE id = sqlc.arg(id)::bigint AND published_at IS NULL AND dead_at IS NULL)
        AND sqlc.arg(id)::bigint < outbox_claim_floor())::boolean AS still;
