-- +goose Up

-- Only a replay changes replay_reason, as only a replay changes the other
-- audit columns: an UPDATE that rewrites the reason of an earlier replay, or
-- sets one with a flag that is dropped (the row is still pending), leaves it
-- as it was. The reason is recorded with the replay it explains.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_replay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.replay_requested AND NOT OLD.replay_requested AND OLD.status IN ('processed', 'dead') THEN
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
        IF NEW.replay_requested AND NOT OLD.replay_requested THEN
            -- A flag set on a row still pending is dropped.
            NEW.replay_requested := false;
        END IF;
        NEW.replay_count  := OLD.replay_count;
        NEW.replayed_at   := OLD.replayed_at;
        NEW.replayed_by   := OLD.replayed_by;
        NEW.replay_reason := OLD.replay_reason;
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

DROP TRIGGER inbox_replay_update ON inbox;
CREATE TRIGGER inbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by, replay_reason ON inbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by IS DISTINCT FROM NEW.replayed_by
   OR OLD.replay_reason IS DISTINCT FROM NEW.replay_reason)
EXECUTE FUNCTION inbox_replay();

-- +goose Down
DROP TRIGGER inbox_replay_update ON inbox;
CREATE TRIGGER inbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by ON inbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by IS DISTINCT FROM NEW.replayed_by)
EXECUTE FUNCTION inbox_replay();
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_replay() RETURNS trigger
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
        NEW.replay_count := OLD.replay_count;
        NEW.replayed_at  := OLD.replayed_at;
        NEW.replayed_by  := OLD.replayed_by;
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd
