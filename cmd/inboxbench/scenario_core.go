package main

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/pipeline"
)

// noopHandler marks every message processed and does nothing else: what is
// left is the inbox's own cost.
type noopHandler struct{}

func (noopHandler) HandleBatch(_ context.Context, _ pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	out := make([]inbox.Outcome, len(msgs))
	for i := range out {
		out[i].Result = "ok"
	}
	return out, nil
}

// core is the inbox alone, in this process: ingest (one channel, batches of
// 500) and workers (2 × 1000) as inboxd runs them, with a handler that does
// nothing. It returns the pipeline of ingest and worker, started.
type core struct {
	*pipeline.Pipeline
	pools []*pgxpool.Pool
}

func startCore(ctx context.Context, e *benchEnv, withConsumer, withWorker bool) (*core, error) {
	c := &core{}
	ingestPool, err := e.newPool(ctx, 3)
	if err != nil {
		return nil, err
	}
	workerPool, err := e.newPool(ctx, 3)
	if err != nil {
		ingestPool.Close()
		return nil, err
	}
	c.pools = []*pgxpool.Pool{ingestPool, workerPool}
	pc := &pipeline.Config{Logger: discard, WorkerPool: workerPool, IngestPool: ingestPool}
	if withWorker {
		pc.Worker = &inbox.WorkerConfig{Handler: noopHandler{}, Logger: discard, PollInterval: 100 * time.Millisecond}
	}
	if withConsumer {
		pc.Ingest = &ingest.Config{URL: e.amqpURL, Logger: discard}
	}
	if c.Pipeline, err = pipeline.New(pc); err != nil {
		c.stop()
		return nil, err
	}
	if err := c.Start(ctx); err != nil {
		c.stop()
		return nil, err
	}
	for withConsumer && !c.Ingest.Consuming() {
		if ctx.Err() != nil {
			c.stop()
			return nil, ctx.Err()
		}
		time.Sleep(10 * time.Millisecond)
	}
	return c, nil
}

func (c *core) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if c.Pipeline != nil {
		c.Stop(ctx)
	}
	for _, p := range c.pools {
		p.Close()
	}
}

// benchCore measures (1): messages per second from the first publish to the
// last processed, through the inbox alone.
func benchCore(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "core")
	if err != nil {
		return err
	}
	defer e.close()
	c, err := startCore(ctx, e, true, true)
	if err != nil {
		return err
	}
	defer c.stop()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	start := time.Now()
	published := make(chan error, 1)
	go func() { published <- loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window) }()
	done, err := waitCount(ctx, e.pool, countProcessed, len(w.Messages), lastProcessed)
	if err != nil {
		return err
	}
	took := done.Sub(start)
	if err := <-published; err != nil {
		return err
	}
	r.core = float64(len(w.Messages)) / took.Seconds()
	r.add("1. core path, publish to processed", "%.0f msg/s (%d messages in %s; ingest 1 channel × 500, workers 2 × 1000, a handler that does nothing)",
		r.core, len(w.Messages), took.Round(time.Millisecond))
	return nil
}

// benchIngestAndWorker measures (3): ingest alone draining a preloaded queue
// into the inbox, then the workers alone draining the inbox it filled.
func benchIngestAndWorker(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "split")
	if err != nil {
		return err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
		return err
	}
	start := time.Now()
	ingest, err := startCore(ctx, e, true, false)
	if err != nil {
		return err
	}
	done, err := waitCount(ctx, e.pool, "SELECT count(*) FROM inbox", len(w.Messages), "SELECT max(received_at) FROM inbox")
	took := done.Sub(start)
	ingest.stop()
	if err != nil {
		return err
	}
	r.add("3. ingest alone", "%.0f msg/s (a preloaded queue of %d into the inbox, %s)",
		float64(len(w.Messages))/took.Seconds(), len(w.Messages), took.Round(time.Millisecond))

	start = time.Now()
	worker, err := startCore(ctx, e, false, true)
	if err != nil {
		return err
	}
	defer worker.stop()
	if done, err = waitCount(ctx, e.pool, countProcessed, len(w.Messages), lastProcessed); err != nil {
		return err
	}
	took = done.Sub(start)
	r.add("   worker alone", "%.0f msg/s (%d pending rows to processed, handler that does nothing, %s)",
		float64(len(w.Messages))/took.Seconds(), len(w.Messages), took.Round(time.Millisecond))
	return nil
}
