-- name: LeaderTake :one
-- LeaderTake makes the session key the leader's if the leader's row names
-- none yet or a key no longer live (its session ended), and returns
-- whether the key leads. The caller's session must hold the key
-- (InboxHoldLiveness). The leader calls it too, as its ping.
WITH taken AS (
    INSERT INTO inbox_leader AS l (session) VALUES (sqlc.arg(session)::bigint)
    ON CONFLICT (one) DO UPDATE SET session = excluded.session, since = now()
    WHERE l.session <> excluded.session
      AND l.session NOT IN (SELECT inbox_live_sessions())
    RETURNING l.session
)
SELECT coalesce((SELECT session FROM taken), (SELECT session FROM inbox_leader)) = sqlc.arg(session)::bigint AS leads;
