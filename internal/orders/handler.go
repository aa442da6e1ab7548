package orders

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// Results recorded in inbox.result.
const (
	ResultConfirmed          = "confirmed"
	ResultRejected           = "rejected"
	ResultAlreadyRecorded    = "order already recorded"
	ResultCancelled          = "cancelled"
	ResultCancelledUnseen    = "cancelled before the order arrived"
	ResultNotCancelledPrefix = "not cancelled: order is "
	// ResultReplayPrefix starts the result of a replayed message.
	ResultReplayPrefix = "replay: "
)

// Handler is the inbox.Handler for order messages.
//
//   - order.created inserts the order's order_confirmations row with
//     ON CONFLICT (order_id) DO NOTHING: an order already recorded, under
//     whatever message id, is left as it is. A newly recorded order reserves
//     the stock of all its items, or of none: then it is rejected, with the
//     unknown or short SKUs as its reason.
//   - order.cancelled moves a confirmed order to cancelled with a conditional
//     UPDATE and gives its reserved stock back. A cancellation of an order
//     not seen yet records the order as cancelled, so that its order.created,
//     arriving later, confirms and reserves nothing.
//
// Every effect that leaves the service is written to the outbox under a key
// derived from the message, so handling a message again adds none.
//
// A body that is not valid JSON, or misses a required field, and a message
// type it does not know are permanent failures: the message goes dead with
// the reason.
type Handler struct {
	queries *dbsqlc.Queries
	logger  *slog.Logger

	// held remembers the stock rows found held by another session past
	// StockLockWait, for StockHeldMemory. A batch only probes them (SKIP
	// LOCKED) instead of waiting for them again: a batch that waited would
	// hold its other stock rows meanwhile, and make the batches of the
	// other workers wait in turn.
	heldMu sync.Mutex
	held   map[string]time.Time // when each was found held
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
	decoded := make([]any, len(msgs))
	for i, m := range msgs {
		switch m.Type {
		case TypeOrderCreated:
			order, err := DecodeOrderCreated(m.Payload)
			if err != nil {
				outcomes[i].Err = inbox.Permanent(err)
				continue
			}
			decoded[i] = order
		case TypeOrderCancelled:
			cancel, err := DecodeOrderCancelled(m.Payload)
			if err != nil {
				outcomes[i].Err = inbox.Permanent(err)
				continue
			}
			decoded[i] = cancel
		default:
			outcomes[i].Err = inbox.Permanentf("unknown message type %q", m.Type)
		}
	}
	blocked, levels, err := h.lockStock(ctx, tx, decoded)
	if err != nil {
		return nil, err
	}
	// A message that waits holds back the later messages of its order in
	// this batch too (they share one only when they have no ordering key).
	waiting := map[string]error{}
	for i, d := range decoded {
		id := orderIDOf(d)
		if skus := blocked[i]; len(skus) > 0 {
			waiting[id] = fmt.Errorf("stock row %s locked by another session", strings.Join(skus, ", "))
		} else if waiting[id] == nil {
			continue
		}
		outcomes[i].Err = inbox.Wait(StockWaitRetry, waiting[id])
		decoded[i] = nil
	}

	var created []pendingCreate
	var events outboxRows
	events.traceOf(msgs)
	flush := func() error {
		if err := h.confirm(ctx, tx, created, levels, outcomes, &events); err != nil {
			return err
		}
		created = created[:0]
		return nil
	}
	for i, d := range decoded {
		switch d := d.(type) {
		case OrderCreated:
			created = append(created, pendingCreate{index: i, messageID: msgs[i].MessageID, order: d})
		case OrderCancelled:
			if err := flush(); err != nil {
				return nil, err
			}
			result, err := h.cancel(ctx, tx, msgs[i].MessageID, d)
			if err != nil {
				return nil, err
			}
			levels = nil // changed by the reserve before and the stock given back
			outcomes[i].Result = result
			if result == ResultCancelled || result == ResultCancelledUnseen {
				events.add(msgs[i].MessageID, d.OrderID, EventOrderCancelled, orderEvent{EventType: EventOrderCancelled, OrderID: d.OrderID, Reason: d.Reason, MessageID: msgs[i].MessageID})
			}
		}
	}
	if err := flush(); err != nil {
		return nil, err
	}
	if err := events.batch.Insert(ctx, tx); err != nil {
		return nil, err
	}
	for i, m := range msgs {
		if m.Replay && outcomes[i].Err == nil {
			outcomes[i].Result = ResultReplayPrefix + outcomes[i].Result
		}
	}
	return outcomes, nil
}

