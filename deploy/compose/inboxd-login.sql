-- Run by the compose file's db-login service after `inboxd migrate`, as the
-- database owner: the login inboxd serves as, a member of inbox_service
-- (the role migrations/00007_roles.sql creates and grants), and nothing more.
-- Idempotent, so it runs at every `docker compose up`. psql variables:
-- password (the login's password).
\set ON_ERROR_STOP on
SELECT format('CREATE ROLE inboxd LOGIN PASSWORD %L', :'password')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inboxd') \gexec
ALTER ROLE inboxd LOGIN PASSWORD :'password';
GRANT inbox_service TO inboxd;
