-- +goose Up

-- New keys are written to a small hot part of the ledger, and moved into
-- their generation's slot in large batches sorted by hash bucket.
--
-- A slot is written for a seventh of the window: 12.5 M keys at 1,000 a
-- second in 3.5 hours, 43 M over the default 12. Its hash index then spans
-- tens of thousands of pages, and each new key lands on a random one:
-- after every checkpoint, the first change to each page writes the whole
-- page to the WAL. Measured here (PostgreSQL 15, a minute after a
-- checkpoint, 100 keys a statement): into a slot of 12.5 M keys, 3,034
-- bytes of WAL and 0.56 full-page images a key, 5.5 ms a statement; into
-- one of 100,000 keys, 210 bytes, 0.009 and 1.9 ms. Moving 2 M keys into
-- the 12.5 M slot in one statement, in bucket order, wrote 297 bytes a key
-- (0.027 page images): each page is written once for many keys.
--
-- So the ledger gets two hot parts, partitions inbox_keys_8 and
-- inbox_keys_9 (their "slot" is the part's number), and a table that says
-- what each holds (inbox_key_hot_parts):
--
--   empty    -> writing   every new key goes to the one part writing, for
--                         the current generation's slot;
--   writing  -> sealed    when it has grown to an eighth of its slot (and
--                         at least min_bytes), or the generation closed:
--                         the other part, empty, starts writing;
--   sealed   -> merged    its keys are copied into their slot, in bucket
--                         order, in one statement (inbox_keys_merge);
--   merged   -> empty     TRUNCATE (inbox_keys_empty).
--
-- Every reader reads the parent, so the hot parts with the slots: a key is
-- found in its part until the merge commits, in its slot from then on (in
-- both until the part is emptied). A part's keys stay remembered for as
-- long as their slot's: a part is merged before its slot can be reused
-- (a rotation waits for the other part to be empty), and its keys count
-- with the slot's generation.
--
-- Sealing takes the remembering lock exclusively, as a rotation does, so no
-- transaction is still writing the sealed part when it is merged; merging
-- holds up only stricter inserters (below); emptying a part waits for the
-- statements reading it,
-- like a rotation's TRUNCATE, and gives up after lock_wait to be tried
-- again. A writer or checker in REPEATABLE READ or SERIALIZABLE locks the
-- parts' rows, so that a part sealed or emptied after its snapshot fails
-- it (serialization failure) rather than hide keys from it: TRUNCATE is
-- not MVCC-safe.

CREATE TABLE inbox_key_hot_parts (
    part  smallint    PRIMARY KEY CONSTRAINT inbox_key_hot_parts_part_check CHECK (part IN (8, 9)),
    state text        NOT NULL CONSTRAINT inbox_key_hot_parts_state_check CHECK (state IN ('empty', 'writing', 'sealed', 'merged')),
    -- The slot its keys belong to; NULL when empty.
    slot  smallint    CONSTRAINT inbox_key_hot_parts_slot_check CHECK (slot BETWEEN 0 AND 7),
    -- When it entered its state.
    since timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT inbox_key_hot_parts_slot_when_held CHECK ((state = 'empty') = (slot IS NULL))
);

CREATE UNIQUE INDEX inbox_key_hot_parts_writing_idx ON inbox_key_hot_parts ((true)) WHERE state = 'writing';

-- No rotation (an earlier inboxd's janitor) between reading the current
-- slot and the new functions' commit.
LOCK TABLE inbox_key_generations IN SHARE ROW EXCLUSIVE MODE;

INSERT INTO inbox_key_hot_parts (part, state, slot)
SELECT 8, 'writing', slot FROM inbox_key_generations WHERE closed_at IS NULL;
INSERT INTO inbox_key_hot_parts (part, state, slot) VALUES (9, 'empty', NULL);

-- Created apart and attached: attaching locks inbox_keys in SHARE UPDATE
-- EXCLUSIVE mode, which lets reads and inserts go on (CREATE TABLE …
-- PARTITION OF would lock it exclusively). Their rows leave by TRUNCATE
-- within hours, so vacuum need not visit them.
-- +goose StatementBegin
DO $$
BEGIN
    FOR p IN 8..9 LOOP
        EXECUTE format('CREATE TABLE %I (LIKE inbox_keys INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (autovacuum_enabled = false)',
                       'inbox_keys_' || p);
        EXECUTE format('ALTER TABLE inbox_keys ATTACH PARTITION %I FOR VALUES IN (%s)', 'inbox_keys_' || p, p);
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_remember writes the keys to the hot part writing. As before,
-- it takes the shared remembering lock first and reads under a snapshot
-- taken after it; a stricter transaction locks the current generation's
-- row and the part's, and fails if either changed since its snapshot.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_remember() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('inboxd key ledger'), hashtext(TG_RELID::text));
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

-- inbox_keys_known as before; a stricter transaction first locks the hot
-- parts' rows, so that one emptied after its snapshot (whose keys its
-- snapshot would find in neither place) fails it instead.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_known() RETURNS trigger
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

-- inbox_keys_hand_over seals the part writing, for the slot of the
-- generation its keys were written in (from_slot: the current one), and
-- makes the other part, which must be empty, write for to_slot. Only for
-- inbox_keys_seal and inbox_keys_rotate, under the remembering lock held
-- exclusively.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_hand_over(from_slot smallint, to_slot smallint) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE inbox_key_hot_parts SET state = 'sealed', slot = from_slot, since = clock_timestamp() WHERE state = 'writing';
    UPDATE inbox_key_hot_parts SET state = 'writing', slot = to_slot, since = clock_timestamp() WHERE state = 'empty';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox_keys_hand_over: no empty hot part to write';
    END IF;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_seal seals the part writing once it holds an eighth as many
-- keys as its slot (ratio), and at least min_bytes, if the other part is
-- empty; it returns whether it did. Sizes are read from the tables' files
-- (the parts' rows are the slots' rows): it counts nothing. A page of a
-- slot's hash index holds about 240 keys, so a merge brings about 30 for
-- each page it changes: some 270 bytes of page images a key at most. The
-- hot part's own index stays an eighth of the slot's.
--
-- Like a rotation, it waits for the transactions writing keys, holding up
-- new inserts meanwhile, and gives up after lock_wait.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_seal(ratio integer DEFAULT 8, min_bytes bigint DEFAULT 16777216, lock_wait interval DEFAULT '100ms') RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    w        inbox_key_hot_parts;
    cur_slot smallint;
BEGIN
    IF ratio IS NULL OR ratio < 1 THEN
        RAISE EXCEPTION 'inbox_keys_seal: ratio must be at least 1, got %', ratio;
    END IF;
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint::text, true);
    -- One seal or rotation at a time.
    LOCK TABLE inbox_key_generations IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO w FROM inbox_key_hot_parts WHERE state = 'writing';
    IF EXISTS (SELECT 1 FROM inbox_key_hot_parts WHERE state <> 'empty' AND part <> w.part)
       OR pg_relation_size(format('inbox_keys_%s', w.part)::regclass) < greatest(min_bytes, 1)
       OR pg_relation_size(format('inbox_keys_%s', w.part)::regclass) * ratio
          < pg_relation_size(format('inbox_keys_%s', w.slot)::regclass) THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('inboxd key ledger'), hashtext('inbox'::regclass::oid::text));
    SELECT g.slot INTO cur_slot FROM inbox_key_generations g WHERE g.closed_at IS NULL;
    PERFORM inbox_keys_hand_over(cur_slot, cur_slot);
    RETURN true;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_merge copies the keys of a sealed part into their slot, in