// orderIDOf returns the order a decoded message is about, "" for none.
func orderIDOf(d any) string {
	switch d := d.(type) {
	case OrderCreated:
		return d.OrderID
	case OrderCancelled:
		return d.OrderID
	}
	return ""
}

// StockLockWait is how long the handler waits for a stock row that another
// session holds before it lets the orders that need it wait instead (see
// inbox.Wait), and handles the rest of the batch.
const StockLockWait = 500 * time.Millisecond

// StockWaitRetry is how soon a message that waits for a held stock row is
// tried again; it costs no attempt.
const StockWaitRetry = 200 * time.Millisecond

// StockHeldMemory is how long a stock row found held is only probed, not
// waited for: long enough that a row an operator holds does not make every
// batch wait, short enough that one a busy worker held briefly is waited
// for again soon.
const StockHeldMemory = 2 * time.Second

// lockStock locks the stock rows that the batch's messages need: the items
// of its orders, and what its cancellations hold reserved. It locks them in
// SKU order, so that batches cannot deadlock, and waits at most
// StockLockWait: a row that another session holds longer (an operator's
// open transaction, say) is not waited for. It returns, per message index,
// the SKUs it needs that another session holds (those messages must not
// run now), and the levels of the rows it locked.
func (h *Handler) lockStock(ctx context.Context, tx pgx.Tx, decoded []any) (map[int][]string, map[string]int32, error) {
	needs := map[int][]string{}
	cancelled := map[string]int{}
	for i, d := range decoded {
		switch d := d.(type) {
		case OrderCreated:
			for _, it := range d.Items {
				needs[i] = append(needs[i], it.SKU)
			}
		case OrderCancelled:
			cancelled[d.OrderID] = i
		}
	}
	if len(cancelled) > 0 {
		reserved, err := h.queries.StockReservedSkus(ctx, tx, slices.Collect(maps.Keys(cancelled)))
		if err != nil {
			return nil, nil, fmt.Errorf("read reserved skus: %w", err)
		}
		for _, r := range reserved {
			i := cancelled[r.OrderID]
			needs[i] = append(needs[i], r.Sku)
		}
	}
	skuSet := map[string]bool{}
	for _, skus := range needs {
		for _, sku := range skus {
			skuSet[sku] = true
		}
	}
	if len(skuSet) == 0 {
		return nil, nil, nil
	}
	skus := slices.Sorted(maps.Keys(skuSet))

	levels, held, err := h.lockOrFindHeld(ctx, tx, skus)
	if err != nil || len(held) == 0 {
		return nil, levels, err
	}
	blocked := map[int][]string{}
	for i, need := range needs {
		for _, sku := range slices.Sorted(slices.Values(need)) {
			if held[sku] && !slices.Contains(blocked[i], sku) {
				blocked[i] = append(blocked[i], sku)
			}
		}
	}
	return blocked, levels, nil
}

