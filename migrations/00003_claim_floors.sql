-- +goose Up

-- Claim floors: where the claims start their scans.
--
-- The workers find pending messages, and the relay open outbox rows, by
-- scanning a partial index from its oldest entry. Each row that ends leaves
-- its entry behind until vacuum removes it, and vacuum removes nothing a
-- snapshot still open could see: an analytics query, a pg_dump, a standby
-- with hot_standby_feedback or a replication slot held for minutes would
-- leave every claim wading through every entry written since.
--
-- A floor is an id under which no row can be claimed: every inbox row below
-- it is processed or dead, every outbox row published or dead. The claims
-- (and the counts of open rows) scan from the floor. It is kept in a
-- sequence, which changes in place and leaves no row versions behind, and
-- the service's keeper raises it only as far as this proves safe:
--
--   * Rows take their ids when inserted but commit in another order. Every
--     statement that writes a table takes its ROW EXCLUSIVE lock before it
--     runs, so before any of its rows takes an id, and holds it until its
--     transaction ends. The keeper notes the last id handed out, then the
--     transactions holding that lock (the table's writers). Once all of
--     those have ended, every row up to the noted id is committed or gone,
--     and the oldest one still open is the new floor; until then the note is
--     kept. So the floor trails by a round of the keeper, and a transaction
--     that writes the table and stays open holds the floor until it ends.
--   * A replay makes an ended row claimable again. A trigger lowers the floor
--     to its row, holding the table's row of claim_floor_locks locked (the
--     floor lock) until its transaction ends; the keeper raises the floor
--     only while holding the same lock, and reads the floor again once it
--     has it.
--   * An audit finds any row left open under a floor and lowers the floor
--     to it.
--
-- Both locks are locks only the service's roles can take: a table's ROW
-- EXCLUSIVE lock needs a right to write it, a row lock a right to update
-- it. Advisory locks are one namespace for every login of the database,
-- and pg_locks shows their keys to all: any login could have held one and
-- stalled every insert, or every raise. Waiting for every writer, not only
-- inserters, costs a floor a round at most: a writer that stays open (a
-- relay waiting for confirms, an operator's open UPDATE) holds it back as
-- an inserter that stays open does.
--
-- The floor only ever makes a scan shorter: with no keeper running it stays
-- where it is and the claims read from there. These are functions and
-- triggers rather than service code so that an operator's replay by hand,
-- and any inserter, keep the floors safe too.

-- The floors. Set to 0 as called, so that pg_sequence_last_value reads 0
-- (the readers coalesce a NULL to 0 as well). The service only reads them
-- and calls setval; nothing calls nextval.
CREATE SEQUENCE inbox_claim_floor_seq AS bigint MINVALUE 0 START WITH 0;
SELECT setval('inbox_claim_floor_seq', 0, true);
CREATE SEQUENCE outbox_claim_floor_seq AS bigint MINVALUE 0 START WITH 0;
SELECT setval('outbox_claim_floor_seq', 0, true);

-- inbox_claim_floor returns the inbox's floor: every pending message has an
-- id at least this. STABLE, so that a claim reads it once, as an index bound.
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor() RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$ SELECT coalesce(pg_sequence_last_value('inbox_claim_floor_seq'), 0) $$;
-- +goose StatementEnd

-- outbox_claim_floor returns the outbox's floor: every row neither published
-- nor dead has an id at least this.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor() RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$ SELECT coalesce(pg_sequence_last_value('outbox_claim_floor_seq'), 0) $$;
-- +goose StatementEnd

-- The floor locks, a row per table with a floor: whoever moves a floor
-- holds its row locked (FOR UPDATE) until its transaction ends.
CREATE TABLE claim_floor_locks (
    tbl regclass PRIMARY KEY
);
INSERT INTO claim_floor_locks VALUES ('inbox'), ('outbox');

-- claim_floor_lock takes, until the transaction ends, the floor lock of tbl,
-- which serialises raising the floor with lowering it: waiting for it, or,
-- with try, not (it then returns false).
-- +goose StatementBegin
CREATE FUNCTION claim_floor_lock(tbl regclass, try boolean) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    IF try THEN
        PERFORM 1 FROM claim_floor_locks l WHERE l.tbl = claim_floor_lock.tbl FOR UPDATE SKIP LOCKED;
        RETURN FOUND;
    END IF;
    PERFORM 1 FROM claim_floor_locks l WHERE l.tbl = claim_floor_lock.tbl FOR UPDATE;
    RETURN true;
END;
$$;
-- +goose StatementEnd

-- claim_floor_inserters returns the transactions (virtual ids) that write
-- tbl (hold its ROW EXCLUSIVE lock) at the time of the call: every
-- transaction inserting into it among them.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_inserters(tbl regclass) RETURNS text[]
LANGUAGE sql
AS $$
    SELECT coalesce(array_agg(l.virtualtransaction), '{}')
    FROM pg_locks l
    WHERE l.locktype = 'relation' AND l.relation = tbl AND l.mode = 'RowExclusiveLock' AND l.granted
      AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
$$;
-- +goose StatementEnd

-- claim_floor_proven reports whether a note's inserters (the transactions
-- that wrote tbl when the note was taken) have all ended, and then takes
-- the floor lock of tbl, held until the calling transaction
-- ends; false while one runs, or while a replay or another keeper holds
-- the lock. Only under READ COMMITTED does each later statement see what
-- those transactions committed.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_proven(seq regclass, tbl regclass, noted_inserters text[]) RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'a claim floor is raised only under READ COMMITTED: each statement must see the transactions that ended before it';
    END IF;
    IF cardinality(noted_inserters) > 0 AND claim_floor_inserters(tbl) && noted_inserters THEN
        RETURN false;
    END IF;
    RETURN claim_floor_lock(tbl, true);
