-- Named after its caller, internal/metrics: its gauges read the inbox and the outbox together, and its lock is no table's.

-- name: MetricsGauges :one
-- MetricsGauges reads the gauges /metrics reports, each through a partial
-- index so that a scrape stays cheap however large the tables grow. The
-- pending messages are counted from the inbox's claim floor, and the
-- outbox's rows through outbox_backlog: under the floors every row has
-- ended, and the ended rows' entries a snapshot held open keeps in the
-- partial indexes are not read.
SELECT
    (SELECT count(*) FROM inbox WHERE status = 'pending' AND id >= inbox_claim_floor())::bigint AS pending,
    (SELECT count(*) FROM inbox WHERE status = 'dead')::bigint AS dead,
    coalesce((SELECT extract(epoch FROM now() - i.received_at)
              FROM inbox i WHERE i.status = 'pending' AND i.id >= inbox_claim_floor() ORDER BY i.id LIMIT 1), 0)::float8 AS oldest_pending_seconds,
    b.unpublished::bigint AS outbox_backlog,
    b.dead::bigint AS outbox_dead,
    -- The oldest event not published, dead ones included (a dead event
    -- holds back its order's later ones), as outbox_backlog reads it.
    coalesce(extract(epoch FROM b.oldest_age), 0)::float8 AS outbox_oldest_seconds,
    b.replies_unpublished::bigint AS replies_unpublished,
    b.replies_undeliverable::bigint AS replies_undeliverable,
    coalesce((SELECT extract(epoch FROM now() - g.opened_at)
              FROM inbox_key_generations g WHERE g.closed_at IS NULL), 0)::float8 AS key_generation_seconds,
    -- How long a hot part of the ledger has waited sealed or merged for a
    -- janitor to move it into its slot and empty it.
    coalesce((SELECT extract(epoch FROM now() - min(h.since))
              FROM inbox_key_hot_parts h WHERE h.state IN ('sealed', 'merged')), 0)::float8 AS key_hot_part_waiting_seconds,
    -- The oldest move not folded yet: each SKU's first move past its fold,
    -- one index look-up a SKU (the folded moves a held snapshot keeps are
    -- not read).
    coalesce((SELECT extract(epoch FROM now() - min(m.moved_at))
              FROM stock s
              CROSS JOIN LATERAL (SELECT f.moved_at FROM stock_moves f
                                  WHERE f.sku = s.sku AND f.id > s.folded_through
                                  ORDER BY f.id LIMIT 1) m), 0)::float8 AS stock_unfolded_seconds
FROM outbox_backlog b;
