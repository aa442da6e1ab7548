-- +goose Up

-- The operators' views. They are part of the contract: operators (role
-- inbox_operator) query them with plain SQL, and the service reads some for
-- its status page and metrics. Each comment says what a row is and when to
-- look at it. Start with inbox_overview and outbox_backlog.
--
--   inbox_overview           one row: how is the inbox doing?
--   inbox_dead               the messages that will not be retried
--   inbox_dead_by_error      why do messages die?
--   inbox_failures_by_build  is a build failing messages?
--   inbox_throughput         how fast is it going, minute by minute?
--   inbox_held_back          which orders wait behind a failing message?
--   inbox_lock_holders       which sessions hold rows the service needs?
--   inbox_replies            did every requester get its reply?
--   inbox_key_ledger         the dedupe ledger's generations
--   outbox_backlog           one row: is the relay keeping up?
--   outbox_dead              the effects that will not be published
--   stock_overview           per SKU: level and open reservations

-- inbox_overview answers "how is the inbox doing?" in one row: the pending
-- messages (in_progress: claimed by a worker; waiting_retry: failed and
-- waiting for their next attempt; replays_waiting: replays not taken yet),
-- the dead and processed ones, the age of the oldest pending, and the pace
-- (per_second_last_5_minutes: processed in the last 5 minutes / 300).
-- conflicting_ids counts the message ids that arrived again with another
-- payload (inbox_conflicts). Look here first. Every count but processed
-- reads a partial index of open rows; processed reads the index of
-- processed rows.
CREATE VIEW inbox_overview AS
SELECT
    (SELECT count(*) FROM inbox WHERE status = 'pending') AS pending,
    (SELECT count(*) FROM inbox
     WHERE status = 'pending' AND claimed_at IS NOT NULL) AS in_progress,
    (SELECT count(*) FROM inbox
     WHERE status = 'pending' AND claimed_at IS NULL AND last_error IS NOT NULL) AS waiting_retry,
    (SELECT count(*) FROM inbox
     WHERE status = 'pending' AND replay_requested) AS replays_waiting,
    (SELECT count(*) FROM inbox WHERE status = 'dead') AS dead,
    (SELECT count(*) FROM inbox WHERE status = 'processed') AS processed,
    (SELECT now() - min(received_at) FROM inbox
     WHERE status = 'pending') AS oldest_pending_age,
    (SELECT count(*) FROM inbox
     WHERE status = 'processed' AND processed_at > now() - interval '1 minute') AS processed_last_minute,
    (SELECT round(count(*) / 300.0, 1) FROM inbox
     WHERE status = 'processed' AND processed_at > now() - interval '5 minutes') AS per_second_last_5_minutes,
    (SELECT count(*) FROM inbox_attempts
     WHERE outcome <> 'processed' AND finished_at > now() - interval '5 minutes') AS failed_attempts_last_5_minutes,
    (SELECT count(*) FROM inbox_conflicts) AS conflicting_ids,
    (SELECT max(processed_at) FROM inbox WHERE status = 'processed') AS last_processed_at;

-- inbox_dead: one row per message that will not be retried, newest first,
-- with why (last_error), how often it was replayed, and which process and
-- build made its last attempt. Look here when inbox_overview.dead grows.
-- Replay one, once its cause is fixed:
--   UPDATE inbox SET replay_requested = true, replay_reason = 'fixed in Y'
--   WHERE id = 42;
CREATE VIEW inbox_dead AS
SELECT i.id,
       i.message_id,
       i.message_type,
       i.attempts,
       i.last_error,
       i.received_at,
       i.processed_at    AS died_at,
       i.replay_requested,
       length(i.payload) AS payload_bytes,
       i.replay_count,
       last.process      AS last_process,
       last.build        AS last_build
