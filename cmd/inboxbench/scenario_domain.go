package main

import (
	"context"
	"fmt"
	"time"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchDomain measures (2): orders per second through a real inboxd process
// with the orders handler, from the first publish to the last event
// published; and, unless -ruler=false, the same traffic through the
// simplest inbox (simplest.go), the two alternating which goes first, for
// -rounds pairs.
func benchDomain(ctx context.Context, o *options, r *report) error {
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: fmt.Sprintf("bench_domain_%d", time.Now().UnixNano()), SKUs: o.skus})
	var ours, ruler, ratios []float64
	for round := range o.rounds {
		var pair [2]domainRun
		for _, side := range r.pairOrder(o) {
			run, err := domainOnce(ctx, o, w, side)
			if err != nil {
				return fmt.Errorf("%s: %w", side, err)
			}
			run.report(r, o, w, side, round)
			pair[side] = run
		}
		ours = append(ours, pair[sideInboxd].published)
		if o.ruler {
			ruler = append(ruler, pair[sideSimplest].published)
			ratios = append(ratios, pair[sideInboxd].published/pair[sideSimplest].published)
			r.add("   inboxd / simplest inbox", "%.2f to the last event published, %.2f to the last processed; PostgreSQL's CPU an order %.2f, its WAL %.2f%s",
				pair[sideInboxd].published/pair[sideSimplest].published, pair[sideInboxd].processed/pair[sideSimplest].processed,
				float64(pair[sideInboxd].postgres.cpu)/float64(pair[sideSimplest].postgres.cpu), pair[sideInboxd].postgres.wal/pair[sideSimplest].postgres.wal,
				roundOf(o, round))
		}
		r.domainPublished, r.domainProcessed = pair[sideInboxd].published, pair[sideInboxd].processed
	}
	if o.rounds > 1 {
		r.add("2. whole domain over the rounds", "inboxd %s orders/s", spread(ours))
		if o.ruler {
			r.add("   simplest inbox over the rounds", "%s orders/s; inboxd / simplest inbox, to the last event published: %s", spread(ruler), spreadRatio(ratios))
		}
	}
	r.domainRatios()
	return nil
}

// domainRun is one run of the whole domain.
type domainRun struct {
	// published and processed are orders per second to the last event
	// published and to the last processed.
	published, processed float64
	// tookPublished and tookProcessed are the times from the start to
	// each; publishTook is the publishers' own time.
	tookPublished, tookProcessed, publishTook time.Duration
	// postgres is what PostgreSQL spent per order, from the side's start
	// to the last event published: CPU of all its processes, and WAL.
	postgres struct {
		cpu time.Duration
		wal float64
	}
	// inboxdCPU is the CPU inboxd's process spent per order over the same
	// span (the simplest inbox runs in the bench process, beside the
	// publishers: its own is not told apart, and is 0).
	inboxdCPU time.Duration
}

