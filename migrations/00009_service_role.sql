-- +goose Up

-- inbox_service is the role inboxd serves as: it reads and writes the rows
-- of the service's tables and owns nothing, so it can create, alter, drop or
-- truncate nothing. Migrations run as the schema's owner (inboxd migrate, or
-- serve with INBOX_MIGRATE=true); serve then runs as a login role granted
-- inbox_service, with INBOX_MIGRATE=false:
--   CREATE ROLE inboxd LOGIN PASSWORD '...' IN ROLE inbox_service;
--
-- inbox_grant_roles() gives inbox_operator and inbox_service, those of them
-- that exist, their rights on this schema. The migrations create the roles
-- when the migrating user may create roles, and call it. Otherwise a
-- database administrator creates them and calls it, at any time, as often
-- as needed:
--   CREATE ROLE inbox_operator NOLOGIN;
--   CREATE ROLE inbox_service NOLOGIN;
--   SELECT inbox_grant_roles();  -- with search_path set to the schema
-- Later migrations that add tables or views replace it.
-- +goose StatementBegin
CREATE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    granted text[] := '{}';
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_operator', current_schema());
        GRANT SELECT ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox,
                        inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                        inbox_held_back, outbox_backlog, stock_overview
            TO inbox_operator;
        GRANT UPDATE (replay_requested, replay_reason) ON inbox TO inbox_operator;
        granted := granted || 'inbox_operator'::text;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_service', current_schema());
        GRANT SELECT, INSERT, UPDATE, DELETE
            ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox
            TO inbox_service;
        GRANT SELECT ON inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                        inbox_held_back, outbox_backlog, stock_overview
            TO inbox_service;
        -- serve checks that the schema is migrated as far as it needs.
        GRANT SELECT ON goose_db_version TO inbox_service;
        granted := granted || 'inbox_service'::text;
    END IF;
    IF cardinality(granted) = 0 THEN
        RETURN 'neither inbox_operator nor inbox_service exists: nothing granted';
    END IF;
    RETURN 'granted to ' || array_to_string(granted, ', ');
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolcreaterole OR rolsuper)) THEN
            RAISE NOTICE 'role inbox_service does not exist and % may not create it: create it, then SELECT inbox_grant_roles()', current_user;
        ELSE
            BEGIN
                CREATE ROLE inbox_service NOLOGIN;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created meanwhile by a migration of another schema
            END;
        END IF;
    END IF;
    PERFORM inbox_grant_roles();
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        REVOKE ALL ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox,
                      inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                      inbox_held_back, outbox_backlog, stock_overview, goose_db_version
            FROM inbox_service;
        EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM inbox_service', current_schema());
    END IF;
END;
$$;
-- +goose StatementEnd
DROP FUNCTION inbox_grant_roles();