FROM inbox i
LEFT JOIN LATERAL (
    SELECT a.process, a.build
    FROM inbox_attempts a
    WHERE a.inbox_id = i.id
    ORDER BY a.run DESC, a.attempt DESC
    LIMIT 1
) AS last ON true
WHERE i.status = 'dead'
ORDER BY i.id DESC;

-- inbox_dead_by_error answers "why do messages die?": one row per error of
-- the dead messages, most frequent first, with their types and when the
-- first and the last died. Look here when many messages die at once.
CREATE VIEW inbox_dead_by_error AS
SELECT last_error,
       count(*)                         AS messages,
       array_agg(DISTINCT message_type) AS message_types,
       min(processed_at)                AS first_died_at,
       max(processed_at)                AS last_died_at
FROM inbox
WHERE status = 'dead'
GROUP BY last_error
ORDER BY count(*) DESC;

-- inbox_failures_by_build answers "is a build failing messages?": one row
-- per build and outcome (retry, dead, abandoned) of the failed attempts of
-- the last 24 hours, latest first. Look here after a deployment.
CREATE VIEW inbox_failures_by_build AS
SELECT build,
       outcome,
       count(*)                 AS attempts,
       count(DISTINCT inbox_id) AS messages,
       min(finished_at)         AS first_at,
       max(finished_at)         AS last_at
FROM inbox_attempts
WHERE outcome <> 'processed'
  AND finished_at > now() - interval '24 hours'
GROUP BY build, outcome
ORDER BY max(finished_at) DESC;

-- inbox_throughput answers "how fast is it going?": one row per minute of
-- the last 15 (the current one included), newest first, with its attempts
-- by outcome.
CREATE VIEW inbox_throughput AS
SELECT date_trunc('minute', finished_at)             AS minute,
       count(*) FILTER (WHERE outcome = 'processed') AS processed,
       count(*) FILTER (WHERE outcome = 'retry')     AS retried,
       count(*) FILTER (WHERE outcome = 'dead')      AS dead,
       count(*) FILTER (WHERE outcome = 'abandoned') AS abandoned
FROM inbox_attempts
WHERE finished_at > date_trunc('minute', now()) - interval '14 minutes'
GROUP BY 1
ORDER BY 1 DESC;

-- inbox_held_back: one row per order whose later messages wait behind an
-- earlier one that is dead or waiting for a retry, with that blocking
-- message, how many messages it holds back and since when. Look here when
-- pending grows while workers are idle. Release an order by replaying the
-- blocking message or by skipping it (see docs/operations.md).
CREATE VIEW inbox_held_back AS
SELECT h.order_key,
       h.id           AS blocking_id,
       h.message_id   AS blocking_message_id,
       h.message_type AS blocking_message_type,
       h.status       AS blocking_status,
       h.attempts,
       h.last_error,
       h.next_attempt_at,
       held.messages  AS held_messages,
       held.oldest    AS oldest_held_received_at
FROM inbox h
CROSS JOIN LATERAL (
    SELECT count(*) AS messages, min(w.received_at) AS oldest
    FROM inbox w
    WHERE w.order_key = h.order_key AND w.id > h.id AND w.status = 'pending'
) AS held
WHERE h.order_key IS NOT NULL
  AND h.status <> 'processed'
  AND (h.status = 'dead' OR h.last_error IS NOT NULL)
  AND held.messages > 0
  AND NOT EXISTS (
      SELECT 1 FROM inbox e
      WHERE e.order_key = h.order_key AND e.id < h.id AND e.status <> 'processed'
  );

