package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// benchClaim measures (6): the claim statement, and a whole work batch, as
// processed rows pile up in the inbox.
func benchClaim(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "claim")
	if err != nil {
		return err
	}
	defer e.close()
	w, err := inbox.NewWorker(e.pool, &inbox.WorkerConfig{Handler: noopHandler{}, Logger: discard, Concurrency: 1})
	if err != nil {
		return err
	}
	q := dbsqlc.New()
	var base float64
	have := 0
	for _, size := range o.claimRows {
		// Processed rows up to size, a million per statement.
		seedStarted := time.Now()
		for have < size {
			n := min(1_000_000, size-have)
			if _, err := e.pool.Exec(ctx, `
				INSERT INTO inbox (message_id, message_type, payload, status, attempts, received_at, processed_at, order_key)
				SELECT 'old-' || g, 'order.created', '{"orderId":"x"}', 'processed', 1, now() - interval '1 day', now() - interval '1 day', 'old-' || g
				FROM generate_series($1::bigint, $2::bigint) g`, have, have+n-1); err != nil {
				return fmt.Errorf("seed processed rows: %w", err)
			}
			have += n
		}
		// 20 batches of 1000 pending messages, one more to warm up; then the
		// table's statistics and visibility map as autovacuum would leave them.
		const batches, batchSize = 20, 1000
		if _, err := e.pool.Exec(ctx, `
			INSERT INTO inbox (message_id, message_type, payload, order_key)
			SELECT 'new-' || $1::text || '-' || g, 'order.created', '{"orderId":"x"}', 'new-' || $1::text || '-' || g
			FROM generate_series(1, $2::int) g`, strconv.Itoa(size), (batches+1)*batchSize); err != nil {
			return err
		}
		if _, err := e.pool.Exec(ctx, "VACUUM ANALYZE inbox"); err != nil {
			return err
		}
		seeded := time.Since(seedStarted)
		if _, err := w.RunOnce(ctx); err != nil { // warm-up, not counted
			return err
		}
		var claims, works []time.Duration
		for range batches {
			started := time.Now()
			claimed, err := q.InboxClaimBatch(ctx, e.pool, dbsqlc.InboxClaimBatchParams{Process: "bench", Build: "bench", MaxRows: batchSize})
			if err != nil {
				return err
			}
			claims = append(claims, time.Since(started))
			if len(claimed) != batchSize {
				return fmt.Errorf("claimed %d, want %d", len(claimed), batchSize)
			}
			ids := make([]int64, len(claimed))
			for i, c := range claimed {
				ids[i] = c.ID
			}
			// Release the claim, then time a whole batch (claim, lock,
			// handle, complete) on the same rows.
			if _, err := e.pool.Exec(ctx, "UPDATE inbox SET claimed_at = NULL, attempts = 0 WHERE id = ANY($1)", ids); err != nil {
				return err
			}
			started = time.Now()
			if _, err := w.RunOnce(ctx); err != nil {
				return err
			}
			works = append(works, time.Since(started))
		}
		slices.Sort(claims)
		slices.Sort(works)
		claim := claims[len(claims)/2]
		if base == 0 {
			base = claim.Seconds()
		}
		r.add(fmt.Sprintf("6. claim with %d processed rows", size), "claim of 1000: median %s (%.2f× the first); whole batch: median %s (seeded in %s)",
			claim.Round(10*time.Microsecond), claim.Seconds()/base, works[len(works)/2].Round(10*time.Microsecond), seeded.Round(time.Second))
	}
	return nil
}