// lockOrFindHeld locks the stock rows of skus and returns the levels of
// those it locked, and the SKUs of those it could not: rows that exist but
// another session holds. Rows found held before are only probed, without
// waiting; the others are waited for StockLockWait at most, in SKU order.
// Rows it finds held are remembered, and forgotten once a probe gets them.
func (h *Handler) lockOrFindHeld(ctx context.Context, tx pgx.Tx, skus []string) (map[string]int32, map[string]bool, error) {
	var probe, rest []string
	h.heldMu.Lock()
	for _, sku := range skus {
		if found, ok := h.held[sku]; ok && time.Since(found) < StockHeldMemory {
			probe = append(probe, sku)
		} else {
			rest = append(rest, sku)
		}
	}
	h.heldMu.Unlock()

	levels := map[string]int32{}
	if len(probe) > 0 {
		rows, err := h.queries.StockLockAvailable(ctx, tx, probe)
		if err != nil {
			return nil, nil, fmt.Errorf("lock available stock: %w", err)
		}
		for _, r := range rows {
			levels[r.Sku] = r.Available
		}
	}
	if len(rest) > 0 {
		rows, err := h.queries.StockLock(ctx, tx, dbsqlc.StockLockParams{Skus: rest, WaitMs: int32(StockLockWait.Milliseconds())})
		if err != nil {
			return nil, nil, fmt.Errorf("lock stock: %w", err)
		}
		for _, r := range rows {
			levels[r.Sku] = r.Available
		}
	}

	// A row not got is held by another session, or not there at all (an
	// unknown SKU, which the order's decision rejects): read which, only
	// when there is one.
	var notGot []string
	for _, sku := range skus {
		if _, got := levels[sku]; !got {
			notGot = append(notGot, sku)
		}
	}
	exists := map[string]bool{}
	if len(notGot) > 0 {
		rows, err := h.queries.StockGetMany(ctx, tx, notGot)
		if err != nil {
			return nil, nil, fmt.Errorf("read stock: %w", err)
		}
		for _, r := range rows {
			exists[r.Sku] = true
		}
	}
	held := map[string]bool{}
	h.heldMu.Lock()
	defer h.heldMu.Unlock()
	if h.held == nil {
		h.held = map[string]time.Time{}
	}
	for _, sku := range skus {
		switch {
		case !exists[sku]: // got, or not there
			delete(h.held, sku)
		case slices.Contains(rest, sku):
			h.held[sku] = time.Now() // found held again after a wait
			fallthrough
		default:
			held[sku] = true
		}
	}
	return levels, held, nil
}

type pendingCreate struct {
	index     int
	messageID string
	order     OrderCreated
}

// confirm records the orders in one statement, reserves the stock of each
// order it newly recorded (all of an order's items, or none), rejects the
// orders whose stock falls short, and sets each message's result and
// effects from that.
func (h *Handler) confirm(ctx context.Context, tx pgx.Tx, created []pendingCreate, levels map[string]int32, outcomes []inbox.Outcome, events *outboxRows) error {
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
	var fresh []pendingCreate
	for _, c := range created {
		if insertedBy[c.messageID] {
			fresh = append(fresh, c)
		} else {
			outcomes[c.index].Result = ResultAlreadyRecorded
		}
	}
	rejections, err := h.reserve(ctx, tx, fresh, levels)
	if err != nil {
		return err
	}
	for i, c := range fresh {
		o := c.order
		if reason := rejections[i]; reason != "" {
			outcomes[c.index].Result = ResultRejected
			events.add(c.messageID, o.OrderID, EventOrderRejected, orderEvent{
				EventType: EventOrderRejected, OrderID: o.OrderID, UserID: o.UserID, Items: o.Items, Reason: reason, MessageID: c.messageID,
			})
			continue
		}
		outcomes[c.index].Result = ResultConfirmed
		events.add(c.messageID, o.OrderID, EventOrderConfirmed, orderEvent{
			EventType: EventOrderConfirmed, OrderID: o.OrderID, UserID: o.UserID, Email: o.Email, Items: o.Items, MessageID: c.messageID,
		})
		events.add(c.messageID, o.OrderID, EventEmailRequested, emailRequest{
			EventType: EventEmailRequested, Template: "order-confirmation", OrderID: o.OrderID, To: o.Email, MessageID: c.messageID,
		})
	}
	return nil
}