-- inbox_lock_holders: one row per session whose transaction has been open
-- for over 5 seconds while it holds a lock that keeps rows of any of the
-- service's tables from others (a SELECT ... FOR UPDATE or an UPDATE left open in psql,
-- say). Such a session holds back the messages that need those rows (they
-- wait, with the reason in last_error) and, through the ordering gate, the
-- later messages of their orders. It says who (user, application, address),
-- since when, on which tables, and the statement that ends the session
-- (end_sql). Look here when messages wait on a lock. inboxd's own
-- transactions are short; a relay's waits for the broker's confirms in its
-- transaction (application_name "inboxd relay ...") and shows here only
-- while the broker is slow to confirm.
CREATE VIEW inbox_lock_holders AS
SELECT a.pid,
       a.usename::text                                              AS usename,
       a.application_name,
       host(a.client_addr)                                          AS client_addr,
       a.state,
       a.xact_start,
       now() - a.xact_start                                         AS open_for,
       array_agg(DISTINCT c.relname::text ORDER BY c.relname::text) AS tables,
       format('SELECT pg_terminate_backend(%s);', a.pid)            AS end_sql
FROM pg_catalog.pg_locks l
JOIN pg_catalog.pg_class c ON c.oid = l.relation
JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation'
  AND l.granted
  AND l.mode <> 'AccessShareLock'
  -- Every table of the service's schema (the one inbox is in), the key
  -- ledger's partitions included.
  AND c.relnamespace = (SELECT s.relnamespace FROM pg_catalog.pg_class s WHERE s.oid = 'inbox'::regclass)
  AND c.relkind IN ('r', 'p')
  AND a.pid <> pg_backend_pid()
  AND a.xact_start < now() - interval '5 seconds'
GROUP BY a.pid, a.usename, a.application_name, a.client_addr, a.state, a.xact_start;

-- inbox_replies answers "did every requester get its reply?": one row per
-- delivery that asked for a reply (inbox_reply_requests), with its
-- message's status and its reply's fate (state):
--   waiting for the message  the message is not handled yet
--   sending                  the reply is queued in the outbox
--   sent                     published (published_at)
--   undeliverable            the broker returned it: the requester is gone
--   cleaned up               the reply's outbox row was deleted by the janitor
-- reply_id is the reply's id, 'reply:<request id>:<run>'.
CREATE VIEW inbox_replies AS
SELECT r.id,
       r.message_id,
       r.reply_to,
       r.correlation_id,
       r.received_at,
       r.answered_run,
       r.answered_at,
       i.status          AS message_status,
       o.idempotency_key AS reply_id,
       CASE WHEN r.answered_run IS NULL THEN 'waiting for the message'
            WHEN o.id IS NULL THEN 'cleaned up'
            WHEN o.published_at IS NOT NULL THEN 'sent'
            WHEN o.dead_at IS NOT NULL THEN 'undeliverable'
            ELSE 'sending'
       END               AS state,
       o.published_at,
       o.dead_at,
       o.last_error
FROM inbox_reply_requests r
LEFT JOIN inbox i ON i.message_id = r.message_id
LEFT JOIN outbox o ON o.idempotency_key = 'reply:' || r.id || ':' || r.answered_run;

-- inbox_key_ledger: one row per generation of the dedupe ledger still held
-- (the last 8), newest first, with its slot, when it opened and closed, and
-- how many keys it holds. The count includes the generation's keys still in
-- a hot part, and counts once those a merge has copied so far into the
-- slot. Counted, not estimated: slow on a large ledger.
CREATE VIEW inbox_key_ledger AS
SELECT g.generation,
       g.slot,
       g.opened_at,
       g.closed_at,
       (SELECT count(*) FROM inbox_keys k WHERE k.slot = g.slot)
       + (SELECT count(*)
          FROM inbox_key_hot_parts h
          JOIN inbox_keys k ON k.slot = h.part
          WHERE h.slot = g.slot
            AND (h.state = 'writing'
                 OR h.state = 'sealed'
                    AND (h.merge_mask IS NULL
                         OR (hashtext(k.message_id) & h.merge_mask) >= h.merged_buckets))
         ) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

