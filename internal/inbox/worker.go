package inbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// Statuses of an inbox row.
const (
	StatusPending   = "pending"
	StatusProcessed = "processed"
	StatusDead      = "dead"
)

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

	// takeover owns the rule that lets a batch run beside the others or
	// alone: every batch runs through it.
	takeover *takeover

	live *liveness
	// floor raises the claim floor the claims scan from; nil when it is
	// kept elsewhere (FloorKeptElsewhere).
	floor *claimfloor.Keeper
	// lost holds the claims to give back before the next claim.
	lost lostClaims
	// waits bounds the log lines of waiting messages.
	waits waitLog
	// answerCursor is the last reply request answerLeft looked at.
	answerCursor atomic.Int64
	service      startstop.Service
}

// NewWorker returns a Worker that claims from the inbox through pool. The
// pool should have at least cfg.Concurrency connections of its own.
func NewWorker(pool *pgxpool.Pool, cfg *WorkerConfig) (*Worker, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	w := &Worker{
		pool:    pool,
		cfg:     c,
		logger:  c.Logger.With(slog.String("component", "inbox.worker")),
		queries: dbsqlc.New(),
		wake:    make(chan struct{}, 1),
		live:    newLiveness(),
	}
	if !c.FloorKeptElsewhere {
		w.floor = claimfloor.InboxKeeper(pool, w.logger)
	}
	w.takeover = &takeover{
		batchSize: c.BatchSize,
		interval:  c.PollInterval,
		logger:    w.logger,
		claim:     w.claimUnfinished,
		waiting:   w.hasUnfinished,
	}
	return w, nil
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
		live.Go(startstop.Guard(func() { w.live.hold(liveCtx, w.pool.Config().ConnConfig, w.logger) }))
		defer func() { endLiveness(); live.Wait() }()
		w.live.waitFirst(fetchCtx, livenessIdleLimit)
		var wg sync.WaitGroup
		for i := range w.cfg.Concurrency {
			wg.Go(startstop.Guard(func() { w.loop(fetchCtx, workCtx, i) }))
		}
		wg.Go(startstop.Guard(func() { w.takeover.loop(fetchCtx, workCtx) }))
		wg.Go(startstop.Guard(func() { w.answerLoop(fetchCtx, w.cfg.PollInterval) }))
		if w.floor != nil {
			wg.Go(startstop.Guard(func() { w.floor.Run(fetchCtx) }))
		}
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

// loop is one claim goroutine: it runs runBatch again at once while there
// is work, and otherwise waits for a wake-up or the next poll.
func (w *Worker) loop(fetchCtx, workCtx context.Context, n int) {
	logger := w.logger.With(slog.Int("worker", n))
	poll := time.NewTicker(w.cfg.PollInterval)
	defer poll.Stop()
	failures := retry.Failures{Policy: retry.Transient}
	for fetchCtx.Err() == nil {
		w.logEndedWaits()
		claimed, err := w.runBatch(workCtx)
		if err != nil {
			if !failures.Wait(fetchCtx, logger, "work batch failed", err) {
				return
			}
			continue
		}
		failures.Reset()
		switch {
		case claimed == w.cfg.BatchSize:
			w.Notify() // there is more: let another goroutine join in
			continue
		case claimed > 0:
			continue // there may be more
		}
		select {
		case <-fetchCtx.Done():
			return
		case <-w.wake:
		case <-poll.C:
		}
	}
}

// logEndedWaits logs, once, each reason messages waited for that no wait
// has come for in a while, with the waits not logged (see waitLog).
func (w *Worker) logEndedWaits() {
	for _, e := range w.waits.ended(time.Now()) {
		w.logger.Info("messages no longer wait for this reason", slog.String("reason", e.reason),
			slog.Int("waits_not_logged", e.notLogged))
	}
}

// RunOnce runs one step of each of the worker's loops, the very steps
// Start's goroutines run: it claims one batch of due messages, handles it
// and commits (runBatch, the step of each claim goroutine), and when there
// was none, takes over unfinished messages (takeover.run, the step of the
// takeover goroutine). It returns how many messages it claimed. Tests and
// benchmarks call it to drive the worker step by step.
//
// The claim is one statement that commits at once: it counts an attempt for
// each row and marks the rows claimed. Then a transaction locks the rows (FOR
// UPDATE), runs the handler and records each outcome, which ends the claim;
// the handler's effects and the outcomes commit together. Because the
// attempt was committed first, a message whose handling kills the process
// still uses up its attempts, and ends dead instead of crash-looping.
func (w *Worker) RunOnce(ctx context.Context) (int, error) {
	n, err := w.runBatch(ctx)
	if err != nil || n > 0 {
		return n, err
	}
	if n, _, err = w.takeover.run(ctx); err != nil {
		return n, err
	}
	_, err = w.answerLeft(ctx)
	return n, err
}

// runBatch claims and handles one batch of messages nobody has claimed,
// beside the other batches (see takeover).
func (w *Worker) runBatch(ctx context.Context) (int, error) {
	return w.takeover.shared(func() (int, error) { return w.claimNew(ctx) })
}

func (w *Worker) claimNew(ctx context.Context) (int, error) {
	if err := w.giveBack(ctx); err != nil {
		return 0, err
	}
	rows, err := w.queries.InboxClaimBatch(ctx, w.pool, dbsqlc.InboxClaimBatchParams{
		Process: w.cfg.Process,
		Build:   w.cfg.Build,
		MaxRows: int32(w.cfg.BatchSize),
		Session: w.live.session(),
		Now:     w.now(),
	})
	if err != nil {
		return 0, fmt.Errorf("claim inbox batch: %w", err)
	}
	return len(rows), w.work(ctx, claimsOf(rows, false))
}
