package main

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchSteady measures (4) and (5): a real inboxd process with the orders
// handler, fed at a steady rate; latency from each publish to its processed
// commit, and the process's memory sampled throughout. Unless -ruler=false,
// the simplest inbox (simplest.go) is fed the same messages at the same
// rate, the two alternating which goes first, for -rounds pairs.
func benchSteady(ctx context.Context, o *options, r *report) error {
	n := int(o.steadyRate * o.steadyDuration.Seconds())
	w := loadgen.Generate(loadgen.Spec{Orders: n, Seed: 2, Prefix: fmt.Sprintf("bench_steady_%d", time.Now().UnixNano()), SKUs: o.skus})
	var ratios []float64
	for round := range o.rounds {
		var p99 [2]time.Duration
		for _, s := range r.pairOrder(o) {
			var err error
			if s == sideInboxd {
				p99[s], err = steadyInboxd(ctx, o, w, r, round)
			} else {
				p99[s], err = steadySimplest(ctx, o, w, r, round)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		if o.ruler {
			ratios = append(ratios, float64(p99[sideInboxd])/float64(p99[sideSimplest]))
			r.add("   inboxd / simplest inbox, p99", "%.2f (%s against %s)%s", ratios[len(ratios)-1],
				p99[sideInboxd].Round(100*time.Microsecond), p99[sideSimplest].Round(100*time.Microsecond), roundOf(o, round))
		}
	}
	if o.ruler && o.rounds > 1 {
		r.add("   inboxd / simplest inbox, p99, over the rounds", "%s", spreadRatio(ratios))
	}
	return nil
}

// steadyInboxd runs w through a fresh inboxd process at -steady-rate,
// reports its latencies and memory, and returns its p99, publish to
// processed.
func steadyInboxd(ctx context.Context, o *options, w *loadgen.Workload, r *report, round int) (time.Duration, error) {
	e, err := newEnv(ctx, o, "steady")
	if err != nil {
		return 0, err
	}
	defer e.close()
	svc, _, err := e.serve(ctx, o)
	if err != nil {
		return 0, err
	}
	defer svc.stop()
	if err := turnOff(ctx, e.pool, o.without); err != nil {
		return 0, err
	}

	memory := sampleMemory(ctx, svc.cmd.Process.Pid)
	// A downstream consumer of order.confirmed, as the orders' customers
	// would run it: when each order's confirmation reached it.
	confirmed, stopConfirmed, err := receiveTimes(ctx, e.amqpURL, "order.confirmed")
	if err != nil {
		memory.stop()
		return 0, err
	}
	defer stopConfirmed()

	sent, err := publishPaced(ctx, e.amqpURL, w.Messages, o.steadyRate)
	if err != nil {
		memory.stop()
		return 0, err
	}
	if _, err := waitCount(ctx, e.pool, countProcessed, len(w.Messages), lastProcessed); err != nil {
		memory.stop()
		return 0, err
	}
	memory.stop()

	l, err := readLatencies(ctx, e.pool, sent)
	if err != nil {
		return 0, err
	}
	l.report(r, sent, o, roundOf(o, round))
	toConsumer := sinceSent(sent, confirmed.wait(ctx, len(w.Messages), 30*time.Second))
	r.add("   publish to order.confirmed received", "p50 %s, p99 %s, max %s (%d of %d received by a downstream consumer)",
		quantile(toConsumer, 0.50), quantile(toConsumer, 0.99), quantile(toConsumer, 1), len(toConsumer), len(w.Messages))
	memory.report(r, o.steadyDuration)
	return quantileOf(l.total, 0.99), nil
}

// steadySimplest runs w through the simplest inbox at -steady-rate, reports
// its latencies, and returns its p99, publish to processed.
func steadySimplest(ctx context.Context, o *options, w *loadgen.Workload, r *report, round int) (time.Duration, error) {
	e, err := newSimplestEnv(ctx, o, "steady")
	if err != nil {
		return 0, err
	}
	defer e.close()
	runCtx, stop, _, err := startSide(ctx, o, e, sideSimplest)
	if err != nil {
		return 0, err
	}
	defer stop()
	confirmed, stopConfirmed, err := receiveTimesFrom(runCtx, e.amqpURL, simplestEvents, "order.confirmed")
	if err != nil {
		return 0, failedSide(stop, err)
	}
	defer stopConfirmed()
	sent, err := publishPaced(runCtx, e.amqpURL, w.Messages, o.steadyRate)
	if err != nil {
		return 0, failedSide(stop, err)
	}
	if _, err := waitCount(runCtx, e.pool, countSimplestProcessed, len(w.Messages), lastProcessed); err != nil {
		return 0, failedSide(stop, err)
	}
	arrived := confirmed.wait(runCtx, len(w.Messages), 30*time.Second)
	if err := stop(); err != nil {
		return 0, err
	}
	l, err := readLatencies(ctx, e.pool, sent)
	if err != nil {
		return 0, err
	}
	toConsumer := sinceSent(sent, arrived)
	r.add("   simplest inbox, same traffic", "p50 %s, p99 %s, p99.9 %s, max %s, publish to processed commit (of which publish to stored p50 %s, p99 %s); to order.confirmed received p50 %s, p99 %s (%d of %d)%s",
		quantile(l.total, 0.50), quantile(l.total, 0.99), quantile(l.total, 0.999), quantile(l.total, 1), quantile(l.ingest, 0.50), quantile(l.ingest, 0.99),
		quantile(toConsumer, 0.50), quantile(toConsumer, 0.99), len(toConsumer), len(w.Messages), roundOf(o, round))
	return quantileOf(l.total, 0.99), nil
}

// memorySampler reads a process's memory every second until stopped.
type memorySampler struct {
	rss  []float64 // resident set size, MiB, one a second
	peak float64   // the process's peak resident set size, MiB
	stop func()    // ends the sampling and waits until it has ended
}

// sampleMemory starts sampling the memory of the process pid.
func sampleMemory(ctx context.Context, pid int) *memorySampler {
	m := &memorySampler{}
	ctx, cancel := context.WithCancel(ctx)
	sampled := make(chan struct{})
	m.stop = func() { cancel(); <-sampled }
	go func() {
		defer close(sampled)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				cur, hwm, err := processMemory(pid)
				if err == nil {
					m.rss = append(m.rss, cur)
					m.peak = max(m.peak, hwm)
				}
			}
		}
	}()
	return m
}

