package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Statuses of an inbox row.
const (
	StatusPending   = "pending"
	StatusProcessed = "processed"
	StatusDead      = "dead"
)

// Defaults of WorkerConfig.
const (
	ConcurrencyDefault    = 2
	BatchSizeDefault      = 1000
	PollIntervalDefault   = time.Second
	HandlerTimeoutDefault = 30 * time.Second
	MaxAttemptsDefault    = 10
	ClaimLeaseDefault     = 5 * time.Second
)

// WorkerConfig configures a Worker.
type WorkerConfig struct {
	// Handler handles the claimed messages. Required.
	Handler Handler
	// Logger receives the worker's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Concurrency is the number of batches handled at once, each in its own
	// transaction on its own connection. Defaults to 2.
	Concurrency int
	// BatchSize is the most messages claimed per transaction. Defaults to
	// 1000.
	BatchSize int
	// PollInterval is how often the worker looks for due messages when nothing
	// has woken it (wake-ups come from Notify). Defaults to 1 second.
	PollInterval time.Duration
	// HandlerTimeout bounds the handling of one batch, the one-by-one
	// handling of its messages after a failure included (see handle).
	// Defaults to 30 seconds.
	HandlerTimeout time.Duration
	// MaxAttempts is the number of failed attempts after which a message is
	// marked dead. Defaults to 10.
	MaxAttempts int
	// RetryBase is the delay before the first retry; each later retry doubles
	// it, up to RetryMax, with full jitter. Defaults to 1 second.
	RetryBase time.Duration
	// RetryMax caps the retry delay. Defaults to 5 minutes.
	RetryMax time.Duration
	// Observe, when set, is told about every batch whose outcomes were
	// committed. It must not block.
	Observe func(BatchStats)
	// ClaimLease is how long a claim that has not locked its row yet is left
	// alone when its process's liveness is unknown (a claim of an earlier
	// build, or taken while the process's liveness session was down). The
	// claims of a process whose liveness session ended (it died) are taken
	// over at once. Defaults to 5 seconds.
	ClaimLease time.Duration
	// Process names this process in inbox.claimed_by and the attempt
	// history. Defaults to DefaultProcessName().
	Process string
	// Build names the build of the handler in inbox.claimed_build and the
	// attempt history. Defaults to "unknown".
	Build string
	// Tracer starts the process span of each handling attempt. Defaults to
	// tracing.PropagateOnly().
	Tracer *tracing.Tracer
}

// DefaultProcessName returns "host/pid", the name a process gives itself in
// the attempt history unless told otherwise.
func DefaultProcessName() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return fmt.Sprintf("%s/%d", host, os.Getpid())
}

func (c *WorkerConfig) withDefaults() (*WorkerConfig, error) {
	out := *c
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.Concurrency = cmp.Or(out.Concurrency, ConcurrencyDefault)
	out.BatchSize = cmp.Or(out.BatchSize, BatchSizeDefault)
	out.PollInterval = cmp.Or(out.PollInterval, PollIntervalDefault)
	out.HandlerTimeout = cmp.Or(out.HandlerTimeout, HandlerTimeoutDefault)
	out.MaxAttempts = cmp.Or(out.MaxAttempts, MaxAttemptsDefault)
	out.RetryBase = cmp.Or(out.RetryBase, retry.BaseDefault)
	out.RetryMax = cmp.Or(out.RetryMax, retry.MaxDefault)
	out.ClaimLease = cmp.Or(out.ClaimLease, ClaimLeaseDefault)
	out.Process = cmp.Or(out.Process, DefaultProcessName())
	out.Build = cmp.Or(out.Build, "unknown")
	out.Tracer = cmp.Or(out.Tracer, tracing.PropagateOnly())
	switch {
	case out.Handler == nil:
		return nil, errors.New("worker: Handler is required")
	case out.Concurrency < 1:
		return nil, fmt.Errorf("worker: Concurrency must be at least 1, got %d", out.Concurrency)
	case out.BatchSize < 1:
		return nil, fmt.Errorf("worker: BatchSize must be at least 1, got %d", out.BatchSize)
	case out.PollInterval <= 0, out.HandlerTimeout <= 0, out.RetryBase <= 0, out.RetryMax < out.RetryBase, out.ClaimLease <= 0:
		return nil, errors.New("worker: PollInterval, HandlerTimeout, RetryBase and ClaimLease must be positive, RetryMax at least RetryBase")
	case out.MaxAttempts < 1:
		return nil, fmt.Errorf("worker: MaxAttempts must be at least 1, got %d", out.MaxAttempts)
	}
	return &out, nil
}

