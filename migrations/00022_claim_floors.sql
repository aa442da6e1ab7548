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
--     order. A statement trigger gives each inserting transaction its
--     transaction id before any row takes an id. The keeper notes the last
--     id handed out, then the running transactions (a snapshot). Once all
--     of those that write the table have ended, every row with an id up to
--     the one noted is committed or gone, and the oldest such row still
--     open is the new floor. So the floor trails by a round of the keeper (a fraction of a
--     second), and a transaction that holds its rows for longer (a commit
--     waiting for a synchronous standby) holds the floor where it is.
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

-- claim_floor_lower lowers the floor seq to id, for a row that becomes
-- claimable again (a replay), and holds the floor there until the calling
-- transaction ends.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_lower(seq regclass, id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM claim_floor_lock(seq, false);
    IF coalesce(pg_sequence_last_value(seq), 0) > id THEN
        PERFORM setval(seq, id, true);
    END IF;
END;
$$;
-- +goose StatementEnd

-- claim_floor_start returns the floor seq of table tbl, to be raised by the
-- caller, when every transaction that was running when the keeper noted
-- (noted_last, noted) and that writes tbl has ended, and the floor lock is
-- free (it is then held until the
-- calling transaction ends); else NULL. noted_last is the last id the
-- table's sequence had handed out, noted the snapshot taken after it.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_start(seq regclass, tbl regclass, noted_last bigint, noted pg_snapshot) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'a claim floor is raised only under READ COMMITTED: each statement must see the transactions that ended before it';
    END IF;
    IF noted IS NULL OR noted_last IS NULL THEN
        RETURN NULL;
    END IF;
    -- A transaction of the note still running matters only if it holds a
    -- lock on the table: one that took an id holds one from the start of
    -- its INSERT to its end. A long transaction elsewhere on the server (a
    -- batch job in another database) does not hold the floor. pg_locks is
    -- read only when one of the note's transactions is still running.
    -- (pg_xact_status is NULL for a transaction too old to be recorded: it
    -- ended long ago.)
    IF EXISTS (SELECT 1 FROM pg_snapshot_xip(noted) x WHERE pg_xact_status(x) = 'in progress')
       AND EXISTS (SELECT 1
                   FROM pg_snapshot_xip(noted) x
                   JOIN pg_locks t ON t.locktype = 'transactionid' AND t.transactionid = x::xid
                   JOIN pg_locks r ON r.virtualtransaction = t.virtualtransaction
                                  AND r.locktype = 'relation' AND r.relation = tbl
                   WHERE pg_xact_status(x) = 'in progress') THEN
        RETURN NULL;
    END IF;
    IF NOT claim_floor_lock(seq, true) THEN
        RETURN NULL;
    END IF;
    -- Read under the lock: a replay that lowered the floor has committed.
    RETURN coalesce(pg_sequence_last_value(seq), 0);
END;
$$;
-- +goose StatementEnd

-- inbox_claim_floor_raise raises the inbox's floor as far as the keeper's
-- last note proves safe (see claim_floor_start), and returns the floor with
-- the next note: the last id handed out, then the running transactions.
-- The keeper calls it in a statement of its own, passing the note it got
-- from the call before (NULLs the first time).
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor_raise(noted_last bigint, noted pg_snapshot,
                                        OUT floor bigint, OUT next_last bigint, OUT next_noted pg_snapshot)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
-- Planned at each call, for the table as it is: a plan kept from when the
-- table was small would scan it whole.
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    from_id bigint := claim_floor_start('inbox_claim_floor_seq', 'inbox', noted_last, noted);
BEGIN
    IF from_id IS NOT NULL AND noted_last >= from_id THEN
        -- A new statement, so a new snapshot: it sees every row up to noted_last.
        SELECT coalesce(min(i.id), noted_last + 1) INTO floor
        FROM inbox i
        WHERE i.status = 'pending' AND i.id >= from_id AND i.id <= noted_last;
        PERFORM setval('inbox_claim_floor_seq', floor, true);
    ELSE
        floor := inbox_claim_floor();
    END IF;
    next_last := coalesce(pg_sequence_last_value(pg_get_serial_sequence('inbox', 'id')::regclass), 0);
    next_noted := pg_current_snapshot();
END;
$$;
-- +goose StatementEnd

-- outbox_claim_floor_raise does for the outbox what inbox_claim_floor_raise
-- does for the inbox.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor_raise(noted_last bigint, noted pg_snapshot,
                                         OUT floor bigint, OUT next_last bigint, OUT next_noted pg_snapshot)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
-- Planned at each call, for the table as it is: a plan kept from when the
-- table was small would scan it whole.
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    from_id bigint := claim_floor_start('outbox_claim_floor_seq', 'outbox', noted_last, noted);
BEGIN
    IF from_id IS NOT NULL AND noted_last >= from_id THEN
        SELECT coalesce(min(o.id), noted_last + 1) INTO floor
        FROM outbox o
        WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.id >= from_id AND o.id <= noted_last;
        PERFORM setval('outbox_claim_floor_seq', floor, true);
    ELSE
        floor := outbox_claim_floor();
    END IF;
    next_last := coalesce(pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass), 0);
    next_noted := pg_current_snapshot();
