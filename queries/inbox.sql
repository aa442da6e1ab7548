-- name: InboxInsertMany :many
-- InboxInsertMany stores a batch of messages in arrival order, skipping every
-- message whose message_id the key ledger (inbox_keys) remembers, or that is
-- already in the inbox (or earlier in the batch), and returns the message
-- ids it inserted (the rows with neither another_user nor a request_id, see
-- below). The ledger knows the ids stored within the dedupe
-- window, also those whose rows left; asked here for the whole batch, it
-- tells the trigger that refuses remembered ids to other writers
-- (inbox_keys_known) not to ask again. The unique index on message_id makes
-- two deliveries of one new id stored at once meet, and knows the ids
-- stored before the ledger started. The ids it does not return were
-- duplicates. The rows take their ids in the order of the arrays: ingest
-- passes them in the order the broker delivered them, and the workers
-- handle each order's messages in id order. An empty traceparent or
-- tracestate is stored as NULL (no trace context); when the arrays are left
-- out, every row has none. An empty user_id is stored as NULL.
--
-- Each delivery with a reply_to, new or duplicate, is stored as a reply
-- request in the same statement, except a redelivery (the broker's, after a
-- lost ack) of a request stored before: same message, reply_to and
-- correlation_id; and except a copy whose user_id is not the one the
-- message's first delivery carried, when that one carried any (the stored
-- row's, or the batch's first with the id): such a request is returned,
-- with another_user set, and never answered. An empty correlation_id is
-- stored as NULL. Each request stored is returned too, as a row with its
-- request_id (0 in the other rows), for the caller to answer in the same
-- transaction (InboxReplyAnswer): its message may have ended already.
WITH m AS (
    SELECT *
    FROM ROWS FROM (unnest(@message_ids::text[]), unnest(@message_types::text[]), unnest(@routing_keys::text[]),
                   unnest(@payloads::bytea[]), unnest(@order_keys::text[]),
                   unnest(@traceparents::text[]), unnest(@tracestates::text[]),
                   unnest(@reply_tos::text[]), unnest(@correlation_ids::text[]), unnest(@redelivered::boolean[]),
                   unnest(@user_ids::text[]))
         WITH ORDINALITY AS m (message_id, message_type, routing_key, payload, order_key, traceparent, tracestate,
                               reply_to, correlation_id, redelivered, user_id, n)
), batch_firsts AS (
    -- The user_id of each asked-about message's first delivery in the
    -- batch; only the messages a delivery asks a reply for are sorted.
    SELECT DISTINCT ON (f.message_id) f.message_id, nullif(f.user_id, '') AS user_id
    FROM m f
    WHERE f.message_id IN (SELECT q.message_id FROM m q WHERE coalesce(q.reply_to, '') <> '')
    ORDER BY f.message_id, f.n
), asking AS (
    SELECT m.message_id, m.reply_to, m.correlation_id, m.redelivered, m.user_id, m.n,
           CASE WHEN s.message_id IS NOT NULL THEN s.user_id ELSE bf.user_id END AS first_user
    FROM m
    JOIN batch_firsts bf ON bf.message_id = m.message_id
    -- The stored message, one probe of its unique index per delivery
    -- (OFFSET 0: a join could read the inbox whole).
    LEFT JOIN LATERAL (SELECT s.message_id, s.user_id FROM inbox s
                       WHERE s.message_id = m.message_id OFFSET 0) AS s ON true
    WHERE coalesce(m.reply_to, '') <> ''
), requests AS (
    INSERT INTO inbox_reply_requests (message_id, reply_to, correlation_id)
    SELECT a.message_id, a.reply_to, nullif(a.correlation_id, '')
    FROM asking a
    WHERE (a.first_user IS NULL OR a.first_user = nullif(a.user_id, ''))
      AND NOT (coalesce(a.redelivered, false) AND EXISTS (
          SELECT 1 FROM inbox_reply_requests r
          WHERE r.message_id = a.message_id
            AND r.reply_to = a.reply_to
            AND r.correlation_id IS NOT DISTINCT FROM nullif(a.correlation_id, '')
      ))
    ORDER BY a.n
    RETURNING id, message_id
), stored AS (
    INSERT INTO inbox (message_id, message_type, routing_key, payload, order_key, traceparent, tracestate, user_id)
    SELECT m.message_id, m.message_type, m.routing_key, m.payload, nullif(m.order_key, ''),
           nullif(m.traceparent, ''), nullif(m.tracestate, ''), nullif(m.user_id, '')
    FROM m
    WHERE NOT EXISTS (SELECT 1 FROM inbox_keys k WHERE k.message_id = m.message_id)
      -- Asked here for the batch: inbox_keys_known need not ask again for this
      -- statement (named by its start; a later one in the same transaction is
      -- asked again).
      AND (SELECT set_config('inboxd.keys_checked', statement_timestamp()::text, true)) IS NOT NULL
    ORDER BY m.n
    ON CONFLICT (message_id) DO NOTHING
    RETURNING message_id
), woken AS (
    -- Wakes the workers of every inboxd process (LISTEN inbox_pending) at
    -- commit when the batch stored any message; the payload is the schema,
    -- so that a process ignores wake-ups meant for another schema.
    SELECT pg_notify('inbox_pending', current_schema()) FROM (SELECT 1 FROM stored LIMIT 1) AS any_stored
)
SELECT stored.message_id, false AS another_user, 0::bigint AS request_id FROM stored, (SELECT count(*) FROM woken) AS w
UNION ALL
SELECT a.message_id, true, 0 FROM asking a
WHERE a.first_user IS NOT NULL AND a.first_user IS DISTINCT FROM nullif(a.user_id, '')
UNION ALL
SELECT requests.message_id, false, requests.id FROM requests;

