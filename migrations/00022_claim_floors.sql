-- +goose Up

-- Claim floors: where the claims start their scans.
--
-- The workers find pending messages, and the relay unpublished rows, by
-- scanning a partial index from its oldest entry. Each message that ends
-- leaves its entry behind until vacuum removes it, and vacuum can remove
-- nothing that a snapshot still open could see: an analytics query, a
-- pg_dump, a standby with hot_standby_feedback or a replication slot held
-- for minutes leaves every claim wading through every entry written since.
--
-- A floor is an id under which no row can be claimed: every row below it
-- has ended (processed or dead; published or dead for the outbox). The
-- claims scan from the floor. It is kept in a sequence, which changes in
-- place and leaves no row versions behind, and it rises only as far as
-- this proves safe:
--
--   * Rows take their ids when they are inserted, but commit in another
--     order. A statement trigger takes, for each inserting transaction, a
--     shared advisory lock of the table (its "inserting" lock) before any
--     of its rows takes an id, held until the transaction ends. The keeper
--     notes the last id handed out, then the transactions holding that
--     lock. Once all of those have ended, every row with an id up to the
--     one noted is committed or gone, and the oldest such row still open
--     is the new floor. Until then the note is kept. So the floor trails
--     by a round of the keeper (a fraction of a second), and a transaction
--     that inserts and stays open (a commit waiting for a synchronous
--     standby) holds the floor where it is until it ends.
--   * A replay makes an old row claimable again. The replay lowers the
--     floor to its row, holding an advisory lock until its transaction
--     ends; the keeper raises the floor only while holding the same lock,
--     and reads the floor again once it has it.
--
-- The floor only ever makes a scan shorter: with no keeper running (an
-- older inboxd), it stays where it is, and the claims are as before.
CREATE SEQUENCE inbox_claim_floor_seq AS bigint MINVALUE 0 START WITH 0;
SELECT setval('inbox_claim_floor_seq', 0, true);
CREATE SEQUENCE outbox_claim_floor_seq AS bigint MINVALUE 0 START WITH 0;
SELECT setval('outbox_claim_floor_seq', 0, true);

-- inbox_claim_floor returns the inbox's floor: every pending message has
-- an id at least this.
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor() RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$ SELECT coalesce(pg_sequence_last_value('inbox_claim_floor_seq'), 0) $$;
-- +goose StatementEnd

-- outbox_claim_floor returns the outbox's floor: every row neither
-- published nor dead has an id at least this.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor() RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$ SELECT coalesce(pg_sequence_last_value('outbox_claim_floor_seq'), 0) $$;
-- +goose StatementEnd

-- claim_floor_lock takes, until the transaction ends, the lock that
-- serialises raising the floor seq with lowering it: waiting for it, or,
-- with try, not (it then returns false).
-- +goose StatementBegin
CREATE FUNCTION claim_floor_lock(seq regclass, try boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF try THEN
        RETURN pg_try_advisory_xact_lock(hashtext('inboxd claim floor'), hashtext(seq::oid::text));
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('inboxd claim floor'), hashtext(seq::oid::text));
    RETURN true;
END;
$$;
-- +goose StatementEnd

-- claim_floor_inserting, a statement trigger before INSERT, takes the
-- inserting lock of the table for the transaction: before any row of the
-- statement takes its id.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_inserting() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('inboxd claim floor inserting'), hashtext(TG_RELID::text));
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_claim_floor_inserting BEFORE INSERT ON inbox
FOR EACH STATEMENT EXECUTE FUNCTION claim_floor_inserting();
CREATE TRIGGER outbox_claim_floor_inserting BEFORE INSERT ON outbox
FOR EACH STATEMENT EXECUTE FUNCTION claim_floor_inserting();

-- claim_floor_inserters returns the transactions (virtual ids) that hold
-- the inserting lock of tbl now.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_inserters(tbl regclass) RETURNS text[]
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(l.virtualtransaction), '{}')
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2
      AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
      AND l.classid = hashtext('inboxd claim floor inserting')::oid
      AND l.objid = hashtext(tbl::oid::text)::oid
