package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// claims names claimed rows: each by its id and the claimed_at its claim
// set, so that a claim taken over by another worker is told apart.
type claims struct {
	dbsqlc.InboxLockClaimedParams
	// takenOver is set for claims taken over from attempts that never
	// finished (InboxClaimUnfinished). Only such a message can have used up
	// its attempts without finishing one; a message claimed afresh finished
	// its last attempt (a retry), and runs even when its attempts are past a
	// limit lowered since.
	takenOver bool
}

// claimsOf names the rows a claim statement returned.
func claimsOf[R dbsqlc.InboxClaimBatchRow | dbsqlc.InboxClaimUnfinishedRow](rows []R, takenOver bool) claims {
	c := claims{takenOver: takenOver}
	for _, r := range rows {
		row := dbsqlc.InboxClaimBatchRow(r)
		c.Ids, c.ClaimedAts = append(c.Ids, row.ID), append(c.ClaimedAts, row.ClaimedAt)
	}
	return c
}

// only returns the claims of c whose ids keep reports true for.
func (c claims) only(keep func(id int64) bool) claims {
	kept := claims{takenOver: c.takenOver}
	for i, id := range c.Ids {
		if keep(id) {
			kept.Ids, kept.ClaimedAts = append(kept.Ids, id), append(kept.ClaimedAts, c.ClaimedAts[i])
		}
	}
	return kept
}

// sourceQueue is where the inbox's messages were read from, named in each
// process span: the queue ingest consumes, broker.QueueInbox (the tracing
// tests hold the two equal), written out so that the worker does not
// depend on the broker.
const sourceQueue = "order-confirmation.inbox"

// The savepoint the handler's call on a whole batch runs under (see
// handle), set in the round trip that begins the work transaction and
// locks the claimed rows; what undoes the call when it fails; and what
// ends it before the outcomes are recorded. The outcomes update the rows
// the transaction locked before the savepoint: updated inside it, by a
// subtransaction, each row would have two lockers, and PostgreSQL would
// write a MultiXact for every message (TestOutcomesTakeNoMultiXact).
const (
	batchSavepoint = "SAVEPOINT inbox_batch"
	batchUndo      = "ROLLBACK TO SAVEPOINT inbox_batch"
	batchRelease   = "RELEASE SAVEPOINT inbox_batch"
)

// work locks the claimed rows, handles them and records the outcomes, all in
// one transaction. When the database loses that transaction, the claims
// are kept to be given back (see lostClaims).
//
// The transaction's BEGIN, the lock of the claimed rows and the batch's
// savepoint go in one round trip (pgx's Batch.BeginTx).
func (w *Worker) work(ctx context.Context, c claims) error {
	if len(c.Ids) == 0 {
		return nil
	}
	conn, err := w.pool.Acquire(ctx)
	if err != nil {
		w.keepIfLost(ctx, nil, c, err)
		return fmt.Errorf("acquire a connection for the work transaction: %w", err)
	}
	defer conn.Release()
	var rows []dbsqlc.InboxLockClaimedRow
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(dbsqlc.InboxLockClaimed, c.Ids, c.ClaimedAts).Query(func(r pgx.Rows) (err error) {
		rows, err = pgx.CollectRows(r, pgx.RowToStructByPos[dbsqlc.InboxLockClaimedRow])
		return err
	})
	b.Queue(batchSavepoint)
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := br.Close(); err != nil {
		w.keepIfLost(ctx, tx, c, err)
		return fmt.Errorf("begin the work transaction and lock its claimed messages: %w", err)
	}
	err = w.workIn(ctx, tx, c, rows)
	w.keepIfLost(ctx, tx, c, err)
	return err
}

// workIn is work's transaction, tx, in which the claims c locked rows.
func (w *Worker) workIn(ctx context.Context, tx pgx.Tx, c claims, rows []dbsqlc.InboxLockClaimedRow) error {
	w.keepUnlocked(c, rows)
	if len(rows) == 0 {
		return nil
	}
	batch := w.claimedBatch(ctx, rows, c.takenOver)
	handlerDuration, err := w.finish(ctx, tx, batch)
	if err == nil {
		w.logDecisions(ctx, batch)
		if w.cfg.Observe != nil {
			w.cfg.Observe(batchStats(batch, handlerDuration))
		}
	}
	// Every message's process span ends once its outcome is known: after
	// the commit, or with the error that abandoned the batch.
	endProcessSpans(batch, err)
	return err
}

