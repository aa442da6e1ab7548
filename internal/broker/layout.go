package broker

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Partitioned ingest's names (see Topology).
const (
	// HeaderOrderID is the header a producer sets to the message's order id
	// (the body's orderId): with more than one partition, the broker hashes
	// it to pick the message's inbox queue, so that every message of an
	// order meets in one queue.
	HeaderOrderID = "x-order-id"
	// QueueIngestReplicas is a transient queue nothing is published to:
	// every replica's partitioned ingest declares and consumes it, and its
	// consumer count tells each how many replicas share the partitions.
	QueueIngestReplicas = "order-confirmation.ingest-replicas"
	// MaxPartitions is the most inbox queues a layout may have.
	MaxPartitions = 64
	// exchangeTypeConsistentHash is the rabbitmq_consistent_hash_exchange
	// plugin's exchange type.
	exchangeTypeConsistentHash = "x-consistent-hash"
)

// Topology says which inbox layout DeclareTopology declares.
//
// With one partition (INBOX_PARTITIONS=1, the default) the layout is
// QueueInbox, bound to ExchangeOrders. With N > 1 it is PartitionExchange(N),
// an x-consistent-hash exchange that hashes HeaderOrderID, bound to
// ExchangeOrders, and the N queues InboxQueues(N) bound to it with weight 1.
// Every inbox queue has the same arguments (single active consumer, its
// dead-letter exchange ExchangeDeadLetter).
type Topology struct {
	// QueueType is the type of the declared queues, QueueTypeQuorum or
	// QueueTypeClassic.
	QueueType string
	// Partitions is the number of inbox queues, 1 to MaxPartitions.
	Partitions int
}

// PartitionExchange names the consistent-hash exchange of the layout of n
// partitions.
func PartitionExchange(n int) string { return fmt.Sprintf("%s.%d-partitions", QueueInbox, n) }

// InboxQueues names the inbox queues of the layout of n partitions, in the
// order in which they are bound (which fixes the hash ring).
func InboxQueues(n int) []string {
	if n <= 1 {
		return []string{QueueInbox}
	}
	names := make([]string, n)
	for i := range n {
		names[i] = fmt.Sprintf("%s.%d-of-%d", QueueInbox, i+1, n)
	}
	return names
}

// LayoutConflictError is DeclareTopology's refusal to declare a layout while
// the queues of another one hold messages, or are consumed: the messages of
// an order would then be stored from two queues in no set order.
type LayoutConflictError struct {
	// Partitions is the layout asked for, Other the one found.
	Partitions, Other int
	// Queue is the first of Other's queues found in use.
	Queue               string
	Messages, Consumers int
}

func (e *LayoutConflictError) Error() string {
	return fmt.Sprintf("INBOX_PARTITIONS is %d, but queue %s, of INBOX_PARTITIONS=%d, holds %d messages and has %d consumers; "+
		"storing both layouts at once could reorder an order's messages: follow \"Changing INBOX_PARTITIONS\" in docs/ordering.md",
		e.Partitions, e.Queue, e.Other, e.Messages, e.Consumers)
}

// withChannel runs f on a channel of its own, opened on conn and closed
// after: a failed passive declaration or delete closes its channel.
func withChannel(conn *amqp.Connection, f func(ch *amqp.Channel) error) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	return f(ch)
}

// isNotFound reports whether err is the broker saying an entity does not
// exist.
func isNotFound(err error) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound
}

// OtherLayouts returns the partition counts of the inbox layouts other than
// partitions' that exist on the broker: QueueInbox for 1, PartitionExchange
// for the others (declared first and deleted last).
func OtherLayouts(conn *amqp.Connection, partitions int) ([]int, error) {
	var found []int
	for n := 1; n <= MaxPartitions; n++ {
		if n == partitions {
			continue
		}
		err := withChannel(conn, func(ch *amqp.Channel) error {
			if n == 1 {
				_, err := ch.QueueDeclarePassive(QueueInbox, true, false, false, false, nil)
				return err
			}
			return ch.ExchangeDeclarePassive(PartitionExchange(n), exchangeTypeConsistentHash, true, false, true, false, nil)
		})
		switch {
		case err == nil:
			found = append(found, n)
		case !isNotFound(err):
			return nil, fmt.Errorf("look for the layout of %d partitions: %w", n, err)
		}
	}
	return found, nil
}

