package main

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchSnapshot measures what an old snapshot does to the flow (issue 23):
// one inboxd process with the orders handler, fed at -snapshot-rate for
// twice -snapshot-hold; for the second half a REPEATABLE READ transaction
// in the same database holds its snapshot open, as a long analytics query,
// pg_dump or a standby with hot_standby_feedback does, so that vacuum and
// index scans can remove nothing processed since. It reports, for the
// messages published in each half, publish to processed and publish to
// order.confirmed received, and the backlog and the inbox's dead rows when
// the snapshot is let go.
func benchSnapshot(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "snapshot")
	if err != nil {
		return err
	}
	defer e.close()
	svc, _, err := e.serve(ctx, o)
	if err != nil {
		return err
	}
	defer svc.stop()
	n := int(o.snapshotRate * 2 * o.snapshotHold.Seconds())
	w := loadgen.Generate(loadgen.Spec{Orders: n, Seed: 3, Prefix: e.name, SKUs: o.skus})
	confirmed, stopConfirmed, err := receiveTimes(ctx, e.amqpURL, "order.confirmed")
	if err != nil {
		return err
	}
	defer stopConfirmed()

	type published struct {
		sent map[string]time.Time
		err  error
	}
	done := make(chan published, 1)
	start := time.Now()
	go func() {
		sent, err := publishPaced(ctx, e.amqpURL, w.Messages, o.snapshotRate)
		done <- published{sent, err}
	}()
	select {
	case <-time.After(o.snapshotHold):
	case <-ctx.Done():
		return ctx.Err()
	}
	holder, err := e.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = holder.Rollback(context.WithoutCancel(ctx)) }()
	held := time.Now()
	if _, err := holder.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
		return err
	}
	var seen int
	if err := holder.QueryRow(ctx, "SELECT count(*) FROM inbox").Scan(&seen); err != nil {
		return err
	}
	pub := <-done
	if pub.err != nil {
		return pub.err
	}
	var backlog, dead int
	if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM inbox WHERE status = 'pending'").Scan(&backlog); err != nil {
		return err
	}
	if err := e.pool.QueryRow(ctx, "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'inbox'::regclass").Scan(&dead); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	heldFor := time.Since(held)
	if err := holder.Rollback(ctx); err != nil {
		return err
	}
	if _, err := waitCount(ctx, e.pool, countProcessed, len(w.Messages), lastProcessed); err != nil {
		return err
	}
	l, err := readLatencies(ctx, e.pool, pub.sent)
	if err != nil {
		return err
	}
	arrived := confirmed.wait(ctx, len(w.Messages), 30*time.Second)
	for _, phase := range []struct {
		name     string
		from, to time.Time
	}{
		{"clean", start, held},
		{"snapshot held", held, held.Add(heldFor)},
	} {
		var total, event []time.Duration
		for id, at := range pub.sent {
			if at.Before(phase.from) || !at.Before(phase.to) {
				continue
			}
			total = append(total, l.totalOf[id])
			if got, ok := arrived[id]; ok {
				event = append(event, got.Sub(at))
			}
		}
		r.add("snapshot: "+phase.name, "publish to processed p50 %s, p99 %s, max %s; to order.confirmed received p50 %s, p99 %s (%d orders at %.0f/s)",
			quantile(total, 0.50), quantile(total, 0.99), quantile(total, 1), quantile(event, 0.50), quantile(event, 0.99), len(total), o.snapshotRate)
	}
	r.add("snapshot: when let go", "backlog %d pending, %d dead inbox rows, after %s held",
		backlog, dead, heldFor.Round(time.Second))
	return nil
}
