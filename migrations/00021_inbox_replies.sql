-- +goose Up

-- Replies. A delivery that carries the AMQP reply_to property asks for the
-- message's result: once the message is handled (processed or dead), one
-- reply goes to reply_to through the outbox, with the delivery's
-- correlation_id. Every delivery of the message that asks gets one, the
-- duplicates included, each with the same result; a replay that ends
-- answers every request again with the new result.
--
-- inbox_reply_requests holds one row per delivery that asked. Ingest
-- inserts it in the statement that stores the delivery, so an ack means the
-- request is stored too; the transaction that ends the message (processed
-- or dead) queues the replies of the requests it sees. answered_run is the run of the message (its
-- inbox.replay_count) whose result the request was last sent; NULL until
-- the first reply.
CREATE TABLE inbox_reply_requests (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id     text        NOT NULL,
    -- Where the reply goes: a queue name, or RabbitMQ's direct reply-to
    -- (amq.rabbitmq.reply-to.…). Published to the default exchange.
    reply_to       text        NOT NULL,
    -- The delivery's correlation_id; NULL when it had none (the reply then
    -- carries the message_id as its correlation_id).
    correlation_id text,
    received_at    timestamptz NOT NULL DEFAULT now(),
    answered_run   integer,
    answered_at    timestamptz
);

-- The answer of a message's requests, the janitor's delete with the
-- message, and ingest's check of a redelivered request.
CREATE INDEX inbox_reply_requests_message_id_idx ON inbox_reply_requests (message_id);

-- The requests still waiting for a first reply: those of messages not
-- handled yet, and those that arrived while their message was being
-- handled (the workers answer those with InboxReplyAnswerLeft).
CREATE INDEX inbox_reply_requests_unanswered_idx ON inbox_reply_requests (id) WHERE answered_run IS NULL;

-- The janitor deletes a request with its message, and any request older
-- than the dead retention by age: one whose message left while it was
-- being stored (the janitor deleted the message between ingest's check and
-- its insert) has no message to go with.
CREATE INDEX inbox_reply_requests_received_at_idx ON inbox_reply_requests (received_at);

-- reply is the body of the message's reply, as its handler gave it (for
-- order messages: the outcome and its reason). The rest of the body
-- (message id, order id, status, run) is the inbox row's.
ALTER TABLE inbox ADD COLUMN reply jsonb;

-- A reply is an outbox row with reply_to set: the relay publishes it to the
-- default exchange with reply_to as the routing key, and correlation_id. It
-- has no order_key, so it never holds back its order's events, and none of
-- them holds it back. A reply the broker returns (its requester is gone)
-- ends dead after the relay's attempts, with the reason: undeliverable.
ALTER TABLE outbox
    ADD COLUMN reply_to       text,
    ADD COLUMN correlation_id text;

-- inbox_reply_answer queues the reply of each request of request_ids whose
-- message is handled (processed or dead) and was not answered with this
-- run's result yet, and records the answer. It returns how many replies it
-- queued. The reply's id is 'reply:<request id>:<run>': the same however
-- often it is queued, so a requester can drop a copy. Three callers: the
-- trigger below (a request for a message handled already), the worker's
-- transaction that ends messages (InboxReplyAnswer) and its sweep
-- (InboxReplyAnswerLeft).
--
-- A request another session holds is skipped, never waited for: the
-- handler's transaction must not wait on someone else's lock. Left
-- unanswered, it is answered by the workers' next pass once free
-- (InboxReplyAnswerLeft).
--
-- Its statement is planned at each call, for the tables as they are: a
-- plan PL/pgSQL cached while the tables were small (a sequential scan) is
-- never replanned on a server that does not analyze them, and was seen to
-- take 5 ms a message once they had grown.
-- +goose StatementBegin
CREATE FUNCTION inbox_reply_answer(request_ids bigint[]) RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    queued integer;
BEGIN
    WITH due AS (
        SELECT r.id, r.message_id, r.reply_to, coalesce(r.correlation_id, r.message_id) AS correlation_id,
               i.replay_count AS run, i.traceparent, i.tracestate,
               CASE WHEN i.status = 'dead'
                    THEN jsonb_build_object('outcome', 'dead', 'error', i.last_error)
                    ELSE coalesce(i.reply, jsonb_build_object('outcome', 'processed', 'result', i.result))
               END || jsonb_build_object('messageId', i.message_id, 'orderId', i.order_key,
                                         'status', i.status, 'run', i.replay_count) AS body
        FROM inbox_reply_requests r
        JOIN inbox i ON i.message_id = r.message_id
        WHERE r.id = ANY(request_ids)
          AND i.status IN ('processed', 'dead')
          AND r.answered_run IS DISTINCT FROM i.replay_count
        ORDER BY r.id
        FOR UPDATE OF r SKIP LOCKED
    ), answered AS (
        UPDATE inbox_reply_requests r
        SET answered_run = due.run, answered_at = statement_timestamp()
        FROM due
        WHERE r.id = due.id
    )
    INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, reply_to, correlation_id, traceparent, tracestate)
    SELECT 'reply:' || due.id || ':' || due.run, 'reply', due.body, due.message_id, due.reply_to, due.correlation_id,
           due.traceparent, due.tracestate
    FROM due
    ORDER BY due.id
    ON CONFLICT (idempotency_key) DO NOTHING;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END;
