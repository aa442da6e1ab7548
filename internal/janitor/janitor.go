// Package janitor deletes what the service no longer needs: processed
// messages (and their attempt history and reply requests) past the retention
// window, dead ones past a longer one, published outbox rows, undeliverable
// replies and old conflict records. It also drives the key ledger, which
// remembers the ids of messages for the dedupe window whether or not their
// rows are still kept: its rotations, seals, merges and emptyings (keys.go;
// migrations/00004_inbox_keys.sql describes the ledger).
//
// It deletes in small batches, each its own short transaction that takes
// only rows nobody has locked (SKIP LOCKED), so cleanup never holds up
// ingest or the workers, and any number of janitors, in any number of
// processes, can run at once without conflict.
package janitor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/testsignal"
)

// Kinds of rows the janitor deletes, as reported to Observe and in Result.
const (
	RowsProcessed = "processed"
	RowsDead      = "dead"
	RowsPublished = "published"
	RowsConflicts = "conflicts"
	// RowsUndeliverable are replies that ended undeliverable (their
	// requester was gone), deleted after the dead retention.
	RowsUndeliverable = "undeliverable"
	// RowsReplyRequests are reply requests past the dead retention whose
	// message left without them (they leave with their message).
	RowsReplyRequests = "reply_requests"
)

// Defaults of Config, and of the retentions inboxd passes.
const (
	IntervalDefault      = time.Minute
	BatchSizeDefault     = 1000
	RetentionDefault     = 24 * time.Hour
	DeadRetentionDefault = 30 * 24 * time.Hour
	DedupeWindowDefault  = 84 * time.Hour
	MergeBytesDefault    = 64 << 20
)

// Config configures a Janitor.
type Config struct {
	// Logger receives the janitor's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Retention is how long processed messages, published outbox rows and
	// conflict records are kept. Required.
	Retention time.Duration
	// DeadRetention is how long dead messages are kept, unless an operator
	// asked for a replay. At least Retention. Required.
	DeadRetention time.Duration
	// DedupeWindow is how long the key ledger remembers a message id after
	// its row was stored. Messages stored before the ledger started are
	// kept for at least this long too, whatever the retentions, until the
	// ledger has covered a whole window. Defaults to 84 hours.
	DedupeWindow time.Duration
	// Interval is the time between two cleanups. Defaults to 1 minute.
	Interval time.Duration
	// BatchSize is the most rows one delete statement removes. Defaults to
	// 1000.
	BatchSize int
	// MergeBytes is about how much of a sealed hot part of the key ledger
	// one merge transaction copies into its slot (a range of its hash
	// buckets holding that much of the part's heap). Defaults to 64 MiB:
	// some 900,000 keys, seconds, well under INBOX_STATEMENT_TIMEOUT.
	MergeBytes int64
	// Observe, when set, is told how many rows of each kind each batch
	// deleted, and how long the batch took. It must not block.
	Observe func(rows string, n int, took time.Duration)
	// Now, when set, is the clock the retentions, the key ledger's window
	// check and its rotations are measured against, read once per cleanup;
	// tests set it forward instead of backdating rows. Nil, as the service
	// leaves it, means the database's clock. The hot parts' times (how long
	// one has waited sealed or merged, a gauge) are always the database's.
	Now func() time.Time
}

func (c *Config) withDefaults() (*Config, error) {
	out := *c
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.Interval = cmp.Or(out.Interval, IntervalDefault)
	out.BatchSize = cmp.Or(out.BatchSize, BatchSizeDefault)
	out.DedupeWindow = cmp.Or(out.DedupeWindow, DedupeWindowDefault)
	out.MergeBytes = cmp.Or(out.MergeBytes, MergeBytesDefault)
	switch {
	case out.Retention <= 0:
		return nil, errors.New("janitor: Retention must be positive")
	case out.DeadRetention < out.Retention:
		return nil, fmt.Errorf("janitor: DeadRetention (%s) must be at least Retention (%s)", out.DeadRetention, out.Retention)
	case out.DedupeWindow < 0:
		return nil, errors.New("janitor: DedupeWindow must be positive")
	case out.Interval < 0:
		return nil, errors.New("janitor: Interval must be positive")
	case out.BatchSize < 1:
		return nil, fmt.Errorf("janitor: BatchSize must be at least 1, got %d", out.BatchSize)
	case out.MergeBytes < 1:
		return nil, fmt.Errorf("janitor: MergeBytes must be at least 1, got %d", out.MergeBytes)
	}
	return &out, nil
}

// Result counts the rows one cleanup deleted, by kind.
type Result map[string]int64

