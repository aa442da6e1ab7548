package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// The rulers: what the broker alone carries of the same traffic, on the
// same machine, in the same run. The inbox's figures are read against the
// best of them.

// ackEvery is how many deliveries a ruler's consumer acknowledges at once
// (one multiple ack), or whatever it holds after ackLinger.
const (
	ackEvery  = 500
	ackLinger = 5 * time.Millisecond
)

// benchPassthrough times the broker alone carrying scenario 1's messages to
// consumers that only acknowledge them, two ways: the bench's publishers
// into two consuming channels, and one publisher channel (a window of 500
// confirms) into one consumer (prefetch 1,000). The better of the two is
// the ruler of the core path.
func benchPassthrough(ctx context.Context, o *options, r *report) error {
	for _, shape := range []struct {
		name                 string
		publishers, channels int
	}{
		{fmt.Sprintf("%d publishers × %d, 2 consuming channels", o.publishers, o.window), o.publishers, 2},
		{"1 publisher × 500, 1 consuming channel", 1, 1},
	} {
		window := o.window
		if shape.publishers == 1 {
			window = 500
		}
		rate, err := passthrough(ctx, o, shape.publishers, window, shape.channels)
		if err != nil {
			return err
		}
		r.add("7. broker only, publish to acked", "%.0f msg/s (%s, prefetch 1,000, acking every %d)", rate, shape.name, ackEvery)
		r.passthrough = max(r.passthrough, rate)
	}
	if r.core > 0 {
		r.add("   core path / broker only", "%.2f (against the better ruler)", r.core/r.passthrough)
	}
	return nil
}