// report adds (5): the peak, and the mean at the start and at the end of
// the run (a minute each, or a third of a shorter run).
func (m *memorySampler) report(r *report, run time.Duration) {
	if len(m.rss) == 0 {
		return
	}
	minute := min(60, len(m.rss)/3)
	first, last := mean(m.rss[:minute]), mean(m.rss[len(m.rss)-minute:])
	r.add("5. inboxd memory", "peak RSS %.1f MiB; mean RSS %.1f MiB in the first %ds, %.1f MiB in the last %ds of %s",
		m.peak, first, minute, last, minute, run)
}

// latencies are each processed message's times from its publish to stored
// (ingest), from stored to processed (work), and the two together (total).
type latencies struct {
	total, ingest, work []time.Duration
	totalOf             map[string]time.Duration // total by message id
}

// readLatencies reads when each message in the inbox was stored and
// processed, against when it was sent.
func readLatencies(ctx context.Context, pool *pgxpool.Pool, sent map[string]time.Time) (*latencies, error) {
	rows, err := pool.Query(ctx, "SELECT message_id, received_at, processed_at FROM inbox")
	if err != nil {
		return nil, err
	}
	l := &latencies{totalOf: map[string]time.Duration{}}
	for rows.Next() {
		var id string
		var received, processed time.Time
		if err := rows.Scan(&id, &received, &processed); err != nil {
			return nil, err
		}
		l.total = append(l.total, processed.Sub(sent[id]))
		l.totalOf[id] = processed.Sub(sent[id])
		l.ingest = append(l.ingest, received.Sub(sent[id]))
		l.work = append(l.work, processed.Sub(received))
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return l, nil
}

// report adds (4): the quantiles of each latency, and the p99 per window;
// round labels the first row.
func (l *latencies) report(r *report, sent map[string]time.Time, o *options, round string) {
	r.add("4. latency at a steady rate", "p50 %s, p99 %s, p99.9 %s, max %s (%d orders at %.0f/s, publish to processed commit, orders handler)%s%s",
		quantile(l.total, 0.50), quantile(l.total, 0.99), quantile(l.total, 0.999), quantile(l.total, 1), len(l.total), o.steadyRate, withoutOf(o), round)
	r.add("   of which publish to stored", "p50 %s, p99 %s", quantile(l.ingest, 0.50), quantile(l.ingest, 0.99))
	r.add("   of which stored to processed", "p50 %s, p99 %s", quantile(l.work, 0.50), quantile(l.work, 0.99))
	r.add("   p99 per window of publishing", "%s", perWindow(sent, l.totalOf, o.steadyDuration))
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
	return receiveTimesFrom(ctx, amqpURL, broker.ExchangeEvents, routingKey)
}

// receiveTimesFrom is receiveTimes on another exchange.
func receiveTimesFrom(ctx context.Context, amqpURL, exchange, routingKey string) (*arrivals, func(), error) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		_, err = ch.QueueDeclare("bench."+routingKey, true, false, false, false, nil)
	}
	if err == nil {
		err = ch.QueueBind("bench."+routingKey, routingKey, exchange, false, nil)
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
	return pace(ctx, ch, msgs, rate, func(m loadgen.Message) amqp.Publishing {
		return amqp.Publishing{ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: m.MessageID, Body: m.Body}
	})
}

// pace publishes msgs to broker.ExchangeOrders on ch, in confirm mode, at
// rate per second in ticks of 10 ms, each as publishing makes it, and
// returns when each was sent. Confirms are waited for at the end, so that
// waiting never delays a publish past its time.
func pace(ctx context.Context, ch *amqp.Channel, msgs []loadgen.Message, rate float64, publishing func(loadgen.Message) amqp.Publishing) (map[string]time.Time, error) {
	p := &broker.Publisher{Ch: ch}
	sent := make(map[string]time.Time, len(msgs))
	start := time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for next := 0; next < len(msgs); {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
		for due := min(len(msgs), int(time.Since(start).Seconds()*rate)); next < due; next++ {
			m := msgs[next]
			sent[m.MessageID] = time.Now()
			if err := p.Publish(ctx, broker.ExchangeOrders, m.RoutingKey, false, publishing(m)); err != nil {
				return nil, err
			}
		}
	}
	if err := p.Wait(ctx); err != nil {
		return nil, err
	}
	return sent, nil
}
