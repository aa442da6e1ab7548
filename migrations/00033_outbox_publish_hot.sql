-- +goose NO TRANSACTION
-- +goose Up

-- A publish rewrites no index entry: no index of the outbox names
-- published_at, so the relay's mark (published_at, attempts, claimed_at,
-- last_error) is a heap-only (HOT) update, written in the row's page.
--
-- An index whose key or predicate names a column the update changes makes
-- PostgreSQL write the new row version in full and a new entry in every
-- index of the table. Each publish did so: the primary key, the
-- idempotency key and published_at each took a second entry (the open
-- rows' indexes did not, the published row being outside their
-- predicates). Measured on 5,000 rows (two `steady` events' worth each),
-- the publish wrote 584 to 729 bytes of WAL a row before and 144 to 283
-- after, and an insert writes one index entry fewer (three, not four).
--
-- What each index that named published_at served, now:
--
-- * outbox_open_idx (id, the rows neither published nor dead): the
--   claim's scan, the floor's raise and the counts of open rows, each a
--   range of ids from the claim floor, where the primary key serves as
--   well: above the floor nearly every row is open. The floor's audit read
--   it under the floor, where every row has ended: that audit now goes a
--   range of ids at a time (claim_floor_audit_range below).
-- * outbox_order_key_unpublished_idx ((order_key, id), the rows not
--   published): the claim's look-ups of a candidate's earlier rows, a
--   range of its order's rows from the floor to the candidate, and
--   outbox_dead's holds_back, an order's rows after its dead one: both now
--   read outbox_order_key_idx, every row of the order in that range (an
--   order has a few), and see published_at in the row.
-- * outbox_dead_at_idx (dead_at, the dead rows, which are never
--   published): the same rows with a predicate on dead_at alone.
-- * outbox_published_at_idx (published_at): the janitor's pass over
--   published rows past their retention, which now reads the primary key
--   from its start up to the first row created within the retention
--   (outbox_created_before below).
--
-- Built before the indexes they replace are dropped, each concurrently, so
-- that inserts, claims and publishes go on throughout.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_order_key_idx ON outbox (order_key, id)
WHERE order_key IS NOT NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_dead_idx ON outbox (dead_at)
WHERE dead_at IS NOT NULL;

-- outbox_created_before returns an id under which every outbox row was
-- created before ts, and past which the rows were created at ts or later,
-- found by a binary search over the primary key (some 30 look-ups of one
-- row each). Ids are taken in the order rows are inserted, and created_at
-- is their transaction's start: a row inserted late in a long transaction
-- may be older than a row under the id returned, which is as exact as a
-- retention needs.
-- +goose StatementBegin
CREATE FUNCTION outbox_created_before(ts timestamptz) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    lo bigint;  -- every row under lo was created before ts
    hi bigint;  -- the row at hi, if any, was created at ts or later
    mid bigint;
    at timestamptz;
BEGIN
    SELECT min(id), max(id) + 1 INTO lo, hi FROM outbox;
    IF lo IS NULL THEN
        RETURN 0;
    END IF;
    WHILE lo < hi LOOP
        mid := lo + (hi - lo) / 2;
        SELECT o.created_at INTO at FROM outbox o WHERE o.id >= mid ORDER BY o.id LIMIT 1;
        IF at < ts THEN
            lo := mid + 1;
        ELSE
            hi := mid;
        END IF;
    END LOOP;
    RETURN lo;
END;
$$;
-- +goose StatementEnd

-- claim_floor_audit_range audits a range of ids under the floor of tbl
-- ('inbox' or 'outbox'): from from_id, span ids (NULL: up to the floor),
-- and stops at the floor. It returns the oldest row it found open there
-- (NULL when none), having lowered the floor to it as claim_floor_audit
-- does, and the id to go on from (the floor, once the range reached it).
-- The outbox has no index of its open rows any more, so its audit reads
-- the primary key: a caller walks the table a range at a time, each a
-- statement of its own, and then follows the floor up.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_audit_range(tbl text, from_id bigint, span bigint,
                                        OUT stranded bigint, OUT next_from bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    seq regclass := CASE tbl WHEN 'inbox' THEN 'inbox_claim_floor_seq'::regclass
                             WHEN 'outbox' THEN 'outbox_claim_floor_seq'::regclass END;
    open text := CASE tbl WHEN 'inbox' THEN $open$status = 'pending'$open$
                          WHEN 'outbox' THEN 'published_at IS NULL AND dead_at IS NULL' END;
    floor bigint;
    still boolean;
BEGIN
    IF seq IS NULL THEN
        RAISE EXCEPTION 'claim_floor_audit_range: no claim floor for %', tbl;
    END IF;
    floor := coalesce(pg_sequence_last_value(seq), 0);
    next_from := CASE WHEN span IS NULL THEN floor ELSE least(from_id + span, floor) END;
    next_from := greatest(next_from, from_id);
    -- A new statement, so a snapshot taken after the floor was read.
    EXECUTE format('SELECT min(id) FROM %I WHERE (%s) AND id >= $1 AND id < $2', tbl, open)
        INTO stranded USING from_id, next_from;
    IF stranded IS NULL THEN
        RETURN;
    END IF;
    PERFORM claim_floor_lock(seq, false);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE id = $1 AND (%s))', tbl, open)
        INTO still USING stranded;
    IF NOT still OR stranded >= coalesce(pg_sequence_last_value(seq), 0) THEN
        stranded := NULL;
        RETURN;
    END IF;
    PERFORM claim_floor_lower(tbl, stranded);
END;
$$;
-- +goose StatementEnd

-- claim_floor_audit, the whole range under the floor in one statement (the
-- inbox's, whose pending rows have an index of their own), is that range
-- audited from the start.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION claim_floor_audit(tbl text) RETURNS bigint
LANGUAGE sql
SET search_path FROM CURRENT
AS $$ SELECT stranded FROM claim_floor_audit_range(tbl, 0, NULL) $$;
-- +goose StatementEnd

DROP INDEX CONCURRENTLY IF EXISTS outbox_order_key_unpublished_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_open_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_dead_at_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_published_at_idx;

-- +goose Down
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_published_at_idx ON outbox (published_at)
WHERE published_at IS NOT NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_dead_at_idx ON outbox (dead_at)
WHERE published_at IS NULL AND dead_at IS NOT NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_open_idx ON outbox (id)
WHERE published_at IS NULL AND dead_at IS NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_order_key_unpublished_idx ON outbox (order_key, id)
WHERE published_at IS NULL AND order_key IS NOT NULL;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION claim_floor_audit(tbl text) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    seq regclass := CASE tbl WHEN 'inbox' THEN 'inbox_claim_floor_seq'::regclass
                             WHEN 'outbox' THEN 'outbox_claim_floor_seq'::regclass END;
    open text := CASE tbl WHEN 'inbox' THEN $open$status = 'pending'$open$
                          WHEN 'outbox' THEN 'published_at IS NULL AND dead_at IS NULL' END;
    floor bigint;
    stranded bigint;
    still boolean;
BEGIN
    IF seq IS NULL THEN
        RAISE EXCEPTION 'claim_floor_audit: no claim floor for %', tbl;
    END IF;
    floor := coalesce(pg_sequence_last_value(seq), 0);
    EXECUTE format('SELECT min(id) FROM %I WHERE (%s) AND id < $1', tbl, open)
        INTO stranded USING floor;
    IF stranded IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM claim_floor_lock(seq, false);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE id = $1 AND (%s))', tbl, open)
        INTO still USING stranded;
    IF NOT still OR stranded >= coalesce(pg_sequence_last_value(seq), 0) THEN
        RETURN NULL;
    END IF;
    PERFORM claim_floor_lower(tbl, stranded);
    RETURN stranded;
END;
$$;
-- +goose StatementEnd

DROP FUNCTION claim_floor_audit_range(text, bigint, bigint);
DROP FUNCTION outbox_created_before(timestamptz);

DROP INDEX CONCURRENTLY IF EXISTS outbox_dead_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_order_key_idx;