func passthrough(ctx context.Context, o *options, publishers, window, channels int) (float64, error) {
	e, err := newEnv(ctx, o, "passthrough")
	if err != nil {
		return 0, err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	conn, err := amqp.Dial(e.amqpURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	var consumed atomic.Int64
	var wg sync.WaitGroup
	for range channels {
		deliveries, err := consume(conn, broker.QueueInbox, 1000)
		if err != nil {
			return 0, err
		}
		wg.Go(func() {
			ackInBatches(deliveries, func(batch []amqp.Delivery) {
				_ = batch[len(batch)-1].Ack(true)
				consumed.Add(int64(len(batch)))
			})
		})
	}
	start := time.Now()
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, publishers, window); err != nil {
		return 0, err
	}
	if err := waitFor(ctx, func() bool { return consumed.Load() >= int64(len(w.Messages)) }); err != nil {
		return 0, err
	}
	took := time.Since(start)
	_ = conn.Close()
	wg.Wait()
	return float64(len(w.Messages)) / took.Seconds(), nil
}

// benchDomainRuler times the broker alone doing the messaging of scenario
// 2: a consumer takes each order.created and publishes two persistent
// events with publisher confirms to the events exchange, acknowledging the
// order once both are confirmed, and a downstream consumer drains a queue
// bound to the events. It is the ruler of the whole domain.
func benchDomainRuler(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "domainruler")
	if err != nil {
		return err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	conn, err := amqp.Dial(e.amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	orders, events, pub, err := domainRulerChannels(conn)
	if err != nil {
		return err
	}
	var drained atomic.Int64
	var relayErr atomic.Pointer[error]
	var wg sync.WaitGroup
	wg.Go(func() {
		ackInBatches(events, func(batch []amqp.Delivery) {
			_ = batch[len(batch)-1].Ack(true)
			drained.Add(int64(len(batch)))
		})
	})
	wg.Go(func() {
		ackInBatches(orders, func(batch []amqp.Delivery) {
			if relayErr.Load() != nil {
				return
			}
			if err := relayEvents(ctx, pub, batch); err != nil {
				relayErr.CompareAndSwap(nil, &err)
				return
			}
			_ = batch[len(batch)-1].Ack(true)
		})
	})
	start := time.Now()
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
		return err
	}
	want := int64(2 * w.UniqueMessageIDs)
	if err := waitFor(ctx, func() bool { return drained.Load() >= want || relayErr.Load() != nil }); err != nil {
		return err
	}
	took := time.Since(start)
	_ = conn.Close()
	wg.Wait()
	if err := relayErr.Load(); err != nil {
		return *err
	}
	// Duplicates in the workload are relayed too: the ruler does more than
	// the domain, which relays each unique message once.
	r.domainRuler = float64(w.UniqueMessageIDs) / took.Seconds()
	r.add("9. broker only, the domain's messaging", "%.0f orders/s (%d messages consumed, two persistent events each published with confirms, %d events drained, %s)",
		r.domainRuler, len(w.Messages), drained.Load(), took.Round(time.Millisecond))
	r.domainRatios()
	return nil
}

// domainRulerChannels declares the downstream queue, bound to every event,
// and opens on conn the consumers of the orders and of the downstream queue
// and a confirmed channel to publish the events on.
func domainRulerChannels(conn *amqp.Connection) (orders, events <-chan amqp.Delivery, pub *amqp.Channel, err error) {
	setup, err := conn.Channel()
	if err != nil {
		return nil, nil, nil, err
	}
	if _, err := setup.QueueDeclare("bench.downstream", true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		return nil, nil, nil, err
	}
	if err := setup.QueueBind("bench.downstream", "#", broker.ExchangeEvents, false, nil); err != nil {
		return nil, nil, nil, err
	}
	if orders, err = consume(conn, broker.QueueInbox, 1000); err != nil {
		return nil, nil, nil, err
	}
	if events, err = consume(conn, "bench.downstream", 1000); err != nil {
		return nil, nil, nil, err
	}
	if pub, err = conn.Channel(); err != nil {
		return nil, nil, nil, err
	}
	if err := pub.Confirm(false); err != nil {
		return nil, nil, nil, err
	}
	return orders, events, pub, nil
}

// relayEvents publishes an order.confirmed and an email.requested for each
// order in batch on pub, and waits until all are confirmed.
func relayEvents(ctx context.Context, pub *amqp.Channel, batch []amqp.Delivery) error {
	events := &broker.Publisher{Ch: pub}
	for _, d := range batch {
		for _, key := range []string{"order.confirmed", "email.requested"} {
			if err := events.Publish(ctx, broker.ExchangeEvents, key, true, amqp.Publishing{
				MessageId: d.MessageId + ":" + key, DeliveryMode: amqp.Persistent, ContentType: "application/json", Body: d.Body,
			}); err != nil {
				return err
			}
		}
	}
	if err := events.Wait(ctx); err != nil {
		return fmt.Errorf("events not confirmed: %w", err)
	}
	return nil
}

// domainRatios prints the whole domain against its ruler once both ran.
func (r *report) domainRatios() {
	if r.domainRuler == 0 || r.domainPublished == 0 {
		return
	}
	r.add("   whole domain / broker only", "%.2f to the last event published, %.2f to the last processed",
		r.domainPublished/r.domainRuler, r.domainProcessed/r.domainRuler)
}

// consume opens a channel on conn consuming queue with the given prefetch.
func consume(conn *amqp.Connection, queue string, prefetch int) (<-chan amqp.Delivery, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return nil, err
	}
	return ch.Consume(queue, "", false, false, false, false, nil)
}

// ackInBatches hands deliveries to done in batches of ackEvery, or what has
// arrived after ackLinger, until the channel closes.
func ackInBatches(deliveries <-chan amqp.Delivery, done func([]amqp.Delivery)) {
	var batch []amqp.Delivery
	linger := time.NewTicker(ackLinger)
	defer linger.Stop()
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			batch = append(batch, d)
			if len(batch) < ackEvery {
				continue
			}
		case <-linger.C:
			if len(batch) == 0 {
				continue
			}
		}
		done(batch)
		batch = batch[:0]
	}
}

// waitFor polls until cond holds or ctx ends.
func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}