-- name: InboxReplyAnswer :one
-- InboxReplyAnswer queues, in the calling transaction, the reply of each
-- request of request_ids that has one due, records the answer, and returns
-- how many replies it queued. A request is due
--   - when its message has ended (processed or dead) and the request was
--     not answered with this run's result yet: the reply carries the
--     result, its idempotency key is 'reply:<request id>:<run>' (the run is
--     inbox.replay_count, so a replay that ends answers again);
--   - when it was never answered and its message's row has left (past
--     INBOX_RETENTION) while the key ledger still remembers the id: the copy
--     is a duplicate, so nothing runs again, and the result is not kept.
--     The reply says so, as run 0 ('reply:<request id>:0'), rather than
--     leave the requester waiting for an answer that will not come.
-- A reply is an outbox row with reply_to set and no order_key (it holds
-- back no event and none holds it back); its key is the same however often
-- it is queued, so a requester can drop a copy. It is the one statement
-- that answers requests: ingest runs it in the transaction that stores
-- them (InboxInsertMany returns their ids), the worker in the transaction
-- that ends their messages (for the requests InboxLockClaimed found), and
-- the workers' sweep for those left over (InboxReplyLeft).
--
-- A request another session holds is skipped, never waited for: the
-- handler's transaction must not wait on someone else's lock; the sweep
-- answers it once free. The requests are named by their keys, which the
-- planner estimates right on tables nobody analyzes (a message id list is
-- taken for a share of the table): a plan made for any request_ids reads
-- each table by index, as one made for the given ones does. When it queued
-- any reply it wakes the relays at commit, as OutboxInsertMany does.
WITH due AS (
    SELECT r.id, r.message_id, r.reply_to, coalesce(r.correlation_id, r.message_id) AS correlation_id,
           coalesce(i.replay_count, 0) AS run, i.traceparent, i.tracestate,
           CASE WHEN i.id IS NULL
                THEN jsonb_build_object('messageId', r.message_id, 'status', 'unknown', 'run', 0, 'outcome', 'forgotten',
                                        'error', 'the message was stored before and has ended; its result is no longer kept (INBOX_RETENTION)')
                ELSE CASE WHEN i.status = 'dead'
                          THEN jsonb_build_object('outcome', 'dead', 'error', i.last_error)
                          ELSE coalesce(i.reply, jsonb_build_object('outcome', 'processed', 'result', i.result))
                     END || jsonb_build_object('messageId', i.message_id, 'orderId', i.order_key,
                                               'status', i.status, 'run', i.replay_count)
           END AS body
    FROM inbox_reply_requests r
    LEFT JOIN inbox i ON i.message_id = r.message_id
    WHERE r.id = ANY(@request_ids::bigint[])
      AND CASE WHEN i.id IS NULL
               THEN r.answered_run IS NULL
                    AND EXISTS (SELECT 1 FROM inbox_keys k WHERE k.message_id = r.message_id)
               ELSE i.status IN ('processed', 'dead') AND r.answered_run IS DISTINCT FROM i.replay_count
          END
    ORDER BY r.id
    FOR UPDATE OF r SKIP LOCKED
), answered AS (
    UPDATE inbox_reply_requests r
    SET answered_run = due.run, answered_at = statement_timestamp()
    FROM due
    WHERE r.id = due.id
), queued AS (
    INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, reply_to, correlation_id, traceparent, tracestate)
    SELECT 'reply:' || due.id || ':' || due.run, 'reply', due.body, due.message_id, due.reply_to, due.correlation_id,
           due.traceparent, due.tracestate
    FROM due
    ORDER BY due.id
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING 1
), woken AS (
    -- Wakes the relays (LISTEN outbox_pending) at commit; the payload is
    -- the schema, so that a process ignores wake-ups meant for another.
    SELECT pg_notify('outbox_pending', current_schema()) FROM (SELECT 1 FROM queued LIMIT 1) AS any_queued
)
SELECT count(*)::integer AS queued FROM queued, (SELECT count(*) FROM woken) AS w;

