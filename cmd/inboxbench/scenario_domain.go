package main

import (
	"context"
	"fmt"
	"time"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchDomain measures (2): orders per second through a real inboxd process
// with the orders handler, from the first publish to the last event
// published.
func benchDomain(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "domain")
	if err != nil {
		return err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})

	var start time.Time
	var publishTook time.Duration
	published := make(chan error, 1)
	publish := func() {
		started := time.Now()
		err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window)
		publishTook = time.Since(started)
		published <- err
	}
	if o.preload {
		publish()
	}
	svc, httpAddr, err := e.startInboxd(o)
	if err != nil {
		return err
	}
	defer svc.stop()
	if o.preload {
		start = time.Now() // the drain includes inboxd's start
	}
	if err := waitReady(ctx, httpAddr); err != nil {
		return err
	}
	if !o.preload {
		start = time.Now()
		go publish()
	}
	processed, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
	if err != nil {
		return err
	}
	took := processed.Sub(start)
	// Every order is confirmed: an order.confirmed and an email.requested each.
	lastEvent, err := waitCount(ctx, e.pool, countPublished, 2*w.UniqueMessageIDs, lastPublished)
	if err != nil {
		return err
	}
	tookPublished := lastEvent.Sub(start)
	if err := <-published; err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	from := "first publish"
	if o.preload {
		from = "inboxd start, queue preloaded"
	}
	r.domainPublished = float64(w.UniqueMessageIDs) / tookPublished.Seconds()
	r.domainProcessed = float64(w.UniqueMessageIDs) / took.Seconds()
	defer r.domainRatios()
	r.add("2. whole domain (inboxd)", "%.0f orders/s (%d orders, %s from %s to the last of %d events published)",
		r.domainPublished, w.UniqueMessageIDs, tookPublished.Round(time.Millisecond), from, 2*w.UniqueMessageIDs)
	r.add("   of which processed", "%.0f orders/s (%s to the last processed); publishing alone %.0f msg/s",
		r.domainProcessed, took.Round(time.Millisecond), float64(len(w.Messages))/publishTook.Seconds())
	return nil
}