END;
$$;
-- +goose StatementEnd

-- claim_floor_raise raises the floor seq of tbl, whose open rows (those a
-- claim may take, at once or later) are those where open holds, as far as the
-- keeper's note proves safe, and returns the floor with the note for the
-- next call: the note given, while its inserters run (or the floor lock is
-- held elsewhere), else a new one. The keeper calls it through the table's
-- function below, in a statement of its own, first with a NULL note. A note
-- whose last id is past the id sequence's (taken on another server, before
-- a failover) is dropped. Its scan is dynamic SQL, planned at each call for
-- the table as it is. Not PUBLIC's: the service alone raises the floors.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_raise(tbl regclass, seq regclass, open text, noted_last bigint, noted_inserters text[],
                                  OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE plpgsql
AS $$
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
    -- The last id handed out, then the transactions writing now: each
    -- took the table's lock before its rows took their ids.
    next_last := coalesce(pg_sequence_last_value(ids), 0);
    next_inserters := claim_floor_inserters(tbl);
END;
$$;
-- +goose StatementEnd

-- inbox_claim_floor_raise raises the inbox's floor (claim_floor_raise): its
-- open rows are the pending messages.
-- +goose StatementBegin
CREATE FUNCTION inbox_claim_floor_raise(noted_last bigint, noted_inserters text[],
                                        OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM claim_floor_raise('inbox', 'inbox_claim_floor_seq', $open$status = 'pending'$open$, noted_last, noted_inserters)
$$;
-- +goose StatementEnd

-- outbox_claim_floor_raise raises the outbox's floor: its open rows are those
-- neither published nor dead.
-- +goose StatementBegin
CREATE FUNCTION outbox_claim_floor_raise(noted_last bigint, noted_inserters text[],
                                         OUT floor bigint, OUT next_last bigint, OUT next_inserters text[])
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM claim_floor_raise('outbox', 'outbox_claim_floor_seq', 'published_at IS NULL AND dead_at IS NULL', noted_last, noted_inserters)
$$;
-- +goose StatementEnd

-- claim_floor_lower lowers the floor of tbl ('inbox' or 'outbox') to id, for
-- a row that becomes claimable again, and holds the floor there until the
-- calling transaction ends. It can only lower a floor. It runs as the owner
-- (SECURITY DEFINER) so that an operator's replay may set the floor's
-- sequence, which the operator may not; so it trusts nothing of the
-- caller's session: catalog objects named in full, and (below)
-- search_path pinned to this schema then pg_temp, and no PUBLIC execute.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_lower(tbl text, id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    seq pg_catalog.regclass;
BEGIN
    IF tbl IS NULL OR tbl NOT IN ('inbox', 'outbox') THEN
        RAISE EXCEPTION 'claim_floor_lower: no claim floor for %', tbl;
    END IF;
    seq := pg_catalog.format('%I.%I', pg_catalog.current_schema(), tbl || '_claim_floor_seq')::pg_catalog.regclass;
    PERFORM claim_floor_lock(pg_catalog.format('%I.%I', pg_catalog.current_schema(), tbl)::pg_catalog.regclass, false);
    IF coalesce(pg_catalog.pg_sequence_last_value(seq), 0) > id THEN
        PERFORM pg_catalog.setval(seq, id, true);
    END IF;
END;
$$;
-- +goose StatementEnd
-- Pinned here, in the migration that creates it: this schema, then pg_temp,
-- never a caller's temporary objects first; and no PUBLIC execute right
-- (inbox_grant_roles grants it by name).
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION claim_floor_lower(text, bigint) SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION claim_floor_lower(text, bigint) FROM PUBLIC;

-- claim_floor_replay, a row trigger, lowers the floor to a row made open
-- again. It finds claim_floor_lower in this schema, then pg_temp, whatever
-- the search_path of the session replaying.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_replay() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM claim_floor_lower(TG_TABLE_NAME, NEW.id);
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION claim_floor_replay() SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd

-- Whatever makes an ended message pending again (the replay trigger, or an
-- UPDATE by hand) lowers the floor. No column list: a replay names only
-- replay_requested, and the replay trigger sets the status.
CREATE TRIGGER inbox_claim_floor_replay AFTER UPDATE ON inbox
FOR EACH ROW WHEN (OLD.status <> 'pending' AND NEW.status = 'pending')
EXECUTE FUNCTION claim_floor_replay();

-- An outbox row is opened again only by the replay of a dead one. (A failed
-- publish's release unmarks rows its own transaction marked published: the
-- floor never passed them.)
CREATE TRIGGER outbox_claim_floor_replay AFTER UPDATE ON outbox
FOR EACH ROW WHEN (OLD.dead_at IS NOT NULL AND NEW.dead_at IS NULL AND NEW.published_at IS NULL)
EXECUTE FUNCTION claim_floor_replay();

-- claim_floor_audit looks under the floor of tbl ('inbox' or 'outbox') for
-- a row still open, which no claim would find, lowers the floor to the
-- oldest such row and returns its id, or NULL when there is none. There
-- should never be one (a replay lowers the floor itself); a dump restored
-- with floors past rows it restores as open (pg_dump reads sequences
-- outside its snapshot), or a fault in the floors, leaves one. The service
-- runs it at start and every ten minutes, and logs each row found as an
-- error.
--
-- Its scan reads the ended rows' entries under the floor that vacuum has
-- not removed, which under a snapshot held open can take many seconds. So
-- the scan takes no lock and the raises go on meanwhile (the caller bounds
-- it with a statement_timeout). A row found was open under the floor read
-- before the scan's snapshot, and only a replay committed in between lowers
-- the floor to it itself; so the row is checked again under the floor lock
-- (which a replay holds until it commits), with a snapshot taken after it:
-- still open, and still under the floor.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_audit(tbl text) RETURNS bigint
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
    -- A new statement, so a snapshot taken after the floor was read.
    EXECUTE format('SELECT min(id) FROM %I WHERE (%s) AND id < $1', tbl, open)
        INTO stranded USING floor;
    IF stranded IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM claim_floor_lock(tbl::regclass, false);
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

-- The service's processes, each by a session key: a process's liveness
-- session (and its leader session, internal/leader) holds the session
-- advisory lock (pg_advisory_lock(bigint)) of its key while it is up, and
-- registers the key here with its pid and login. A key is live only while
-- a session of that pid and that login holds its lock: advisory locks are
-- one namespace for every login of the database, and pg_locks shows their
-- keys and pids to all, so a lock alone would let any login keep a dead
-- process's claims, or the lead, alive by taking its key after it (and a
-- pid alone, by connecting until it is given the dead session's pid).
-- Only the service writes here; the janitor deletes the rows of ended
-- sessions.
CREATE TABLE inbox_sessions (
    session    bigint      PRIMARY KEY,
    pid        integer     NOT NULL,
    login      oid         NOT NULL DEFAULT to_regrole(quote_ident(session_user::text))::oid,
    started_at timestamptz NOT NULL DEFAULT now()
);

-- inbox_live_sessions returns the live session keys: those whose lock is
-- held by a session of the pid and login that registered them. A claim whose
-- inbox.claimed_session is not among them (its process died, and
-- PostgreSQL ended its sessions and locks) is taken over at once instead
-- of after the claim lease.
-- +goose StatementBegin
CREATE FUNCTION inbox_live_sessions() RETURNS SETOF bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT s.session
    FROM inbox_sessions s
    JOIN pg_catalog.pg_locks l ON l.pid = s.pid
    JOIN pg_catalog.pg_stat_activity a ON a.pid = s.pid AND a.usesysid = s.login
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
      AND ((l.classid::bigint << 32) | l.objid::bigint) = s.session
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
$$;
-- +goose StatementEnd

-- The process that leads (internal/leader): it runs the maintenance and
-- exports the database gauges. One row, naming its leader session's key;
-- once that key is no longer live another process takes the row over. A
-- row only the service may write, rather than an advisory lock any login
-- could take.
CREATE TABLE inbox_leader (
    one     boolean     PRIMARY KEY DEFAULT true CHECK (one),
    session bigint      NOT NULL,
    since   timestamptz NOT NULL DEFAULT now()
);
