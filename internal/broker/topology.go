// Package broker holds the service's RabbitMQ contract: the names of its
// exchanges, queues and headers, DeclareTopology, and Dial, the one way the
// service connects.
package broker

import (
	"context"
	"errors"
	"fmt"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
)

// RabbitMQ names of the service's external contract.
const (
	// ExchangeOrders is the producers' topic exchange.
	ExchangeOrders = "orders"
	// QueueInbox is the queue ingest consumes, bound to ExchangeOrders with
	// inboxRoutingKeys.
	QueueInbox = "order-confirmation.inbox"
	// ExchangeDeadLetter receives deliveries that cannot enter the inbox.
	ExchangeDeadLetter = "order-confirmation.dlx"
	// QueueDead holds everything published to ExchangeDeadLetter.
	QueueDead = "order-confirmation.dead"
	// ExchangeEvents is the topic exchange the outbox relay publishes to.
	ExchangeEvents = "order-confirmation.events"
	// ExchangeUnroutable is ExchangeEvents' alternate exchange: an event no
	// binding of ExchangeEvents routes goes there instead of being dropped.
	ExchangeUnroutable = "order-confirmation.unroutable"
	// QueueUnroutable holds everything published to ExchangeUnroutable,
	// until an operator redelivers it (inboxd redeliver-unroutable).
	QueueUnroutable = "order-confirmation.unroutable"

	// HeaderRejectReason is the header that says why a delivery was
	// dead-lettered instead of stored.
	HeaderRejectReason = "x-inbox-reject-reason"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey record where a
	// dead-lettered delivery was first published.
	HeaderOriginalExchange   = "x-inbox-original-exchange"
	HeaderOriginalRoutingKey = "x-inbox-original-routing-key"
	// HeaderOriginalExpiration and HeaderOriginalUserID keep the two
	// properties a dead letter cannot carry as they were: an expiration
	// would let the broker drop it unseen, and the broker refuses a publish
	// whose user_id is not the publishing connection's user.
	HeaderOriginalExpiration = "x-inbox-original-expiration"
	HeaderOriginalUserID     = "x-inbox-original-user-id"
)

// Queue types accepted for QueueInbox and QueueDead.
const (
	QueueTypeQuorum  = "quorum"
	QueueTypeClassic = "classic"
)

// inboxRoutingKeys are the routing keys that bind the inbox layout (QueueInbox,
// or a partitioned layout's exchange) to ExchangeOrders.
var inboxRoutingKeys = []string{"order.created", "order.cancelled"}

// ErrInboxQueueOutdated is returned by DeclareTopology when QueueInbox exists
// without the single-active-consumer argument, as builds before it declared
// it. A queue's arguments cannot change in place; docs/ordering.md's "Upgrading
// the inbox queue" moves it without losing a message.
var ErrInboxQueueOutdated = errors.New("queue " + QueueInbox + " was declared without x-single-active-consumer by an older inboxd, " +
	"so several consumers could interleave an order's messages; RabbitMQ cannot add the argument in place: " +
	"follow \"Upgrading the inbox queue\" in docs/ordering.md to re-declare it without losing a message")

// ErrEventsExchangeOutdated is returned by DeclareTopology when
// ExchangeEvents exists without its alternate exchange, as builds before it
// declared it.
var ErrEventsExchangeOutdated = errors.New("exchange " + ExchangeEvents + " was declared without alternate-exchange by an older inboxd, " +
	"so events no queue is bound for would be dropped; RabbitMQ cannot add the argument in place: " +
	"follow \"Upgrading the events exchange\" in docs/operations.md")

// DeclareShared declares the contract's exchanges and queues other than the
// inbox queues: the orders, dead-letter, events and unroutable exchanges and
// the dead and unroutable queues. It is idempotent, so every process does it
// at every (re)connection. A queue that already exists with other arguments
// (another queue type, say) fails with a PRECONDITION_FAILED channel error.
func DeclareShared(ch *amqp.Channel, queueType string) error {
	for _, ex := range []string{ExchangeOrders, ExchangeDeadLetter} {
		if err := ch.ExchangeDeclare(ex, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare exchange %q: %w", ex, err)
		}
	}
	if err := ch.ExchangeDeclare(ExchangeUnroutable, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", ExchangeUnroutable, err)
	}
	if _, err := ch.QueueDeclare(QueueUnroutable, true, false, false, false, amqp.Table{amqp.QueueTypeArg: queueType}); err != nil {
		return fmt.Errorf("declare queue %q: %w", QueueUnroutable, err)
	}
	if err := ch.QueueBind(QueueUnroutable, "", ExchangeUnroutable, false, nil); err != nil {
		return fmt.Errorf("bind queue %q: %w", QueueUnroutable, err)
	}
	err := ch.ExchangeDeclare(ExchangeEvents, amqp.ExchangeTopic, true, false, false, false, amqp.Table{"alternate-exchange": ExchangeUnroutable})
	if isInequivalent(err, "alternate-exchange") {
		return ErrEventsExchangeOutdated
	} else if err != nil {
		return fmt.Errorf("declare exchange %q: %w", ExchangeEvents, err)
	}
	if _, err := ch.QueueDeclare(QueueDead, true, false, false, false, amqp.Table{amqp.QueueTypeArg: queueType}); err != nil {
		return fmt.Errorf("declare queue %q: %w", QueueDead, err)
	}
	if err := ch.QueueBind(QueueDead, "#", ExchangeDeadLetter, false, nil); err != nil {
		return fmt.Errorf("bind queue %q: %w", QueueDead, err)
	}
	return nil
}

