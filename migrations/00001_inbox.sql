-- +goose Up

-- The inbox: every incoming message, stored once, and what became of it.
--
--   inbox                 one row per unique message id. Ingest inserts with
--                         ON CONFLICT (message_id) DO NOTHING, so a redelivery
--                         never adds a row; workers claim pending rows with
--                         FOR UPDATE SKIP LOCKED; an operator replays a message
--                         by setting replay_requested (inbox_replay does the rest).
--   inbox_attempts        the history of every handling attempt.
--   inbox_conflicts       ids that arrived again with a different payload.
--   inbox_reply_requests  deliveries that asked (AMQP reply_to) for the result.
--
-- The claim floor and the key ledger are with their areas (floors, keys).

-- A row is pending until a worker records its outcome: processed, or dead
-- (failed and given up, or unreadable). Only a replay makes it pending again.
CREATE TABLE inbox (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The AMQP message_id: the idempotency key of the message.
    message_id       text        NOT NULL UNIQUE,
    -- The AMQP type property, else the routing key it was published with.
    message_type     text        NOT NULL,
    routing_key      text        NOT NULL DEFAULT '',
    -- The body exactly as received. bytea, so that a body that is not valid
    -- JSON (or holds NUL bytes) is still stored and can be marked dead with
    -- its reason. Read it with convert_from(payload, 'UTF8').
    payload          bytea       NOT NULL,
    status           text        NOT NULL DEFAULT 'pending'
                                 CHECK (status IN ('pending', 'processed', 'dead')),
    -- Claims of the message in this run. Committed before the handler runs,
    -- so attempts that crashed the process or lost their transaction count
    -- too: that bounds a crash loop.
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       text,
    -- A short description of what the handler did, e.g. 'confirmed'.
    result           text,
    received_at      timestamptz NOT NULL DEFAULT now(),
    -- A pending row is not claimed before this time (retry backoff).
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- When a worker last claimed the row; NULL while unclaimed.
    claimed_at       timestamptz,
    processed_at     timestamptz,
    -- Set to true by an operator to have a processed or dead message handled
    -- again; the worker clears it when the replay is done.
    replay_requested boolean     NOT NULL DEFAULT false,
    -- Groups the messages that must be handled in arrival order (for order
    -- messages, the orderId). NULL: ordered with no other message (its body
    -- had no key, or could not be read).
    order_key        text,
    -- The replay audit, written only by inbox_replay: how many replays
    -- (the message's run), the last one's time and role, and its reason.
    replay_count     integer     NOT NULL DEFAULT 0,
    replayed_at      timestamptz,
    replayed_by      text,
    replay_reason    text,
    -- The process (host/pid) holding the current claim, and its build.
    claimed_by       text,
    claimed_build    text,
    -- W3C trace context of the delivery; NULL when it carried none, or a
    -- malformed one (never stored as if it were valid).
    traceparent      text,
    tracestate       text,
    -- The claiming process's session key (inbox_sessions): live while the
    -- process is up. When the process dies its sessions end, the key is
    -- live no more, and the claim is taken over at once rather than after
    -- the claim lease. NULL: the lease alone decides.
    claimed_session  bigint,
    -- The body of the message's reply as its handler gave it (for orders:
    -- the outcome and its reason); the rest of the reply is the row's.
    reply            jsonb,
    -- See the column comment below. NULL when the delivery carried none.
    user_id          text,

    CONSTRAINT inbox_message_id_not_empty CHECK (message_id <> '')
)
-- Free space on every page keeps the claim's update (attempts, claimed_*:
-- no indexed column) on the page as a HOT update.
WITH (fillfactor = 50);

-- RabbitMQ refuses a publish whose user_id is not its connection's user, so
-- a producer that learns another's message id cannot read that message's
-- stored result by sending a copy that asks for a reply (InboxInsertMany).
COMMENT ON COLUMN inbox.user_id IS 'AMQP user_id of the delivery that stored the message; a copy asking for a reply is answered only under the same';

