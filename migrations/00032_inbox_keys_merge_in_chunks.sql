-- +goose Up

-- A sealed hot part is merged into its slot a range of hash buckets at a
-- time, each range its own transaction.
--
-- In one statement (00031) a merge took 4 to 7 µs a key here: 20 to 35 s
-- for the 4.8 M keys a part holds at the end of a generation of the
-- default window at 1,000 keys a second (a slot of 43 M keys, a part an
-- eighth of it). That is over the 30 s statement_timeout every inboxd
-- connection has (INBOX_STATEMENT_TIMEOUT): the merge would fail at each
-- cleanup, the part would stay sealed, and neither the next seal nor the
-- next rotation could go on. It was also the oldest snapshot for that long,
-- and held up stricter inserters for all of it.
--
-- Now each call copies the part's keys whose bucket falls in the next range
-- and records how far it got; the part is merged once the last range is
-- copied. The ranges are of the buckets of one mask, chosen at the first
-- call (merge_mask), so that the slot's index is still written in one pass
-- over its pages, each changed once: the WAL a key costs is as before. A
-- range holds about max_bytes of the part's heap (64 MB: some 900,000 keys
-- of 36-byte ids, rows of about 70 bytes; seconds). The mask has at least
-- as many buckets as the part has ranges, even when the slot is small (a
-- slot just emptied, a part grown while the janitors were away): over a
-- small index the copy then makes a few passes, each cheap. Each call
-- reads the whole part to find its range, which costs a sequential read
-- of the part per range.
--
-- Until the part is merged its keys are found there, and those copied so
-- far in their slot too; inbox_key_ledger counts each once.
ALTER TABLE inbox_key_hot_parts
    ADD COLUMN merge_mask integer,
    ADD COLUMN merged_buckets integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN inbox_key_hot_parts.merge_mask IS 'while a sealed part is being merged: the mask of hashtext(message_id) whose buckets it is merged by';
COMMENT ON COLUMN inbox_key_hot_parts.merged_buckets IS 'while a sealed part is being merged: its keys in buckets below this are in their slot';

DROP FUNCTION inbox_keys_merge();

-- inbox_keys_merge copies the keys of the next range of buckets of a
-- sealed part into their slot, in bucket order, and marks the part merged
-- once the last range is copied. It returns how many keys it copied, or
-- NULL if no part was sealed (or another session is merging it): the
-- caller calls it until then, each call its own transaction. A bucket is
-- the low bits of the key's hash (hashtext), as many as the slot's index
-- has pages when the merge starts, rounded down to a power of two: in
-- that order the copy visits the index's buckets in one pass, at most two
-- buckets at a time (the index has more pages than buckets: overflow
-- pages, buckets allocated ahead). When the part has more ranges than
-- that, more bits, one bucket or more a range.
--
-- It holds up no one but a stricter inserter (REPEATABLE READ or
-- SERIALIZABLE), whose check waits for the range in progress and then
-- fails, to be tried again.
-- +goose StatementBegin
CREATE FUNCTION inbox_keys_merge(max_bytes bigint DEFAULT 67108864) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    p      inbox_key_hot_parts;
    pages  bigint;
    mask   integer;
    ranges bigint;
    lo     bigint;
    hi     bigint;
    copied bigint;
BEGIN
    IF max_bytes IS NULL OR max_bytes < 1 THEN
        RAISE EXCEPTION 'inbox_keys_merge: max_bytes must be at least 1, got %', max_bytes;
    END IF;
    SELECT * INTO p FROM inbox_key_hot_parts WHERE state = 'sealed' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- The part no longer changes: the same ranges at every call.
    ranges := greatest(1, ceil(pg_relation_size(format('inbox_keys_%s', p.part)::regclass)::numeric / max_bytes));
    mask := p.merge_mask;
    IF mask IS NULL THEN
        pages := pg_indexes_size(format('inbox_keys_%s', p.slot)::regclass) / current_setting('block_size')::bigint;
        mask := (1 << least(30, greatest(1, floor(log(2, greatest(pages, 2)))::integer,
                                         ceil(log(2, ranges::numeric))::integer))) - 1;
    END IF;
    lo := p.merged_buckets;
    hi := least(mask::bigint + 1, lo + ceil((mask::numeric + 1) / ranges)::bigint);
    PERFORM set_config('work_mem', '64MB', true);
    -- Through the parent, as the service may write only there.
    INSERT INTO inbox_keys (slot, message_id)
    SELECT p.slot, k.message_id FROM inbox_keys k
    WHERE k.slot = p.part AND (hashtext(k.message_id) & mask) >= lo AND (hashtext(k.message_id) & mask) < hi
    ORDER BY hashtext(k.message_id) & mask;
    GET DIAGNOSTICS copied = ROW_COUNT;
    IF hi > mask THEN
        UPDATE inbox_key_hot_parts SET state = 'merged', since = clock_timestamp(), merge_mask = NULL, merged_buckets = 0
        WHERE part = p.part;
    ELSE
        UPDATE inbox_key_hot_parts SET merge_mask = mask, merged_buckets = hi WHERE part = p.part;
    END IF;
    RETURN copied;
END;
$$;
-- +goose StatementEnd

-- The generations' key counts include their keys still in a hot part, and
-- count once those a merge has copied so far.
CREATE OR REPLACE VIEW inbox_key_ledger AS
SELECT g.generation, g.slot, g.opened_at, g.closed_at,
       (SELECT count(*) FROM inbox_keys k WHERE k.slot = g.slot)
       + (SELECT count(*) FROM inbox_key_hot_parts h JOIN inbox_keys k ON k.slot = h.part
          WHERE h.slot = g.slot
            AND (h.state = 'writing'
                 OR h.state = 'sealed' AND (h.merge_mask IS NULL OR (hashtext(k.message_id) & h.merge_mask) >= h.merged_buckets))) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

-- +goose Down
-- A merge under way is finished first (all its ranges at once), so that
-- 00031's merge does not copy its keys again. The lock waits for a
-- janitor's range in progress and keeps the janitors from starting one
-- until the columns that record them are gone.
LOCK TABLE inbox_key_hot_parts IN EXCLUSIVE MODE;
SELECT inbox_keys_merge(9223372036854775807) FROM inbox_key_hot_parts WHERE merge_mask IS NOT NULL;

CREATE OR REPLACE VIEW inbox_key_ledger AS
SELECT g.generation, g.slot, g.opened_at, g.closed_at,
       (SELECT count(*) FROM inbox_keys k
        WHERE k.slot = g.slot
           OR k.slot IN (SELECT h.part FROM inbox_key_hot_parts h WHERE h.slot = g.slot AND h.state IN ('writing', 'sealed'))) AS keys
FROM inbox_key_generations g
WHERE g.generation > (SELECT max(generation) FROM inbox_key_generations) - 8
ORDER BY g.generation DESC;

DROP FUNCTION inbox_keys_merge(bigint);

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

ALTER TABLE inbox_key_hot_parts DROP COLUMN merge_mask, DROP COLUMN merged_buckets;