$$;
-- +goose StatementEnd

-- claim_floor_proven reports whether a note's inserters (the transactions
-- that held tbl's inserting lock when the note was taken) have all ended,
-- taking the floor lock of seq when they have (held until the calling
-- transaction ends); false when the lock is held by a replay, or another
-- keeper.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_proven(seq regclass, tbl regclass, noted_inserters text[]) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'a claim floor is raised only under READ COMMITTED: each statement must see the transactions that ended before it';
    END IF;
    IF cardinality(noted_inserters) > 0 AND claim_floor_inserters(tbl) && noted_inserters THEN
        RETURN false;
    END IF;
    RETURN claim_floor_lock(seq, true);
END;
$$;
-- +goose StatementEnd

-- claim_floor_raise raises the floor seq of tbl, whose open rows (those
-- a claim may take, now or later) are those where open holds, as far as
-- the keeper's note proves safe, and returns the floor with the note for
-- the next call: the note given, while its inserters run (or the floor
-- lock is taken), else a new one. The keeper calls it (through the
-- table's function below) in a statement of its own, first with a NULL
-- note. A note whose last id is past the sequence's (taken on another
-- server, before a failover) is dropped. Its scan is planned at each
-- call, for the table as it is.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_raise(tbl regclass, seq regclass, open text, noted_last bigint, noted_inserters text[],
                                  OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE plpgsql AS $$
DECLARE
    ids regclass := pg_get_serial_sequence(tbl::text, 'id')::regclass;
    from_id bigint;
BEGIN
    floor := coalesce(pg_sequence_last_value(seq), 0);
    IF noted_last > coalesce(pg_sequence_last_value(ids), 0) THEN
        noted_last := NULL;
    END IF;
    IF noted_last IS NOT NULL THEN
        IF NOT claim_floor_proven(seq, tbl, noted_inserters) THEN
            next_last := noted_last;
            next_inserters := noted_inserters;
            RETURN;
        END IF;
        -- Read under the lock: a replay that lowered the floor has committed.
        from_id := coalesce(pg_sequence_last_value(seq), 0);
        IF noted_last >= from_id THEN
            -- A new statement, so a new snapshot: it sees every row up to noted_last.
            EXECUTE format('SELECT coalesce(min(id), $2 + 1) FROM %s WHERE (%s) AND id >= $1 AND id <= $2', tbl, open)
                INTO floor USING from_id, noted_last;
            PERFORM setval(seq, floor, true);
        ELSE
            floor := from_id;
        END IF;
    END IF;
    -- The last id handed out, then the transactions inserting now: each
    -- took the inserting lock before its rows took their ids.
    next_last := coalesce(pg_sequence_last_value(ids), 0);
    next_inserters := claim_floor_inserters(tbl);
END;
$$;
-- +goose StatementEnd

-- inbox_claim_floor_raise raises the inbox's floor (claim_floor_raise):
-- its open rows are the pending messages.
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor_raise(noted_last bigint, noted_inserters text[],
                                        OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM claim_floor_raise('inbox', 'inbox_claim_floor_seq', $open$status = 'pending'$open$, noted_last, noted_inserters)
$$;
-- +goose StatementEnd

-- outbox_claim_floor_raise raises the outbox's floor: its open rows are
-- those neither published nor dead.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor_raise(noted_last bigint, noted_inserters text[],
                                         OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM claim_floor_raise('outbox', 'outbox_claim_floor_seq', 'published_at IS NULL AND dead_at IS NULL', noted_last, noted_inserters)
$$;
-- +goose StatementEnd

-- claim_floor_lower lowers the floor of tbl ('inbox' or 'outbox') to id,
-- for a row that becomes claimable again (a replay), and holds the floor
-- there until the calling transaction ends. It runs as the owner, for the
-- operators' replays; it can only lower a floor.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_lower(tbl text, id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    seq regclass := CASE tbl WHEN 'inbox' THEN 'inbox_claim_floor_seq'::regclass
                             WHEN 'outbox' THEN 'outbox_claim_floor_seq'::regclass END;
BEGIN
    IF seq IS NULL THEN
        RAISE EXCEPTION 'claim_floor_lower: no claim floor for %', tbl;
    END IF;
    PERFORM claim_floor_lock(seq, false);
    IF coalesce(pg_sequence_last_value(seq), 0) > id THEN
        PERFORM setval(seq, id, true);
    END IF;
END;
$$;
-- +goose StatementEnd

-- Run as the owner, it finds its sequences in this schema only, never in
-- a caller's temporary schema.
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION claim_floor_lower(text, bigint) SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd

-- A replay lowers the floor to its row.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM claim_floor_lower(TG_TABLE_NAME, NEW.id);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- The replay triggers find claim_floor_lower in this schema, whatever the
-- search_path of the session replaying.
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION claim_floor_replay() SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd

-- Whatever makes an ended message pending again (the replay trigger, or
-- an UPDATE by hand) lowers the floor. No column list: a replay names
-- only replay_requested, and its trigger sets the status.
CREATE TRIGGER inbox_claim_floor_replay AFTER UPDATE ON inbox
FOR EACH ROW WHEN (OLD.status <> 'pending' AND NEW.status = 'pending')
EXECUTE FUNCTION claim_floor_replay();
-- An outbox row is opened again only by the replay of a dead one. (The
-- relay's release unmarks rows its own transaction marked published: the
-- floor never passed them.)
CREATE TRIGGER outbox_claim_floor_replay AFTER UPDATE ON outbox
FOR EACH ROW WHEN (OLD.dead_at IS NOT NULL AND NEW.dead_at IS NULL AND NEW.published_at IS NULL)
EXECUTE FUNCTION claim_floor_replay();

-- Only the service raises the floors (and it needs UPDATE on the floors).
REVOKE EXECUTE ON FUNCTION claim_floor_raise(regclass, regclass, text, bigint, text[]),
    inbox_claim_floor_raise(bigint, text[]), outbox_claim_floor_raise(bigint, text[]) FROM PUBLIC;

-- The grants of migration 00021 stay as they were, under another name.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00021; END $$;
-- +goose StatementEnd

-- The claims read the floors; the service raises them (reading the ids
-- handed out); a replay lowers them through claim_floor_lower.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00021();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_claim_floor_seq, outbox_claim_floor_seq TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT, UPDATE ON inbox_claim_floor_seq, outbox_claim_floor_seq TO inbox_service;
        EXECUTE format('GRANT SELECT ON %s, %s TO inbox_service',
                       pg_get_serial_sequence('inbox', 'id'), pg_get_serial_sequence('outbox', 'id'));
        GRANT EXECUTE ON FUNCTION claim_floor_raise(regclass, regclass, text, bigint, text[]),
            inbox_claim_floor_raise(bigint, text[]), outbox_claim_floor_raise(bigint, text[]) TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00021() IS 'the grants of migration 00021; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00021() RENAME TO inbox_grant_roles;
DROP TRIGGER outbox_claim_floor_replay ON outbox;
DROP TRIGGER inbox_claim_floor_replay ON inbox;
DROP FUNCTION claim_floor_replay();
DROP FUNCTION claim_floor_lower(text, bigint);
DROP FUNCTION outbox_claim_floor_raise(bigint, text[]);
DROP FUNCTION inbox_claim_floor_raise(bigint, text[]);
DROP FUNCTION claim_floor_raise(regclass, regclass, text, bigint, text[]);
DROP FUNCTION claim_floor_proven(regclass, regclass, text[]);
DROP FUNCTION claim_floor_inserters(regclass);
DROP TRIGGER outbox_claim_floor_inserting ON outbox;
DROP TRIGGER inbox_claim_floor_inserting ON inbox;
DROP FUNCTION claim_floor_inserting();
DROP FUNCTION claim_floor_lock(regclass, boolean);
DROP FUNCTION outbox_claim_floor();
DROP FUNCTION inbox_claim_floor();
DROP SEQUENCE outbox_claim_floor_seq;
DROP SEQUENCE inbox_claim_floor_seq;
