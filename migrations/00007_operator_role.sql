-- +goose Up

-- inbox_operator is the role of the people who inspect the service and
-- replay messages with plain SQL: it reads every table and view, and may
-- change only the replay columns of inbox (the replay trigger does the
-- rest). Grant it to a login role: GRANT inbox_operator TO alice;
-- Roles belong to the whole cluster: the role is created if it does not
-- exist and the migrating user may create roles; otherwise a database
-- administrator creates it (CREATE ROLE inbox_operator NOLOGIN) and runs
-- the grants below.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolcreaterole OR rolsuper)) THEN
            RAISE NOTICE 'role inbox_operator does not exist and % may not create it: skipping its grants', current_user;
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE inbox_operator NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by a migration of another schema
        END;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_operator', current_schema());
    GRANT SELECT ON inbox, order_confirmations, stock, stock_reservations, outbox,
                    inbox_overview, inbox_dead, inbox_held_back, outbox_backlog, stock_overview
        TO inbox_operator;
    GRANT UPDATE (replay_requested, replay_reason) ON inbox TO inbox_operator;
END;
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        REVOKE ALL ON inbox, order_confirmations, stock, stock_reservations, outbox,
                      inbox_overview, inbox_dead, inbox_held_back, outbox_backlog, stock_overview
            FROM inbox_operator;
        EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM inbox_operator', current_schema());
    END IF;
END;
$$;
-- +goose StatementEnd