// BatchStats describes one committed work batch.
type BatchStats struct {
	// Processed, Retried and Dead count the messages by outcome, Waiting
	// those that wait without an attempt counted (see Wait); Replays counts
	// the replayed messages among them.
	Processed, Retried, Dead, Waiting, Replays int
	// HandlerDuration is how long the handler took for the batch.
	HandlerDuration time.Duration
	// Latencies holds, for each processed message, the time from its
	// arrival in the inbox to the commit.
	Latencies []time.Duration
	// TraceIDs holds, for each of Latencies, the trace id of the message's
	// process span when that trace is sampled (exported), else "".
	TraceIDs []string
}

// Worker claims pending inbox rows in batches with FOR UPDATE SKIP LOCKED,
// runs the Handler on them and marks each one processed, retried or dead in
// the same transaction as the handler's effects. Any number of Workers, in
// any number of processes, can share one inbox. See RunOnce.
type Worker struct {
	pool    *pgxpool.Pool
	cfg     *WorkerConfig
	logger  *slog.Logger
	queries *dbsqlc.Queries
	wake    chan struct{}

	// exclusive is held for writing while a message whose last claim never
	// ended is claimed and handled, and for reading by every other batch.
	exclusive sync.RWMutex

	live    *liveness
	service startstop.Service
}

// NewWorker returns a Worker that claims from the inbox through pool. The
// pool should have at least cfg.Concurrency connections of its own.
func NewWorker(pool *pgxpool.Pool, cfg *WorkerConfig) (*Worker, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Worker{
		pool:    pool,
		cfg:     c,
		logger:  c.Logger.With(slog.String("component", "inbox.worker")),
		queries: dbsqlc.New(),
		wake:    make(chan struct{}, 1),
		live:    newLiveness(),
	}, nil
}

// Notify wakes an idle worker goroutine to look for due messages. It never
// blocks; wake-ups that arrive while one is already pending are merged.
func (w *Worker) Notify() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Start launches the worker goroutines and returns at once. ctx bounds the
// whole run; Stop ends it gracefully.
func (w *Worker) Start(ctx context.Context) error {
	return w.service.Start(ctx, func(fetchCtx, workCtx context.Context) {
		// Held until the last batch has ended, so that no claim of this
		// process is taken over while it is still handled here.
		liveCtx, endLiveness := context.WithCancel(workCtx)
		var live sync.WaitGroup
		live.Go(func() { w.live.hold(liveCtx, w.pool.Config().ConnConfig, w.logger) })
		defer func() { endLiveness(); live.Wait() }()
		var wg sync.WaitGroup
		for i := range w.cfg.Concurrency {
			wg.Go(func() { w.loop(fetchCtx, workCtx, i) })
		}
		wg.Go(func() { w.takeOverLoop(fetchCtx, workCtx) })
		wg.Wait()
	})
}

// Stop stops claiming new batches and waits for the batches in flight to
// commit. When ctx ends first, the in-flight handlers are cancelled and their
// transactions rolled back (the messages stay pending), and Stop returns once
// they have.
func (w *Worker) Stop(ctx context.Context) {
	w.service.StopOrLog(ctx, w.logger)
}

func (w *Worker) loop(fetchCtx, workCtx context.Context, n int) {
	logger := w.logger.With(slog.Int("worker", n))
	poll := time.NewTicker(w.cfg.PollInterval)
	defer poll.Stop()
	failures := 0
	fail := func(err error) bool {
		if fetchCtx.Err() != nil {
			return false
		}
		failures++
		delay := retry.Backoff(failures, 100*time.Millisecond, 10*time.Second)
		logger.Error("work batch failed", slog.String("error", err.Error()), slog.Duration("retry_in", delay))
		return retry.Sleep(fetchCtx, delay)
	}
	for fetchCtx.Err() == nil {
		claimed, err := w.runBatch(workCtx)
		switch {
		case err != nil:
			if !fail(err) {
				return
			}
			continue
		case claimed == w.cfg.BatchSize:
			failures = 0
			w.Notify() // there is more: let another goroutine join in
			continue
		case claimed > 0:
			failures = 0
			continue // there may be more
		}
		failures = 0
		select {
		case <-fetchCtx.Done():
			return
		case <-w.wake:
		case <-poll.C:
		}
	}
}

