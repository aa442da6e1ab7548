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
                                  ORDER BY f.id LIMIT 1) m), 0)::float8 AS stock_unfolded_seconds,
    held.orders::bigint AS held_back_orders,
    coalesce(extract(epoch FROM now() - held.oldest), 0)::float8 AS held_back_oldest_seconds,
    -- The oldest transaction of this database holding a snapshot back
    -- (backend_xmin set), by its xact_start. pg_stat_activity shows the
    -- xact_start of other logins' sessions only to members of
    -- pg_read_all_stats: without it, only the service login's own.
    coalesce((SELECT extract(epoch FROM now() - min(a.xact_start))
              FROM pg_catalog.pg_stat_activity a
              WHERE a.datname = current_database() AND a.backend_xmin IS NOT NULL
                AND a.pid <> pg_backend_pid()), 0)::float8 AS oldest_snapshot_seconds
FROM outbox_backlog b
-- The orders held back, as inbox_held_back reads them: each order's first
-- open message, dead or failed (last_error set), whose next open message
-- is pending; the age that of this next message. The blocking messages are
-- read through the dead rows' index and the pending ones' from the claim
-- floor, and each of their orders through the open rows' index.
CROSS JOIN LATERAL (
    SELECT count(*) AS orders, min(w.received_at) AS oldest
    FROM (SELECT d.id, d.order_key FROM inbox d
          WHERE d.status = 'dead' AND d.order_key IS NOT NULL
          UNION ALL
          SELECT p.id, p.order_key FROM inbox p
          WHERE p.status = 'pending' AND p.id >= inbox_claim_floor()
            AND p.last_error IS NOT NULL AND p.order_key IS NOT NULL) h
    CROSS JOIN LATERAL (SELECT w.status, w.received_at FROM inbox w
                        WHERE w.order_key = h.order_key AND w.id > h.id AND w.status <> 'processed'
                        ORDER BY w.id LIMIT 1) w
    WHERE w.status = 'pending'
      -- A probe of the order's open rows per order (OFFSET 0 keeps it a
      -- subplan): as an anti-join, the plan kept from an inbox of a few
      -- hundred rows without statistics hashed the inbox whole, and went
      -- on doing so at each read of the gauges once it had grown.
      AND NOT EXISTS (SELECT 1 FROM inbox e
                      WHERE e.order_key = h.order_key AND e.id < h.id AND e.status <> 'processed'
                      OFFSET 0)
) held;
