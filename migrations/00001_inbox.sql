-- +goose Up

-- inbox holds one row per unique incoming message. Ingest inserts rows with
-- ON CONFLICT (message_id) DO NOTHING, so a redelivered message never adds a
-- second row; workers claim pending rows with FOR UPDATE SKIP LOCKED.
CREATE TABLE inbox (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The AMQP message_id: the idempotency key of the message.
    message_id       text        NOT NULL,
    -- The AMQP type property, else the routing key the message was published with.
    message_type     text        NOT NULL,
    -- The routing key the message was published with.
    routing_key      text        NOT NULL DEFAULT '',
    -- The body exactly as received. bytea, so that a body that is not valid
    -- JSON (or holds NUL bytes) is still stored and can be marked dead with its
    -- reason. Read it with convert_from(payload, 'UTF8').
    payload          bytea       NOT NULL,
    status           text        NOT NULL DEFAULT 'pending',
    -- Number of times a worker has claimed the message to handle it. It is
    -- committed before the handler runs, so attempts that crashed the
    -- process or lost their transaction count too.
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    -- A short description of what the handler did, e.g. 'confirmed'.
    result           text,
    received_at      timestamptz NOT NULL DEFAULT now(),
    -- A pending row is not claimed before this time (retry backoff).
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- When a worker last claimed the row; other workers leave it alone for a
    -- short lease while that worker takes its row lock.
    claimed_at       timestamptz,
    processed_at     timestamptz,
    -- Set to true by an operator to have a processed or dead message handled again.
    replay_requested boolean     NOT NULL DEFAULT false,

    CONSTRAINT inbox_message_id_key UNIQUE (message_id),
    CONSTRAINT inbox_status_check CHECK (status IN ('pending', 'processed', 'dead')),
    CONSTRAINT inbox_message_id_not_empty CHECK (message_id <> ''),
    CONSTRAINT inbox_attempts_check CHECK (attempts >= 0)
)
-- Free space on every page lets the claim's update (attempts, claimed_at:
-- no indexed column) stay on the page as a HOT update.
WITH (fillfactor = 50);

-- The claim query reads only pending rows in arrival order. A partial index
-- keeps it small and fast however many processed rows pile up.
CREATE INDEX inbox_pending_idx ON inbox (id) WHERE status = 'pending';

-- Dead rows are few and looked at by operators.
CREATE INDEX inbox_dead_idx ON inbox (id) WHERE status = 'dead';

-- Retention deletes processed rows by age.
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at) WHERE status = 'processed';

-- inbox_notify wakes the workers of every inboxd process (LISTEN inbox_pending)
-- when rows arrive, whoever inserted them. The payload is the table's schema, so
-- a process ignores wake-ups meant for another schema in the same database.
-- +goose StatementBegin
CREATE FUNCTION inbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM pg_notify('inbox_pending', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_notify_insert
AFTER INSERT ON inbox
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION inbox_notify();

-- inbox_overview answers "how is the inbox doing?" in one row per status.
CREATE VIEW inbox_overview AS
SELECT s.status,
       count(i.id)                                            AS messages,
       count(i.id) FILTER (WHERE i.replay_requested)          AS replays_requested,
       min(i.received_at)                                     AS oldest_received_at,
       now() - min(i.received_at)                             AS oldest_age,
       max(i.processed_at)                                    AS last_processed_at
FROM (SELECT 'pending' AS status UNION ALL SELECT 'processed' UNION ALL SELECT 'dead') AS s
LEFT JOIN inbox i ON i.status = s.status
GROUP BY s.status;

-- inbox_dead lists the messages that will not be retried, newest first, with why.
CREATE VIEW inbox_dead AS
SELECT id,
       message_id,
       message_type,
       attempts,
       last_error,
       received_at,
       processed_at AS died_at,
       replay_requested,
       length(payload) AS payload_bytes
FROM inbox
WHERE status = 'dead'
ORDER BY id DESC;

-- +goose Down
DROP VIEW inbox_dead;
DROP VIEW inbox_overview;
DROP TABLE inbox;
DROP FUNCTION inbox_notify();