// InspectQueue returns what the broker says of a queue: its ready messages
// and its consumers (for a queue with a single active consumer, 1 when it
// has any). It fails with a NOT_FOUND *amqp.Error when the queue does not
// exist.
func InspectQueue(conn *amqp.Connection, name string) (amqp.Queue, error) {
	var q amqp.Queue
	err := withChannel(conn, func(ch *amqp.Channel) error {
		var err error
		q, err = ch.QueueDeclarePassive(name, true, false, false, false, nil)
		return err
	})
	return q, err
}

// LayoutQueues returns the queues of the layout of n partitions that exist,
// with their ready messages and consumers.
func LayoutQueues(conn *amqp.Connection, n int) ([]amqp.Queue, error) {
	var queues []amqp.Queue
	for _, name := range InboxQueues(n) {
		q, err := InspectQueue(conn, name)
		switch {
		case err == nil:
			queues = append(queues, q)
		case !isNotFound(err):
			return nil, fmt.Errorf("inspect %s: %w", name, err)
		}
	}
	return queues, nil
}

// busyQueue returns the first queue of the layout of n partitions that
// holds messages or has consumers, or nil when none does.
func busyQueue(conn *amqp.Connection, n int) (*amqp.Queue, error) {
	queues, err := LayoutQueues(conn, n)
	if err != nil {
		return nil, err
	}
	for _, q := range queues {
		if q.Messages > 0 || q.Consumers > 0 {
			return &q, nil
		}
	}
	return nil, nil
}

// inUse returns a *LayoutConflictError, for a service asked for the layout
// of partitions, when a queue of the layout of n partitions holds messages
// or has consumers.
func inUse(conn *amqp.Connection, partitions, n int) error {
	q, err := busyQueue(conn, n)
	if err != nil || q == nil {
		return err
	}
	return &LayoutConflictError{Partitions: partitions, Other: n, Queue: q.Name, Messages: q.Messages, Consumers: q.Consumers}
}

// idleOtherLayouts returns the layouts other than partitions' that exist,
// or a *LayoutConflictError for the first of them whose queues hold
// messages or are consumed.
func idleOtherLayouts(conn *amqp.Connection, partitions int) ([]int, error) {
	others, err := OtherLayouts(conn, partitions)
	if err != nil {
		return nil, err
	}
	for _, n := range others {
		if err := inUse(conn, partitions, n); err != nil {
			return nil, err
		}
	}
	return others, nil
}

// DeleteLayout deletes the queues of the layout of n partitions and its
// exchange, which takes its bindings with it. RabbitMQ deletes a quorum
// queue whatever it holds (it cannot delete one "if empty" or "if
// unused"), so DeleteLayout first checks that each is empty and unconsumed,
// and deletes nothing otherwise; it is for a layout that is unbound
// already, where nothing new can arrive.
func DeleteLayout(conn *amqp.Connection, n int) error {
	if q, err := busyQueue(conn, n); err != nil {
		return err
	} else if q != nil {
		return fmt.Errorf("not deleting the layout of %d partitions: queue %s holds %d messages and has %d consumers", n, q.Name, q.Messages, q.Consumers)
	}
	for _, name := range InboxQueues(n) {
		err := withChannel(conn, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(name, false, false, false)
			return err
		})
		if err != nil && !isNotFound(err) {
			return fmt.Errorf("delete %s: %w", name, err)
		}
	}
	if n == 1 {
		return nil
	}
	return withChannel(conn, func(ch *amqp.Channel) error {
		if err := ch.ExchangeDelete(PartitionExchange(n), false, false); err != nil {
			return fmt.Errorf("delete exchange %s: %w", PartitionExchange(n), err)
		}
		return nil
	})
}

