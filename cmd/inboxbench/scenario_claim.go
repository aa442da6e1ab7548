package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// Each measurement times claimBatches batches of claimBatchSize pending
// messages, after one more to warm up.
const claimBatches, claimBatchSize = 20, 1000

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
	var base float64
	have := 0
	for _, size := range o.claimRows {
		seedStarted := time.Now()
		if have, err = seedProcessed(ctx, e.pool, have, size); err != nil {
			return err
		}
		if err := seedPending(ctx, e.pool, size); err != nil {
			return err
		}
		seeded := time.Since(seedStarted)
		claims, works, err := timeClaims(ctx, e.pool, w)
		if err != nil {
			return err
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

// seedProcessed adds processed rows to the have the inbox holds until it
// holds size, a million per statement, and returns how many it holds.
func seedProcessed(ctx context.Context, pool *pgxpool.Pool, have, size int) (int, error) {
	for have < size {
		n := min(1_000_000, size-have)
		if _, err := pool.Exec(ctx, `
			INSERT INTO inbox (message_id, message_type, payload, status, attempts, received_at, processed_at, order_key)
			SELECT 'old-' || g, 'order.created', '{"orderId":"x"}', 'processed', 1, now() - interval '1 day', now() - interval '1 day', 'old-' || g
			FROM generate_series($1::bigint, $2::bigint) g`, have, have+n-1); err != nil {
			return have, fmt.Errorf("seed processed rows: %w", err)
		}
		have += n
	}
	return have, nil
}

// seedPending adds the pending messages timeClaims claims, then leaves the
// table's statistics and visibility map as autovacuum would.
func seedPending(ctx context.Context, pool *pgxpool.Pool, size int) error {
	if _, err := pool.Exec(ctx, `
		INSERT INTO inbox (message_id, message_type, payload, order_key)
		SELECT 'new-' || $1::text || '-' || g, 'order.created', '{"orderId":"x"}', 'new-' || $1::text || '-' || g
		FROM generate_series(1, $2::int) g`, strconv.Itoa(size), (claimBatches+1)*claimBatchSize); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, "VACUUM ANALYZE inbox")
	return err
}

// timeClaims runs one batch to warm up, then times claimBatches claims of
// claimBatchSize, and a whole batch of w (claim, lock, handle, complete) on
// the same rows after each.
func timeClaims(ctx context.Context, pool *pgxpool.Pool, w *inbox.Worker) (claims, works []time.Duration, err error) {
	if _, err := w.RunOnce(ctx); err != nil { // warm-up, not counted
		return nil, nil, err
	}
	q := dbsqlc.New()
	for range claimBatches {
		started := time.Now()
		claimed, err := q.InboxClaimBatch(ctx, pool, dbsqlc.InboxClaimBatchParams{Process: "bench", Build: "bench", MaxRows: claimBatchSize})
		if err != nil {
			return nil, nil, err
		}
		claims = append(claims, time.Since(started))
		if len(claimed) != claimBatchSize {
			return nil, nil, fmt.Errorf("claimed %d, want %d", len(claimed), claimBatchSize)
		}
		ids := make([]int64, len(claimed))
		for i, c := range claimed {
			ids[i] = c.ID
		}
		// Release the claim, then time the whole batch on the same rows.
		if _, err := pool.Exec(ctx, "UPDATE inbox SET claimed_at = NULL, attempts = 0 WHERE id = ANY($1)", ids); err != nil {
			return nil, nil, err
		}
		started = time.Now()
		if _, err := w.RunOnce(ctx); err != nil {
			return nil, nil, err
		}
		works = append(works, time.Since(started))
	}
	return claims, works, nil
}