-- name: InboxReplyLeft :one
-- InboxReplyLeft finds the requests whose message was handled but that
-- were never answered, for the workers' sweep to answer (InboxReplyAnswer):
-- a request stored while its message was being handled (after
-- InboxLockClaimed looked, and before the handler's transaction committed)
-- is answered neither by that transaction nor by the one that stored it,
-- which saw the message pending; one another session held when its message
-- ended was skipped. It looks at up to max_scan unanswered requests after
-- after_id, in id order (most of them wait for their message: the caller
-- goes on from last_id at its next pass, and from the start once a pass
-- scanned fewer than max_scan), and takes no lock.
WITH scanned AS (
    SELECT r.id, r.message_id
    FROM inbox_reply_requests r
    WHERE r.answered_run IS NULL
      AND r.id > sqlc.arg(after_id)::bigint
    ORDER BY r.id
    LIMIT sqlc.arg(max_scan)
)
SELECT array(SELECT s.id FROM scanned s
             -- One probe of the message's unique index per request
             -- (OFFSET 0: a join could read the inbox whole).
             CROSS JOIN LATERAL (SELECT i.status FROM inbox i
                                 WHERE i.message_id = s.message_id OFFSET 0) AS i
             WHERE i.status IN ('processed', 'dead') ORDER BY s.id)::bigint[] AS due_ids,
       coalesce((SELECT max(id) FROM scanned), 0)::bigint AS last_id,
       (SELECT count(*) FROM scanned)::integer AS scanned;

-- name: InboxClaimBatch :many
-- InboxClaimBatch claims up to max_rows due pending messages that no worker
-- has claimed, oldest first, and counts an attempt for each. It runs on its
-- own and commits at once, so the attempt is counted even if the handler then
-- kills the process: that is what bounds a crash loop. The caller then locks
-- the rows with InboxLockClaimed.
--
-- A message is claimed only when no earlier message with its order_key is
-- still open (pending, claimed, waiting for a retry, or dead): the messages
-- of one order are handled one at a time, in arrival order, while different
-- orders proceed in parallel.
--
-- session is the key of the liveness lock the claiming process holds (see
-- InboxHoldLiveness), or 0 when it holds none. A message is due once its
-- next_attempt_at has passed, measured against now, or now() when NULL (a
-- test sets it forward rather than wait out a retry delay).
--
-- The scan starts at the claim floor (internal/claimfloor keeps it): under it
-- every message has ended, and an old snapshot would leave the index full
-- of their entries.
UPDATE inbox
SET attempts = inbox.attempts + 1,
    claimed_at = now(),
    claimed_by = sqlc.arg(process)::text,
    claimed_build = sqlc.arg(build)::text,
    claimed_session = nullif(sqlc.arg(session)::bigint, 0)
WHERE inbox.id IN (
    SELECT i.id
    FROM inbox i
    WHERE i.status = 'pending'
      AND i.id >= inbox_claim_floor()
      AND i.next_attempt_at <= coalesce(sqlc.narg('now')::timestamptz, now())
      AND i.claimed_at IS NULL
      AND (i.order_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM inbox e
          WHERE e.order_key = i.order_key
            AND e.id < i.id
            AND e.status <> 'processed'
      ))
    ORDER BY i.id
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE SKIP LOCKED
)
RETURNING inbox.id, inbox.claimed_at::timestamptz AS claimed_at;