// RunOnce claims one batch of due messages, handles it and commits, and
// returns how many messages it claimed. It is what each worker goroutine does
// in a loop; tests call it to drive the worker step by step.
//
// The claim is one statement that commits at once: it counts an attempt for
// each row and marks the rows claimed. Then a transaction locks the rows (FOR
// UPDATE), runs the handler and records each outcome, which ends the claim;
// the handler's effects and the outcomes commit together. Because the
// attempt was committed first, a message whose handling kills the process
// still uses up its attempts, and ends dead instead of crash-looping.
//
// When there is no batch to claim, RunOnce takes over messages whose last
// claim never ended (see runUnfinished); a Worker started with Start does
// that on a timer of its own, every PollInterval.
func (w *Worker) RunOnce(ctx context.Context) (int, error) {
	n, err := w.runBatch(ctx)
	if err != nil || n > 0 {
		return n, err
	}
	return w.runUnfinished(ctx)
}

// runBatch claims and handles one batch of messages nobody has claimed.
func (w *Worker) runBatch(ctx context.Context) (int, error) {
	w.exclusive.RLock()
	defer w.exclusive.RUnlock()
	rows, err := w.queries.InboxClaimBatch(ctx, w.pool, dbsqlc.InboxClaimBatchParams{
		Process: w.cfg.Process,
		Build:   w.cfg.Build,
		MaxRows: int32(w.cfg.BatchSize),
		Session: w.live.session(),
	})
	if err != nil {
		return 0, fmt.Errorf("claim inbox batch: %w", err)
	}
	var c claims
	for _, r := range rows {
		c.Ids, c.ClaimedAts = append(c.Ids, r.ID), append(c.ClaimedAts, r.ClaimedAt)
	}
	return len(rows), w.work(ctx, c)
}

// runUnfinished takes over messages whose last claim never ended (the
// process died, or lost its database connection, while handling them). A
// message that loses its claim for the first time in its run is taken over
// with the others like it, a batch at a time, beside the other work; one
// that lost a claim before is handled alone, while no other work of this
// Worker is in flight: if it kills the process again, it costs no other
// message an attempt. Once such a message has used up its attempts it is
// marked dead without running. It returns the number of messages claimed.
func (w *Worker) runUnfinished(ctx context.Context) (int, error) {
	if n, err := w.takeOverBatch(ctx); err != nil || n > 0 {
		return n, err
	}
	w.exclusive.Lock()
	defer w.exclusive.Unlock()
	return w.takeOverOne(ctx)
}

// takeOverBatch claims and handles a batch of messages that lost their
// claim for the first time in their run, as runBatch does new ones.
func (w *Worker) takeOverBatch(ctx context.Context) (int, error) {
	w.exclusive.RLock()
	defer w.exclusive.RUnlock()
	return w.takeOver(ctx, true, w.cfg.BatchSize)
}

// takeOverOne claims and handles one unfinished message. The caller holds
// exclusive for writing.
func (w *Worker) takeOverOne(ctx context.Context) (int, error) {
	return w.takeOver(ctx, false, 1)
}

// takeOver claims up to max unfinished messages (only those that lost no
// claim before in their run, with firstLossOnly) and handles them.
func (w *Worker) takeOver(ctx context.Context, firstLossOnly bool, max int) (int, error) {
	rows, err := w.queries.InboxClaimUnfinished(ctx, w.pool, dbsqlc.InboxClaimUnfinishedParams{
		LeaseSeconds:  w.cfg.ClaimLease.Seconds(),
		FirstLossOnly: firstLossOnly,
		MaxRows:       int32(max),
		Process:       w.cfg.Process,
		Build:         w.cfg.Build,
		Session:       w.live.session(),
	})
	if err != nil {
		return 0, fmt.Errorf("claim unfinished messages: %w", err)
	}
	var c claims
	for _, r := range rows {
		c.Ids, c.ClaimedAts = append(c.Ids, r.ID), append(c.ClaimedAts, r.ClaimedAt)
	}
	return len(rows), w.work(ctx, c)
}