END;
$$;
-- +goose StatementEnd

-- claim_floor_xact gives the inserting transaction its transaction id
-- before any of its rows takes an id (see the top of this file).
-- +goose StatementBegin
CREATE FUNCTION claim_floor_xact() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER inbox_claim_floor_xact BEFORE INSERT ON inbox
FOR EACH STATEMENT EXECUTE FUNCTION claim_floor_xact();
CREATE TRIGGER outbox_claim_floor_xact BEFORE INSERT ON outbox
FOR EACH STATEMENT EXECUTE FUNCTION claim_floor_xact();

-- A replay lowers the floor to its row.
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM claim_floor_lower('inbox_claim_floor_seq', NEW.id);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM claim_floor_lower('outbox_claim_floor_seq', NEW.id);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- Whatever makes an ended row open again (the replay triggers, or an
-- UPDATE by hand) lowers the floor. No column list: a replay names only
-- replay_requested, and its trigger sets the status.
CREATE TRIGGER inbox_claim_floor_replay AFTER UPDATE ON inbox
FOR EACH ROW WHEN (OLD.status <> 'pending' AND NEW.status = 'pending')
EXECUTE FUNCTION inbox_claim_floor_replay();
CREATE TRIGGER outbox_claim_floor_replay AFTER UPDATE ON outbox
FOR EACH ROW WHEN ((OLD.published_at IS NOT NULL OR OLD.dead_at IS NOT NULL)
                   AND NEW.published_at IS NULL AND NEW.dead_at IS NULL)
EXECUTE FUNCTION outbox_claim_floor_replay();

-- The grants of migration 00021 stay as they were, under another name.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00021; END $$;
-- +goose StatementEnd

-- The claims read the floors; the keeper raises them, and a replay lowers
-- them, through functions that run as the tables' owner.
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
        GRANT SELECT ON inbox_claim_floor_seq, outbox_claim_floor_seq TO inbox_service;
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
DROP FUNCTION outbox_claim_floor_replay();
DROP FUNCTION inbox_claim_floor_replay();
DROP TRIGGER outbox_claim_floor_xact ON outbox;
DROP TRIGGER inbox_claim_floor_xact ON inbox;
DROP FUNCTION claim_floor_xact();
DROP FUNCTION outbox_claim_floor_raise(bigint, pg_snapshot);
DROP FUNCTION inbox_claim_floor_raise(bigint, pg_snapshot);
DROP FUNCTION claim_floor_start(regclass, regclass, bigint, pg_snapshot);
DROP FUNCTION claim_floor_lower(regclass, bigint);
DROP FUNCTION claim_floor_lock(regclass, boolean);
DROP FUNCTION outbox_claim_floor();
DROP FUNCTION inbox_claim_floor();
DROP SEQUENCE outbox_claim_floor_seq;
DROP SEQUENCE inbox_claim_floor_seq;
