-- +goose Up

-- Two roles, created here when the migrating user may create roles:
--
--   inbox_operator  the people who inspect the service and replay messages
--                   with plain SQL. Reads every table and view; may change
--                   only the replay columns of inbox and outbox (the replay
--                   triggers do the rest) and lower a claim floor.
--                   GRANT inbox_operator TO alice;
--   inbox_service   the role inboxd serves as. Reads and writes the rows of
--                   the service's tables and owns nothing, so it can create,
--                   alter or drop nothing (it may TRUNCATE only the key
--                   ledger's slots and hot parts, which its janitor
--                   empties: internal/janitor/keys.go).
--                   CREATE ROLE inboxd LOGIN PASSWORD '...' IN ROLE inbox_service;
--
-- Roles belong to the whole cluster. Where the migrating user may not
-- create them, a database administrator does, then calls inbox_grant_roles()
-- with search_path set to the schema, at any time, as often as needed:
--   CREATE ROLE inbox_operator NOLOGIN;
--   CREATE ROLE inbox_service NOLOGIN;
--   SELECT inbox_grant_roles();
-- +goose StatementBegin
DO $$
DECLARE
    role text;
BEGIN
    FOREACH role IN ARRAY ARRAY['inbox_operator', 'inbox_service'] LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role);
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolcreaterole OR rolsuper)) THEN
            RAISE NOTICE 'role % does not exist and % may not create it: create it, then SELECT inbox_grant_roles()', role, current_user;
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by a migration of another schema
        END;
    END LOOP;
END;
$$;
-- +goose StatementEnd

-- inbox_grant_roles gives inbox_operator and inbox_service, those of them
-- that exist, their rights on this schema, and returns whom it granted to.
-- Every right either role has is here, once; docs/security.md
-- lists them, and a test holds the catalogs to that list. A change of
-- rights is a new migration that replaces this function (CREATE OR
-- REPLACE) and calls it.
--
-- It also gives inbox_operator, and each login granted it that has not
-- set its own, the session defaults an operator's psql should carry
-- (statement, lock and idle-in-transaction timeouts): an operator's
-- forgotten BEGIN must not hold rows the service needs for long.
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
    part     integer;
    -- Every table and view, which both roles read.
    readable text := 'inbox, inbox_attempts, inbox_conflicts, inbox_reply_requests, '
        'inbox_keys, inbox_key_generations, inbox_key_hot_parts, inbox_sessions, inbox_leader, claim_floor_locks, '
        'outbox, order_confirmations, stock, stock_moves, stock_reservations, '
        'inbox_overview, inbox_dead, inbox_dead_by_error, inbox_failures_by_build, '
        'inbox_throughput, inbox_held_back, inbox_lock_holders, inbox_replies, '
        'inbox_key_ledger, outbox_backlog, outbox_dead, stock_levels, stock_overview';
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('inbox_grant_roles'));

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO inbox_operator', current_schema());
        EXECUTE format('GRANT SELECT ON %s, inbox_claim_floor_seq, outbox_claim_floor_seq TO inbox_operator', readable);
        GRANT UPDATE (replay_requested, replay_reason) ON inbox, outbox TO inbox_operator;
        GRANT EXECUTE ON FUNCTION claim_floor_lower(text, bigint) TO inbox_operator;
        granted := granted || 'inbox_operator'::text;

        FOREACH setting IN ARRAY defaults LOOP
            IF NOT EXISTS (SELECT 1 FROM pg_db_role_setting s, unnest(s.setconfig) c
                           WHERE s.setrole = 'inbox_operator'::regrole AND s.setdatabase = 0
                             AND split_part(c, '=', 1) = split_part(setting, '=', 1)) THEN
                BEGIN
                    EXECUTE format('ALTER ROLE inbox_operator SET %I = %L', split_part(setting, '=', 1), split_part(setting, '=', 2));
                EXCEPTION
                    WHEN insufficient_privilege THEN
                        RAISE NOTICE '% may not change inbox_operator: run ALTER ROLE inbox_operator SET % = %', current_user, split_part(setting, '=', 1), quote_literal(split_part(setting, '=', 2));
                    -- Roles are the cluster's, the advisory lock above the
                    -- database's: a migration of another database set the
                    -- same default at the same moment.
                    WHEN unique_violation THEN
                        NULL;
                END;
            END IF;
        END LOOP;

        -- A login granted inbox_operator (directly or through other roles)
        -- gets the role's defaults it has not set itself. A role dropped
        -- while this runs is tried again.
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
                    EXCEPTION
                        WHEN insufficient_privilege THEN
                            RAISE NOTICE '% may not change role %: run ALTER ROLE % SET % = %', current_user, login, quote_ident(login), split_part(setting, '=', 1), quote_literal(split_part(setting, '=', 2));
                        WHEN unique_violation THEN
                            NULL; -- set at the same moment by another database's migration
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
        EXECUTE format('GRANT SELECT ON %s, goose_db_version TO inbox_service', readable);
        -- inbox: stored by ingest, claimed, handled and marked by workers,
        -- and deleted by the janitor after retention.
        GRANT INSERT, DELETE ON inbox, inbox_attempts, inbox_conflicts, inbox_reply_requests, stock_moves, outbox
            TO inbox_service;
        GRANT UPDATE (attempts, claimed_at, claimed_by, claimed_build, claimed_session, status, replay_requested,
                      result, reply, last_error, processed_at, next_attempt_at)
            ON inbox TO inbox_service;
        GRANT UPDATE (deliveries, last_seen_at) ON inbox_conflicts TO inbox_service;
        GRANT UPDATE (answered_run, answered_at) ON inbox_reply_requests TO inbox_service;
        GRANT INSERT ON inbox_keys TO inbox_service;
        GRANT INSERT, UPDATE ON inbox_key_generations TO inbox_service;
        GRANT UPDATE ON inbox_key_hot_parts TO inbox_service;
        FOR part IN 0..9 LOOP
            EXECUTE format('GRANT TRUNCATE ON %I TO inbox_service', 'inbox_keys_' || part);
        END LOOP;
        GRANT UPDATE (attempts, claimed_at, published_at, dead_at, last_error, next_attempt_at) ON outbox TO inbox_service;
        GRANT INSERT ON order_confirmations, stock_reservations TO inbox_service;
        GRANT UPDATE (status, reason, updated_at) ON order_confirmations TO inbox_service;
        GRANT UPDATE (available, folded_through, updated_at) ON stock TO inbox_service;
        GRANT UPDATE (released_at) ON stock_reservations TO inbox_service;
        GRANT SELECT, UPDATE ON inbox_claim_floor_seq, outbox_claim_floor_seq TO inbox_service;
        -- The keeper locks a floor's row (FOR UPDATE); nothing changes it.
        GRANT UPDATE (tbl) ON claim_floor_locks TO inbox_service;
        -- Each process registers its session keys, and the janitor deletes
        -- those of ended sessions; the leader's row names the one leading.
        GRANT INSERT, DELETE, UPDATE (pid, login, started_at) ON inbox_sessions TO inbox_service;
        GRANT INSERT, UPDATE (session, since) ON inbox_leader TO inbox_service;
        EXECUTE format('GRANT SELECT ON %s, %s TO inbox_service',
                       pg_get_serial_sequence('inbox', 'id'), pg_get_serial_sequence('outbox', 'id'));
        GRANT EXECUTE ON FUNCTION claim_floor_lower(text, bigint), inbox_keys_analyze_parts() TO inbox_service;
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
