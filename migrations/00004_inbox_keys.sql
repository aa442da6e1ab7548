-- +goose Up

-- The key ledger: every message id the inbox has stored, remembered for the
-- dedupe window (INBOX_DEDUPE_WINDOW), apart from the inbox rows that carry
-- the payloads. Those can leave sooner (INBOX_RETENTION) while their ids still
-- stop a redelivery: a key costs its id and a few bytes, a row its payload,
-- trace context, attempts (inbox_attempts) and indexes.
--
-- Keys live in inbox_keys, partitioned by "slot":
--
--   inbox_keys_0..7  the slots. A generation is the time one slot is the
--                    current one; every seventh of the window the next slot
--                    is emptied with TRUNCATE (its keys have left the
--                    window) and becomes current (a rotation). Old keys
--                    leave without a DELETE, a dead row or a vacuum.
--   inbox_keys_8, 9  the hot parts. New keys are written to the one part
--                    "writing", which is small, and moved into their slot in
--                    large batches sorted by hash bucket (seal, merge, empty
--                    below). Into a slot of 12.5 M keys a key inserted alone
--                    cost 3 KB of WAL (a full-page image every other key);
--                    in a sorted batch, about 300 bytes.
--
-- Every reader reads the parent, so the hot parts with the slots: a key is
-- found in its part until its merge commits, in its slot from then on. A
-- part is merged and emptied before its slot can be reused, so its keys are
-- remembered as long as their slot's.
--
-- Every insert into the inbox is checked against the ledger, whoever makes
-- it: ingest asks itself, for its batch, and skips what it finds; the
-- trigger inbox_keys_known refuses a remembered id to anyone else (an
-- operator, any other writer). Two deliveries of one new id stored at once still
-- meet on the inbox's unique message_id index; the ledger answers only for
-- ids stored before, which are committed.
--
-- Locking, in short. Whoever writes keys holds the "remembering" lock,
-- inbox_key_hot_parts' ROW EXCLUSIVE lock, for its transaction; sealing and
-- rotating take its SHARE lock, which waits for those and holds up new
-- ones, so no transaction is still writing a part that is sealed or a
-- generation that is closed. Both need a right to write the table, which
-- only the service's roles have (an advisory lock, one namespace for every
-- login of the database, would let any login stall every insert).
-- TRUNCATE waits for the statements reading the table, and is not MVCC-safe:
-- a REPEATABLE READ or SERIALIZABLE writer or checker locks the generation's
-- and the parts' rows, so that a change after its snapshot fails it
-- (serialization failure) rather than hide keys from it.
--
-- The database holds the ledger's state (the two tables below) and makes
-- every writer check and remember its keys (the triggers below); the
-- service drives the states from one place, its leader's janitor:
-- internal/janitor/keys.go rotates, seals, merges and empties, each step
-- one transaction that takes the locks above in that order.

-- One row per generation: which slot it wrote, and from when to when. Kept
-- after its slot is reused, as a record (two rows a day with the default
-- window). closed_at is when the next generation opened: every key of this
-- one was committed by then.
CREATE TABLE inbox_key_generations (
    generation bigint      PRIMARY KEY,
    slot       smallint    NOT NULL CHECK (slot BETWEEN 0 AND 7),
    opened_at  timestamptz NOT NULL,
    closed_at  timestamptz
);

-- The current generation is the one not closed, and there is exactly one.
CREATE UNIQUE INDEX inbox_key_generations_current_idx
    ON inbox_key_generations ((closed_at IS NULL)) WHERE closed_at IS NULL;

-- What each hot part holds. A part goes round
--
--   empty   -> writing  every new key goes to the one part writing, for the
--                       current generation's slot;
--   writing -> sealed   when it has grown to an eighth of its slot (and at
--                       least 16 MB), or its generation closed; the other
--                       part, empty, starts writing (SealKeys, RotateKeys);
--   sealed  -> merged   its keys are copied into their slot, in bucket order,
--                       a range of buckets per transaction (MergeKeys);
--   merged  -> empty    TRUNCATE (EmptyKeys).
--
-- slot is the slot its keys belong to (NULL when empty); since, when it
-- entered its state. (The names in brackets are internal/janitor/keys.go's.)
CREATE TABLE inbox_key_hot_parts (
    part           smallint    PRIMARY KEY CHECK (part IN (8, 9)),
    state          text        NOT NULL CHECK (state IN ('empty', 'writing', 'sealed', 'merged')),
    slot           smallint    CHECK (slot BETWEEN 0 AND 7),
    since          timestamptz NOT NULL DEFAULT clock_timestamp(),
    merge_mask     integer,
    merged_buckets integer     NOT NULL DEFAULT 0,
    CONSTRAINT inbox_key_hot_parts_slot_when_held CHECK ((state = 'empty') = (slot IS NULL))
);

COMMENT ON COLUMN inbox_key_hot_parts.merge_mask IS 'while a sealed part is being merged: the mask of hashtext(message_id) whose buckets it is merged by';
COMMENT ON COLUMN inbox_key_hot_parts.merged_buckets IS 'while a sealed part is being merged: its keys in buckets below this are in their slot';

-- At most one part writes.
CREATE UNIQUE INDEX inbox_key_hot_parts_writing_idx
    ON inbox_key_hot_parts ((true)) WHERE state = 'writing';

-- No primary key: each new id is admitted once by the inbox's unique index,
-- and with it its key.
CREATE TABLE inbox_keys (
    slot       smallint NOT NULL,
    message_id text     NOT NULL
) PARTITION BY LIST (slot);

-- Ids are looked up by equality only, in every partition. A hash index holds
-- a 4-byte hash code per key where a B-tree holds the id (34 bytes a key
-- against 78 for 36-byte ids); it cannot be unique, and need not be.
CREATE INDEX inbox_keys_message_id_idx ON inbox_keys USING hash (message_id);

-- +goose StatementBegin
DO $$
BEGIN
    -- The slots. Their rows are inserted once and never updated: the first
    -- vacuum that finds a page all visible freezes it too, and none comes
    -- back to it for wraparound.
    FOR slot IN 0..7 LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF inbox_keys FOR VALUES IN (%s) WITH (autovacuum_freeze_min_age = 0)',
                       'inbox_keys_' || slot, slot);
    END LOOP;
    -- The hot parts. Their rows leave by TRUNCATE within hours, so vacuum
    -- need not visit them (inbox_keys_analyze_parts gives them statistics).
    FOR part IN 8..9 LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF inbox_keys FOR VALUES IN (%s) WITH (autovacuum_enabled = false)',
                       'inbox_keys_' || part, part);
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- The first generation writes slot 0, through hot part 8.
INSERT INTO inbox_key_generations (generation, slot, opened_at) VALUES (1, 0, clock_timestamp());
INSERT INTO inbox_key_hot_parts (part, state, slot) VALUES (8, 'writing', 0), (9, 'empty', NULL);

