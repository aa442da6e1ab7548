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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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

	// heldStock remembers the stock rows found held by another session.
	heldStock heldRows
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
	ready, done := decodeBatch(msgs)
	blocked, locked, err := h.lockStock(ctx, tx, ready)
	if err != nil {
		return nil, err
	}
	if blocked, err = h.lockOrders(ctx, tx, ready, blocked); err != nil {
		return nil, err
	}
	ready, waiting := holdBack(ready, blocked)
	applied, err := h.apply(ctx, tx, ready, locked)
	if err != nil {
		return nil, err
	}
	done = append(append(done, waiting...), applied...)
	return record(ctx, tx, msgs, done)
}

// handled is what handling one message of a batch came to: its outcome, and
// the effects it writes to the outbox, in the order they are published.
type handled struct {
	index   int // in the batch
	outcome inbox.Outcome
	effects []effect
}

// decodeBatch decodes each message of msgs once. It returns those that
// decode, in order, and the failure of each that does not.
func decodeBatch(msgs []inbox.Message) ([]message, []handled) {
	var ready []message
	var failed []handled
	for i, m := range msgs {
		d, err := decode(i, m)
		if err != nil {
			failed = append(failed, handled{index: i, outcome: inbox.Outcome{Err: err}})
			continue
		}
		ready = append(ready, d)
	}
	return ready, failed
}

// holdBack returns the messages that run now, and the outcome of each that
// waits instead: one that needs rows another session holds (blocked, by
// batch index, with the reason) waits, and holds back the later messages of
// its order in this batch too (they share one only when they have no
// ordering key).
func holdBack(ready []message, blocked map[int]error) (run []message, waiting []handled) {
	waits := map[string]error{}
	for _, m := range ready {
		id := m.orderID()
		if wait := blocked[m.index]; wait != nil {
			waits[id] = wait
		} else if waits[id] == nil {
			run = append(run, m)
			continue
		}
		waiting = append(waiting, handled{index: m.index, outcome: inbox.Outcome{Err: waits[id]}})
	}
	return run, waiting
}

// apply handles the messages that run now, in order: each run of
// consecutive order.created messages with one confirm, each order.cancelled
// on its own after it. locked are the stock levels lockStock read.
func (h *Handler) apply(ctx context.Context, tx pgx.Tx, ready []message, locked map[string]int32) ([]handled, error) {
	stock := stockLevels{locked: locked}
	var done []handled
	var run []message
	for _, m := range ready {
		if m.created != nil {
			run = append(run, m)
			continue
		}
		confirmed, err := h.confirm(ctx, tx, run, stock)
		if err != nil {
			return nil, err
		}
		cancelled, err := h.cancel(ctx, tx, m)
		if err != nil {
			return nil, err
		}
		done = append(append(done, confirmed...), cancelled)
		run, stock.stale = nil, true
	}
	confirmed, err := h.confirm(ctx, tx, run, stock)
	if err != nil {
		return nil, err
	}
	return append(done, confirmed...), nil
}

