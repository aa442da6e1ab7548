-- name: LeaderTryLock :one
-- LeaderTryLock tries to take, for the session, the advisory lock whose
-- holder is the one process of the current schema that runs the
-- maintenance and exports the database gauges (internal/leader). It
-- returns whether the session took it. Each success takes the lock once
-- more: call it only while not holding the lock.
SELECT pg_try_advisory_lock(hashtextextended('inboxd leader ' || coalesce(current_schema(), ''), 0)) AS held;