// takeOverSlice bounds how long the takeover holds the worker's other work
// paused in one go; with more to take over, it lets the batches in line run
// and goes on.
const takeOverSlice = time.Second

// takeOverLoop takes over the claims of crashed workers on a timer of its
// own, every PollInterval, however busy the other goroutines are: a backlog
// draining never delays a crashed process's messages, and the later
// messages of their orders, past a tick once the process is known dead (its
// liveness session ended), or past their lease. Messages that lost
// their first claim go a batch at a time beside the other work; those that
// lost one before go one at a time, each alone, with the other work paused
// once for a run of them (up to takeOverSlice) rather than once each.
func (w *Worker) takeOverLoop(fetchCtx, workCtx context.Context) {
	tick := time.NewTicker(w.cfg.PollInterval)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-fetchCtx.Done():
			return
		case <-tick.C:
		}
		for more := true; more && fetchCtx.Err() == nil; {
			var taken int
			var err error
			taken, more, err = w.takeOverRun(workCtx)
			if taken > 0 {
				failures = 0 // the database answers: a failure now is one message's
			}
			if err != nil {
				failures++
				delay := retry.Backoff(failures, 100*time.Millisecond, 10*time.Second)
				w.logger.Error("take over unfinished messages", slog.String("error", err.Error()), slog.Duration("retry_in", delay))
				retry.Sleep(fetchCtx, delay)
				break
			}
			failures = 0
		}
	}
}

// takeOverRun takes over unfinished messages: those that lost their first
// claim in batches, then the others one at a time for up to takeOverSlice.
// It returns how many it handled and whether it stopped with more to do.
func (w *Worker) takeOverRun(ctx context.Context) (taken int, more bool, err error) {
	for {
		n, err := w.takeOverBatch(ctx)
		taken += n
		if err != nil {
			return taken, false, err
		}
		if n < w.cfg.BatchSize {
			break
		}
	}
	// The pause below waits for the batches in flight: only for a reason.
	if waiting, err := w.queries.InboxHasUnfinished(ctx, w.pool, w.cfg.ClaimLease.Seconds()); err != nil || !waiting {
		return taken, false, err
	}
	w.exclusive.Lock()
	defer w.exclusive.Unlock()
	for end := time.Now().Add(takeOverSlice); time.Now().Before(end); taken++ {
		n, err := w.takeOverOne(ctx)
		if err != nil || n == 0 {
			return taken, false, err
		}
	}
	return taken, true, nil
}

// claims names claimed rows: each by its id and the claimed_at its claim
// set, so that a claim taken over by another worker is told apart.
type claims = dbsqlc.InboxLockClaimedParams

// work locks the claimed rows, handles them and records the outcomes, all in
// one transaction.
func (w *Worker) work(ctx context.Context, c claims) error {
	if len(c.Ids) == 0 {
		return nil
	}
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin work transaction: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	rows, err := w.queries.InboxLockClaimed(ctx, tx, c)
	if err != nil {
		return fmt.Errorf("lock claimed messages: %w", err)
	}
	// msgs are handled; givenUp have used up their attempts without ever
	// finishing one, and are recorded dead without running.
	var msgs, givenUp []Message
	// Every message's process span ends once its outcome is known: after
	// the commit, or with the error that abandoned the batch.
	spans := make([]trace.Span, 0, len(rows))
	var all []Message
	var decisions []decision
	var workErr error
	defer func() { endProcessSpans(spans, all, decisions, workErr) }()
	for _, r := range rows {
		m := Message{
			ID:         r.ID,
			MessageID:  r.MessageID,
			Type:       r.MessageType,
			Payload:    r.Payload,
			Attempt:    int(r.Attempts),
			ReceivedAt: r.ReceivedAt,
			Replay:     r.ReplayRequested,
		}
		_, m.span = w.cfg.Tracer.StartProcess(ctx, broker.QueueInbox, tracing.Message{
			ID: m.MessageID, Type: m.Type, Attempt: m.Attempt, Replay: m.Replay,
			Origin: tracing.Text{Traceparent: r.Traceparent, Tracestate: r.Tracestate},
		})
		spans = append(spans, m.span)
		if m.Attempt > w.cfg.MaxAttempts {
			givenUp = append(givenUp, m)
		} else {
			msgs = append(msgs, m)
		}
	}

	handleStarted := time.Now()
	var outcomes []Outcome
	if len(msgs) > 0 {
		if outcomes, err = w.handle(ctx, tx, msgs); err != nil {
			workErr = err
			return err
		}
	}
	handlerDuration := time.Since(handleStarted)
	all = append(msgs, givenUp...)
	if len(all) == 0 {
		return nil
	}
	decisions = make([]decision, len(all))
	for i, m := range all {
		var out *Outcome
		if i < len(msgs) {
			out = &outcomes[i]
		}
		decisions[i] = w.decide(m, out)
	}
	if err = w.complete(ctx, tx, all, decisions); err != nil {
		workErr = err
		return err
	}
	// Commit even when ctx was cancelled during a graceful stop: the work is done.
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		// The outcome of a failed COMMIT may be unknown. Nothing is redone
		// here: if it did not commit, the rows are claimed again once their
		// lease ends, and the domain's unique keys make a second run safe.
		workErr = fmt.Errorf("commit work batch: %w", err)
		return workErr
	}
	if w.cfg.Observe != nil {
		w.cfg.Observe(batchStats(all, decisions, handlerDuration))
	}
	return nil
}

