package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Event is one effect to publish, as a handler writes it.
type Event struct {
	// IdempotencyKey is the row's unique key and the published AMQP
	// message_id: an event added twice under one key is stored once.
	IdempotencyKey string
	// RoutingKey is the routing key on broker.ExchangeEvents.
	RoutingKey string
	// Payload is the JSON body.
	Payload []byte
	// MessageID is the inbox message whose handling caused the event.
	MessageID string
	// OrderKey groups the events published in the order they were added;
	// empty orders the event with no other.
	OrderKey string
	// Trace is the trace context the published event carries.
	Trace tracing.Text
}

// Batch collects events and writes them with one statement, in the
// transaction of the state they follow from. The zero value is empty and
// ready to use.
type Batch struct {
	p dbsqlc.OutboxInsertManyParams
}

// Add appends e to the batch. The relay publishes the events of one order
// key in the order they were added.
func (b *Batch) Add(e Event) {
	b.p.IdempotencyKeys = append(b.p.IdempotencyKeys, e.IdempotencyKey)
	b.p.RoutingKeys = append(b.p.RoutingKeys, e.RoutingKey)
	b.p.Payloads = append(b.p.Payloads, string(e.Payload))
	b.p.MessageIds = append(b.p.MessageIds, e.MessageID)
	b.p.OrderKeys = append(b.p.OrderKeys, e.OrderKey)
	b.p.Traceparents = append(b.p.Traceparents, e.Trace.Traceparent)
	b.p.Tracestates = append(b.p.Tracestates, e.Trace.Tracestate)
}

// Len returns the number of events added.
func (b *Batch) Len() int { return len(b.p.IdempotencyKeys) }

// Insert writes the batch's events in tx, skipping those whose idempotency
// key is already in the outbox. An empty batch writes nothing.
func (b *Batch) Insert(ctx context.Context, tx pgx.Tx) error {
	if b.Len() == 0 {
		return nil
	}
	if err := dbsqlc.New().OutboxInsertMany(ctx, tx, b.p); err != nil {
		return fmt.Errorf("insert outbox rows: %w", err)
	}
	return nil
}