-- name: InboxClaimUnfinished :many
-- InboxClaimUnfinished claims up to max_rows of the oldest messages whose
-- last claim never recorded an outcome (the process died, or lost its
-- transaction, while handling them), counts an attempt for each, and writes
-- the lost attempt to inbox_attempts as abandoned. A claim is taken over
-- once no session holds its process's liveness lock (the process died), or,
-- for a claim without one, once it is older than lease_seconds: until then
-- its worker may be about to lock the row (the lease, and the retry delay,
-- are measured against now, or now() when NULL: a test sets it forward). A
-- row that a worker has
-- locked is skipped. As in InboxClaimBatch, a message waits while an earlier message
-- of its order is open.
--
-- With first_loss_only, it claims only messages that lost no claim before
-- in their run (no abandoned attempt since the last replay). Most lost
-- claims are those of a replica stopped from outside (a deploy, a lost
-- node, an OOM kill): the worker takes those over a batch at a time. A
-- message that loses its claim again may be the one that kills its
-- process, and is taken over alone.
--
-- A claim made before the database server started (it was stopped or
-- restarted since: pg_postmaster_start_time) was lost to the database, not
-- to its message: it is taken over with the attempt it counted, given
-- back as the attempt of the new claim, and with no abandoned attempt.
-- (A crash that restarts only the server's processes keeps its start time:
-- a message whose handling crashes the server still counts its attempts.)
WITH target AS (
    SELECT i.id, i.message_id, i.attempts, i.replay_count, i.claimed_at, i.claimed_by, i.claimed_build,
           i.claimed_at < pg_postmaster_start_time() AS lost_to_restart
    FROM inbox i
    WHERE i.status = 'pending'
      AND i.id >= inbox_claim_floor()
      AND i.next_attempt_at <= coalesce(sqlc.narg('now')::timestamptz, now())
      AND i.claimed_at IS NOT NULL
      -- A live claim is never taken over: the lease covers only claims
      -- whose liveness is unknown (no session key), and the caller's own
      -- claims, which it is not handling if it has not locked them by then
      -- (its batch failed); the rows its batches hold locked are skipped.
      AND CASE WHEN i.claimed_session IS NULL OR i.claimed_session = nullif(sqlc.arg(session)::bigint, 0)
               THEN i.claimed_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(lease_seconds)::float8)
               ELSE i.claimed_session NOT IN (SELECT inbox_live_sessions()) END
      -- A probe of the attempts' primary key per row (OFFSET 0 keeps the
      -- planner from making it a join that reads every attempt).
      AND (NOT sqlc.arg(first_loss_only)::boolean OR NOT EXISTS (
          SELECT 1 FROM inbox_attempts a
          WHERE a.inbox_id = i.id AND a.run = i.replay_count AND a.outcome = 'abandoned'
          OFFSET 0
      ))
      AND (i.order_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM inbox e
          WHERE e.order_key = i.order_key
            AND e.id < i.id
            AND e.status <> 'processed'
      ))
    ORDER BY i.id
    LIMIT sqlc.arg(max_rows)
    FOR UPDATE OF i SKIP LOCKED
), claimed AS (
    UPDATE inbox
    SET attempts = inbox.attempts + CASE WHEN target.lost_to_restart THEN 0 ELSE 1 END,
        claimed_at = now(),
        claimed_by = sqlc.arg(process)::text,
        claimed_build = sqlc.arg(build)::text,
        claimed_session = nullif(sqlc.arg(session)::bigint, 0)
    FROM target
    WHERE inbox.id = target.id
    RETURNING inbox.id, inbox.claimed_at
), abandoned AS (
    INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, error, process, build, started_at)
    SELECT id, replay_count, attempts, message_id, 'abandoned',
           'the attempt never finished: its process died or stopped, or lost its database connection, while handling the message',
           coalesce(claimed_by, 'unknown'), coalesce(claimed_build, 'unknown'), claimed_at
    FROM target
    WHERE NOT target.lost_to_restart
    ON CONFLICT DO NOTHING
)
SELECT id, claimed_at::timestamptz AS claimed_at FROM claimed;