// endProcessSpans ends the process span of every claimed message: with its
// recorded decision once the batch committed, else as abandoned with
// workErr. decisions is parallel to msgs when the batch committed.
func endProcessSpans(spans []trace.Span, msgs []Message, decisions []decision, workErr error) {
	if workErr == nil && len(decisions) == len(msgs) && len(msgs) == len(spans) {
		for i, m := range msgs {
			d := decisions[i]
			var err error
			if d.lastError != "" {
				err = errors.New(d.lastError)
			}
			tracing.EndProcess(m.span, spanOutcome(d.status), err)
		}
		return
	}
	for _, span := range spans {
		tracing.EndProcess(span, "abandoned", cmp.Or(workErr, errors.New("not handled")))
	}
}

// spanOutcome names a decision's status in the process span.
func spanOutcome(status string) string {
	switch status {
	case StatusPending:
		return "retried"
	case outcomeWaiting:
		return "waiting"
	}
	return status
}

func batchStats(msgs []Message, decisions []decision, handlerDuration time.Duration) BatchStats {
	st := BatchStats{HandlerDuration: handlerDuration}
	now := time.Now()
	for i, m := range msgs {
		switch decisions[i].status {
		case StatusProcessed:
			st.Processed++
			st.Latencies = append(st.Latencies, now.Sub(m.ReceivedAt))
			st.TraceIDs = append(st.TraceIDs, tracing.SampledTraceID(m.Context(context.Background())))
		case StatusDead:
			st.Dead++
		case outcomeWaiting:
			st.Waiting++
		default:
			st.Retried++
		}
		if m.Replay {
			st.Replays++
		}
	}
	return st
}

// handle runs the handler on the whole batch under a savepoint; if that
// fails it runs it on each message alone, each under its own savepoint.
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
	outcomes, batchErr := w.handleUnderSavepoint(ctx, tx, msgs, time.Now().Add(batchTimeout))
	switch {
	case batchErr == nil:
		return outcomes, nil
	case errors.Is(batchErr, errTxBroken):
		return nil, batchErr
	case len(msgs) == 1:
		return []Outcome{{Err: batchErr}}, nil
	}
	w.logger.Warn("batch handler failed, handling messages one by one",
		slog.Int("batch_size", len(msgs)), slog.String("error", batchErr.Error()))
	outcomes = make([]Outcome, len(msgs))
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
	if err == nil && len(outcomes) != len(msgs) {
		err = fmt.Errorf("handler returned %d outcomes for %d messages", len(outcomes), len(msgs))
	}
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

// callHandler runs the handler until deadline and turns a panic into an
// error.
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
	return w.cfg.Handler.HandleBatch(ctx, tx, msgs)
}

// outcomeWaiting is the status InboxCompleteMany takes for a message that
// waits (see Wait): pending again, the attempt given back.
const outcomeWaiting = "waiting"

// decision is what becomes of a handled message: the status recorded
// (StatusProcessed, StatusDead, StatusPending for a retry, or
// outcomeWaiting), its result or error text, and the delay before a retry
// or after a wait.
type decision struct {
	status, result, lastError string
	delay                     time.Duration
}

