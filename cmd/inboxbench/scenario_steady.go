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

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

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