-- name: InboxGiveBack :many
-- InboxGiveBack ends claims whose work transaction was lost to the
-- database (its connection failed, the server shut down) before it
-- recorded an outcome, or that its batch could not lock (another session
-- held the row: see InboxLockClaimed), and gives back the attempt each
-- claim counted, as a wait does: the message is due again at once, with no
-- history row, and last_error says why. A claim is named by its row and
-- its claimed_at, so one taken over meanwhile, or recorded after all (a
-- COMMIT whose answer was lost), is left alone. A row another session
-- still holds is not waited for: it returns the ids of those, still
-- claimed, for the caller to give back later.
WITH c AS (
    SELECT unnest(@ids::bigint[]) AS id, unnest(@claimed_ats::timestamptz[]) AS claimed_at,
           unnest(@reasons::text[]) AS reason
), claimed AS (
    SELECT i.id FROM inbox i JOIN c ON c.id = i.id AND c.claimed_at = i.claimed_at
    WHERE i.status = 'pending' AND i.id >= inbox_claim_floor()
), free AS (
    SELECT i.id FROM inbox i WHERE i.id IN (SELECT id FROM claimed)
    FOR UPDATE OF i SKIP LOCKED
), given AS (
    UPDATE inbox
    SET attempts        = inbox.attempts - 1,
        claimed_at      = NULL,
        claimed_by      = NULL,
        claimed_build   = NULL,
        claimed_session = NULL,
        last_error      = c.reason,
        next_attempt_at = now()
    FROM c
    WHERE inbox.id = c.id AND inbox.id IN (SELECT id FROM free)
    RETURNING inbox.id
)
SELECT id FROM claimed WHERE id NOT IN (SELECT id FROM given);

-- name: InboxLockClaimed :many
-- InboxLockClaimed locks claimed messages for the rest of the calling
-- transaction and returns them in arrival order, leaving out any that are no
-- longer pending or no longer hold this claim: a claim is named by its row
-- and its claimed_at, so a worker whose claim was taken over (its lease ran
-- out while it stalled, or its liveness session was lost) locks nothing and
-- handles nothing. A row another session holds (an operator's SELECT … FOR
-- UPDATE left open, or a claim statement looking at it for an instant) is
-- skipped rather than waited for: the batch goes on without it, and the
-- worker gives that claim back (InboxGiveBack), so the message is claimed
-- again once the row is free, its attempt not counted.
--
-- A claimed message is pending, so at the claim floor or above: with the
-- floor in its condition, a plan that reads inbox_pending_idx (the planner
-- takes it once ANALYZE has seen few pending messages) starts there, not
-- at the entries an old snapshot keeps (see InboxClaimBatch).
--
-- reply_request_ids are the message's reply requests stored by now: the
-- transaction answers them when the message ends (InboxReplyAnswer); a
-- request stored later is found by the workers' sweep (InboxReplyLeft).
SELECT i.id, i.message_id, i.message_type, i.payload, i.attempts, i.received_at, i.replay_requested,
       i.replay_count, i.claimed_at::timestamptz AS claimed_at,
       coalesce(i.traceparent, '') AS traceparent, coalesce(i.tracestate, '') AS tracestate,
       array(SELECT r.id FROM inbox_reply_requests r WHERE r.message_id = i.message_id ORDER BY r.id)::bigint[] AS reply_request_ids
FROM inbox i
JOIN (SELECT unnest(@ids::bigint[]) AS id, unnest(@claimed_ats::timestamptz[]) AS claimed_at) AS c
  ON c.id = i.id AND c.claimed_at = i.claimed_at
