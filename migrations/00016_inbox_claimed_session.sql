-- +goose Up

-- claimed_session names the liveness of the process holding a message's
-- claim: while that process is up, one of its database sessions holds the
-- session-level advisory lock of this key (pg_advisory_lock(bigint)). When
-- the process dies, PostgreSQL ends its sessions and the lock with them,
-- and the claim is taken over at once instead of after the claim lease.
-- NULL (claims of earlier builds, or taken while the process held no such
-- lock) leaves the claim to the lease alone.
ALTER TABLE inbox ADD COLUMN claimed_session bigint;

-- inbox_live_sessions returns the keys of the session advisory locks
-- (pg_advisory_lock(bigint)) that this database's sessions hold: the
-- processes whose claims are alive.
-- +goose StatementBegin
CREATE FUNCTION inbox_live_sessions() RETURNS SETOF bigint
LANGUAGE sql STABLE
AS $$
    SELECT (l.classid::bigint << 32) | l.objid::bigint
    FROM pg_catalog.pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
$$;
-- +goose StatementEnd

-- The service updates the new column with the other claim columns. The
-- grants of migration 00013 stay as they were, under another name (called
-- only from here: on its own it would revoke this right), and the function
-- operators run after creating the roles adds this one. A later migration
-- that replaces inbox_grant_roles() with a whole body of its own must grant
-- it too.
-- (In a DO block: sqlc, which reads these files for its catalog, does not
-- follow a function's rename.)
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00013; END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00013();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT UPDATE (claimed_session) ON inbox TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00013() IS 'the grants of migration 00013; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_live_sessions();
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00013() RENAME TO inbox_grant_roles;
SELECT inbox_grant_roles();
ALTER TABLE inbox DROP COLUMN claimed_session;