// Janitor deletes rows past their retention; see the package documentation.
type Janitor struct {
	pool    *pgxpool.Pool
	cfg     *Config
	logger  *slog.Logger
	queries *dbsqlc.Queries
	service startstop.Service

	// TestSignals tell a test what the running service did; they are off
	// unless a test initializes them.
	TestSignals TestSignals
}

// TestSignals are the janitor's signals to tests.
type TestSignals struct {
	// CleanedUp carries what each cleanup of the running service deleted.
	CleanedUp testsignal.Signal[Result]
}

// New returns a Janitor that deletes through pool, which it uses one
// connection of at a time.
func New(pool *pgxpool.Pool, cfg *Config) (*Janitor, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Janitor{
		pool:    pool,
		cfg:     c,
		logger:  c.Logger.With(slog.String("component", "janitor")),
		queries: dbsqlc.New(),
	}, nil
}

// Start runs a cleanup at once and then every Interval, until ctx ends or
// Stop is called (Run, in the background). It returns at once.
func (j *Janitor) Start(ctx context.Context) error {
	return j.service.Start(ctx, func(fetchCtx, _ context.Context) { j.Run(fetchCtx) })
}

// Run runs a cleanup at once and then every Interval, until ctx ends.
func (j *Janitor) Run(ctx context.Context) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	failures := retry.Failures{Policy: retry.Policy{Base: time.Second, Max: j.cfg.Interval}}
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		next := j.cfg.Interval
		res, err := j.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			next = min(next, failures.Next())
			j.logger.Error("cleanup failed", slog.String("error", err.Error()), slog.Duration("retry_in", next))
		default:
			failures.Reset()
			j.TestSignals.CleanedUp.Signal(res)
		}
		timer.Reset(next)
	}
}

// Stop ends the cleanup in progress between two batches and waits for it.
func (j *Janitor) Stop(ctx context.Context) {
	j.service.StopOrLog(ctx, j.logger)
}

// tendHotParts moves the key ledger's sealed hot part into its slot and
// empties it (MergeKeys, EmptyKeys), so that a rotation or a seal
// finds the other part empty. The merge goes a range of buckets at a time, each its own
// transaction, pausing between two as long as the last took. A part that
// cannot be emptied at once (a statement reads it) is logged and emptied
// at a later cleanup; its keys are in their slot meanwhile.
func (j *Janitor) tendHotParts(ctx context.Context) error {
	empty := func() error {
		switch emptied, err := EmptyKeys(ctx, j.pool, KeysLockWaitDefault); {
		case err != nil && ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			j.logger.Warn("key ledger: emptying a merged hot part failed, trying again at the next cleanup", slog.String("error", err.Error()))
		case emptied:
			j.logger.Debug("key ledger: merged hot part emptied")
		}
		return nil
	}
	if err := empty(); err != nil {
		return err
	}
	started := time.Now()
	merged, ranges := int64(0), 0
	for {
		rangeStarted := time.Now()
		n, merging, err := MergeKeys(ctx, j.pool, j.cfg.MergeBytes)
		switch {
		case err != nil && ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			// The deletes go on; the part stays sealed, its keys found
			// there, and the merge goes on from its last range.
			j.logger.Error("key ledger: merging the sealed hot part failed, trying again at the next cleanup",
				slog.String("error", err.Error()), slog.Int64("keys_merged", merged))
			return nil
		case !merging && ranges == 0:
			return nil // no part sealed, or another janitor merging it
		case !merging:
			// Merged, unless another janitor has taken the last ranges:
			// then emptying finds nothing yet, and a later cleanup does.
			j.logger.Info("key ledger: sealed hot part copied into its slot", slog.Int64("keys", merged), slog.Int("ranges", ranges),
				slog.Duration("took", time.Since(started)))
			return empty()
		}
		merged, ranges = merged+n, ranges+1
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Since(rangeStarted)):
		}
	}
}