WHERE i.status = 'pending' AND i.id >= inbox_claim_floor()
ORDER BY i.id
FOR UPDATE OF i SKIP LOCKED;

-- name: InboxCompleteMany :exec
-- InboxCompleteMany records the outcome of one handling attempt for each
-- locked message: status processed, dead, or pending again with a retry
-- delay. It ends the claim and writes the attempt to inbox_attempts.
--
-- The status 'waiting' is not an attempt: the message could not be handled
-- for a reason outside it (a row it needs is locked by another session, the
-- batch's deadline passed before its turn). It goes back to pending after
-- its delay with the attempt the claim counted given back, and no history
-- row; last_error says why it waits.
--
-- started_ats are the messages' claimed_at, as InboxLockClaimed matched
-- them: when each attempt began.
WITH u AS (
    SELECT unnest(@ids::bigint[])              AS id,
           unnest(@statuses::text[])           AS status,
           unnest(@results::text[])            AS result,
           unnest(@last_errors::text[])        AS last_error,
           unnest(@retry_delays_ms::bigint[])  AS retry_delay_ms,
           unnest(@replies::text[])            AS reply,
           unnest(@started_ats::timestamptz[]) AS started_at
), done AS (
    UPDATE inbox
    SET status           = CASE u.status WHEN 'waiting' THEN 'pending' ELSE u.status END,
        attempts         = CASE u.status WHEN 'waiting' THEN inbox.attempts - 1 ELSE inbox.attempts END,
        claimed_at       = NULL,
        claimed_by       = NULL,
        claimed_build    = NULL,
        claimed_session  = NULL,
        -- A replay that has to wait is still a replay when it runs.
        replay_requested = u.status = 'waiting' AND inbox.replay_requested,
        result          = nullif(u.result, ''),
        last_error      = nullif(u.last_error, ''),
        -- The handler's reply, kept for the requests still to come (see
        -- inbox_reply_requests); the transaction answers those already
        -- here (InboxReplyAnswer).
        reply           = nullif(u.reply, '')::jsonb,
        -- When the outcome was recorded, after the handler ran (now() would
        -- be the start of the transaction).
        processed_at    = CASE WHEN u.status IN ('pending', 'waiting') THEN NULL ELSE statement_timestamp() END,
        -- A retry's delay runs from this outcome, not from the start of
        -- the transaction, which a long batch may have used up.
        next_attempt_at = CASE WHEN u.status IN ('pending', 'waiting')
                               THEN statement_timestamp() + u.retry_delay_ms * interval '1 millisecond'
                               ELSE inbox.next_attempt_at END
    FROM u
    WHERE inbox.id = u.id
    RETURNING inbox.id, inbox.replay_count, inbox.attempts, inbox.message_id, u.status
)
INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, error, result, process, build, started_at, finished_at)
SELECT done.id, done.replay_count, done.attempts, done.message_id,
       CASE u.status WHEN 'pending' THEN 'retry' ELSE u.status END,
       nullif(u.last_error, ''), nullif(u.result, ''),
       sqlc.arg(process)::text, sqlc.arg(build)::text, u.started_at, statement_timestamp()