-- outbox_backlog answers "is the relay keeping up?" in one row, about
-- events: unpublished counts the events not published (dead ones
-- included), failing those still retrying after an error, dead those that
-- ended dead (see outbox_dead), oldest_* the oldest unpublished event. A
-- reply whose requester is gone is no operator's alarm, so replies are
-- counted apart: replies_unpublished still to send, replies_undeliverable
-- ended dead (the janitor deletes them after the dead retention).
--
-- It reads only the rows it counts, even while a snapshot held open keeps
-- the index entries of every row ended since (reading those made a metrics
-- scrape take seconds during the very incident it was watched for):
--   - the open rows from the claim floor up: under the floor every row has
--     ended (the keeper's audit, internal/claimfloor, finds any left open
--     and lowers the floor);
--   - the dead rows, which are few, by a range on dead_at that holds for
--     each of them: a condition only outbox_dead_at_idx serves, so the
--     planner takes it even without statistics.
CREATE VIEW outbox_backlog AS
WITH open AS (
    SELECT count(*) FILTER (WHERE reply_to IS NULL)                            AS events,
           count(*) FILTER (WHERE reply_to IS NULL AND last_error IS NOT NULL) AS failing,
           min(created_at) FILTER (WHERE reply_to IS NULL)                     AS oldest_created_at,
           count(*) FILTER (WHERE reply_to IS NOT NULL)                        AS replies
    FROM outbox
    WHERE published_at IS NULL AND dead_at IS NULL AND id >= outbox_claim_floor()
), dead AS (
    SELECT count(*) FILTER (WHERE reply_to IS NULL)        AS events,
           min(created_at) FILTER (WHERE reply_to IS NULL) AS oldest_created_at,
           count(*) FILTER (WHERE reply_to IS NOT NULL)    AS replies
    FROM outbox
    WHERE published_at IS NULL AND dead_at >= '-infinity'
)
SELECT (open.events + dead.events)::bigint                           AS unpublished,
       open.failing                                                  AS failing,
       least(open.oldest_created_at, dead.oldest_created_at)         AS oldest_created_at,
       now() - least(open.oldest_created_at, dead.oldest_created_at) AS oldest_age,
       dead.events                                                   AS dead,
       open.replies                                                  AS replies_unpublished,
       dead.replies                                                  AS replies_undeliverable
FROM open, dead;

-- outbox_dead: one row per event (not reply) that ended dead, refused for a
-- reason retrying will not change (a publish the broker nacks, properties
-- the client cannot encode, a body over the broker's size limit). It stays
-- unpublished and holds back the later events of its order: holds_back
-- counts them. Look here when outbox_backlog.dead is not 0. replay_sql is
-- the statement that replays it (put a real reason in place of 'why').
CREATE VIEW outbox_dead AS
SELECT o.id,
       o.idempotency_key,
       o.routing_key,
       o.order_key,
       o.message_id,
       o.attempts,
       o.last_error,
       o.created_at,
       o.dead_at,
       o.replay_count,
       (SELECT count(*) FROM outbox h
        WHERE h.order_key = o.order_key AND h.id > o.id AND h.published_at IS NULL) AS holds_back,
       format('UPDATE outbox SET replay_requested = true, replay_reason = %L WHERE id = %s;',
              'why', o.id)                                                          AS replay_sql
FROM outbox o
WHERE o.dead_at IS NOT NULL AND o.reply_to IS NULL;

-- stock_overview: one row per SKU, with its level (stock_levels.available),
-- the quantity its open reservations hold and how many orders hold them.
-- Look here before changing a level by hand.
CREATE VIEW stock_overview AS
SELECT l.sku,
       l.available,
       coalesce(sum(r.quantity) FILTER (WHERE r.released_at IS NULL), 0)::integer AS reserved,
       count(r.order_id) FILTER (WHERE r.released_at IS NULL)                   AS orders,
       l.updated_at
FROM stock_levels l
LEFT JOIN stock_reservations r USING (sku)
GROUP BY l.sku, l.available, l.updated_at;
