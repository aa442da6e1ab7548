package inbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// takeover takes over messages whose last claim never ended: the process
// died, or lost its database connection, while handling them. A message
// that loses its claim for the first time in its run is taken over with the
// others like it, a batch at a time, beside the other work; one that lost a
// claim before is handled alone. Once such a message has used up its
// attempts it is marked dead without running (see decide).
//
// Its locking rule, exclusive, is the one rule between a Worker's batches:
// a message that lost a claim before (it may be what killed a process) is
// handled while no other work of this Worker is in flight, so that if it
// kills the process again it costs no other message an attempt. Every other
// batch, of new messages (Worker.runBatch) or of messages that lost their
// first claim, runs on the shared side (shared); the messages handled alone
// run on the exclusive side (alone), for a run of such messages at a time
// (up to takeOverSlice) rather than once each.
//
// The exclusive side never waits for a slow batch: it is taken only once no
// batch is in flight. While the takeover waits for that (up to
// takeOverSlice, then again at its next tick), a batch about to start first
// gives it up to yieldWait to get in; so a message handled alone delays the
// other batches by at most that, and a slow batch delays only itself (Go's
// RWMutex alone would hold every new batch back behind the waiting writer
// for as long as the slow batch runs).
type takeover struct {
	exclusive sync.RWMutex
	// wanted is set while alone waits for the exclusive side.
	wanted atomic.Bool

	batchSize int
	interval  time.Duration
	logger    *slog.Logger
	// claim claims and handles up to max unfinished messages (only those
	// that lost no claim before in their run, with firstLossOnly) and
	// returns how many it claimed.
	claim func(ctx context.Context, firstLossOnly bool, max int) (int, error)
	// waiting reports whether a message waits to be taken over.
	waiting func(ctx context.Context) (bool, error)
}

// takeOverSlice bounds how long the takeover holds the worker's other work
// paused in one go; with more to take over, it lets the batches in line run
// and goes on.
const takeOverSlice = time.Second

// yieldWait is the longest a batch about to start waits for a takeover that
// wants the exclusive side.
const yieldWait = 20 * time.Millisecond

// shared runs step, one batch, on the shared side of exclusive: beside any
// other batch, never while a message is handled alone.
func (t *takeover) shared(step func() (int, error)) (int, error) {
	for end := time.Now().Add(yieldWait); t.wanted.Load() && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	t.exclusive.RLock()
	defer t.exclusive.RUnlock()
	return step()
}

// lockAlone takes the exclusive side once no batch is in flight, without
// holding new batches back (but for yieldWait each), and gives up after
// takeOverSlice or when ctx ends. It reports whether it took it.
func (t *takeover) lockAlone(ctx context.Context) bool {
	t.wanted.Store(true)
	defer t.wanted.Store(false)
	for end := time.Now().Add(takeOverSlice); !t.exclusive.TryLock(); {
		if ctx.Err() != nil || time.Now().After(end) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// alone takes over, on the exclusive side of exclusive, the messages that
// lost a claim before, one at a time, for up to takeOverSlice. It returns
// how many it handled and whether it stopped with more to do. When batches
// kept the exclusive side busy, it handles none, and the loop tries again
// at its next tick.
func (t *takeover) alone(ctx context.Context) (taken int, more bool, err error) {
	if !t.lockAlone(ctx) {
		return 0, false, nil
	}
	defer t.exclusive.Unlock()
	for end := time.Now().Add(takeOverSlice); time.Now().Before(end); taken++ {
		n, err := t.claim(ctx, false, 1)
		if err != nil || n == 0 {
			return taken, false, err
		}
	}
	return taken, true, nil
}

// loop runs the takeover on a timer of its own, every interval, however
// busy the other goroutines are: a backlog draining never delays a crashed
// process's messages, and the later messages of their orders, past a tick
// once the process is known dead (its liveness session ended), or past
// their lease.
func (t *takeover) loop(fetchCtx, workCtx context.Context) {
	tick := time.NewTicker(t.interval)
	defer tick.Stop()
	failures := retry.Failures{Policy: retry.Transient}
	for {
		select {
		case <-fetchCtx.Done():
			return
		case <-tick.C:
		}
		for more := true; more && fetchCtx.Err() == nil; {
			var taken int
			var err error
			taken, more, err = t.run(workCtx)
			if taken > 0 {
				failures.Reset() // the database answers: a failure now is one message's
			}
			if err != nil {
				failures.Wait(fetchCtx, t.logger, "take over unfinished messages", err)
				break
			}
			failures.Reset()
		}
	}
}

// run is one step of loop: it takes over the messages that lost their
// first claim, in batches, then the others one at a time (see alone). It
// returns how many it handled and whether it stopped with more to do.
func (t *takeover) run(ctx context.Context) (taken int, more bool, err error) {
	for {
		n, err := t.shared(func() (int, error) { return t.claim(ctx, true, t.batchSize) })
		taken += n
		if err != nil {
			return taken, false, err
		}
		if n < t.batchSize {
			break
		}
	}
	// The pause of alone waits for the batches in flight: only for a reason.
	if waiting, err := t.waiting(ctx); err != nil || !waiting {
		return taken, false, err
	}
	n, more, err := t.alone(ctx)
	return taken + n, more, err
}

// claimUnfinished claims up to max unfinished messages (only those that
// lost no claim before in their run, with firstLossOnly) and handles them.
func (w *Worker) claimUnfinished(ctx context.Context, firstLossOnly bool, max int) (int, error) {
	// Its own lost claims first: they are not the takeover's to count.
	if err := w.giveBack(ctx); err != nil {
		return 0, err
	}
	rows, err := w.queries.InboxClaimUnfinished(ctx, w.pool, dbsqlc.InboxClaimUnfinishedParams{
		Now:           w.now(),
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
	return len(rows), w.work(ctx, claimsOf(rows, true))
}

// hasUnfinished reports whether a message waits to be taken over.
func (w *Worker) hasUnfinished(ctx context.Context) (bool, error) {
	return w.queries.InboxHasUnfinished(ctx, w.pool, dbsqlc.InboxHasUnfinishedParams{
		Now: w.now(), LeaseSeconds: w.cfg.ClaimLease.Seconds(), Session: w.live.session(),
	})
}

// now is the time the claim lease and the retry delays are measured
// against: nil, the database's clock, unless a test set a clock.
func (w *Worker) now() *time.Time {
	if w.cfg.Now == nil {
		return nil
	}
	t := w.cfg.Now()
	return &t
}