FROM done
JOIN u ON u.id = done.id
WHERE done.status <> 'waiting'
-- Only a hand edit of inbox.attempts (by the schema's owner) can repeat an
-- attempt number within a run; the history then keeps the first, and the
-- handling goes on.
ON CONFLICT DO NOTHING;

-- name: InboxRecordConflicts :many
-- InboxRecordConflicts looks at deliveries whose message_id was already in
-- the inbox and records, in inbox_conflicts, each whose payload differs from
-- the stored one. It returns one row per message id and conflicting payload,
-- with the number of such deliveries in this call. Ingest runs it only for
-- the duplicates of a batch.
WITH d AS (
    SELECT unnest(@message_ids::text[])   AS message_id,
           unnest(@message_types::text[]) AS message_type,
           unnest(@payloads::bytea[])     AS payload
), c AS (
    SELECT d.message_id,
           min(d.message_type)                AS message_type,
           encode(sha256(i.payload), 'hex')   AS stored_sha256,
           encode(sha256(d.payload), 'hex')   AS conflicting_sha256,
           (array_agg(d.payload))[1]          AS conflicting_payload,
           count(*)::integer                  AS deliveries
    FROM d
    -- One probe of the message_id index per delivery, in a subquery the
    -- planner may not merge into a join (OFFSET 0): as a join, a plan made
    -- while the inbox was small hashed the deliveries and read the inbox
    -- whole, and kept, did so once it had grown.
    CROSS JOIN LATERAL (SELECT i.payload FROM inbox i WHERE i.message_id = d.message_id OFFSET 0) AS i
    WHERE i.payload <> d.payload
    GROUP BY d.message_id, i.payload, d.payload
), recorded AS (
    INSERT INTO inbox_conflicts (message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload, deliveries)
    SELECT message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload, deliveries
    FROM c
    -- In key order, so two ingest channels recording the same conflicts
    -- cannot deadlock.
    ORDER BY message_id, conflicting_sha256
    ON CONFLICT (message_id, conflicting_sha256) DO UPDATE
    SET deliveries   = inbox_conflicts.deliveries + excluded.deliveries,
        last_seen_at = now()
)
SELECT message_id::text AS message_id, stored_sha256, conflicting_sha256, deliveries FROM c;

-- name: InboxHasUnfinished :one
-- InboxHasUnfinished reports whether a message that lost a claim before in
-- its run waits to be taken over alone (see InboxClaimUnfinished), without
-- locking anything: the worker makes room for such a takeover only when
-- there is one. Another process's live claim never counts, however old: it
-- is handling it (a slow batch). The caller's own claim counts past the
-- lease: it handles such a message only alone, so none of its batches has it.
-- The lease and the retry delay are measured against now, or now() when
-- NULL.
SELECT EXISTS (
    SELECT 1 FROM inbox i
    WHERE i.status = 'pending' AND i.id >= inbox_claim_floor()
      AND i.next_attempt_at <= coalesce(sqlc.narg('now')::timestamptz, now()) AND i.claimed_at IS NOT NULL
      AND CASE WHEN i.claimed_session IS NULL OR i.claimed_session = nullif(sqlc.arg(session)::bigint, 0)
               THEN i.claimed_at < coalesce(sqlc.narg('now')::timestamptz, now()) - make_interval(secs => sqlc.arg(lease_seconds)::float8)
               ELSE i.claimed_session NOT IN (SELECT inbox_live_sessions()) END
      -- A probe of the attempts' primary key per claimed row (OFFSET 0 keeps
      -- the planner from turning it into a join): as a join, a plan made
      -- while the tables were small read every attempt for abandoned ones,
      -- and kept, did so once the history had grown.
      AND EXISTS (
          SELECT 1 FROM inbox_attempts a
          WHERE a.inbox_id = i.id AND a.run = i.replay_count AND a.outcome = 'abandoned'
          OFFSET 0
      )
)::boolean AS has_unfinished;

-- name: InboxHoldLiveness :one
-- InboxHoldLiveness takes, for the calling session, the advisory lock of a
-- session key, and registers the key with the session's pid in
-- inbox_sessions: the key is live (inbox_live_sessions) while this session
-- holds it, and no other session's hold of it counts. The worker's
-- liveness session holds the key its claims carry (see
-- InboxClaimUnfinished); PostgreSQL drops the lock when the session ends,
-- and with it the process's claims. It returns no row, registering
-- nothing, when another session holds the key (one that took it after
-- this process's last session ended): the caller then takes another key.
WITH locked AS (
    SELECT pg_try_advisory_lock(sqlc.arg(session)::bigint) AS held
)
INSERT INTO inbox_sessions (session, pid)
SELECT sqlc.arg(session)::bigint, pg_backend_pid() FROM locked WHERE held
ON CONFLICT (session) DO UPDATE SET pid = excluded.pid, login = excluded.login, started_at = now()
RETURNING true AS registered;

-- name: InboxSessionsForget :execrows
-- InboxSessionsForget deletes the registered session keys that are no
-- longer live and were registered over a minute ago (a session registering
-- again sets started_at, so a row being taken back is never deleted).
DELETE FROM inbox_sessions
WHERE started_at < now() - interval '1 minute'
  AND session NOT IN (SELECT inbox_live_sessions());
