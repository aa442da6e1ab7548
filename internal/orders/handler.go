package orders

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// Results recorded in inbox.result.
const (
	ResultConfirmed          = "confirmed"
	ResultAlreadyRecorded    = "order already recorded"
	ResultCancelled          = "cancelled"
	ResultCancelledUnseen    = "cancelled before the order arrived"
	ResultNotCancelledPrefix = "not cancelled: order is "
)

// Handler is the inbox.Handler for order messages.
//
//   - order.created inserts the order's order_confirmations row with
//     ON CONFLICT (order_id) DO NOTHING: an order already recorded, under
//     whatever message id, is left as it is.
//   - order.cancelled moves a confirmed order to cancelled with a conditional
//     UPDATE. A cancellation of an order not seen yet records the order as
//     cancelled, so that its order.created, arriving later, confirms nothing.
//
// A body that is not valid JSON, or misses a required field, and a message
// type it does not know are permanent failures: the message goes dead with
// the reason.
type Handler struct {
	queries *dbsqlc.Queries
	logger  *slog.Logger
}

// NewHandler returns the order Handler. logger defaults to slog.Default().
func NewHandler(logger *slog.Logger) *Handler {
	return &Handler{
		queries: dbsqlc.New(),
		logger:  cmp.Or(logger, slog.Default()).With(slog.String("component", "orders.handler")),
	}
}

var _ inbox.Handler = (*Handler)(nil)

// HandleBatch handles msgs in order. Consecutive order.created messages are
// confirmed with one statement; each order.cancelled runs on its own, after
// the messages before it, so a batch holding both kinds for one order
// applies them in arrival order.
func (h *Handler) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	outcomes := make([]inbox.Outcome, len(msgs))
	var created []pendingCreate
	var events outboxRows
	flush := func() error {
		if err := h.confirm(ctx, tx, created, outcomes, &events); err != nil {
			return err
		}
		created = created[:0]
		return nil
	}
	for i, m := range msgs {
		switch m.Type {
		case TypeOrderCreated:
			order, err := DecodeOrderCreated(m.Payload)
			if err != nil {
				outcomes[i].Err = inbox.Permanent(err)
				continue
			}
			created = append(created, pendingCreate{index: i, messageID: m.MessageID, order: order})
		case TypeOrderCancelled:
			cancel, err := DecodeOrderCancelled(m.Payload)
			if err != nil {
				outcomes[i].Err = inbox.Permanent(err)
				continue
			}
			if err := flush(); err != nil {
				return nil, err
			}
			result, err := h.cancel(ctx, tx, m.MessageID, cancel)
			if err != nil {
				return nil, err
			}
			outcomes[i].Result = result
			if result == ResultCancelled || result == ResultCancelledUnseen {
				events.add(m.MessageID, EventOrderCancelled, orderEvent{EventType: EventOrderCancelled, OrderID: cancel.OrderID, Reason: cancel.Reason, MessageID: m.MessageID})
			}
		default:
			outcomes[i].Err = inbox.Permanentf("unknown message type %q", m.Type)
		}
	}
	if err := flush(); err != nil {
		return nil, err
	}
	if err := events.insert(ctx, tx, h.queries); err != nil {
		return nil, err
	}
	return outcomes, nil
}

type pendingCreate struct {
	index     int
	messageID string
	order     OrderCreated
}

// confirm inserts the orders' rows in one statement and sets each message's
// result from which rows it inserted.
func (h *Handler) confirm(ctx context.Context, tx pgx.Tx, created []pendingCreate, outcomes []inbox.Outcome, events *outboxRows) error {
	if len(created) == 0 {
		return nil
	}
	p := dbsqlc.OrderConfirmationInsertManyParams{
		OrderIds:   make([]string, len(created)),
		UserIds:    make([]string, len(created)),
		Emails:     make([]string, len(created)),
		MessageIds: make([]string, len(created)),
	}
	for i, c := range created {
		p.OrderIds[i], p.UserIds[i], p.Emails[i], p.MessageIds[i] = c.order.OrderID, c.order.UserID, c.order.Email, c.messageID
	}
	rows, err := h.queries.OrderConfirmationInsertMany(ctx, tx, p)
	if err != nil {
		return fmt.Errorf("insert order confirmations: %w", err)
	}
	insertedBy := make(map[string]bool, len(rows))
	for _, r := range rows {
		insertedBy[r.MessageID] = true
	}
	for _, c := range created {
		if insertedBy[c.messageID] {
			outcomes[c.index].Result = ResultConfirmed
			o := c.order
			events.add(c.messageID, EventOrderConfirmed, orderEvent{
				EventType: EventOrderConfirmed, OrderID: o.OrderID, UserID: o.UserID, Email: o.Email, Items: o.Items, MessageID: c.messageID,
			})
			events.add(c.messageID, EventEmailRequested, emailRequest{
				EventType: EventEmailRequested, Template: "order-confirmation", OrderID: o.OrderID, To: o.Email, MessageID: c.messageID,
			})
		} else {
			outcomes[c.index].Result = ResultAlreadyRecorded
		}
	}
	return nil
}

func (h *Handler) cancel(ctx context.Context, tx pgx.Tx, messageID string, m OrderCancelled) (string, error) {
	_, err := h.queries.OrderConfirmationCancel(ctx, tx, dbsqlc.OrderConfirmationCancelParams{
		OrderID: m.OrderID, Reason: m.Reason,
	})
	if err == nil {
		return ResultCancelled, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("cancel order: %w", err)
	}
	_, err = h.queries.OrderConfirmationInsertCancelled(ctx, tx, dbsqlc.OrderConfirmationInsertCancelledParams{
		OrderID: m.OrderID, MessageID: messageID, Reason: m.Reason,
	})
	if err == nil {
		return ResultCancelledUnseen, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("record early cancellation: %w", err)
	}
	status, err := h.queries.OrderConfirmationGetStatus(ctx, tx, m.OrderID)
	if err != nil {
		return "", fmt.Errorf("read order status: %w", err)
	}
	return ResultNotCancelledPrefix + status, nil
}