// record returns the outcome of each message of msgs from what handling it
// came to, done, with its reply, and writes the effects to the outbox in the
// order of done. A replayed message's result says so.
func record(ctx context.Context, tx pgx.Tx, msgs []inbox.Message, done []handled) ([]inbox.Outcome, error) {
	outcomes := make([]inbox.Outcome, len(msgs))
	var events outboxRows
	events.traceOf(msgs)
	for _, d := range done {
		if d.outcome.Err == nil && d.outcome.Reply == nil {
			d.outcome.Reply = replyOf(d.outcome.Result, "")
		}
		outcomes[d.index] = d.outcome
		for _, e := range d.effects {
			events.add(e)
		}
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
// why it must not run now when it needs stock rows another session holds,
// and the levels of the rows it locked.
func (h *Handler) lockStock(ctx context.Context, tx pgx.Tx, ready []message) (map[int]error, map[string]int32, error) {
	needs, err := h.stockNeeds(ctx, tx, ready)
	if err != nil {
		return nil, nil, err
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
	levels, held, err := h.lockOrFindHeld(ctx, tx, slices.Sorted(maps.Keys(skuSet)))
	if err != nil || len(held) == 0 {
		return nil, levels, err
	}
	blocked := map[int]error{}
	for i, need := range needs {
		var skus []string
		for _, sku := range slices.Sorted(slices.Values(need)) {
			if held[sku] && !slices.Contains(skus, sku) {
				skus = append(skus, sku)
			}
		}
		if len(skus) > 0 {
			blocked[i] = inbox.WaitFor(StockWaitRetry, "a stock row it needs is locked by another session",
				fmt.Errorf("stock row %s locked by another session", strings.Join(skus, ", ")))
		}
	}
	return blocked, levels, nil
}

// lockOrders locks the rows the batch's cancellations change, their orders'
// order_confirmations and stock_reservations rows, waiting OrderLockWait at
// most (see LockOrders), and returns blocked with each cancellation added
// whose order has a row another session holds: it waits, and the batch goes
// on.
func (h *Handler) lockOrders(ctx context.Context, tx pgx.Tx, ready []message, blocked map[int]error) (map[int]error, error) {
	byOrder := map[string][]int{}
	for _, m := range ready {
		if m.cancelled != nil && blocked[m.index] == nil {
			byOrder[m.cancelled.OrderID] = append(byOrder[m.cancelled.OrderID], m.index)
		}
	}
	if len(byOrder) == 0 {
		return blocked, nil
	}
	held, err := LockOrders(ctx, tx, slices.Sorted(maps.Keys(byOrder)), OrderLockWait)
	if err != nil {
		return nil, fmt.Errorf("lock orders: %w", err)
	}
	if len(held) > 0 && blocked == nil {
		blocked = map[int]error{}
	}
	for _, id := range held {
		for _, i := range byOrder[id] {
			blocked[i] = inbox.WaitFor(StockWaitRetry, "its order's order_confirmations or stock_reservations rows are locked by another session",
				fmt.Errorf("order %s: its order_confirmations or stock_reservations rows are locked by another session", id))
		}
	}
	return blocked, nil
}

// OrderLockWait is how long a cancellation waits for its order's rows:
// hardly at all. Only its own order's messages change them, one at a
// time (the inbox hands an order's messages out in turn), so another
// session holding one is outside the service (an operator's open UPDATE)
// and unlikely to let go within a wait that would hold the rest of the
// batch; the cancellation waits instead, and is tried again after
// StockWaitRetry. (A wait of 0 would be none at all: LockOrders then
// only takes the rows nobody holds.)
const OrderLockWait = time.Millisecond

// stockNeeds returns, per message index, the SKUs of the stock rows each
// message needs: an order's items, and the rows a cancellation's order
// holds reserved.
func (h *Handler) stockNeeds(ctx context.Context, tx pgx.Tx, ready []message) (map[int][]string, error) {
	needs := map[int][]string{}
	cancelled := map[string]int{}
	for _, m := range ready {
		if m.created == nil {
			cancelled[m.cancelled.OrderID] = m.index
			continue
		}
		for _, it := range m.created.Items {
			needs[m.index] = append(needs[m.index], it.SKU)
		}
	}
	if len(cancelled) == 0 {
		return needs, nil
	}
	reserved, err := h.queries.StockReservedSkus(ctx, tx, slices.Collect(maps.Keys(cancelled)))
	if err != nil {
		return nil, fmt.Errorf("read reserved skus: %w", err)
	}
	for _, r := range reserved {
		i := cancelled[r.OrderID]
		needs[i] = append(needs[i], r.Sku)
	}
	return needs, nil
}

// lockOrFindHeld locks the stock rows of skus and returns the levels of
// those it locked, and the SKUs of those it could not: rows that exist but
// another session holds. Rows found held before are only probed, without
// waiting; the others are waited for StockLockWait at most, in SKU order
// (see LockStock). Rows it finds held are remembered, and forgotten once a
// probe gets them.
func (h *Handler) lockOrFindHeld(ctx context.Context, tx pgx.Tx, skus []string) (map[string]int32, map[string]bool, error) {
	probe, wait := h.heldStock.split(skus)
	levels, held := map[string]int32{}, map[string]bool{}
	for _, c := range []struct {
		skus []string
		wait time.Duration
	}{{probe, 0}, {wait, StockLockWait}} {
		if len(c.skus) == 0 {
			continue
		}
		got, notGot, err := LockStock(ctx, tx, c.skus, c.wait)
		if err != nil {
			return nil, nil, fmt.Errorf("lock stock: %w", err)
		}
		maps.Copy(levels, got)
		maps.Copy(held, notGot)
	}
	h.heldStock.remember(skus, wait, held)
	return levels, held, nil
}

// stockLevels are the levels of the stock rows that reserve decides on.
type stockLevels struct {
	// locked are the levels of the batch's stock rows as lockStock read them
	// when it locked them.
	locked map[string]int32
	// stale is set once the batch has handled a cancellation: one, the only
	// thing that ends a run of orders early, gives stock back after the run
	// before it took some, so the next run's reserve reads the levels again.
	stale bool
}

// confirm records the orders of run, order.created messages, in one
// statement, reserves the stock of each order it newly recorded (all of an
// order's items, or none), rejects the orders whose stock falls short, and
// returns what each message came to.
func (h *Handler) confirm(ctx context.Context, tx pgx.Tx, run []message, stock stockLevels) ([]handled, error) {
	if len(run) == 0 {
		return nil, nil
	}
	inserted, err := h.insertOrders(ctx, tx, run)
	if err != nil {
		return nil, err
	}
	var done []handled
	var fresh []message
	for _, m := range run {
		if inserted[m.id] {
			fresh = append(fresh, m)
		} else {
			done = append(done, handled{index: m.index, outcome: inbox.Outcome{Result: ResultAlreadyRecorded}})
		}
	}
	rejections, err := h.reserve(ctx, tx, fresh, stock)
	if err != nil {
		return nil, err
	}
	for i, m := range fresh {
		done = append(done, decided(m, rejections[i]))
	}
	return done, nil
}

// insertOrders records the orders of run, ON CONFLICT (order_id) DO
// NOTHING, and returns the ids of the messages whose order it recorded.
func (h *Handler) insertOrders(ctx context.Context, tx pgx.Tx, run []message) (map[string]bool, error) {
	p := dbsqlc.OrderConfirmationInsertManyParams{
		OrderIds:   make([]string, len(run)),
		UserIds:    make([]string, len(run)),
		Emails:     make([]string, len(run)),
		MessageIds: make([]string, len(run)),
	}
	for i, m := range run {
		p.OrderIds[i], p.UserIds[i], p.Emails[i], p.MessageIds[i] = m.created.OrderID, m.created.UserID, m.created.Email, m.id
	}
	rows, err := h.queries.OrderConfirmationInsertMany(ctx, tx, p)
	if err != nil {
		return nil, fmt.Errorf("insert order confirmations: %w", err)
	}
	insertedBy := make(map[string]bool, len(rows))
	for _, r := range rows {
		insertedBy[r.MessageID] = true
	}
	return insertedBy, nil
}

// decided is what a newly recorded order's message comes to: rejected for
// reason, or confirmed when reason is "".
func decided(m message, reason string) handled {
	if reason != "" {
		return handled{index: m.index, outcome: inbox.Outcome{Result: ResultRejected, Reply: replyOf(ResultRejected, reason)},
			effects: []effect{rejectedEffect(m, reason)}}
	}
	return handled{index: m.index, outcome: inbox.Outcome{Result: ResultConfirmed}, effects: confirmedEffects(m)}
}

// reserve reserves the stock of each order, in order and all or nothing
// per order, and returns for each the reason it was rejected ("" when its
// stock is reserved); the rejected orders' rows are marked rejected. The
// stock rows are locked already (see lockStock), so their levels hold until
// the transaction ends: decideStock decides on them, and the takes,
// reservations and rejections are then written with one statement each.
// It decides on the levels lockStock read, unless stock says they are
// stale: then it reads them again.
func (h *Handler) reserve(ctx context.Context, tx pgx.Tx, orders []message, stock stockLevels) ([]string, error) {
	if len(orders) == 0 {
		return nil, nil
	}
	available := stock.locked
	if stock.stale {
		var err error
		if available, err = h.readStock(ctx, tx, orders); err != nil {
			return nil, err
		}
	}
	created := make([]OrderCreated, len(orders))
	for i, m := range orders {
		created[i] = *m.created
	}
	d := decideStock(created, available)
	if err := h.writeStock(ctx, tx, d); err != nil {
		return nil, err
	}
	return d.reasons, nil
}

// readStock reads the levels of the stock rows of the orders' items.
func (h *Handler) readStock(ctx context.Context, tx pgx.Tx, orders []message) (map[string]int32, error) {
	skuSet := map[string]bool{}
	for _, m := range orders {
		for _, it := range m.created.Items {
			skuSet[it.SKU] = true
		}
	}
	rows, err := h.queries.StockGetMany(ctx, tx, slices.Sorted(maps.Keys(skuSet)))
	if err != nil {
		return nil, fmt.Errorf("read stock: %w", err)
	}
	available := make(map[string]int32, len(rows))
	for _, r := range rows {
		available[r.Sku] = r.Available
	}
	return available, nil
}

// writeStock writes what decideStock decided: the reservations and the
// stock they take, in one round trip, and the rejections.
func (h *Handler) writeStock(ctx context.Context, tx pgx.Tx, d stockDecision) error {
	res, take, reject := d.reservations, d.take, d.reject
	if len(res.OrderIds) > 0 {
		// The take is sent with the reservations, before their count is
		// checked: a count that is wrong fails the batch, which rolls the
		// take back with the rest.
		b := &pgx.Batch{}
		// A reservation that exists already fails the insert (see
		// StockReservationInsertMany), and the batch with it.
		b.Queue(dbsqlc.StockReservationInsertMany, res.OrderIds, res.Skus, res.Quantities).Exec(func(ct pgconn.CommandTag) error {
			if n := ct.RowsAffected(); n != int64(len(res.OrderIds)) {
				return fmt.Errorf("record reservations: %d written for %d", n, len(res.OrderIds))
			}
			return nil
		})
		b.Queue(dbsqlc.StockTakeMany, take.Skus, take.Quantities).Exec(func(ct pgconn.CommandTag) error {
			if n := ct.RowsAffected(); n != int64(len(take.Skus)) {
				return fmt.Errorf("take stock: %d moves written for %d SKUs", n, len(take.Skus))
			}
			return nil
		})
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("reserve stock: %w", err)
		}
	}
	if len(reject.OrderIds) > 0 {
		if err := h.queries.OrderConfirmationRejectMany(ctx, dbsqlc.PlanEachCall(tx), reject); err != nil {
			return fmt.Errorf("reject orders: %w", err)
		}
	}
	return nil
}

// cancel handles m, an order.cancelled message, and returns what it came
// to: a cancellation that took effect adds order.cancelled to the outbox.
func (h *Handler) cancel(ctx context.Context, tx pgx.Tx, m message) (handled, error) {
	result, err := h.cancelOrder(ctx, tx, m.id, *m.cancelled)
	if err != nil {
		return handled{}, err
	}
	done := handled{index: m.index, outcome: inbox.Outcome{Result: result}}
	if result == ResultCancelled || result == ResultCancelledUnseen {
		done.effects = []effect{cancelledEffect(m)}
	}
	return done, nil
}

// cancelOrder moves a confirmed order to cancelled and gives its stock
// back; the conditional update makes both happen once, however often the
// cancellation is handled. It returns the message's result.
func (h *Handler) cancelOrder(ctx context.Context, tx pgx.Tx, messageID string, m OrderCancelled) (string, error) {
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