// claimedBatch makes a claimed message of each locked row, its process span
// started: first those to handle, in the order of rows, then those given up
// (taken over past their attempts).
func (w *Worker) claimedBatch(ctx context.Context, rows []dbsqlc.InboxLockClaimedRow, takenOver bool) []claimed {
	var handled, givenUp []claimed
	for _, r := range rows {
		c := claimed{msg: Message{
			ID:         r.ID,
			MessageID:  r.MessageID,
			Type:       r.MessageType,
			Payload:    r.Payload,
			Attempt:    int(r.Attempts),
			ReceivedAt: r.ReceivedAt,
			Replay:     r.ReplayRequested,
		}, replyRequests: r.ReplyRequestIds, claimedAt: r.ClaimedAt}
		m := &c.msg
		_, m.span = w.cfg.Tracer.StartProcess(ctx, sourceQueue, tracing.Message{
			ID: m.MessageID, Type: m.Type, Attempt: m.Attempt, Replay: m.Replay,
			Origin: tracing.Text{Traceparent: r.Traceparent, Tracestate: r.Tracestate},
		})
		c.givenUp = takenOver && m.Attempt > w.cfg.MaxAttempts
		if c.givenUp {
			givenUp = append(givenUp, c)
		} else {
			handled = append(handled, c)
		}
	}
	return append(handled, givenUp...)
}

// finish runs the handler on the batch's messages, decides and records
// each one's outcome and commits. It returns how long the handler took.
func (w *Worker) finish(ctx context.Context, tx pgx.Tx, batch []claimed) (time.Duration, error) {
	started := time.Now()
	if err := w.handleClaimed(ctx, tx, batch); err != nil {
		return 0, err
	}
	handlerDuration := time.Since(started)
	for i := range batch {
		batch[i].decision = decide(w.cfg, &batch[i])
	}
	if _, err := tx.Exec(ctx, batchRelease); err != nil {
		return 0, fmt.Errorf("%w: release savepoint: %w", errTxBroken, err)
	}
	if err := w.complete(ctx, tx, batch); err != nil {
		return 0, err
	}
	// Commit even when ctx was cancelled during a graceful stop: the work is done.
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		// The outcome of a failed COMMIT may be unknown. Nothing is redone
		// here: if it did not commit, the rows are claimed again once their
		// lease ends, and the domain's unique keys make a second run safe.
		return 0, fmt.Errorf("commit work batch: %w", err)
	}
	return handlerDuration, nil
}

