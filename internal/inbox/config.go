package inbox

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/tracing"
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
	// Now, when set, is the clock the claim lease and the retry delays are
	// measured against; tests set it forward instead of sleeping past a
	// lease or a delay. Nil, as the service leaves it, means the database's
	// clock (now()).
	Now func() time.Time
	// FloorKeptElsewhere leaves the inbox's claim floor to a keeper run
	// elsewhere (claimfloor.InboxKeeper, run by the elected leader: see
	// internal/pipeline). When false, the worker raises the floor itself.
	FloorKeptElsewhere bool
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
