-- name: LeaderTake :one
-- LeaderTake returns whether the session key leads, making it the leader's
-- first if the leader's row names none yet or a key no longer live (its
-- session ended). The caller's session must hold the key
-- (InboxHoldLiveness). The leader calls it too, as its ping: while the row
-- names a live key it only reads, so a slow commit (a lagging synchronous
-- standby) never makes a ping wait.
WITH current AS (
    SELECT l.session, l.session IN (SELECT inbox_live_sessions()) AS live
    FROM inbox_leader l
), taken AS (
    INSERT INTO inbox_leader AS l (session)
    SELECT sqlc.arg(session)::bigint
    WHERE NOT EXISTS (SELECT 1 FROM current c WHERE c.session = sqlc.arg(session)::bigint OR c.live)
    ON CONFLICT (one) DO UPDATE SET session = excluded.session, since = now()
    WHERE l.session <> excluded.session
      AND l.session NOT IN (SELECT inbox_live_sessions())
    RETURNING l.session
)
-- (No row at all: another replica's first insert met this one's; try again.)
SELECT coalesce(coalesce((SELECT session FROM taken), (SELECT session FROM current)) = sqlc.arg(session)::bigint,
                false)::boolean AS leads;