-- The claims read only pending rows in id order. Partial, so it stays as
-- small as the backlog however many ended rows pile up.
CREATE INDEX inbox_pending_idx ON inbox (id) WHERE status = 'pending';

-- Dead rows are few and looked at by operators.
CREATE INDEX inbox_dead_idx ON inbox (id) WHERE status = 'dead';

-- Retention deletes processed rows by age.
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at) WHERE status = 'processed';

-- The inbox claim takes a message only when no earlier message of its order
-- is still open (pending or dead). Processed rows leave this index, so it
-- stays as small as the open backlog.
CREATE INDEX inbox_order_key_open_idx ON inbox (order_key, id)
WHERE status <> 'processed' AND order_key IS NOT NULL;

-- inbox_replay makes a replay one SQL statement by an operator:
--   UPDATE inbox SET replay_requested = true, replay_reason = 'fixed SKU data'
--   WHERE message_id = 'msg-1001';
-- The database, not the service, makes that safe and records it, whoever
-- runs the statement: a processed or dead row goes back to pending with
-- fresh attempts and is announced to the workers; the replay is counted and
-- its time and role noted, whatever the statement said of those columns. A
-- flag set on a row still pending is dropped: the message is about to run
-- anyway. Only a replay changes the audit columns: a statement that rewrites
-- them (a past replay's reason included), or sets a reason with a dropped
-- flag, leaves them as they were; the reason stays with the replay it
-- explains. (The claim floor is lowered to the row by inbox_claim_floor_replay.)
-- +goose StatementBegin
CREATE FUNCTION inbox_replay() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF NEW.replay_requested AND NOT OLD.replay_requested AND OLD.status IN ('processed', 'dead') THEN
        NEW.status          := 'pending';
        NEW.attempts        := 0;
        NEW.next_attempt_at := now();
        NEW.claimed_at      := NULL;
        NEW.processed_at    := NULL;
        NEW.replay_count    := OLD.replay_count + 1;
        NEW.replayed_at     := now();
        NEW.replayed_by     := current_user;
        PERFORM pg_notify('inbox_pending', TG_TABLE_SCHEMA);
    ELSE
        IF NEW.replay_requested AND NOT OLD.replay_requested THEN
            -- A flag set on a row still pending is dropped.
            NEW.replay_requested := false;
        END IF;
        NEW.replay_count  := OLD.replay_count;
        NEW.replayed_at   := OLD.replayed_at;
        NEW.replayed_by   := OLD.replayed_by;
        NEW.replay_reason := OLD.replay_reason;
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

-- The WHEN clause keeps the function out of every other update (the
-- workers', above all).
CREATE TRIGGER inbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by, replay_reason ON inbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by IS DISTINCT FROM NEW.replayed_by
   OR OLD.replay_reason IS DISTINCT FROM NEW.replay_reason)
EXECUTE FUNCTION inbox_replay();

-- inbox_attempts is the history of every handling attempt: when, by which
-- process and build, and what came of it. The worker writes a row in the
-- transaction that records the outcome; an attempt whose process died (or
-- lost its transaction) is written as 'abandoned' when another worker takes
-- the message over. No foreign key: the janitor deletes a message's attempts
-- in the statement that deletes it. Replay every message build X failed with:
--   UPDATE inbox SET replay_requested = true, replay_reason = 'fixed in Y'
--   WHERE status = 'dead' AND id IN (
--       SELECT inbox_id FROM inbox_attempts
--       WHERE build = 'X' AND outcome <> 'processed');
CREATE TABLE inbox_attempts (
    inbox_id    bigint      NOT NULL,
    -- 0 for the message's first run, n for its n-th replay (replay_count).
    run         integer     NOT NULL,
    -- inbox.attempts of this attempt: 1 for the first of a run.
    attempt     integer     NOT NULL,
    message_id  text        NOT NULL,
    -- processed, retry (failed, will be tried again), dead (failed, given
    -- up) or abandoned (the process died or lost its transaction).
    outcome     text        NOT NULL
                            CHECK (outcome IN ('processed', 'retry', 'dead', 'abandoned')),
    error       text,
    result      text,
    -- The process (host/pid) and the build of inboxd that made the attempt.
    process     text        NOT NULL,
    build       text        NOT NULL,
    -- When the message was claimed for this attempt, and when its outcome
    -- was recorded.
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT now(),

    PRIMARY KEY (inbox_id, run, attempt)
);

-- Time ranges ("failures in the last hour"). A btree, not a BRIN: the
-- janitor's deletes free pages that new rows then fill, so the table's
-- physical order does not follow finished_at for long.
CREATE INDEX inbox_attempts_finished_at_idx ON inbox_attempts (finished_at);

-- A build's failed attempts: inbox_failures_by_build, and the replay of
-- every message a build failed (above). Partial: the processed attempts,
-- nearly all of them, are never looked up by build, so they add no entry.
CREATE INDEX inbox_attempts_build_idx ON inbox_attempts (build) WHERE outcome <> 'processed';

-- inbox_conflicts records every message id that arrived again with a
-- different payload. The payload stored first stays the one handled; each
-- distinct conflicting payload is kept here once, for inspection.
CREATE TABLE inbox_conflicts (
    id                  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id          text        NOT NULL,
    message_type        text        NOT NULL,
    -- Hex SHA-256 of the payload in the inbox, and of the one refused.
    stored_sha256       text        NOT NULL,
    conflicting_sha256  text        NOT NULL,
    conflicting_payload bytea       NOT NULL,
    -- Deliveries of this conflicting payload seen so far.
    deliveries          integer     NOT NULL DEFAULT 1,
    first_seen_at       timestamptz NOT NULL DEFAULT now(),
    last_seen_at        timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT inbox_conflicts_key UNIQUE (message_id, conflicting_sha256)
);

-- Retention deletes conflicts by age.
CREATE INDEX inbox_conflicts_last_seen_at_idx ON inbox_conflicts (last_seen_at);

-- Replies. A delivery that carries the AMQP reply_to property asks for the
-- message's result: once the message has ended (processed or dead), one
-- reply goes to reply_to through the outbox, with the delivery's
-- correlation_id. Every delivery that asks gets one, duplicates included,
-- each with the same result; a replay that ends answers every request again.
--
-- inbox_reply_requests holds one row per delivery that asked. Ingest inserts
-- it in the statement that stores the delivery, and answers it in the same
-- transaction, so an ack means the request is stored too, and its reply
-- queued if its message had ended; the transaction that ends the message
-- answers the requests it sees, and the workers' sweep those left over. One
-- statement answers in all three places (InboxReplyAnswer). No foreign key
-- to inbox: a request may outlive its message (a copy of a message whose
-- row has left is answered 'forgotten'; see also the received_at index).
CREATE TABLE inbox_reply_requests (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id     text        NOT NULL,
    -- Where the reply goes: a queue name, or RabbitMQ's direct reply-to
    -- (amq.rabbitmq.reply-to.*). Published to the default exchange.
    reply_to       text        NOT NULL,
    -- The delivery's correlation_id; NULL when it had none (the reply then
    -- carries the message_id as its correlation_id).
    correlation_id text,
    received_at    timestamptz NOT NULL DEFAULT now(),
    -- The run of the message (its inbox.replay_count) whose result was last
    -- sent; NULL until the first reply.
    answered_run   integer,
    answered_at    timestamptz
);

-- The answer of a message's requests, the janitor's delete with the
-- message, and ingest's check of a redelivered request.
CREATE INDEX inbox_reply_requests_message_id_idx ON inbox_reply_requests (message_id);

-- The requests still waiting for a first reply: those of messages not
-- handled yet, and those that arrived while their message was being handled
-- (the workers' sweep finds those with InboxReplyLeft).
CREATE INDEX inbox_reply_requests_unanswered_idx ON inbox_reply_requests (id) WHERE answered_run IS NULL;

-- The janitor deletes a request with its message, and any request older
-- than the dead retention by age: one whose message was deleted between
-- ingest's check and its insert has no message to go with.
CREATE INDEX inbox_reply_requests_received_at_idx ON inbox_reply_requests (received_at);
