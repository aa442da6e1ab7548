package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/sandbox"
)

// benchEnv is a fresh schema and virtual host for one scenario.
type benchEnv struct {
	name    string
	dbURL   string
	amqpURL string
	pool    *pgxpool.Pool
	cleanup func()
}

// newEnv creates a migrated schema with stocked SKUs and a virtual host with
// the service's topology, named after the scenario.
func newEnv(ctx context.Context, o *options, scenario string) (*benchEnv, error) {
	name := fmt.Sprintf("bench_%s_%d", scenario, time.Now().Unix())
	dbURL, cleanupDB, err := sandbox.CreateSchema(ctx, o.databaseURL, name)
	if err != nil {
		return nil, err
	}
	amqpURL, cleanupBroker, err := createVhost(ctx, o.amqpURL, o.adminURL, name)
	if err != nil {
		cleanupDB()
		return nil, err
	}
	e := &benchEnv{name: name, dbURL: dbURL, amqpURL: amqpURL, cleanup: func() {}}
	if !o.keep {
		e.cleanup = func() { cleanupBroker(); cleanupDB() }
	}
	if err := loadgen.DeclareTopology(amqpURL, broker.QueueTypeQuorum); err != nil {
		e.cleanup()
		return nil, fmt.Errorf("declare topology: %w", err)
	}
	if e.pool, err = pgxpool.New(ctx, dbURL); err != nil {
		e.cleanup()
		return nil, err
	}
	if err := seedStock(ctx, e.pool, o.skus); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

func (e *benchEnv) close() {
	e.pool.Close()
	e.cleanup()
}

// startInboxd runs `inboxd serve` on the scenario's schema and virtual
// host, and returns it with its HTTP address.
func (e *benchEnv) startInboxd(o *options) (*service, string, error) {
	httpAddr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	svc, err := startInboxd(o, e.dbURL, e.amqpURL, httpAddr, e.name)
	return svc, httpAddr, err
}

// newPool opens a pool of its own on the scenario's schema.
func (e *benchEnv) newPool(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	pipeline.ConfigureSession(cfg.ConnConfig)
	return pgxpool.NewWithConfig(ctx, cfg)
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

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

// The counts the scenarios wait for, and the time of the last row each
// counts.
const (
	countProcessed = "SELECT count(*) FROM inbox WHERE status = 'processed'"
	lastProcessed  = "SELECT max(processed_at) FROM inbox"
	countPublished = "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
	lastPublished  = "SELECT max(published_at) FROM outbox"
)

// waitCount waits until query counts want rows, then returns what last
// returns: the database's time of the last of them (max of a timestamp
// column). The finish time comes from the rows themselves, so the polls can
// be rare: each count scans the table, and at 100,000 rows one poll every
// 100 ms took 15% of PostgreSQL's time in the core path (0.86 s of 5.7 s,
// pg_stat_statements), which the rulers, counting in memory, do not pay.
func waitCount(ctx context.Context, pool *pgxpool.Pool, query string, want int, last string) (time.Time, error) {
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		var n int
		if err := pool.QueryRow(ctx, query).Scan(&n); err != nil {
			return time.Time{}, fmt.Errorf("%s: %w", query, err)
		}
		if n >= want {
			var at time.Time
			if err := pool.QueryRow(ctx, last).Scan(&at); err != nil {
				return time.Time{}, fmt.Errorf("%s: %w", last, err)
			}
			return at, nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("%d of %d after %q: %w", n, want, query, ctx.Err())
		case <-tick.C:
		}
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

// benchSteady measures (4) and (5): a real inboxd process with the orders
// handler, fed at a steady rate; latency from each publish to its processed
// commit, and the process's memory sampled throughout.
func benchSteady(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "steady")
	if err != nil {
		return err
	}
	defer e.close()
	svc, httpAddr, err := e.startInboxd(o)
	if err != nil {
		return err
	}
	defer svc.stop()
	if err := waitReady(ctx, httpAddr); err != nil {
		return err
	}
	n := int(o.steadyRate * o.steadyDuration.Seconds())
	w := loadgen.Generate(loadgen.Spec{Orders: n, Seed: 2, Prefix: e.name, SKUs: o.skus})

	// Memory, every second.
	var rss []float64
	var peak float64
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
				cur, hwm, err := processMemory(svc.cmd.Process.Pid)
				if err == nil {
					rss = append(rss, cur)
					peak = max(peak, hwm)
				}
			}
		}
	}()

	// A downstream consumer of order.confirmed, as the orders' customers
	// would run it: when each order's confirmation reached it.
	confirmed, stopConfirmed, err := receiveTimes(ctx, e.amqpURL, "order.confirmed")
	if err != nil {
		stopSampling()
		return err
	}
	defer stopConfirmed()

	sent, err := publishPaced(ctx, e.amqpURL, w.Messages, o.steadyRate)
	if err != nil {
		stopSampling()
		return err
	}
	if _, err := waitCount(ctx, e.pool, countProcessed, len(w.Messages), lastProcessed); err != nil {
		stopSampling()
		return err
	}
	stopSampling()
	<-sampled

	rows, err := e.pool.Query(ctx, "SELECT message_id, received_at, processed_at FROM inbox")
	if err != nil {
		return err
	}
	var total, ingest, work []time.Duration
	totalOf := map[string]time.Duration{}
	for rows.Next() {
		var id string
		var received, processed time.Time
		if err := rows.Scan(&id, &received, &processed); err != nil {
			return err
		}
		total = append(total, processed.Sub(sent[id]))
		totalOf[id] = processed.Sub(sent[id])
		ingest = append(ingest, received.Sub(sent[id]))
		work = append(work, processed.Sub(received))
	}
	if err := rows.Err(); err != nil {
		return err
	}
	r.add("4. latency at a steady rate", "p50 %s, p99 %s, p99.9 %s, max %s (%d orders at %.0f/s, publish to processed commit, orders handler)",
		quantile(total, 0.50), quantile(total, 0.99), quantile(total, 0.999), quantile(total, 1), len(total), o.steadyRate)
	r.add("   of which publish to stored", "p50 %s, p99 %s", quantile(ingest, 0.50), quantile(ingest, 0.99))
	r.add("   of which stored to processed", "p50 %s, p99 %s", quantile(work, 0.50), quantile(work, 0.99))
	r.add("   p99 per window of publishing", "%s", perWindow(sent, totalOf, o.steadyDuration))
	downstream := confirmed.wait(ctx, len(w.Messages), 30*time.Second)
	var toConsumer []time.Duration
	for id, at := range downstream {
		toConsumer = append(toConsumer, at.Sub(sent[id]))
	}
	r.add("   publish to order.confirmed received", "p50 %s, p99 %s, max %s (%d of %d received by a downstream consumer)",
		quantile(toConsumer, 0.50), quantile(toConsumer, 0.99), quantile(toConsumer, 1), len(toConsumer), len(w.Messages))
	if len(rss) > 0 {
		minute := min(60, len(rss)/3)
		first, last := mean(rss[:minute]), mean(rss[len(rss)-minute:])
		r.add("5. inboxd memory", "peak RSS %.1f MiB; mean RSS %.1f MiB in the first %ds, %.1f MiB in the last %ds of %s",
			peak, first, minute, last, minute, o.steadyDuration)
	}
	return nil
}

