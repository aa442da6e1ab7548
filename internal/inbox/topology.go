package inbox

import (
	"fmt"

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

// DeclareTopology declares the contract's exchanges, queues and bindings. It
// is idempotent, so every process does it at every (re)connection. A queue
// that already exists with other arguments (another queue type, say) fails
// with a PRECONDITION_FAILED channel error.
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
		"x-dead-letter-exchange": ExchangeDeadLetter,
	}
	if _, err := ch.QueueDeclare(QueueInbox, true, false, false, false, inboxArgs); err != nil {
		return fmt.Errorf("declare queue %q: %w", QueueInbox, err)
	}
	for _, key := range InboxRoutingKeys {
		if err := ch.QueueBind(QueueInbox, key, ExchangeOrders, false, nil); err != nil {
			return fmt.Errorf("bind queue %q to %q: %w", QueueInbox, key, err)
		}
	}
	return nil
}
