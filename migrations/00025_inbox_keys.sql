-- +goose Up

-- The key ledger remembers every message id the inbox has stored, for the
-- dedupe window (INBOX_DEDUPE_WINDOW), apart from the inbox rows that carry
-- the payloads. Those can then leave sooner (INBOX_RETENTION) while their
-- ids still stop a redelivery: a key costs its id and a few bytes, a row
-- its payload, trace context, history and indexes.
--
-- Keys are kept in eight slots, each a partition, written one at a time: a
-- generation is the time one slot is written. Every seventh of the window
-- the next slot becomes the current one, emptied first with TRUNCATE: its
-- keys left the window (see inbox_keys_rotate). Old keys leave without a
-- row DELETE, a dead row version or a vacuum pass, and a slot's rows are
-- inserted once and never change, so vacuum freezes each page once.
--
-- Every insert into the inbox is checked against the ledger, whoever makes
-- it: ingest asks for its batch and skips what it finds (InboxInsertMany);
-- inbox_keys_known refuses a remembered id to anyone else (an earlier
-- inboxd, an operator). An id found there is a duplicate whether or not
-- its inbox row is still kept. Two deliveries of one new id stored at once
-- still meet on inbox_message_id_key, which waits for the first to commit;
-- the ledger only answers for ids stored earlier, which are committed.

-- One row per generation: which slot it wrote, and from when to when.
-- Kept after their slot is reused, as a record (two rows a day with the
-- default window).
CREATE TABLE inbox_key_generations (
    generation bigint      PRIMARY KEY,
    slot       smallint    NOT NULL CONSTRAINT inbox_key_generations_slot_check CHECK (slot BETWEEN 0 AND 7),
    opened_at  timestamptz NOT NULL,
    -- When the next generation opened: every key of this one was
    -- committed by then.
    closed_at  timestamptz
);

-- The current generation is the one not closed, and there is one.
CREATE UNIQUE INDEX inbox_key_generations_current_idx ON inbox_key_generations ((closed_at IS NULL)) WHERE closed_at IS NULL;

CREATE TABLE inbox_keys (
    slot       smallint NOT NULL,
    message_id text     NOT NULL
) PARTITION BY LIST (slot);

-- Ids are looked up by equality only, in every slot. A hash index holds a
-- 4-byte hash code per key where a B-tree holds the id: 34 bytes a key
-- against 78 for 36-byte ids, and the same for ids of any length. It
-- cannot be unique, and need not be: the inbox's unique index admits each
-- new id once, and with it its key.
CREATE INDEX inbox_keys_message_id_idx ON inbox_keys USING hash (message_id);

-- Rows are never updated: the first vacuum that finds a page all visible
-- freezes it too, and none comes back to it for wraparound.
-- +goose StatementBegin
DO $$
BEGIN
    FOR s IN 0..7 LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF inbox_keys FOR VALUES IN (%s) WITH (autovacuum_freeze_min_age = 0)',
                       'inbox_keys_' || s, s);
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_known refuses an insert of an id the ledger remembers, as
-- a duplicate (unique_violation, naming the id), whoever inserts: an
-- earlier inboxd still running or rolled back to (which then stores its
-- batch's other messages one by one and dead-letters the duplicate with
-- the reason), or an operator. Ingest asks the ledger itself in its
-- statement and skips what it finds, and says so for that statement
-- (inboxd.keys_checked holds the statement's start): the trigger then asks
-- nothing. Either way every slot is read, so a rotation's TRUNCATE of the
-- next one waits for the transactions that insert.
--
-- It asks once per statement, for all of its rows: row by row it cost
-- 30 µs a row here (eight slots each time). Its look-up is planned at each
-- call: a plan kept (as PL/pgSQL keeps one per session) from while the
-- slots were empty and, with autovacuum off, never analyzed, scanned them,
-- and read 1.3 billion keys in the first 50,000 orders of a benchmark.
-- It runs before inbox_keys_remember (triggers of one event run in name
-- order), so it does not find the keys its own rows are about to add.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_known() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    known text;
BEGIN
    IF current_setting('inboxd.keys_checked', true) = statement_timestamp()::text THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT n.message_id FROM new_rows n
                    WHERE EXISTS (SELECT 1 FROM %I.inbox_keys k WHERE k.message_id = n.message_id) LIMIT 1',
                   TG_TABLE_SCHEMA)
        INTO known;
    IF known IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            MESSAGE = format('message id %s is a duplicate: the key ledger remembers it (inbox_keys), its row has left the inbox', known),
            HINT = 'A message delivered again within INBOX_DEDUPE_WINDOW is not stored again.';
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_keys_known
AFTER INSERT ON inbox
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_known();

