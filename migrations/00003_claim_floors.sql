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
-- sequence, which changes in place and leaves no row versions behind.
--
-- The service's keeper (internal/claimfloor, which has the argument) raises
-- a floor only as far as it proves safe, and audits it. What must hold for
-- every writer is here, so that an operator's replay by hand, and any
-- inserter, keep the floors safe too:
--
--   * A row takes its id once its statement holds the table's ROW
--     EXCLUSIVE lock, which PostgreSQL takes before any statement that
--     writes a table runs and holds until its transaction ends, whoever
--     writes; the keeper reads the table's writers from that lock.
--   * A replay makes an ended row claimable again. A trigger lowers the floor
--     to its row, holding the table's row of claim_floor_locks locked (the
--     floor lock) until its transaction ends; the keeper raises the floor
--     only while holding the same lock, and reads the floor again once it
--     has it.
--
-- Both locks are locks only the service's roles can take: a table's ROW
-- EXCLUSIVE lock needs a right to write it, a row lock a right to update
-- it. Advisory locks are one namespace for every login of the database,
-- and pg_locks shows their keys to all: any login could have held one and
-- stalled every insert, or every raise.
--
-- The floor only ever makes a scan shorter: with no keeper running it stays
-- where it is and the claims read from there.

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