// quantile returns the p-quantile of ds (which it sorts), rounded.
func quantile(ds []time.Duration, p float64) string {
	if len(ds) == 0 {
		return "-"
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(p*float64(len(ds))))].Round(100 * time.Microsecond).String()
}

// perWindow gives the p99 of latency for the messages published in each
// window of the run (a minute, or a fifth of a shorter run): flat, or not.
func perWindow(sent map[string]time.Time, latency map[string]time.Duration, run time.Duration) string {
	var start time.Time
	for _, at := range sent {
		if start.IsZero() || at.Before(start) {
			start = at
		}
	}
	window := min(time.Minute, max(run/5, time.Second))
	var buckets [][]time.Duration
	for id, d := range latency {
		i := int(sent[id].Sub(start) / window)
		for len(buckets) <= i {
			buckets = append(buckets, nil)
		}
		buckets[i] = append(buckets[i], d)
	}
	parts := make([]string, len(buckets))
	for i, b := range buckets {
		parts[i] = quantile(b, 0.99)
	}
	return fmt.Sprintf("%s (each %s)", strings.Join(parts, ", "), window)
}

// arrivals records when each message of one routing key first reached a
// consumer, by the inbox message id it answers.
type arrivals struct {
	mu sync.Mutex
	at map[string]time.Time
}

// wait returns the arrivals once n have arrived, or timeout passed.
func (a *arrivals) wait(ctx context.Context, n int, timeout time.Duration) map[string]time.Time {
	deadline := time.Now().Add(timeout)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		a.mu.Lock()
		got := len(a.at)
		a.mu.Unlock()
		if got >= n {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.at)
}

