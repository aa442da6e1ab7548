-- +goose Up

-- claimed_by and claimed_build name the process (host/pid) holding a
-- message's current claim and its build, so an operator can see who is
-- handling what, and whose claim a crashed attempt was.
ALTER TABLE inbox
    ADD COLUMN claimed_by    text,
    ADD COLUMN claimed_build text;

-- inbox_attempts is the history of every handling attempt: when, by which
-- process and which build, and what came of it. The worker writes a row in
-- the transaction that records the outcome; an attempt whose process died
-- (or lost its transaction) is written as 'abandoned' when another worker
-- takes the message over. Replay every message that build X failed with:
--   UPDATE inbox SET replay_requested = true, replay_reason = 'fixed in Y'
--   WHERE status = 'dead' AND id IN (
--       SELECT inbox_id FROM inbox_attempts WHERE build = 'X' AND outcome <> 'processed');
CREATE TABLE inbox_attempts (
    inbox_id    bigint      NOT NULL,
    -- 0 for the message's first run, n for its n-th replay.
    run         integer     NOT NULL,
    -- inbox.attempts of this attempt: 1 for the first of a run.
    attempt     integer     NOT NULL,
    message_id  text        NOT NULL,
    -- processed, retry (failed, will be tried again), dead (failed, given
    -- up) or abandoned (the process died or lost its transaction).
    outcome     text        NOT NULL,
    error       text,
    result      text,
    -- The process (host/pid) and the build of inboxd that made the attempt.
    process     text        NOT NULL,
    build       text        NOT NULL,
    -- When the message was claimed for this attempt, and when its outcome
    -- was recorded.
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT now(),

    PRIMARY KEY (inbox_id, run, attempt),
    CONSTRAINT inbox_attempts_outcome_check CHECK (outcome IN ('processed', 'retry', 'dead', 'abandoned'))
);

-- Time ranges ("failures in the last hour"). A btree, not a BRIN: the
-- janitor's deletes free pages that new rows then fill, so the table's
-- physical order does not follow finished_at for long.
CREATE INDEX inbox_attempts_finished_at_idx ON inbox_attempts (finished_at);
CREATE INDEX inbox_attempts_build_idx ON inbox_attempts (build);

-- inbox_conflicts records every message id that arrived again with a
-- different payload. The payload stored first stays the one handled; the
-- conflicting one is kept here (the first of each kind) for inspection.
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

CREATE INDEX inbox_conflicts_last_seen_at_idx ON inbox_conflicts (last_seen_at);

-- inbox_overview answers "how is the inbox doing?" in one row. Every count
-- but processed reads a partial index of open rows; processed reads the
-- index of processed rows.
DROP VIEW inbox_overview;
CREATE VIEW inbox_overview AS
SELECT
    (SELECT count(*) FROM inbox WHERE status = 'pending')                                  AS pending,
    (SELECT count(*) FROM inbox WHERE status = 'pending' AND claimed_at IS NOT NULL)       AS in_progress,
    (SELECT count(*) FROM inbox WHERE status = 'pending' AND claimed_at IS NULL
                                  AND last_error IS NOT NULL)                              AS waiting_retry,
    (SELECT count(*) FROM inbox WHERE status = 'pending' AND replay_requested)             AS replays_waiting,
    (SELECT count(*) FROM inbox WHERE status = 'dead')                                     AS dead,
    (SELECT count(*) FROM inbox WHERE status = 'processed')                                AS processed,
    (SELECT now() - min(received_at) FROM inbox WHERE status = 'pending')                  AS oldest_pending_age,
    (SELECT count(*) FROM inbox WHERE status = 'processed'
                                  AND processed_at > now() - interval '1 minute')          AS processed_last_minute,
    (SELECT round(count(*) / 300.0, 1) FROM inbox WHERE status = 'processed'
                                  AND processed_at > now() - interval '5 minutes')         AS per_second_last_5_minutes,
    (SELECT count(*) FROM inbox_attempts WHERE outcome <> 'processed'
                                  AND finished_at > now() - interval '5 minutes')          AS failed_attempts_last_5_minutes,
    (SELECT count(*) FROM inbox_conflicts)                                                 AS conflicting_ids,
    (SELECT max(processed_at) FROM inbox WHERE status = 'processed')                       AS last_processed_at;

-- inbox_dead gains how often each dead message was replayed and which
-- process and build made its last attempt.
CREATE OR REPLACE VIEW inbox_dead AS
SELECT i.id,
       i.message_id,
       i.message_type,
       i.attempts,
       i.last_error,
       i.received_at,
       i.processed_at AS died_at,
       i.replay_requested,
       length(i.payload) AS payload_bytes,
       i.replay_count,
       last.process AS last_process,
       last.build   AS last_build
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

-- inbox_dead_by_error answers "why do messages die?": one row per error.
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

-- inbox_failures_by_build answers "is a build failing messages?": failed
-- attempts of the last 24 hours per build and outcome.
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

-- inbox_throughput answers "how fast is it going?": attempts per minute
-- over the last 15 minutes, by outcome.
CREATE VIEW inbox_throughput AS
SELECT date_trunc('minute', finished_at)                 AS minute,
       count(*) FILTER (WHERE outcome = 'processed')     AS processed,
       count(*) FILTER (WHERE outcome = 'retry')         AS retried,
       count(*) FILTER (WHERE outcome = 'dead')          AS dead,
       count(*) FILTER (WHERE outcome = 'abandoned')     AS abandoned
FROM inbox_attempts
WHERE finished_at > date_trunc('minute', now()) - interval '14 minutes'
GROUP BY 1
ORDER BY 1 DESC;

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_attempts, inbox_conflicts, inbox_overview, inbox_dead, inbox_dead_by_error,
                        inbox_failures_by_build, inbox_throughput
            TO inbox_operator;
    END IF;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP VIEW inbox_throughput;
DROP VIEW inbox_failures_by_build;
DROP VIEW inbox_dead_by_error;
DROP VIEW inbox_dead;
CREATE VIEW inbox_dead AS
SELECT id, message_id, message_type, attempts, last_error, received_at,
       processed_at AS died_at, replay_requested, length(payload) AS payload_bytes
FROM inbox
WHERE status = 'dead'
ORDER BY id DESC;
DROP VIEW inbox_overview;
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
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_overview, inbox_dead TO inbox_operator;
    END IF;
END;
$$;
-- +goose StatementEnd
DROP TABLE inbox_conflicts;
DROP TABLE inbox_attempts;
ALTER TABLE inbox DROP COLUMN claimed_build, DROP COLUMN claimed_by;
