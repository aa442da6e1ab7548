-- +goose Up

-- Replaying a message is one SQL statement by an operator:
--   UPDATE inbox SET replay_requested = true, replay_reason = 'fixed SKU data'
--   WHERE message_id = 'msg-1001';
-- The database itself makes that safe and records it: the trigger below
-- puts a processed or dead row back to pending (with fresh attempts),
-- counts the replay and notes when and by whom, whatever the statement said
-- about those columns. The worker tells the handler the message is a replay
-- and clears the flag when done. A flag set on a row that is still pending
-- is dropped: the message is about to run anyway.
ALTER TABLE inbox
    ADD COLUMN replay_count  integer NOT NULL DEFAULT 0,
    ADD COLUMN replayed_at   timestamptz,
    ADD COLUMN replayed_by   text,
    ADD COLUMN replay_reason text;

-- +goose StatementBegin
CREATE FUNCTION inbox_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.replay_requested AND NOT OLD.replay_requested THEN
        IF OLD.status IN ('processed', 'dead') THEN
            NEW.status          := 'pending';
            NEW.attempts        := 0;
            NEW.next_attempt_at := now();
            NEW.claimed_at      := NULL;
            NEW.processed_at    := NULL;
            NEW.replay_count    := OLD.replay_count + 1;
            NEW.replayed_at     := now();
            NEW.replayed_by     := current_user;
            PERFORM pg_notify('inbox_pending', TG_TABLE_SCHEMA);
        ELSE
            NEW.replay_requested := false;
        END IF;
    ELSE
        -- Only a replay changes the audit columns.
        NEW.replay_count := OLD.replay_count;
        NEW.replayed_at  := OLD.replayed_at;
        NEW.replayed_by  := OLD.replayed_by;
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

-- The WHEN clause keeps the function out of every other update (the
-- worker's, above all).
CREATE TRIGGER inbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by ON inbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by IS DISTINCT FROM NEW.replayed_by)
EXECUTE FUNCTION inbox_replay();

-- +goose Down
DROP TRIGGER inbox_replay_update ON inbox;
DROP FUNCTION inbox_replay();
ALTER TABLE inbox
    DROP COLUMN replay_reason,
    DROP COLUMN replayed_by,
    DROP COLUMN replayed_at,
    DROP COLUMN replay_count;