// domainOnce runs w through a fresh inboxd process, or through the
// simplest inbox, in a schema and virtual host of its own.
func domainOnce(ctx context.Context, o *options, w *loadgen.Workload, s side) (domainRun, error) {
	var e *benchEnv
	var err error
	if s == sideInboxd {
		e, err = newEnv(ctx, o, "domain")
	} else {
		e, err = newSimplestEnv(ctx, o, "domain")
	}
	if err != nil {
		return domainRun{}, err
	}
	defer e.close()

	var run domainRun
	published := make(chan error, 1)
	publish := func() {
		started := time.Now()
		err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window)
		run.publishTook = time.Since(started)
		published <- err
	}
	if o.preload {
		publish()
	}
	start := time.Now() // with -preload, the drain includes the start
	// With -preload, what PostgreSQL and inboxd spend is counted from
	// before the start (inboxd's migration and start included): the side
	// drains the queue as soon as it is up.
	before, err := readPostgresCost(ctx, e)
	if err != nil {
		return domainRun{}, err
	}
	waitCtx, stop, pid, err := startSide(ctx, o, e, s)
	if err != nil {
		return domainRun{}, err
	}
	defer stop()
	var inboxdBefore time.Duration
	if !o.preload {
		if before, err = readPostgresCost(ctx, e); err != nil {
			return domainRun{}, failedSide(stop, err)
		}
		if inboxdBefore, err = pidCPU(pid); err != nil {
			return domainRun{}, failedSide(stop, err)
		}
		start = time.Now()
		go publish()
	}
	counts := countsOf(s)
	processed, err := waitCount(waitCtx, e.pool, counts.processed, w.UniqueMessageIDs, counts.lastProcessed)
	if err != nil {
		return domainRun{}, failedSide(stop, err)
	}
	// Every order is confirmed: an order.confirmed and an email.requested each.
	lastEvent, err := waitCount(waitCtx, e.pool, counts.published, 2*w.UniqueMessageIDs, counts.lastPublished)
	if err != nil {
		return domainRun{}, failedSide(stop, err)
	}
	after, err := readPostgresCost(ctx, e)
	if err != nil {
		return domainRun{}, failedSide(stop, err)
	}
	inboxdAfter, err := pidCPU(pid)
	if err != nil {
		return domainRun{}, failedSide(stop, err)
	}
	orders := float64(w.UniqueMessageIDs)
	run.inboxdCPU = time.Duration(float64(inboxdAfter-inboxdBefore) / orders)
	run.postgres.cpu = time.Duration(float64(after.cpu-before.cpu) / orders)
	run.postgres.wal = float64(after.wal-before.wal) / orders
	if err := <-published; err != nil {
		return domainRun{}, fmt.Errorf("publish: %w", err)
	}
	if err := stop(); err != nil {
		return domainRun{}, err
	}
	run.tookProcessed, run.tookPublished = processed.Sub(start), lastEvent.Sub(start)
	run.published = float64(w.UniqueMessageIDs) / run.tookPublished.Seconds()
	run.processed = float64(w.UniqueMessageIDs) / run.tookProcessed.Seconds()
	return run, nil
}

// report adds the rows of run, of side s, in round.
func (run domainRun) report(r *report, o *options, w *loadgen.Workload, s side, round int) {
	from := "first publish"
	if o.preload {
		from = map[side]string{sideInboxd: "inboxd start", sideSimplest: "start"}[s] + ", queue preloaded"
	}
	if s == sideSimplest {
		r.add("   simplest inbox, same traffic", "%.0f orders/s to the last event published (%s from %s), %.0f to the last processed (%s); PostgreSQL per order %s of CPU, %.0f bytes of WAL%s",
			run.published, run.tookPublished.Round(time.Millisecond), from, run.processed, run.tookProcessed.Round(time.Millisecond),
			run.postgres.cpu.Round(time.Microsecond), run.postgres.wal, roundOf(o, round))
		return
	}
	r.add("2. whole domain (inboxd)", "%.0f orders/s (%d orders, %s from %s to the last of %d events published)%s%s",
		run.published, w.UniqueMessageIDs, run.tookPublished.Round(time.Millisecond), from, 2*w.UniqueMessageIDs, withoutOf(o), roundOf(o, round))
	r.add("   of which processed", "%.0f orders/s (%s to the last processed); publishing alone %.0f msg/s",
		run.processed, run.tookProcessed.Round(time.Millisecond), float64(len(w.Messages))/run.publishTook.Seconds())
	r.add("   PostgreSQL per order", "%s of CPU (all its processes, the other work of the machine's server included), %.0f bytes of WAL, to the last event published%s",
		run.postgres.cpu.Round(time.Microsecond), run.postgres.wal, withoutOf(o))
	r.add("   inboxd per order", "%s of CPU (its process), to the last event published", run.inboxdCPU.Round(time.Microsecond))
}