// UnbindLayout stops ExchangeOrders routing to the layout of n partitions:
// what it holds stays, and nothing new arrives.
func UnbindLayout(conn *amqp.Connection, n int) error {
	return withChannel(conn, func(ch *amqp.Channel) error {
		for _, key := range inboxRoutingKeys {
			var err error
			if n == 1 {
				err = ch.QueueUnbind(QueueInbox, key, ExchangeOrders, nil)
			} else {
				err = ch.ExchangeUnbind(PartitionExchange(n), key, ExchangeOrders, false, nil)
			}
			if err != nil {
				return fmt.Errorf("unbind the layout of %d partitions from %s: %w", n, ExchangeOrders, err)
			}
		}
		return nil
	})
}

// declareLayout declares the inbox queues of t and binds them.
func declareLayout(ch *amqp.Channel, t Topology) error {
	if t.Partitions < 1 || t.Partitions > MaxPartitions {
		return fmt.Errorf("partitions must be 1 to %d, got %d", MaxPartitions, t.Partitions)
	}
	queues := InboxQueues(t.Partitions)
	for _, name := range queues {
		if _, err := ch.QueueDeclare(name, true, false, false, false, inboxArgs(t.QueueType)); err != nil {
			if isInequivalent(err, "x-single-active-consumer") {
				return ErrInboxQueueOutdated
			}
			return fmt.Errorf("declare queue %q: %w", name, err)
		}
	}
	if t.Partitions == 1 {
		for _, key := range inboxRoutingKeys {
			if err := ch.QueueBind(QueueInbox, key, ExchangeOrders, false, nil); err != nil {
				return fmt.Errorf("bind queue %q to %q: %w", QueueInbox, key, err)
			}
		}
		return nil
	}
	ex := PartitionExchange(t.Partitions)
	// Internal: producers publish to ExchangeOrders, never around it.
	err := ch.ExchangeDeclare(ex, exchangeTypeConsistentHash, true, false, true, false, amqp.Table{"hash-header": HeaderOrderID})
	if err != nil {
		return fmt.Errorf("declare exchange %q (is the rabbitmq_consistent_hash_exchange plugin enabled?): %w", ex, err)
	}
	// The ring's buckets follow the order of the bindings; binding again
	// is a no-op, so the ring never changes while the layout lives.
	for _, name := range queues {
		if err := ch.QueueBind(name, "1", ex, false, nil); err != nil {
			return fmt.Errorf("bind queue %q to %q: %w", name, ex, err)
		}
	}
	for _, key := range inboxRoutingKeys {
		if err := ch.ExchangeBind(ex, key, ExchangeOrders, false, nil); err != nil {
			return fmt.Errorf("bind exchange %q to %q with %q: %w", ex, ExchangeOrders, key, err)
		}
	}
	return nil
}

// Reroute declares the layout of t and binds it, then unbinds every other
// layout found from ExchangeOrders, in that order, so that no message
// published meanwhile is unroutable (one may reach both layouts; the inbox
// stores it once). It returns the other layouts, whose queues keep what
// they hold until it is stored.
func Reroute(conn *amqp.Connection, t Topology) (others []int, err error) {
	err = withChannel(conn, func(ch *amqp.Channel) error {
		if err := DeclareShared(ch, t.QueueType); err != nil {
			return err
		}
		return declareLayout(ch, t)
	})
	if err != nil {
		return nil, err
	}
	if others, err = OtherLayouts(conn, t.Partitions); err != nil {
		return nil, err
	}
	for _, n := range others {
		if err := UnbindLayout(conn, n); err != nil {
			return nil, err
		}
	}
	return others, nil
}
