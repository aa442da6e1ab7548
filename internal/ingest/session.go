package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// session runs one connection: it declares the topology and consumes each
// inbox queue on a channel of its own until the connection or a channel
// fails, or until fetchCtx ends.
func (i *Ingest) session(fetchCtx, workCtx context.Context) error {
	conn, err := broker.Dial(i.cfg.URL, i.cfg.ConnectionName, i.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	// Dead letters go out on a connection of their own: under a memory or
	// disk alarm the broker blocks publishing connections, and this one
	// carries the acks of everything ingest stores.
	pubConn, err := broker.Dial(i.cfg.URL, i.cfg.ConnectionName+" dead letters", i.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = pubConn.Close() }()
	pubClosed := pubConn.NotifyClose(make(chan *amqp.Error, 1))
	// Past the grace period nothing waits on the broker: closing the
	// connections ends every publish, confirm and read in flight.
	defer context.AfterFunc(workCtx, func() { broker.CloseHard(conn, pubConn) })()

	if err := i.declare(conn); err != nil {
		return err
	}

	sessCtx, cancel := context.WithCancelCause(fetchCtx)
	defer cancel(nil)
	queues := broker.InboxQueues(i.cfg.Partitions)
	parts := make([]*partition, len(queues))
	var consumers sync.WaitGroup
	for n, queue := range queues {
		parts[n] = &partition{queue: queue, yield: make(chan struct{}, 1)}
		consumers.Go(startstop.Guard(func() {
			err := i.consumeQueue(sessCtx, workCtx, conn, pubConn, parts[n])
			if err == nil && fetchCtx.Err() == nil {
				err = errors.New("consumer stopped")
			}
			cancel(err)
		}))
	}
	i.parts.Store(&parts)
	defer i.parts.Store(nil)
	if len(parts) > 1 {
		consumers.Go(startstop.Guard(func() {
			if err := i.balance(sessCtx, conn, parts); err != nil {
				cancel(err)
			}
		}))
	}
	i.logger.Info("connected to broker", slog.Int("partitions", len(parts)))
	select {
	case amqpErr := <-connClosed:
		cancel(closedError("connection", amqpErr))
	case amqpErr := <-pubClosed:
		cancel(closedError("dead-letter connection", amqpErr))
	case <-sessCtx.Done():
	}
	consumers.Wait()
	if fetchCtx.Err() != nil {
		return nil
	}
	return context.Cause(sessCtx)
}

// declare declares the topology.
func (i *Ingest) declare(conn *amqp.Connection) error {
	return broker.DeclareTopology(conn, broker.Topology{QueueType: i.cfg.QueueType, Partitions: i.cfg.Partitions})
}

// inbound is what the consuming channel hands ingest: its deliveries, and
// word of its end.
type inbound struct {
	deliveries <-chan amqp.Delivery
	closed     <-chan *amqp.Error
	cancelled  <-chan string
}

// yieldPause is how long a partition's consumer stays away after giving
// the partition up, so that a standby replica's consumer becomes active.
const yieldPause = time.Second

// consumeQueue consumes p's queue until it fails or sessCtx ends, giving the
// queue up and consuming it again, as a standby, each time it is told to
// yield.
func (i *Ingest) consumeQueue(sessCtx, workCtx context.Context, conn, pubConn *amqp.Connection, p *partition) error {
	defer func() {
		if p.counted {
			i.consuming.Add(-1)
		}
	}()
	for {
		err := i.consume(sessCtx, workCtx, conn, pubConn, p)
		if !errors.Is(err, errYielded) {
			return err
		}
		p.activeSince.Store(0)
		i.logger.Info("gave a partition up to another replica", slog.String("queue", p.queue))
		select {
		case <-time.After(yieldPause):
		case <-sessCtx.Done():
			return nil
		}
		select {
		case <-p.yield: // asked while away
		default:
		}
	}
}

// consume opens a consuming channel on p's queue, and a dead-letter channel,
// and collects batches until either fails, sessCtx ends or p is told to
// yield (errYielded).
func (i *Ingest) consume(sessCtx, workCtx context.Context, conn, pubConn *amqp.Connection, p *partition) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	in := inbound{
		closed:    ch.NotifyClose(make(chan *amqp.Error, 1)),
		cancelled: ch.NotifyCancel(make(chan string, 1)),
	}
	if err := ch.Qos(i.prefetch(), 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}

	dl, err := openDeadLetters(pubConn, i.cfg.BatchSize, i.logger, i.cfg.ReplyPolicy)
	if err != nil {
		return err
	}
	defer dl.close()

	in.deliveries, err = ch.Consume(p.queue, i.cfg.ConnectionName, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %q: %w", p.queue, err)
	}
	if !p.counted {
		p.counted = true
		i.consuming.Add(1)
	}
	return i.collect(sessCtx, workCtx, in, &batch{ch: ch, queue: p.queue, stopping: sessCtx.Done()}, dl, p)
}

// closedError says what closed, and why when the broker said.
func closedError(what string, amqpErr *amqp.Error) error {
	if amqpErr == nil {
		return errors.New(what + " closed")
	}
	return fmt.Errorf("%s closed: %w", what, amqpErr)
}

// channelError is why a channel's deliveries ended: the broker's reason
// when it gave one, else fallback.
func channelError(chClosed <-chan *amqp.Error, fallback string) error {
	select {
	case amqpErr := <-chClosed:
		if amqpErr != nil {
			return fmt.Errorf("channel closed: %w", amqpErr)
		}
	default:
	}
	return errors.New(fallback)
}