// decide turns a message's outcome into its decision; out is nil for a
// message that was given up without running. It is pure: the outcome
// statement stores the decision, and the stats, spans and logs read it.
func (w *Worker) decide(m Message, out *Outcome) decision {
	var wait *waitError
	var ra *retryAfterError
	switch {
	case out == nil:
		// Not handled at all: its earlier attempts never finished.
		return decision{status: StatusDead, lastError: fmt.Sprintf(
			"gave up after %d attempts: the last ones never finished (the process died, or lost its database connection, while handling the message)",
			m.Attempt-1)}
	case out.Err == nil:
		return decision{status: StatusProcessed, result: storable(out.Result)}
	case errors.As(out.Err, &wait):
		return decision{status: outcomeWaiting, lastError: storable("waiting: " + out.Err.Error()), delay: wait.after}
	case IsLockNotAvailable(out.Err):
		return decision{status: outcomeWaiting, lastError: storable("waiting: a row it needs is locked by another session: " + out.Err.Error()), delay: WaitDefault}
	case errors.Is(out.Err, ErrPermanent), m.Attempt >= w.cfg.MaxAttempts:
		return decision{status: StatusDead, lastError: storable(out.Err.Error())}
	case errors.As(out.Err, &ra):
		return decision{status: StatusPending, lastError: storable(out.Err.Error()), delay: ra.after}
	default:
		return decision{status: StatusPending, lastError: storable(out.Err.Error()),
			delay: retry.Backoff(m.Attempt, w.cfg.RetryBase, w.cfg.RetryMax)}
	}
}

// CancelQueryOnContextEnd is a pgconn.Config.BuildContextWatcherHandler
// that answers a context ending inside a query by cancelling the query on
// the server, instead of closing the connection as pgx does by default: the
// transaction stays usable, so a batch whose handler ran out of time rolls
// back to its savepoint and goes on with its other messages. A query that
// ignores the cancel for 5 seconds closes the connection after all.
func CancelQueryOnContextEnd(conn *pgconn.PgConn) ctxwatch.Handler {
	return &pgconn.CancelRequestContextWatcherHandler{Conn: conn, DeadlineDelay: 5 * time.Second}
}

// IsLockNotAvailable reports whether err is PostgreSQL's lock_timeout (or a
// NOWAIT lock) giving up: SQLSTATE 55P03.
func IsLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// complete records every message's decision in one statement; decisions is
// parallel to msgs.
func (w *Worker) complete(ctx context.Context, tx pgx.Tx, msgs []Message, decisions []decision) error {
	p := dbsqlc.InboxCompleteManyParams{
		Process:       w.cfg.Process,
		Build:         w.cfg.Build,
		Ids:           make([]int64, len(msgs)),
		Statuses:      make([]string, len(msgs)),
		Results:       make([]string, len(msgs)),
		LastErrors:    make([]string, len(msgs)),
		RetryDelaysMs: make([]int64, len(msgs)),
	}
	for i, m := range msgs {
		d := decisions[i]
		p.Ids[i], p.Statuses[i], p.Results[i], p.LastErrors[i] = m.ID, d.status, d.result, d.lastError
		p.RetryDelaysMs[i] = d.delay.Milliseconds()
		mctx := m.Context(ctx)
		switch d.status {
		case StatusDead:
			w.logger.WarnContext(mctx, "message dead", slog.String("message_id", m.MessageID),
				slog.String("message_type", m.Type), slog.Int("attempt", m.Attempt), slog.String("error", d.lastError))
		case StatusPending:
			w.logger.InfoContext(mctx, "message will be retried", slog.String("message_id", m.MessageID),
				slog.Int("attempt", m.Attempt), slog.Duration("retry_in", d.delay), slog.String("error", d.lastError))
		case outcomeWaiting:
			w.logger.InfoContext(mctx, "message waits, its attempt not counted", slog.String("message_id", m.MessageID),
				slog.Duration("retry_in", d.delay), slog.String("reason", d.lastError))
		}
	}
	if err := w.queries.InboxCompleteMany(ctx, tx, p); err != nil {
		return fmt.Errorf("record outcomes: %w", err)
	}
	return nil
}

// storable makes a handler's result or error text safe for a text column
// (valid UTF-8, no NUL), so that no message text can fail the statement that
// records a whole batch, and bounds its length.
func storable(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "\uFFFD")
	if len(s) > 4096 {
		s = strings.ToValidUTF8(s[:4096], "") + "…"
	}
	return s
}
