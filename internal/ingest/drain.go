package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
)

// drainPoll is how often Drain looks at the queue it empties.
const drainPoll = 200 * time.Millisecond

// Drain stores what waits in queues into the inbox, each queue in its order
// and one after the other, as a consumer of each (standing by while another
// is active), and returns once each is empty. The queues are meant to be
// unbound already (broker.Reroute): Drain stops at the first moment a queue
// has nothing ready, and would leave what arrives later.
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

// drain empties one queue: it consumes until the queue has nothing ready,
// stores the batch in hand and closes the channel (what it had been sent
// ahead goes back to the queue), and starts again until the queue is empty
// with the channel closed.
func (i *Ingest) drain(ctx context.Context, conn, pubConn *amqp.Connection, queue string) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		if q.Messages == 0 {
			return nil
		}
		i.logger.Info("draining", slog.String("queue", queue), slog.Int("messages", q.Messages))
		p := &partition{queue: queue, yield: make(chan struct{}, 1)}
		watchCtx, stopWatching := context.WithCancel(ctx)
		go func() {
			tick := time.NewTicker(drainPoll)
			defer tick.Stop()
			for {
				select {
				case <-watchCtx.Done():
					return
				case <-tick.C:
				}
				if q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil && q.Messages == 0 {
					p.yield <- struct{}{}
					return
				}
			}
		}()
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
