-- +goose Up

-- inbox_lock_holders lists the sessions whose transaction has been open for
-- over 5 seconds while it holds a lock that keeps rows of the service's
-- tables from others: a SELECT … FOR UPDATE or an UPDATE left open in psql,
-- say. Such a session holds back the messages that need those rows (they
-- wait, with the reason in last_error) and, through the ordering gate, the
-- later messages of their orders. It says who (user, application, address),
-- since when, on which tables, and the statement that ends the session.
-- inboxd's own transactions are short; a relay's waits for the broker's
-- confirms in its transaction (application_name "inboxd relay …") show here
-- only while the broker is slow to confirm.
CREATE VIEW inbox_lock_holders AS
SELECT a.pid,
       a.usename::text                                              AS usename,
       a.application_name,
       host(a.client_addr)                                          AS client_addr,
       a.state,
       a.xact_start,
       now() - a.xact_start                                         AS open_for,
       array_agg(DISTINCT c.relname::text ORDER BY c.relname::text) AS tables,
       format('SELECT pg_terminate_backend(%s);', a.pid)            AS end_sql
FROM pg_catalog.pg_locks l
JOIN pg_catalog.pg_class c ON c.oid = l.relation
JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation'
  AND l.granted
  AND l.mode <> 'AccessShareLock'
  AND l.relation IN ('inbox'::regclass, 'outbox'::regclass, 'order_confirmations'::regclass,
                     'stock'::regclass, 'stock_reservations'::regclass)
  AND a.pid <> pg_backend_pid()
  AND a.xact_start < now() - interval '5 seconds'
GROUP BY a.pid, a.usename, a.application_name, a.client_addr, a.state, a.xact_start;

-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00017; END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00017();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON inbox_lock_holders TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT ON inbox_lock_holders TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00017() IS 'the grants of migration 00017; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00017() RENAME TO inbox_grant_roles;
SELECT inbox_grant_roles();
DROP VIEW inbox_lock_holders;
