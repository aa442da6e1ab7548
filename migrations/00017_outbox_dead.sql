-- +goose Up

-- An outbox row can end. A row the broker or the client refuses for a
-- reason that retrying will not change (a publish the broker nacks, one
-- whose properties the client cannot encode, one over the broker's size
-- limit) ends dead after the relay's maximum number of attempts: dead_at
-- says since when, last_error why. It stays unpublished, and it holds back
-- the later rows of its order, visibly (outbox_dead, outbox_backlog.dead,
-- the status page): the order's events keep their order, nothing is
-- skipped silently.
--
-- Replaying it is one SQL statement by an operator, as for the inbox:
--   UPDATE outbox SET replay_requested = true, replay_reason = 'bound the queue'
--   WHERE idempotency_key = 'msg-1001:order.confirmed';
-- The trigger below makes that safe and records it: a dead row is put back
-- to be published at once, with fresh attempts, and the replay is counted
-- with when and by whom, whatever the statement said about those columns.
-- A flag set on a row that is not dead is dropped.
ALTER TABLE outbox
    ADD COLUMN dead_at          timestamptz,
    ADD COLUMN replay_requested boolean NOT NULL DEFAULT false,
    ADD COLUMN replay_count     integer NOT NULL DEFAULT 0,
    ADD COLUMN replayed_at      timestamptz,
    ADD COLUMN replayed_by      text,
    ADD COLUMN replay_reason    text;

-- +goose StatementBegin
CREATE FUNCTION outbox_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.replay_requested AND NOT OLD.replay_requested AND OLD.dead_at IS NOT NULL THEN
        NEW.dead_at         := NULL;
        NEW.attempts        := 0;
        NEW.next_attempt_at := now();
        NEW.replay_count    := OLD.replay_count + 1;
        NEW.replayed_at     := now();
        NEW.replayed_by     := current_user;
        PERFORM pg_notify('outbox_pending', TG_TABLE_SCHEMA);
    ELSE
        -- Only a replay changes the audit columns, the reason included.
        NEW.replay_count  := OLD.replay_count;
        NEW.replayed_at   := OLD.replayed_at;
        NEW.replayed_by   := OLD.replayed_by;
        NEW.replay_reason := OLD.replay_reason;
    END IF;
    -- The flag is a request, not a state: the count records it.
    NEW.replay_requested := false;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

-- The WHEN clause keeps the function out of the relay's updates.
CREATE TRIGGER outbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by, replay_reason ON outbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by IS DISTINCT FROM NEW.replayed_by
   OR OLD.replay_reason IS DISTINCT FROM NEW.replay_reason)
EXECUTE FUNCTION outbox_replay();

-- outbox_dead lists the rows that ended dead, with how many later rows of
-- their order each one holds back, and the statement that replays it.
CREATE VIEW outbox_dead AS
SELECT o.id, o.idempotency_key, o.routing_key, o.order_key, o.message_id, o.attempts, o.last_error,
       o.created_at, o.dead_at, o.replay_count,
       (SELECT count(*) FROM outbox h
        WHERE h.order_key = o.order_key AND h.id > o.id AND h.published_at IS NULL) AS holds_back,
       format('UPDATE outbox SET replay_requested = true, replay_reason = %L WHERE id = %s;', 'why', o.id) AS replay_sql
FROM outbox o
WHERE o.dead_at IS NOT NULL;

-- outbox_backlog counts the dead rows apart; failing counts the rows still
-- retrying.
CREATE OR REPLACE VIEW outbox_backlog AS
SELECT count(*)                                                       AS unpublished,
       count(*) FILTER (WHERE last_error IS NOT NULL AND dead_at IS NULL) AS failing,
       min(created_at)                                                AS oldest_created_at,
       now() - min(created_at)                                        AS oldest_age,
       count(*) FILTER (WHERE dead_at IS NOT NULL)                    AS dead
FROM outbox
WHERE published_at IS NULL;

-- The grants of migration 00016 stay as they were, under another name, as
-- 00016 did with those of 00013.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00016; END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00016();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON outbox_dead TO inbox_operator;
        GRANT UPDATE (replay_requested, replay_reason) ON outbox TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT ON outbox_dead TO inbox_service;
        GRANT UPDATE (dead_at) ON outbox TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00016() IS 'the grants of migration 00016; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00016() RENAME TO inbox_grant_roles;
SELECT inbox_grant_roles();
DROP VIEW outbox_dead;
DROP VIEW outbox_backlog;
CREATE VIEW outbox_backlog AS
SELECT count(*)                                         AS unpublished,
       count(*) FILTER (WHERE last_error IS NOT NULL)   AS failing,
       min(created_at)                                  AS oldest_created_at,
       now() - min(created_at)                          AS oldest_age
FROM outbox
WHERE published_at IS NULL;
DROP TRIGGER outbox_replay_update ON outbox;
DROP FUNCTION outbox_replay();
ALTER TABLE outbox
    DROP COLUMN replay_reason,
    DROP COLUMN replayed_by,
    DROP COLUMN replayed_at,
    DROP COLUMN replay_count,
    DROP COLUMN replay_requested,
    DROP COLUMN dead_at;
