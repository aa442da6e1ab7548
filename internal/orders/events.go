package orders

import (
	"encoding/json"
	"fmt"

	"github.com/orderconfirm/inboxd/internal/inbox"
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
// the effect named by routingKey of handling the inbox message messageID.
func IdempotencyKey(messageID, routingKey string) string {
	return messageID + ":" + routingKey
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

// add records the effect routingKey, with its body, of handling the inbox
// message messageID about order orderID. The relay publishes an order's
// effects in the order they were added.
func (o *outboxRows) add(messageID, orderID, routingKey string, body any) {
	b, err := json.Marshal(body)
	if err != nil {
		panic(fmt.Sprintf("marshal %s event: %v", routingKey, err)) // the event types always marshal
	}
	o.batch.Add(outbox.Event{
		IdempotencyKey: IdempotencyKey(messageID, routingKey),
		RoutingKey:     routingKey,
		Payload:        b,
		MessageID:      messageID,
		OrderKey:       orderID,
		Trace:          o.trace[messageID],
	})
}
