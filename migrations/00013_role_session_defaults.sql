-- +goose Up

-- Two changes to the roles of 00007 and 00009, both made by
-- inbox_grant_roles(), which this migration replaces and calls:
--
-- 1. Operators' sessions get short defaults, so that a forgotten psql
--    transaction holding inbox rows (SELECT … FOR UPDATE) cannot hold them
--    for long: statement_timeout 30s, lock_timeout 5s,
--    idle_in_transaction_session_timeout 60s. PostgreSQL applies a role's
--    settings (ALTER ROLE … SET) only to sessions whose session user is
--    that role, never to its members: inbox_operator cannot log in, so its
--    settings are the defaults that inbox_grant_roles() copies to each
--    login that is a member of it (directly or through other roles),
--    for every setting that login has none of its own. A login's own
--    setting is never overwritten:
--      ALTER ROLE alice SET statement_timeout = '5min';    -- alice only
--      ALTER ROLE inbox_operator SET lock_timeout = '2s';  -- the defaults;
--      ALTER ROLE alice RESET lock_timeout;                -- then, per login,
--      SELECT inbox_grant_roles();                         -- copied again
--    A login made an operator later gets them when inbox_grant_roles()
--    runs again (or by the same ALTER ROLE statements). Changing another
--    role's settings takes CREATEROLE (or a superuser): without it, the
--    function says which statements to run instead.
--
-- 2. inbox_service keeps only the rights inboxd uses: SELECT on its tables
--    and views; INSERT on what ingest, workers and the handler write;
--    UPDATE on only the columns they change; DELETE on only what the
--    janitor deletes (inbox, inbox_attempts, outbox, inbox_conflicts).
--    Orders, stock and reservations are never deleted by the service, and
--    stock is filled by operators.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    granted  text[] := '{}';
    defaults text[] := ARRAY['statement_timeout=30s', 'lock_timeout=5s', 'idle_in_transaction_session_timeout=60s'];
    setting  text;
    login    text;
BEGIN
    -- Role settings are rows of one catalog: concurrent calls (migrations
    -- of several schemas) would update the same ones.
    PERFORM pg_advisory_xact_lock(hashtext('inbox_grant_roles'));

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_operator', current_schema());
        GRANT SELECT ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox,
                        inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                        inbox_held_back, outbox_backlog, stock_overview
            TO inbox_operator;
        GRANT UPDATE (replay_requested, replay_reason) ON inbox TO inbox_operator;
        granted := granted || 'inbox_operator'::text;

        -- The defaults, on inbox_operator, where it has none of its own.
        FOREACH setting IN ARRAY defaults LOOP
            IF NOT EXISTS (SELECT 1 FROM pg_db_role_setting s, unnest(s.setconfig) c
                           WHERE s.setrole = 'inbox_operator'::regrole AND s.setdatabase = 0
                             AND split_part(c, '=', 1) = split_part(setting, '=', 1)) THEN
                BEGIN
                    EXECUTE format('ALTER ROLE inbox_operator SET %I = %L', split_part(setting, '=', 1), split_part(setting, '=', 2));
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE '% may not change inbox_operator: run ALTER ROLE inbox_operator SET % = %', current_user, split_part(setting, '=', 1), quote_literal(split_part(setting, '=', 2));
                END;
            END IF;
        END LOOP;

        -- Copied to each login member (not a superuser, not the caller,
        -- not the service) that has no setting of its own for it.
        -- A login dropped meanwhile (by another session, between the
        -- query's reading of the members and its checks of each) needs no
        -- settings: the copy runs again without it.
        FOR try IN 1..3 LOOP
            BEGIN
                FOR login, setting IN
                    WITH RECURSIVE members AS (
                        SELECT m.member FROM pg_auth_members m WHERE m.roleid = 'inbox_operator'::regrole
                        UNION
                        SELECT m.member FROM pg_auth_members m JOIN members ON m.roleid = members.member
                    )
                    SELECT r.rolname, c
                    FROM members
                    JOIN pg_roles r ON r.oid = members.member
                    CROSS JOIN LATERAL (SELECT unnest(setconfig) AS c FROM pg_db_role_setting
                                        WHERE setrole = 'inbox_operator'::regrole AND setdatabase = 0) g
                    WHERE r.rolcanlogin AND NOT r.rolsuper AND r.rolname <> current_user
                      AND NOT pg_has_role(r.oid, 'inbox_service', 'MEMBER')
                      AND split_part(c, '=', 1) IN ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')
                      AND NOT EXISTS (SELECT 1 FROM pg_db_role_setting s, unnest(s.setconfig) own
                                      WHERE s.setrole = r.oid AND s.setdatabase = 0
                                        AND split_part(own, '=', 1) = split_part(c, '=', 1))
                LOOP
                    BEGIN
                        EXECUTE format('ALTER ROLE %I SET %I = %L', login, split_part(setting, '=', 1), split_part(setting, '=', 2));
                    EXCEPTION WHEN insufficient_privilege THEN
                        RAISE NOTICE '% may not change role %: run ALTER ROLE % SET % = %', current_user, login, quote_ident(login), split_part(setting, '=', 1), quote_literal(split_part(setting, '=', 2));
                    END;
                END LOOP;
                EXIT;
            EXCEPTION WHEN undefined_object THEN
                IF try = 3 THEN
                    RAISE;
                END IF;
            END;
        END LOOP;
    END IF;

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_service', current_schema());
        -- What an earlier version granted goes first (column rights too).
        REVOKE ALL ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox
            FROM inbox_service;
        GRANT SELECT ON inbox, inbox_attempts, inbox_conflicts, order_confirmations, stock, stock_reservations, outbox,
                        inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, inbox_throughput,
                        inbox_held_back, outbox_backlog, stock_overview
            TO inbox_service;
        -- ingest stores deliveries; workers claim, record outcomes and the
        -- attempt history; the janitor deletes past the retention.
        GRANT INSERT, DELETE ON inbox, inbox_attempts TO inbox_service;
        GRANT UPDATE (attempts, claimed_at, claimed_by, claimed_build, status, replay_requested,
                      result, last_error, processed_at, next_attempt_at)
            ON inbox TO inbox_service;
        -- ingest records conflicting duplicates; the janitor deletes them.
        GRANT INSERT, DELETE ON inbox_conflicts TO inbox_service;
        GRANT UPDATE (deliveries, last_seen_at) ON inbox_conflicts TO inbox_service;
        -- the handler records, cancels and rejects orders.
        GRANT INSERT ON order_confirmations TO inbox_service;
        GRANT UPDATE (status, reason, updated_at) ON order_confirmations TO inbox_service;
        -- the handler reserves and releases stock.
        GRANT UPDATE (available, updated_at) ON stock TO inbox_service;
        GRANT INSERT ON stock_reservations TO inbox_service;
        GRANT UPDATE (released_at) ON stock_reservations TO inbox_service;
        -- the handler writes effects; the relay claims and marks them; the
        -- janitor deletes published ones.
        GRANT INSERT, DELETE ON outbox TO inbox_service;
        GRANT UPDATE (attempts, claimed_at, published_at, last_error, next_attempt_at) ON outbox TO inbox_service;
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

SELECT inbox_grant_roles();

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
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

-- The operators' session defaults stay: roles belong to the cluster, and
-- other schemas' deployments may rely on them.
SELECT inbox_grant_roles();
