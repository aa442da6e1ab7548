-- +goose Up

-- inbox_service is the role inboxd serves as: it reads and writes the rows
-- of the service's tables and owns nothing, so it can create, alter, drop or
-- truncate nothing. Migrations run as the schema's owner (inboxd migrate, or
-- serve with INBOX_MIGRATE=true); serve then runs as a login role granted
-- inbox_service, with INBOX_MIGRATE=false:
--   CREATE ROLE inboxd LOGIN PASSWORD '...' IN ROLE inbox_service;
-- As with inbox_operator, the role is created if the migrating user may;
-- otherwise a database administrator creates it (CREATE ROLE inbox_service
-- NOLOGIN) and migrates again, or runs the grants below.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolcreaterole OR rolsuper)) THEN
            RAISE NOTICE 'role inbox_service does not exist and % may not create it: skipping its grants', current_user;
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE inbox_service NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by a migration of another schema
        END;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_service', current_schema());
    GRANT SELECT, INSERT, UPDATE, DELETE
        ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox
        TO inbox_service;
    GRANT SELECT ON inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                    inbox_held_back, outbox_backlog, stock_overview
        TO inbox_service;
    -- serve checks that the schema is migrated as far as it needs.
    GRANT SELECT ON goose_db_version TO inbox_service;
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