// handleClaimed runs the handler on the messages of batch that are not
// given up, and sets their outcomes.
func (w *Worker) handleClaimed(ctx context.Context, tx pgx.Tx, batch []claimed) error {
	var msgs []Message
	var at []int // at[i] is msgs[i]'s place in batch
	for i, c := range batch {
		if !c.givenUp {
			msgs, at = append(msgs, c.msg), append(at, i)
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	outcomes, err := w.handle(ctx, tx, msgs)
	if err != nil {
		return err
	}
	for i, out := range outcomes {
		batch[at[i]].outcome = out
	}
	return nil
}

// handle runs the handler on the whole batch under the batch's savepoint
// (batchSavepoint); if that fails it rolls the call back and runs the
// handler on each message alone, each under its own savepoint.
// HandlerTimeout bounds it all: the batch gets half of it (all of it for a
// single message), and the messages handled alone share what is left, each
// getting an equal part of the time that remains for those still to come
// (and at least an eighth of HandlerTimeout, or a second).
// So a message stuck in a query uses up its own part only; the others are
// handled, and a message whose turn comes after the deadline waits (see
// Wait) instead of losing an attempt. A context that ends inside a query
// cancels the query (the pools are configured so), which keeps the
// transaction usable: the savepoint rolls it back.
func (w *Worker) handle(ctx context.Context, tx pgx.Tx, msgs []Message) ([]Outcome, error) {
	deadline := time.Now().Add(w.cfg.HandlerTimeout)
	batchTimeout := w.cfg.HandlerTimeout
	if len(msgs) > 1 {
		batchTimeout /= 2
	}
	outcomes, batchErr := w.callHandler(ctx, tx, msgs, time.Now().Add(batchTimeout))
	if batchErr == nil {
		return outcomes, nil
	}
	if _, err := tx.Exec(context.WithoutCancel(ctx), batchUndo); err != nil {
		return nil, fmt.Errorf("%w: roll back to savepoint after %w: %w", errTxBroken, batchErr, err)
	}
	if len(msgs) == 1 {
		return []Outcome{{Err: batchErr}}, nil
	}
	w.logger.Warn("batch handler failed, handling messages one by one",
		slog.Int("batch_size", len(msgs)), slog.String("error", batchErr.Error()))
	return w.handleEach(ctx, tx, msgs, deadline)
}

// handleEach runs the handler on each message alone, under a savepoint of
// its own, sharing the time left until deadline (see handle).
func (w *Worker) handleEach(ctx context.Context, tx pgx.Tx, msgs []Message, deadline time.Time) ([]Outcome, error) {
	outcomes := make([]Outcome, len(msgs))
	// A message that runs out of its share has failed an attempt, so every
	// share is at least minShare (past the handler's lock waits); a message
	// whose turn leaves less waits instead.
	minShare := min(w.cfg.HandlerTimeout/8, time.Second)
	for i := range msgs {
		left := time.Until(deadline)
		share := max(left/time.Duration(len(msgs)-i), minShare)
		if share > left || ctx.Err() != nil {
			outcomes[i] = Outcome{Err: Wait(0, fmt.Errorf("not handled: the batch's handler timeout (%s) passed before its turn", w.cfg.HandlerTimeout))}
			continue
		}
		out, err := w.handleUnderSavepoint(ctx, tx, msgs[i:i+1], time.Now().Add(share))
		if errors.Is(err, errTxBroken) {
			return nil, err
		}
		if err != nil {
			outcomes[i] = Outcome{Err: err}
			continue
		}
		outcomes[i] = out[0]
	}
	return outcomes, nil
}

// errTxBroken means the claiming transaction itself can no longer be used
// (a savepoint could not be created or rolled back): the batch is abandoned
// and its rows stay pending.
var errTxBroken = errors.New("claim transaction broken")

func (w *Worker) handleUnderSavepoint(ctx context.Context, tx pgx.Tx, msgs []Message, deadline time.Time) ([]Outcome, error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: create savepoint: %w", errTxBroken, err)
	}
	outcomes, err := w.callHandler(ctx, sp, msgs, deadline)
	if err != nil {
		if rbErr := sp.Rollback(context.WithoutCancel(ctx)); rbErr != nil {
			return nil, fmt.Errorf("%w: roll back savepoint after %w: %w", errTxBroken, err, rbErr)
		}
		return nil, err
	}
	if err := sp.Commit(ctx); err != nil {
		return nil, fmt.Errorf("%w: release savepoint: %w", errTxBroken, err)
	}
	return outcomes, nil
}

// callHandler runs the handler until deadline, in tx, and turns a panic
// into an error, as it does a count of outcomes that is not one per
// message. The handler gets tx as a handlerTx: it cannot end it.
func (w *Worker) callHandler(ctx context.Context, tx pgx.Tx, msgs []Message, deadline time.Time) (outcomes []Outcome, err error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if len(msgs) == 1 {
		ctx = msgs[0].Context(ctx) // a batch of one runs in its message's span
	}
	defer func() {
		if r := recover(); r != nil {
			w.logger.ErrorContext(ctx, "handler panicked", slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			outcomes, err = nil, fmt.Errorf("handler panicked: %v", r)
		}
	}()
	outcomes, err = w.cfg.Handler.HandleBatch(ctx, handlerTx{tx}, msgs)
	if err == nil && len(outcomes) != len(msgs) {
		err = fmt.Errorf("handler returned %d outcomes for %d messages", len(outcomes), len(msgs))
	}
	return outcomes, err
}

// handlerTx is the worker's transaction as the handler gets it: the
// handler may run statements in it and savepoints under it (Begin), but
// not end it. Ending it would commit or roll back the batch's outcomes
// with the handler's effects, or lose them.
type handlerTx struct{ pgx.Tx }

// errHandlerEndsTx is what a handler that tries to end the worker's
// transaction gets.
var errHandlerEndsTx = errors.New("the handler must not end the worker's transaction")

// Commit refuses: see handlerTx.
func (handlerTx) Commit(context.Context) error { return errHandlerEndsTx }

// Rollback refuses: see handlerTx.
func (handlerTx) Rollback(context.Context) error { return errHandlerEndsTx }