// RunOnce tends the key ledger (merges a sealed hot part into its slot,
// rotates the generations if a rotation is due, seals the hot part if it
// has grown), forgets the session keys of ended processes, then deletes, batch after batch, every row past its
// retention, and returns how many of each kind it deleted. Between two batches it pauses as long as the last one
// took. It stops between batches when ctx ends. A rotation that fails (its
// locks were not free at once) is logged and tried again the next time.
func (j *Janitor) RunOnce(ctx context.Context) (Result, error) {
	window := j.cfg.DedupeWindow.Seconds()
	// The cleanup's clock: nil, the database's.
	var now *time.Time
	if j.cfg.Now != nil {
		t := j.cfg.Now()
		now = &t
	}
	if err := j.tendHotParts(ctx); err != nil {
		return Result{}, err
	}
	switch generation, err := RotateKeys(ctx, j.pool, j.cfg.DedupeWindow, KeysLockWaitDefault, now); {
	case err != nil && ctx.Err() != nil:
		return Result{}, ctx.Err()
	case err != nil:
		j.logger.Warn("key ledger rotation failed, trying again at the next cleanup", slog.String("error", err.Error()))
	case generation > 0:
		j.logger.Info("key ledger rotated", slog.Int64("generation", generation))
	}
	switch sealed, err := SealKeys(ctx, j.pool, SealRatioDefault, SealMinBytesDefault, KeysLockWaitDefault); {
	case err != nil && ctx.Err() != nil:
		return Result{}, ctx.Err()
	case err != nil:
		j.logger.Warn("key ledger: sealing the hot part failed, trying again at the next cleanup", slog.String("error", err.Error()))
	case sealed:
		j.logger.Info("key ledger: hot part sealed, to be merged into its slot")
	}
	// The session keys of processes that have ended (one a process start).
	if _, err := j.queries.InboxSessionsForget(ctx, j.pool); err != nil {
		return Result{}, fmt.Errorf("forget ended sessions: %w", err)
	}
	retention, dead := j.cfg.Retention.Seconds(), j.cfg.DeadRetention.Seconds()
	// Rows stored before the ledger started are the only record of their
	// ids: they stay for the window, until the ledger has covered one.
	covered, err := j.queries.JanitorKeysCoverWindow(ctx, j.pool, dbsqlc.JanitorKeysCoverWindowParams{Now: now, DedupeWindowSeconds: window})
	if err != nil {
		return Result{}, fmt.Errorf("read the key ledger's start: %w", err)
	}
	if !covered {
		retention, dead = max(retention, window), max(dead, window)
	}
	limit := int32(j.cfg.BatchSize)
	kinds := []struct {
		rows   string
		delete func(context.Context) (int64, error)
	}{
		{RowsProcessed, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeleteProcessed(ctx, j.pool, dbsqlc.JanitorDeleteProcessedParams{Now: now, OlderThanSeconds: retention, MaxRows: limit})
		}},
		{RowsDead, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeleteDead(ctx, j.pool, dbsqlc.JanitorDeleteDeadParams{Now: now, OlderThanSeconds: dead, MaxRows: limit})
		}},
		{RowsPublished, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeletePublished(ctx, j.pool, dbsqlc.JanitorDeletePublishedParams{Now: now, OlderThanSeconds: retention, MaxRows: limit})
		}},
		{RowsConflicts, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeleteConflicts(ctx, j.pool, dbsqlc.JanitorDeleteConflictsParams{Now: now, OlderThanSeconds: retention, MaxRows: limit})
		}},
		{RowsUndeliverable, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeleteUndeliverable(ctx, j.pool, dbsqlc.JanitorDeleteUndeliverableParams{Now: now, OlderThanSeconds: dead, MaxRows: limit})
		}},
		{RowsReplyRequests, func(ctx context.Context) (int64, error) {
			return j.queries.JanitorDeleteReplyRequests(ctx, j.pool, dbsqlc.JanitorDeleteReplyRequestsParams{Now: now, OlderThanSeconds: dead, MaxRows: limit})
		}},
	}
	res := Result{}
	started := time.Now()
	for _, k := range kinds {
		for ctx.Err() == nil {
			batchStarted := time.Now()
			n, err := k.delete(ctx)
			if err != nil {
				return res, fmt.Errorf("delete %s rows: %w", k.rows, err)
			}
			res[k.rows] += n
			if n > 0 && j.cfg.Observe != nil {
				j.cfg.Observe(k.rows, int(n), time.Since(batchStarted))
			}
			if n < int64(limit) {
				break
			}
			// There is more. Pause as long as the batch took, so that a
			// large backlog is worked off at no more than half of one
			// connection's time, leaving the database to ingest and the
			// workers.
			if !retry.Sleep(ctx, time.Since(batchStarted)) {
				break
			}
		}
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	if res[RowsProcessed]+res[RowsDead]+res[RowsPublished]+res[RowsConflicts]+res[RowsUndeliverable]+res[RowsReplyRequests] > 0 {
		j.logger.Info("cleanup done",
			slog.Int64("processed", res[RowsProcessed]), slog.Int64("dead", res[RowsDead]),
			slog.Int64("published", res[RowsPublished]), slog.Int64("conflicts", res[RowsConflicts]),
			slog.Int64("undeliverable", res[RowsUndeliverable]), slog.Int64("reply_requests", res[RowsReplyRequests]),
			slog.Duration("took", time.Since(started)))
	}
	return res, nil
}