// reserve reserves the stock of each order, in order and all or nothing
// per order, and returns for each the reason it was rejected ("" when its
// stock is reserved); the rejected orders' rows are marked rejected. The
// stock rows are locked already (see lockStock), so their levels hold until
// the transaction ends: decideStock decides on them, and the takes,
// reservations and rejections are then written with one statement each.
// levels are the locked rows' levels as lockStock read them; nil reads
// them again. The handler passes them to its first reserve only: a
// cancellation, the only thing that ends a run of orders early, gives
// stock back, and the next run reads the levels again.
func (h *Handler) reserve(ctx context.Context, tx pgx.Tx, orders []pendingCreate, levels map[string]int32) ([]string, error) {
	if len(orders) == 0 {
		return nil, nil
	}
	available := levels
	if available == nil {
		skuSet := map[string]bool{}
		for _, c := range orders {
			for _, it := range c.order.Items {
				skuSet[it.SKU] = true
			}
		}
		rows, err := h.queries.StockGetMany(ctx, tx, slices.Sorted(maps.Keys(skuSet)))
		if err != nil {
			return nil, fmt.Errorf("read stock: %w", err)
		}
		available = make(map[string]int32, len(rows))
		for _, r := range rows {
			available[r.Sku] = r.Available
		}
	}

	created := make([]OrderCreated, len(orders))
	for i, c := range orders {
		created[i] = c.order
	}
	d := decideStock(created, available)
	res, take, reject := d.reservations, d.take, d.reject

	if len(res.OrderIds) > 0 {
		inserted, err := h.queries.StockReservationInsertMany(ctx, tx, res)
		if err != nil {
			return nil, fmt.Errorf("record reservations: %w", err)
		}
		if len(inserted) != len(res.OrderIds) {
			// Only an order recorded in this very transaction reserves, so
			// its reservations cannot exist yet: refuse to take stock twice.
			return nil, fmt.Errorf("record reservations: %d of %d already existed", len(res.OrderIds)-len(inserted), len(res.OrderIds))
		}
		n, err := h.queries.StockTakeMany(ctx, tx, take)
		if err != nil {
			return nil, fmt.Errorf("take stock: %w", err)
		}
		if n != int64(len(take.Skus)) {
			return nil, fmt.Errorf("take stock: %d of %d SKUs no longer had the stock", int64(len(take.Skus))-n, len(take.Skus))
		}
	}
	if len(reject.OrderIds) > 0 {
		if err := h.queries.OrderConfirmationRejectMany(ctx, tx, reject); err != nil {
			return nil, fmt.Errorf("reject orders: %w", err)
		}
	}
	return d.reasons, nil
}

// cancel moves a confirmed order to cancelled and gives its stock back; the
// conditional update makes both happen once, however often the cancellation
// is handled.
func (h *Handler) cancel(ctx context.Context, tx pgx.Tx, messageID string, m OrderCancelled) (string, error) {
	cancelled, err := h.cancelConfirmed(ctx, tx, m)
	if err != nil || cancelled {
		return ResultCancelled, err
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
	// The order was recorded meanwhile, by a transaction that the insert
	// waited for: it is visible now, so try the cancellation again.
	if cancelled, err := h.cancelConfirmed(ctx, tx, m); err != nil || cancelled {
		return ResultCancelled, err
	}
	status, err := h.queries.OrderConfirmationGetStatus(ctx, tx, m.OrderID)
	if err != nil {
		return "", fmt.Errorf("read order status: %w", err)
	}
	return ResultNotCancelledPrefix + status, nil
}

// cancelConfirmed cancels the order if it is confirmed, and then releases its
// stock. It reports whether it did.
func (h *Handler) cancelConfirmed(ctx context.Context, tx pgx.Tx, m OrderCancelled) (bool, error) {
	_, err := h.queries.OrderConfirmationCancel(ctx, tx, dbsqlc.OrderConfirmationCancelParams{
		OrderID: m.OrderID, Reason: m.Reason,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("cancel order: %w", err)
	}
	if _, err := h.queries.StockRelease(ctx, tx, m.OrderID); err != nil {
		return false, fmt.Errorf("release stock: %w", err)
	}
	return true, nil
}
