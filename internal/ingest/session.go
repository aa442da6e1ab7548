package ingest

import (
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
)

// session runs one connection: it declares the topology and consumes on one
// channel until the connection or the channel fails, or until fetchCtx ends.
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
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		err := i.consume(sessCtx, workCtx, conn, pubConn)
		if err == nil && fetchCtx.Err() == nil {
			err = errors.New("consumer stopped")
		}
		cancel(err)
	}()
	i.logger.Info("connected to broker")
	select {
	case amqpErr := <-connClosed:
		cancel(closedError("connection", amqpErr))
	case amqpErr := <-pubClosed:
		cancel(closedError("dead-letter connection", amqpErr))
	case <-sessCtx.Done():
	}
	<-consumed
	if fetchCtx.Err() != nil {
		return nil
	}
	return context.Cause(sessCtx)
}

// declare declares the topology on a channel of its own.
func (i *Ingest) declare(conn *amqp.Connection) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := broker.DeclareTopology(ch, i.cfg.QueueType); err != nil {
		return err
	}
	_ = ch.Close()
	return nil
}

// inbound is what the consuming channel hands ingest: its deliveries, and
// word of its end.
type inbound struct {
	deliveries <-chan amqp.Delivery
	closed     <-chan *amqp.Error
	cancelled  <-chan string
}

// consume opens the consuming channel and the dead-letter channel and
// collects batches until either fails or sessCtx ends.
func (i *Ingest) consume(sessCtx, workCtx context.Context, conn, pubConn *amqp.Connection) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	in := inbound{
		closed:    ch.NotifyClose(make(chan *amqp.Error, 1)),
		cancelled: ch.NotifyCancel(make(chan string, 1)),
	}
	if err := ch.Qos(i.cfg.Prefetch, 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}

	dl, err := openDeadLetters(pubConn, i.cfg.BatchSize, i.logger)
	if err != nil {
		return err
	}
	defer dl.close()

	tag := i.cfg.ConnectionName
	in.deliveries, err = ch.Consume(broker.QueueInbox, tag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %q: %w", broker.QueueInbox, err)
	}
	i.consuming.Store(true)
	defer i.consuming.Store(false)

	return i.collect(sessCtx, workCtx, in, &batch{ch: ch, stopping: sessCtx.Done()}, dl)
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
