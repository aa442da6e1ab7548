package inbox

import (
	"errors"
	"fmt"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// RabbitMQ names of the service's external contract.
const (
	// ExchangeOrders is the producers' topic exchange.
	ExchangeOrders = "orders"
	// QueueInbox is the queue ingest consumes, bound to ExchangeOrders with
	// InboxRoutingKeys.
	QueueInbox = "order-confirmation.inbox"
	// ExchangeDeadLetter receives deliveries that cannot enter the inbox.
	ExchangeDeadLetter = "order-confirmation.dlx"
	// QueueDead holds everything published to ExchangeDeadLetter.
	QueueDead = "order-confirmation.dead"
	// ExchangeEvents is the topic exchange the outbox relay publishes to.
	ExchangeEvents = "order-confirmation.events"

	// HeaderRejectReason is the header that says why a delivery was
	// dead-lettered instead of stored.
	HeaderRejectReason = "x-inbox-reject-reason"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey record where a
	// dead-lettered delivery was first published.
	HeaderOriginalExchange   = "x-inbox-original-exchange"
	HeaderOriginalRoutingKey = "x-inbox-original-routing-key"
)

// Queue types accepted for QueueInbox and QueueDead.
const (
	QueueTypeQuorum  = "quorum"
	QueueTypeClassic = "classic"
)

// InboxRoutingKeys are the routing keys that bind QueueInbox to ExchangeOrders.
var InboxRoutingKeys = []string{"order.created", "order.cancelled"}

// ErrInboxQueueOutdated is returned by DeclareTopology when QueueInbox exists
// without the single-active-consumer argument, as builds before it declared
// it. A queue's arguments cannot change in place; the README's "Upgrading
// the inbox queue" moves it without losing a message.
var ErrInboxQueueOutdated = errors.New("queue " + QueueInbox + " was declared without x-single-active-consumer by an older inboxd, " +
	"so several consumers could interleave an order's messages; RabbitMQ cannot add the argument in place: " +
	"follow the README's \"Upgrading the inbox queue\" to re-declare it without losing a message")

// DeclareTopology declares the contract's exchanges, queues and bindings. It
// is idempotent, so every process does it at every (re)connection. A queue
// that already exists with other arguments (another queue type, say) fails
// with a PRECONDITION_FAILED channel error; QueueInbox without single active
// consumer with ErrInboxQueueOutdated.
//
// QueueInbox has a single active consumer: however many processes consume
// it, the broker delivers to one at a time, so the inbox stores the queue's
// messages in the queue's order. The others stand by and take over, after
// the messages their predecessor left unacknowledged, when it goes.
func DeclareTopology(ch *amqp.Channel, queueType string) error {
	for _, ex := range []string{ExchangeOrders, ExchangeDeadLetter, ExchangeEvents} {
		if err := ch.ExchangeDeclare(ex, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare exchange %q: %w", ex, err)
		}
	}
	queueArgs := amqp.Table{amqp.QueueTypeArg: queueType}
	if _, err := ch.QueueDeclare(QueueDead, true, false, false, false, queueArgs); err != nil {
		return fmt.Errorf("declare queue %q: %w", QueueDead, err)
	}
	if err := ch.QueueBind(QueueDead, "#", ExchangeDeadLetter, false, nil); err != nil {
		return fmt.Errorf("bind queue %q: %w", QueueDead, err)
	}
	inboxArgs := amqp.Table{
		amqp.QueueTypeArg: queueType,
		// Whatever the broker itself dead-letters (a delivery limit set by an
		// operator's policy, say) lands in the dead queue too.
		"x-dead-letter-exchange":   ExchangeDeadLetter,
		"x-single-active-consumer": true,
	}
	if _, err := ch.QueueDeclare(QueueInbox, true, false, false, false, inboxArgs); err != nil {
		var amqpErr *amqp.Error
		if errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed &&
			strings.Contains(amqpErr.Reason, "x-single-active-consumer") {
			return ErrInboxQueueOutdated
		}
		return fmt.Errorf("declare queue %q: %w", QueueInbox, err)
	}
	for _, key := range InboxRoutingKeys {
		if err := ch.QueueBind(QueueInbox, key, ExchangeOrders, false, nil); err != nil {
			return fmt.Errorf("bind queue %q to %q: %w", QueueInbox, key, err)
		}
	}
	return nil
}

// Declare connects to the broker at url, declares the topology with
// DeclareTopology and disconnects.
func Declare(url, queueType string) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Locale: "en_US", Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return fmt.Errorf("connect to broker: %w", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	return DeclareTopology(ch, queueType)
}