-- the order of the slot's hash buckets, so that each page of its index is
-- changed once, and marks the part merged; it returns how many keys it
-- copied, or NULL if no part was sealed (or another session is merging
-- it). A bucket is the low bits of the key's hash (hashtext): ordering by
-- as many low bits as the index has pages, rounded down to a power of two,
-- visits the buckets in one pass, at most two buckets at a time (the index
-- has more pages than buckets: overflow pages, buckets allocated ahead).
--
-- It holds up no one but a stricter inserter (REPEATABLE READ or
-- SERIALIZABLE), whose check waits for it and then fails, to be tried
-- again. It is one transaction of seconds (2 M keys in 7.5 s here): the
-- oldest snapshot for that long.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_merge() RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    p      inbox_key_hot_parts;
    pages  bigint;
    mask   integer;
    copied bigint;
BEGIN
    SELECT * INTO p FROM inbox_key_hot_parts WHERE state = 'sealed' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    pages := pg_indexes_size(format('inbox_keys_%s', p.slot)::regclass) / current_setting('block_size')::bigint;
    mask := (1 << least(30, greatest(1, floor(log(2, greatest(pages, 2)))::integer))) - 1;
    PERFORM set_config('work_mem', '64MB', true);
    -- Through the parent, as the service may write only there.
    INSERT INTO inbox_keys (slot, message_id)
    SELECT p.slot, k.message_id FROM inbox_keys k WHERE k.slot = p.part
    ORDER BY hashtext(k.message_id) & mask;
    GET DIAGNOSTICS copied = ROW_COUNT;
    UPDATE inbox_key_hot_parts SET state = 'merged', since = clock_timestamp() WHERE part = p.part;
    RETURN copied;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_empty truncates a merged part, whose keys are in their slot,
-- and returns whether it did. TRUNCATE waits for the statements reading
-- the part; it gives up after lock_wait, to be tried again.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_empty(lock_wait interval DEFAULT '100ms') RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    p inbox_key_hot_parts;
BEGIN
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint::text, true);
    SELECT * INTO p FROM inbox_key_hot_parts WHERE state = 'merged' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE inbox_key_hot_parts SET state = 'empty', slot = NULL, since = clock_timestamp() WHERE part = p.part;
    EXECUTE format('TRUNCATE %I', 'inbox_keys_' || p.part);
    RETURN true;
END;
$$;
-- +goose StatementEnd

