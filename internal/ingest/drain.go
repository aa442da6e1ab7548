package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// drainPoll is how often Drain looks at the queue it empties.
const drainPoll = 100 * time.Millisecond

// drainSettle bounds the wait for a queue's consumers to go: the broker
// hands a closed channel's unacknowledged deliveries back to a quorum queue
// a moment after the close.
const drainSettle = 30 * time.Second

// Drain stores what waits in queues into the inbox, each queue in its order
// and one after the other, and returns once each is empty with no consumer.
// The queues must be unbound already (broker.Reroute) and consumed by no
// one else (every replica stopped): Drain fails when a queue still has a
// consumer after drainSettle, and stops at the first moment a queue is
// empty and unconsumed, leaving whatever would arrive later.
func (i *Ingest) Drain(ctx context.Context, queues []string) error {
	conn, err := broker.Dial(i.cfg.URL, i.cfg.ConnectionName, i.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	pubConn, err := broker.Dial(i.cfg.URL, i.cfg.ConnectionName+" dead letters", i.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = pubConn.Close() }()
	for _, queue := range queues {
		if err := i.drain(ctx, conn, pubConn, queue); err != nil {
			return fmt.Errorf("drain %s: %w", queue, err)
		}
	}
	return nil
}

// drain empties one queue: it consumes until nothing is ready (the rest is
// in the consumer's hands), stores the batch in hand and closes the
// channel, which sends what it had been sent ahead back to the queue, and
// starts again until the queue is empty once its consumers are gone.
func (i *Ingest) drain(ctx context.Context, conn, pubConn *amqp.Connection, queue string) error {
	for {
		q, err := unconsumed(ctx, conn, queue)
		if err != nil {
			return err
		}
		if q.Messages == 0 {
			return nil
		}
		i.logger.Info("draining", slog.String("queue", queue), slog.Int("messages", q.Messages))
		p := &partition{queue: queue, yield: make(chan struct{}, 1)}
		watchCtx, stopWatching := context.WithCancel(ctx)
		startstop.Go(func() {
			tick := time.NewTicker(drainPoll)
			defer tick.Stop()
			for {
				select {
				case <-watchCtx.Done():
					return
				case <-tick.C:
				}
				// On an error too: the next look at the queue says why.
				if q, err := broker.InspectQueue(conn, queue); err != nil || q.Messages == 0 {
					p.yield <- struct{}{}
					return
				}
			}
		})
		err = i.consume(ctx, ctx, conn, pubConn, p)
		stopWatching()
		switch {
		case errors.Is(err, errYielded):
		case err != nil:
			return err
		case ctx.Err() != nil:
			return ctx.Err()
		default:
			return errors.New("consumer stopped")
		}
	}
}

// unconsumed waits until queue has no consumer, at most drainSettle, and
// returns what the broker then says of it.
func unconsumed(ctx context.Context, conn *amqp.Connection, queue string) (amqp.Queue, error) {
	deadline := time.Now().Add(drainSettle)
	for {
		q, err := broker.InspectQueue(conn, queue)
		if err != nil || q.Consumers == 0 {
			return q, err
		}
		if time.Now().After(deadline) {
			return q, fmt.Errorf("%d consumers still, %s after its own went: stop every replica first", q.Consumers, drainSettle)
		}
		select {
		case <-time.After(drainPoll / 2):
		case <-ctx.Done():
			return q, ctx.Err()
		}
	}
}