$$;
-- +goose StatementEnd

-- A request for a message already handled is answered in the statement
-- that stores it.
-- +goose StatementBegin
CREATE FUNCTION inbox_reply_requests_answer() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A statement trigger runs for every ingest batch, requests or not.
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM inbox_reply_answer(array(SELECT id FROM new_rows));
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_reply_requests_insert
AFTER INSERT ON inbox_reply_requests
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION inbox_reply_requests_answer();

-- inbox_replies answers "did every requester get its reply?": one row per
-- request, with its message's status and its reply's fate.
CREATE VIEW inbox_replies AS
SELECT r.id, r.message_id, r.reply_to, r.correlation_id, r.received_at, r.answered_run, r.answered_at,
       i.status AS message_status,
       o.idempotency_key AS reply_id,
       CASE WHEN r.answered_run IS NULL THEN 'waiting for the message'
            WHEN o.id IS NULL THEN 'cleaned up'
            WHEN o.published_at IS NOT NULL THEN 'sent'
            WHEN o.dead_at IS NOT NULL THEN 'undeliverable'
            ELSE 'sending' END AS state,
       o.published_at, o.dead_at, o.last_error
FROM inbox_reply_requests r
LEFT JOIN inbox i ON i.message_id = r.message_id
LEFT JOIN outbox o ON o.idempotency_key = 'reply:' || r.id || ':' || r.answered_run;

-- outbox_backlog and outbox_dead are about events: a reply whose requester
-- is gone is not an operator's alarm. replies_undeliverable counts those
-- replies, which the janitor deletes after the dead retention.
CREATE OR REPLACE VIEW outbox_backlog AS
SELECT count(*) FILTER (WHERE reply_to IS NULL)                                                AS unpublished,
       count(*) FILTER (WHERE reply_to IS NULL AND last_error IS NOT NULL AND dead_at IS NULL) AS failing,
       min(created_at) FILTER (WHERE reply_to IS NULL)                                         AS oldest_created_at,
       now() - min(created_at) FILTER (WHERE reply_to IS NULL)                                 AS oldest_age,
       count(*) FILTER (WHERE reply_to IS NULL AND dead_at IS NOT NULL)                        AS dead,
       count(*) FILTER (WHERE reply_to IS NOT NULL AND dead_at IS NULL)                        AS replies_unpublished,
       count(*) FILTER (WHERE reply_to IS NOT NULL AND dead_at IS NOT NULL)                    AS replies_undeliverable
FROM outbox
WHERE published_at IS NULL;

CREATE OR REPLACE VIEW outbox_dead AS
SELECT o.id, o.idempotency_key, o.routing_key, o.order_key, o.message_id, o.attempts, o.last_error,
       o.created_at, o.dead_at, o.replay_count,
       (SELECT count(*) FROM outbox h
        WHERE h.order_key = o.order_key AND h.id > o.id AND h.published_at IS NULL) AS holds_back,
       format('UPDATE outbox SET replay_requested = true, replay_reason = %L WHERE id = %s;', 'why', o.id) AS replay_sql
FROM outbox o
WHERE o.dead_at IS NOT NULL AND o.reply_to IS NULL;

-- The grants of migration 00019 stay as they were, under another name.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00019; END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00019();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_reply_requests, inbox_replies TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT, INSERT, DELETE ON inbox_reply_requests TO inbox_service;
        GRANT UPDATE (answered_run, answered_at) ON inbox_reply_requests TO inbox_service;
        GRANT UPDATE (reply) ON inbox TO inbox_service;
        GRANT SELECT ON inbox_replies TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00019() IS 'the grants of migration 00019; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00019() RENAME TO inbox_grant_roles;
CREATE OR REPLACE VIEW outbox_dead AS
SELECT o.id, o.idempotency_key, o.routing_key, o.order_key, o.message_id, o.attempts, o.last_error,
       o.created_at, o.dead_at, o.replay_count,
       (SELECT count(*) FROM outbox h
        WHERE h.order_key = o.order_key AND h.id > o.id AND h.published_at IS NULL) AS holds_back,
       format('UPDATE outbox SET replay_requested = true, replay_reason = %L WHERE id = %s;', 'why', o.id) AS replay_sql
FROM outbox o
WHERE o.dead_at IS NOT NULL;
DROP VIEW outbox_backlog;
CREATE VIEW outbox_backlog AS
SELECT count(*)                                                       AS unpublished,
       count(*) FILTER (WHERE last_error IS NOT NULL AND dead_at IS NULL) AS failing,
       min(created_at)                                                AS oldest_created_at,
       now() - min(created_at)                                        AS oldest_age,
       count(*) FILTER (WHERE dead_at IS NOT NULL)                    AS dead
FROM outbox
WHERE published_at IS NULL;
DROP VIEW inbox_replies;
DROP TRIGGER inbox_reply_requests_insert ON inbox_reply_requests;
DROP FUNCTION inbox_reply_requests_answer();
DROP FUNCTION inbox_reply_answer(bigint[]);
ALTER TABLE outbox DROP COLUMN correlation_id, DROP COLUMN reply_to;
ALTER TABLE inbox DROP COLUMN reply;
DROP TABLE inbox_reply_requests;
-- Last: the views made again above get their grants.
SELECT inbox_grant_roles();