-- inbox_keys_remember adds the ids of the rows an INSERT stored to the
-- current generation's slot. It first takes the shared "remembering" lock
-- that inbox_keys_rotate takes exclusively, so a rotation waits for the
-- transactions writing the old slot to end before it opens the next, and
-- then reads the slot under a snapshot taken after the lock (READ
-- COMMITTED). A transaction of a stricter isolation level reads the slot
-- under its own snapshot, which may predate a rotation: it locks the
-- generation's row, which fails (could not serialize) if a rotation has
-- closed it since, and else holds the next rotation until it ends.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_remember() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('inboxd key ledger'), hashtext(TG_RELID::text));
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM 1 FROM inbox_key_generations WHERE closed_at IS NULL FOR SHARE;
    END IF;
    INSERT INTO inbox_keys (slot, message_id)
    SELECT (SELECT slot FROM inbox_key_generations WHERE closed_at IS NULL), n.message_id
    FROM new_rows n;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_keys_remember
AFTER INSERT ON inbox
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_remember();

-- The ledger starts once its triggers are in place: rows committed before
-- are known by their rows only (inbox_keys_since).
INSERT INTO inbox_key_generations (generation, slot, opened_at) VALUES (1, 0, clock_timestamp());

-- inbox_keys_rotate opens the next generation when the current one has
-- lasted a seventh of dedupe_window, and returns its number; else NULL.
-- The next slot is emptied first, once every key in it has been
-- remembered for dedupe_window since its generation closed. So a key is
-- remembered from its commit for at least dedupe_window, and at most
-- dedupe_window plus a seventh of it (plus however late the rotation runs).
--
-- Emptying the slot waits for the statements that read it (every ingest
-- reads all slots), and then the "remembering" lock for the transactions
-- that write the current one; new ingest statements wait behind both
-- until it commits. lock_wait bounds that pause (it is the transaction's
-- lock_timeout from then on): a rotation that cannot have its locks in
-- time fails, to be tried again. Any number of callers may run it at
-- once; one rotates.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_rotate(dedupe_window interval, lock_wait interval DEFAULT '100ms') RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    cur       inbox_key_generations;
    next_slot smallint;
    reused    inbox_key_generations;
BEGIN
    IF dedupe_window IS NULL OR dedupe_window <= interval '0' THEN
        RAISE EXCEPTION 'inbox_keys_rotate: dedupe_window must be positive, got %', dedupe_window;
    END IF;
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint::text, true);
    LOCK TABLE inbox_key_generations IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO cur FROM inbox_key_generations WHERE closed_at IS NULL;
    IF clock_timestamp() < cur.opened_at + dedupe_window / 7 THEN
        RETURN NULL;
    END IF;
    next_slot := (cur.slot + 1) % 8;
    SELECT * INTO reused FROM inbox_key_generations
    WHERE slot = next_slot ORDER BY generation DESC LIMIT 1;
    IF FOUND AND reused.closed_at > clock_timestamp() - dedupe_window THEN
        RETURN NULL;  -- a longer window than before: its keys are still in it
    END IF;

    -- The slot first: once it is ours, no ingest statement that read it is
    -- still running, so none holds the remembering lock and waits for us.
    EXECUTE format('TRUNCATE %I', 'inbox_keys_' || next_slot);
    PERFORM pg_advisory_xact_lock(hashtext('inboxd key ledger'), hashtext('inbox'::regclass::oid::text));
    UPDATE inbox_key_generations SET closed_at = clock_timestamp() WHERE generation = cur.generation;
    INSERT INTO inbox_key_generations (generation, slot, opened_at)
    VALUES (cur.generation + 1, next_slot, clock_timestamp());
    RETURN cur.generation + 1;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_since is when the ledger started remembering: ids stored
