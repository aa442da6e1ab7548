-- name: MetricsGauges :one
-- MetricsGauges reads the gauges /metrics reports, each through a partial
-- index so that a scrape stays cheap however large the tables grow.
SELECT
    (SELECT count(*) FROM inbox WHERE status = 'pending')::bigint AS pending,
    (SELECT count(*) FROM inbox WHERE status = 'dead')::bigint AS dead,
    coalesce((SELECT extract(epoch FROM now() - i.received_at)
              FROM inbox i WHERE i.status = 'pending' ORDER BY i.id LIMIT 1), 0)::float8 AS oldest_pending_seconds,
    (SELECT count(*) FROM outbox WHERE published_at IS NULL)::bigint AS outbox_backlog;
