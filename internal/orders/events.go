package orders

import (
	"encoding/json"
	"fmt"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/msgid"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Effects published on order-confirmation.events, as routing keys.
const (
	EventOrderConfirmed = "order.confirmed"
	EventOrderRejected  = "order.rejected"
	EventOrderCancelled = "order.cancelled"
	EventEmailRequested = "email.requested"
)

// orderEvent is the body of order.confirmed, order.rejected and
// order.cancelled.
type orderEvent struct {
	EventType string `json:"eventType"`
	OrderID   string `json:"orderId"`
	UserID    string `json:"userId,omitempty"`
	Email     string `json:"email,omitempty"`
	Items     []Item `json:"items,omitempty"`
	Reason    string `json:"reason,omitempty"`
	// MessageID is the inbox message that caused the event.
	MessageID string `json:"messageId"`
}

// emailRequest is the body of email.requested.
type emailRequest struct {
	EventType string `json:"eventType"`
	Template  string `json:"template"`
	OrderID   string `json:"orderId"`
	To        string `json:"to"`
	MessageID string `json:"messageId"`
}

// IdempotencyKey is the outbox key, and the published AMQP message_id, of
// the effect named by routingKey of handling the inbox message messageID:
// msgid.EventID, which fits an AMQP short string whatever the id's length.
func IdempotencyKey(messageID, routingKey string) string {
	return msgid.EventID(messageID, routingKey)
}

// outboxRows collects the effects of a batch, written with one statement.
// Each row carries the trace context of the message that caused it (see
// traceOf), which the relay sends on as the event's traceparent.
type outboxRows struct {
	batch outbox.Batch
	// trace is the trace context of each message of the batch, by message id.
	trace map[string]tracing.Text
}

// traceOf records the trace context of each message's handling, for the
// rows its effects add.
func (o *outboxRows) traceOf(msgs []inbox.Message) {
	o.trace = make(map[string]tracing.Text, len(msgs))
	for _, m := range msgs {
		o.trace[m.MessageID] = m.TraceContext()
	}
}

// effect is one event that handling an inbox message writes to the outbox:
// routingKey, with its body, of handling the message messageID about order
// orderID.
type effect struct {
	messageID, orderID, routingKey string
	body                           any
}

// add records the effect e. The relay publishes an order's effects in the
// order they were added.
func (o *outboxRows) add(e effect) {
	b, err := json.Marshal(e.body)
	if err != nil {
		panic(fmt.Sprintf("marshal %s event: %v", e.routingKey, err)) // the event types always marshal
	}
	o.batch.Add(outbox.Event{
		IdempotencyKey: IdempotencyKey(e.messageID, e.routingKey),
		RoutingKey:     e.routingKey,
		Payload:        b,
		MessageID:      e.messageID,
		OrderKey:       e.orderID,
		Trace:          o.trace[e.messageID],
	})
}

// confirmedEffects are the effects of confirming the order of m, an
// order.created message: order.confirmed, then email.requested.
func confirmedEffects(m message) []effect {
	o := m.created
	return []effect{
		{m.id, o.OrderID, EventOrderConfirmed, orderEvent{
			EventType: EventOrderConfirmed, OrderID: o.OrderID, UserID: o.UserID, Email: o.Email, Items: o.Items, MessageID: m.id,
		}},
		{m.id, o.OrderID, EventEmailRequested, emailRequest{
			EventType: EventEmailRequested, Template: "order-confirmation", OrderID: o.OrderID, To: o.Email, MessageID: m.id,
		}},
	}
}

// rejectedEffect is the effect of rejecting the order of m, an
// order.created message, for reason.
func rejectedEffect(m message, reason string) effect {
	o := m.created
	return effect{m.id, o.OrderID, EventOrderRejected, orderEvent{
		EventType: EventOrderRejected, OrderID: o.OrderID, UserID: o.UserID, Items: o.Items, Reason: reason, MessageID: m.id,
	}}
}

// cancelledEffect is the effect of cancelling the order of m, an
// order.cancelled message.
func cancelledEffect(m message) effect {
	c := m.cancelled
	return effect{m.id, c.OrderID, EventOrderCancelled, orderEvent{
		EventType: EventOrderCancelled, OrderID: c.OrderID, Reason: c.Reason, MessageID: m.id,
	}}
}