// receiveTimes consumes the events of routingKey from a queue of its own
// bound to the events exchange, and records when each arrived.
func receiveTimes(ctx context.Context, amqpURL, routingKey string) (*arrivals, func(), error) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		_, err = ch.QueueDeclare("bench."+routingKey, true, false, false, false, nil)
	}
	if err == nil {
		err = ch.QueueBind("bench."+routingKey, routingKey, broker.ExchangeEvents, false, nil)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = consume(conn, "bench."+routingKey, 1000)
	}
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	a := &arrivals{at: map[string]time.Time{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ackInBatches(deliveries, func(batch []amqp.Delivery) {
			now := time.Now()
			a.mu.Lock()
			for _, d := range batch {
				id := strings.TrimSuffix(d.MessageId, ":"+routingKey)
				if _, seen := a.at[id]; !seen {
					a.at[id] = now
				}
			}
			a.mu.Unlock()
			_ = batch[len(batch)-1].Ack(true)
		})
	}()
	return a, func() { _ = conn.Close(); <-done }, nil
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// processMemory returns a process's resident set size and its peak, in MiB.
func processMemory(pid int) (rss, hwm float64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, value, ok := strings.Cut(sc.Text(), ":")
		if !ok || (key != "VmRSS" && key != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(value), " kB"), 64)
		if err != nil {
			return 0, 0, err
		}
		if key == "VmRSS" {
			rss = kb / 1024
		} else {
			hwm = kb / 1024
		}
	}
	return rss, hwm, sc.Err()
}

// publishPaced publishes msgs at rate per second, in ticks of 10 ms, on one
// confirmed channel, and returns when each message was sent.
func publishPaced(ctx context.Context, amqpURL string, msgs []loadgen.Message, rate float64) (map[string]time.Time, error) {
	conn, err := broker.Dial(amqpURL, "inboxbench paced publisher", 0)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		return nil, err
	}
	// No window: confirms are waited for at the end, so that waiting never
	// delays a publish past its time.
	p := &broker.Publisher{Ch: ch}
	sent := make(map[string]time.Time, len(msgs))
	start := time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	next := 0
	for next < len(msgs) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
		due := min(len(msgs), int(time.Since(start).Seconds()*rate))
		for ; next < due; next++ {
			m := msgs[next]
			sent[m.MessageID] = time.Now()
			if err := p.Publish(ctx, broker.ExchangeOrders, m.RoutingKey, false, amqp.Publishing{
				ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: m.MessageID, Body: m.Body,
			}); err != nil {
				return nil, err
			}
		}
	}
	if err := p.Wait(ctx); err != nil {
		return nil, err
	}
	return sent, nil
}

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

// benchProbes measures (8): a real inboxd with the orders handler drains a
// preloaded queue of o.probeMessages orders, once without and once with
// o.probeClients clients sending GET /readyz in a loop, each run in a fresh
// schema and virtual host; the drop of processed orders per second is what
// the probes cost.
func benchProbes(ctx context.Context, o *options, r *report) error {
	var rates [2]float64
	for i, clients := range []int{0, o.probeClients} {
		e, err := newEnv(ctx, o, fmt.Sprintf("probes%d", clients))
		if err != nil {
			return err
		}
		w := loadgen.Generate(loadgen.Spec{Orders: o.probeMessages, Seed: 1, Prefix: e.name, SKUs: o.skus})
		if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
			e.close()
			return err
		}
		svc, httpAddr, err := e.startInboxd(o)
		if err != nil {
			e.close()
			return err
		}
		if err := waitReady(ctx, httpAddr); err != nil {
			svc.stop()
			e.close()
			return err
		}
		probeCtx, stopProbes := context.WithCancel(ctx)
		var ok, notOK int64
		probed := make(chan struct{})
		go func() {
			defer close(probed)
			if clients > 0 {
				ok, notOK = probeLoop(probeCtx, httpAddr, clients)
			}
		}()
		start := time.Now()
		done, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
		took := done.Sub(start)
		stopProbes()
		<-probed
		svc.stop()
		e.close()
		if err != nil {
			return err
		}
		rates[i] = float64(w.UniqueMessageIDs) / took.Seconds()
		if clients == 0 {
			r.add("8. backlog, no probes", "%.0f orders/s processed (%d orders preloaded, %s from ready to the last processed)",
				rates[i], w.UniqueMessageIDs, took.Round(time.Millisecond))
			continue
		}
		r.add(fmt.Sprintf("   with %d /readyz loops", clients), "%.0f orders/s processed (%s), %.1f%% of the run without; %.0f probes/s answered 200, %d not",
			rates[i], took.Round(time.Millisecond), 100*rates[i]/rates[0], float64(ok)/took.Seconds(), notOK)
	}
	return nil
}