// DeclareTopology declares the whole contract: DeclareShared's part, then
// the inbox queues of t's layout (see Topology) and their bindings. Another
// layout found on the broker (INBOX_PARTITIONS changed) is then unbound from
// ExchangeOrders when its queues are empty and unconsumed (they are left,
// empty), and refused with a *LayoutConflictError, before anything is
// declared, when they are not. An inbox queue that exists without single
// active consumer fails with ErrInboxQueueOutdated.
//
// Each inbox queue has a single active consumer: however many processes
// consume it, the broker delivers to one at a time, so the inbox stores the
// queue's messages in the queue's order. The others stand by and take over,
// after the messages their predecessor left unacknowledged, when it goes.
func DeclareTopology(conn *amqp.Connection, t Topology) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	if err := DeclareShared(ch, t.QueueType); err != nil {
		return err
	}
	others, err := idleOtherLayouts(conn, t.Partitions)
	if err != nil {
		return err
	}
	if err := declareLayout(ch, t); err != nil {
		return err
	}
	for _, n := range others {
		if err := UnbindLayout(conn, n); err != nil {
			return err
		}
		// A message published between the check and the new layout's
		// binding reached the old layout alone: refuse, so that it is
		// stored (inboxd repartition) before anything newer of its order.
		if err := inUse(conn, t.Partitions, n); err != nil {
			return err
		}
	}
	return nil
}

// inboxArgs are the arguments of every inbox queue.
func inboxArgs(queueType string) amqp.Table {
	return amqp.Table{
		amqp.QueueTypeArg: queueType,
		// Whatever the broker itself dead-letters (a delivery limit set by an
		// operator's policy, say) lands in the dead queue too.
		"x-dead-letter-exchange":   ExchangeDeadLetter,
		"x-single-active-consumer": true,
	}
}

// isInequivalent reports whether err is the broker refusing a declaration
// because the existing entity has another value of argument arg.
func isInequivalent(err error, arg string) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed &&
		strings.Contains(amqpErr.Reason, "'"+arg+"'")
}

// DrainReturns takes every return waiting in returns (a channel from
// amqp.Channel.NotifyReturn) without blocking. The broker sends the return
// of a mandatory publish before its confirm, so once a batch's confirms have
// arrived, its returns are all there. A closed channel (the AMQP channel
// closed) has no more.
func DrainReturns(returns <-chan amqp.Return) []amqp.Return {
	var out []amqp.Return
	for {
		select {
		case ret, ok := <-returns:
			if !ok {
				return out
			}
			out = append(out, ret)
		default:
			return out
		}
	}
}

// Declare connects to the broker at url, declares the topology with
// DeclareTopology and disconnects.
func Declare(url string, t Topology) error {
	conn, err := Dial(url, "inboxd topology", 0)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	return DeclareTopology(conn, t)
}

// RedeliverUnroutable moves the events waiting in QueueUnroutable back to
// ExchangeEvents, each with its routing key, message id and other
// properties, once an operator has bound the queues that were missing. It
// moves as many as the queue held when it began, acknowledging each only
// after the broker confirmed its republish, and returns how many it moved
// and how many the queue holds afterwards: events that still no binding
// takes come back to it through the alternate exchange.
func RedeliverUnroutable(ctx context.Context, url string) (moved, left int, err error) {
	conn, err := Dial(url, "inboxd redeliver-unroutable", 0)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return 0, 0, fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return 0, 0, fmt.Errorf("enable publisher confirms: %w", err)
	}
	q, err := ch.QueueDeclarePassive(QueueUnroutable, true, false, false, false, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("inspect %s: %w", QueueUnroutable, err)
	}
	for moved < q.Messages {
		d, ok, err := ch.Get(QueueUnroutable, false)
		if err != nil {
			return moved, 0, fmt.Errorf("get from %s: %w", QueueUnroutable, err)
		}
		if !ok {
			break
		}
		pub := Publisher{Ch: ch}
		err = pub.Publish(ctx, ExchangeEvents, d.RoutingKey, false, amqp.Publishing{
			Headers: d.Headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
			DeliveryMode: amqp.Persistent, Priority: d.Priority, CorrelationId: d.CorrelationId,
			MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId, Body: d.Body,
		})
		if err != nil {
			return moved, 0, fmt.Errorf("republish %s: %w", d.MessageId, err)
		}
		if err := pub.Wait(ctx); err != nil {
			_ = d.Nack(false, true)
			return moved, 0, fmt.Errorf("republish %s: not confirmed (%v)", d.MessageId, err)
		}
		if err := d.Ack(false); err != nil {
			return moved, 0, fmt.Errorf("ack %s: %w", d.MessageId, err)
		}
		moved++
	}
	q, err = ch.QueueDeclarePassive(QueueUnroutable, true, false, false, false, nil)
	if err != nil {
		return moved, 0, fmt.Errorf("inspect %s: %w", QueueUnroutable, err)
	}
	return moved, q.Messages, nil
}