-- inbox_keys_analyze_parts gives each hot part statistics once it holds
-- some keys (100 pages), if it has none, and returns how many it analyzed.
-- The janitors call it; nobody else need. Without statistics the planner
-- takes 1 in 200 keys of a part to match each id probed: with a part of
-- 1.44 M keys, 8,320 rows a probe, a cost over JIT's threshold for a batch
-- of 20 and 45 ms of compilation in each ingest statement (the window
-- bench went from 1 ms to 50 ms a call, and fell minutes behind). A part's
-- ids are all distinct, and its statistics say so once (n_distinct -1):
-- they stay through its TRUNCATEs, and scale with its size. Autovacuum is
-- off on the parts (and on some servers), so it runs ANALYZE itself, as
-- the tables' owner.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_analyze_parts() RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    p        smallint;
    analyzed integer := 0;
BEGIN
    FOR p IN SELECT part FROM inbox_key_hot_parts ORDER BY part LOOP
        IF pg_relation_size(format('inbox_keys_%s', p)::regclass) >= 100 * current_setting('block_size')::bigint
           AND NOT EXISTS (SELECT 1 FROM pg_stats s
                           WHERE s.schemaname = current_schema() AND s.tablename = 'inbox_keys_' || p
                             AND s.attname = 'message_id') THEN
            EXECUTE format('ANALYZE %I', 'inbox_keys_' || p);
            analyzed := analyzed + 1;
        END IF;
    END LOOP;
    RETURN analyzed;
END;
$$;
-- +goose StatementEnd

REVOKE EXECUTE ON FUNCTION inbox_keys_analyze_parts() FROM PUBLIC;

-- inbox_keys_rotate as in 00025, and the generation it opens writes the
-- other hot part: the part of the one it closes is sealed, to be merged
-- into that one's slot. It waits (returns NULL, to be tried again) while
-- the other part still holds keys not yet emptied.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_rotate(dedupe_window interval, lock_wait interval DEFAULT '100ms') RETURNS bigint
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
    IF (SELECT count(*) FROM inbox_key_hot_parts WHERE state = 'empty') = 0 THEN
        RETURN NULL;  -- the sealed part is merged and emptied first
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
    PERFORM inbox_keys_hand_over(cur.slot, next_slot);
    UPDATE inbox_key_generations SET closed_at = clock_timestamp() WHERE generation = cur.generation;
    INSERT INTO inbox_key_generations (generation, slot, opened_at)
    VALUES (cur.generation + 1, next_slot, clock_timestamp());
    RETURN cur.generation + 1;
END;
$$;
-- +goose StatementEnd

-- The generations' key counts include their keys still in a hot part.
CREATE OR REPLACE VIEW inbox_key_ledger AS
SELECT g.generation, g.slot, g.opened_at, g.closed_at,
       (SELECT count(*) FROM inbox_keys k
        WHERE k.slot = g.slot
           OR k.slot IN (SELECT h.part FROM inbox_key_hot_parts h WHERE h.slot = g.slot AND h.state IN ('writing', 'sealed'))) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00026; END $$;
-- +goose StatementEnd

-- The janitors seal, merge and empty the hot parts.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00026();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_key_hot_parts TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT, UPDATE ON inbox_key_hot_parts TO inbox_service;
        GRANT EXECUTE ON FUNCTION inbox_keys_analyze_parts() TO inbox_service;
        GRANT TRUNCATE ON inbox_keys_8, inbox_keys_9 TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00026() IS 'the grants of migration 00026; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00026() RENAME TO inbox_grant_roles;
COMMENT ON FUNCTION inbox_grant_roles() IS NULL;

-- The keys not yet in their slots go there first. No insert into the inbox
-- writes keys meanwhile: the lock waits for the transactions that read or
-- write the ledger (every insert into the inbox does), and holds up new
-- ones until the functions of 00025 are back.
LOCK TABLE inbox_keys IN ACCESS EXCLUSIVE MODE;

INSERT INTO inbox_keys (slot, message_id)
SELECT h.slot, k.message_id
FROM inbox_keys k
JOIN inbox_key_hot_parts h ON k.slot = h.part
WHERE h.state IN ('writing', 'sealed');

CREATE OR REPLACE VIEW inbox_key_ledger AS
SELECT g.generation, g.slot, g.opened_at, g.closed_at,
       (SELECT count(*) FROM inbox_keys k WHERE k.slot = g.slot) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_rotate(dedupe_window interval, lock_wait interval DEFAULT '100ms') RETURNS bigint
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_known() RETURNS trigger
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_remember() RETURNS trigger
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

DROP FUNCTION inbox_keys_analyze_parts();
DROP FUNCTION inbox_keys_empty(interval);
DROP FUNCTION inbox_keys_merge();
DROP FUNCTION inbox_keys_seal(integer, bigint, interval);
DROP FUNCTION inbox_keys_hand_over(smallint, smallint);
DROP TABLE inbox_keys_8;
DROP TABLE inbox_keys_9;
DROP TABLE inbox_key_hot_parts;
