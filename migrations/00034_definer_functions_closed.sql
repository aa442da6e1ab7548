-- +goose Up

-- The functions that run as the schema's owner (SECURITY DEFINER) trust
-- nothing of their caller's session.
--
-- A definer function runs with the owner's rights: where migrations run as
-- a superuser, with a superuser's. Each of them therefore
--   * sets search_path to this schema, then pg_temp, and nothing else: a
--     caller's temporary table or view (pg_temp is searched first for
--     relations unless it is listed, and last when it is) is never found
--     instead of the schema's, and pg_catalog, searched first when it is
--     not listed, is never shadowed;
--   * names catalog objects in full (pg_catalog.…);
--   * may be executed by the roles that need it only, never by PUBLIC (the
--     default of every new function).
-- TestDefinerFunctionsAreClosed checks the three on the catalogs, and
-- TestNoLoginGainsARightThroughADefinerFunction tries the hijack, as a
-- login of each role, against each of them.

-- inbox_keys_analyze_parts gives each hot part statistics once it holds
-- some keys (100 pages), if it has none, and returns how many it analyzed;
-- ANALYZE needs the owner's right, so it runs as the owner. As in 00031,
-- except that its search_path was the migrating session's ("$user",
-- public, or the schema alone: pg_temp first either way).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_keys_analyze_parts() RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    p        smallint;
    part     text;
    analyzed integer := 0;
BEGIN
    FOR p IN SELECT h.part FROM inbox_key_hot_parts h ORDER BY h.part LOOP
        part := 'inbox_keys_' || p;
        IF pg_catalog.pg_relation_size(pg_catalog.format('%I.%I', pg_catalog.current_schema(), part)::pg_catalog.regclass)
               >= 100 * pg_catalog.current_setting('block_size')::bigint
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stats s
                           WHERE s.schemaname = pg_catalog.current_schema() AND s.tablename = part
                             AND s.attname = 'message_id') THEN
            EXECUTE pg_catalog.format('ANALYZE %I.%I', pg_catalog.current_schema(), part);
            analyzed := analyzed + 1;
        END IF;
    END LOOP;
    RETURN analyzed;
END;
$$;
-- +goose StatementEnd

-- claim_floor_lower lowers the floor of tbl ('inbox' or 'outbox') to id
-- and holds it there until the calling transaction ends; it runs as the
-- owner so that an operator's replay (through claim_floor_replay) may set
-- the floor's sequence, which the operator may not. As in 00022, with the
-- catalog's functions named in full.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION claim_floor_lower(tbl text, id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    seq pg_catalog.regclass;
BEGIN
    seq := CASE tbl WHEN 'inbox' THEN pg_catalog.format('%I.inbox_claim_floor_seq', pg_catalog.current_schema())::pg_catalog.regclass
                    WHEN 'outbox' THEN pg_catalog.format('%I.outbox_claim_floor_seq', pg_catalog.current_schema())::pg_catalog.regclass END;
    IF seq IS NULL THEN
        RAISE EXCEPTION 'claim_floor_lower: no claim floor for %', tbl;
    END IF;
    PERFORM claim_floor_lock(seq, false);
    IF coalesce(pg_catalog.pg_sequence_last_value(seq), 0) > id THEN
        PERFORM pg_catalog.setval(seq, id, true);
    END IF;
END;
$$;
-- +goose StatementEnd

-- Both find this schema's objects, then pg_temp's, never the caller's first.
-- +goose StatementBegin
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION inbox_keys_analyze_parts() SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION claim_floor_lower(text, bigint) SET search_path = %I, pg_temp', current_schema());
END;
$$;
-- +goose StatementEnd

-- Neither is PUBLIC's. The janitors analyze the hot parts; a replay by an
-- operator, or by the service, lowers a floor.
REVOKE ALL ON FUNCTION inbox_keys_analyze_parts() FROM PUBLIC;
REVOKE ALL ON FUNCTION claim_floor_lower(text, bigint) FROM PUBLIC;

-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00031; END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00031();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT EXECUTE ON FUNCTION claim_floor_lower(text, bigint) TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT EXECUTE ON FUNCTION claim_floor_lower(text, bigint) TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00031() IS 'the grants of migration 00031; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00031() RENAME TO inbox_grant_roles;
COMMENT ON FUNCTION inbox_grant_roles() IS NULL;
GRANT EXECUTE ON FUNCTION claim_floor_lower(text, bigint) TO PUBLIC;