-- before it are known only by their inbox rows.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_since() RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$ SELECT min(opened_at) FROM inbox_key_generations $$;
-- +goose StatementEnd

-- inbox_key_ledger shows, per generation still held, its slot, its time
-- and how many keys it holds (counted: slow on a large ledger).
CREATE VIEW inbox_key_ledger AS
SELECT g.generation, g.slot, g.opened_at, g.closed_at,
       (SELECT count(*) FROM inbox_keys k WHERE k.slot = g.slot) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

-- inbox_reply_forgotten answers the requests of request_ids for a message
-- whose row has left (past INBOX_RETENTION) while the ledger remembers its
-- id: the copy is a duplicate, so nothing runs again, and the result is no
-- longer kept. The reply says so, as run 0 (its id 'reply:<request id>:0'),
-- rather than leave the requester waiting for an answer that will not come.
-- +goose StatementBegin
CREATE FUNCTION inbox_reply_forgotten(request_ids bigint[]) RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
SET search_path FROM CURRENT
AS $$
DECLARE
    queued integer;
BEGIN
    WITH due AS (
        SELECT r.id, r.message_id, r.reply_to, coalesce(r.correlation_id, r.message_id) AS correlation_id
        FROM inbox_reply_requests r
        WHERE r.id = ANY(request_ids)
          AND r.answered_run IS NULL
          AND NOT EXISTS (SELECT 1 FROM inbox i WHERE i.message_id = r.message_id)
          AND EXISTS (SELECT 1 FROM inbox_keys k WHERE k.message_id = r.message_id)
        ORDER BY r.id
        FOR UPDATE OF r SKIP LOCKED
    ), answered AS (
        UPDATE inbox_reply_requests r
        SET answered_run = 0, answered_at = statement_timestamp()
        FROM due
        WHERE r.id = due.id
    )
    INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, reply_to, correlation_id)
    SELECT 'reply:' || due.id || ':0', 'reply',
           jsonb_build_object('messageId', due.message_id, 'status', 'unknown', 'run', 0, 'outcome', 'forgotten',
                              'error', 'the message was stored before and has ended; its result is no longer kept (INBOX_RETENTION)'),
           due.message_id, due.reply_to, due.correlation_id
    FROM due
    ORDER BY due.id
    ON CONFLICT (idempotency_key) DO NOTHING;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END;
$$;
-- +goose StatementEnd

-- A request is answered in the statement that stores it when its message
-- was handled already, or has left and is remembered.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_reply_requests_answer() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A statement trigger runs for every ingest batch, requests or not.
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM inbox_reply_answer(array(SELECT id FROM new_rows));
        PERFORM inbox_reply_forgotten(array(SELECT id FROM new_rows));
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- The grants of migration 00022 stay as they were, under another name.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00022; END $$;
-- +goose StatementEnd

-- Whoever inserts into the inbox remembers its keys; the service's
-- janitor rotates the generations, emptying a slot with TRUNCATE.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00022();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_keys, inbox_key_generations, inbox_key_ledger TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT, INSERT ON inbox_keys TO inbox_service;
        GRANT SELECT, INSERT, UPDATE ON inbox_key_generations TO inbox_service;
        GRANT SELECT ON inbox_key_ledger TO inbox_service;
        FOR s IN 0..7 LOOP
            EXECUTE format('GRANT TRUNCATE ON %I TO inbox_service', 'inbox_keys_' || s);
        END LOOP;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00022() IS 'the grants of migration 00022; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00022() RENAME TO inbox_grant_roles;
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_reply_requests_answer() RETURNS trigger
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
DROP FUNCTION inbox_reply_forgotten(bigint[]);
DROP VIEW inbox_key_ledger;
DROP FUNCTION inbox_keys_since();
DROP FUNCTION inbox_keys_rotate(interval, interval);
DROP TRIGGER inbox_keys_remember ON inbox;
DROP FUNCTION inbox_keys_remember();
DROP TRIGGER inbox_keys_known ON inbox;
DROP FUNCTION inbox_keys_known();
DROP TABLE inbox_keys;
DROP TABLE inbox_key_generations;