-- inbox_keys_known refuses an insert into the inbox of an id the ledger
-- remembers, as a duplicate (unique_violation, naming the id), whoever
-- inserts: an operator or any other writer (a batch refused so stores its
-- other messages one by one and dead-letters the duplicate). Ingest asks the
-- ledger itself and skips what it finds, and says so for its statement
-- (inboxd.keys_checked holds the statement's start): the trigger then asks
-- nothing. Either way every partition is read, so a TRUNCATE of one waits
-- for the transactions that insert.
--
-- It asks once per statement, for all of its rows (row by row it cost 30 us
-- a row). The look-up is an EXECUTE, planned at each call: a plan kept for
-- the session from while the slots were empty and never analyzed scanned
-- them, reading 1.3 billion keys in the first 50,000 orders of a benchmark.
-- Its names are qualified with the trigger's schema, so it needs no
-- search_path of its own. It runs before inbox_keys_remember (triggers of one
-- event run in name order), so it does not find the keys its own rows are
-- about to add. A stricter transaction first locks the hot parts' rows, so
-- that one emptied after its snapshot (whose keys that snapshot would find
-- in neither place) fails it instead.
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
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        EXECUTE format('SELECT 1 FROM %I.inbox_key_hot_parts FOR SHARE', TG_TABLE_SCHEMA);
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

-- inbox_keys_remember adds the ids of the rows an INSERT stored to the hot
-- part writing. It first takes the remembering lock shared, so that a seal
-- or rotation (which takes it exclusively) waits for the transactions still
-- writing, and then reads the part under a snapshot taken after the lock
-- (READ COMMITTED). A stricter transaction reads under its own snapshot,
-- which may predate a seal or rotation: it locks the current generation's
-- row and the writing part's, which fails (could not serialize) if either
-- changed since, and else holds the next seal or rotation until it ends.
-- A trigger, not the service, so that every insert is remembered, whoever
-- makes it.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_remember() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    LOCK TABLE inbox_key_hot_parts IN ROW EXCLUSIVE MODE;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM 1 FROM inbox_key_generations WHERE closed_at IS NULL FOR SHARE;
        PERFORM 1 FROM inbox_key_hot_parts WHERE state = 'writing' FOR SHARE;
    END IF;
    INSERT INTO inbox_keys (slot, message_id)
    SELECT (SELECT part FROM inbox_key_hot_parts WHERE state = 'writing'), n.message_id
    FROM new_rows n;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_keys_remember
AFTER INSERT ON inbox
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_remember();

-- inbox_keys_analyze_parts gives each hot part statistics once it holds
-- keys (a page of them), if it has none, and returns how many it analyzed;
-- the janitors call it. Without statistics the planner takes 1 in 200 of a
-- part's keys to match each id probed: the ingest statement's probe read
-- the whole part by a sequential scan for each batch, and a large part
-- pushed each statement over JIT's threshold (45 ms of compilation a
-- statement). A part's ids are
-- all distinct, and its statistics say so once (n_distinct -1): they stay
-- through its TRUNCATEs and scale with its size. Autovacuum is off on the
-- parts, so it runs ANALYZE itself; ANALYZE needs the owner's right, so it
-- runs as the owner (SECURITY DEFINER), names catalog objects in full, and
-- its search_path is pinned below to this schema then pg_temp, and it is kept
-- from PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_analyze_parts() RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    p        smallint;
    part     text;
    analyzed integer := 0;
BEGIN
    FOR p IN SELECT h.part FROM inbox_key_hot_parts h ORDER BY h.part LOOP
        part := 'inbox_keys_' || p;
        IF pg_catalog.pg_relation_size(pg_catalog.format('%I.%I', pg_catalog.current_schema(), part)::pg_catalog.regclass) > 0
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stats s
                           WHERE s.schemaname = pg_catalog.current_schema() AND s.tablename = part
                             AND s.attname = 'message_id') THEN
            EXECUTE pg_catalog.format('ANALYZE %I.%I', pg_catalog.current_schema(), part);
            analyzed := analyzed + 1;
        END IF;
    END LOOP;
    RETURN analyzed;
END;
$$;
-- +goose StatementEnd
-- Pinned here, in the migration that creates it: this schema, then pg_temp,
-- never a caller's temporary objects first; and no PUBLIC execute right
-- (inbox_grant_roles grants it by name).
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION inbox_keys_analyze_parts() SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION inbox_keys_analyze_parts() FROM PUBLIC;
