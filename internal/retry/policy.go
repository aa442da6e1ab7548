package retry

import (
	"context"
	"log/slog"
	"time"
)

// Policy bounds the delays of one kind of retry: Base before the first
// retry, doubled per failure in a row up to Max, jittered (see Backoff).
type Policy struct {
	Base, Max time.Duration
}

// Delay returns the delay before retry number failures (1-based).
func (p Policy) Delay(failures int) time.Duration { return Backoff(failures, p.Base, p.Max) }

// The policies the services share. Each loop names the one it follows, so
// that the bounds of every retry in the process are read here.
var (
	// Session is how long a service waits before it opens a connection
	// again after its session (a broker connection, a LISTEN connection, a
	// liveness session) ended: 200 ms, up to 15 s.
	Session = Policy{Base: 200 * time.Millisecond, Max: 15 * time.Second}
	// Transient is how long a loop waits after a statement or a batch
	// failed for a reason that is not its input's (the database away, a
	// timeout): 100 ms, up to 10 s.
	Transient = Policy{Base: 100 * time.Millisecond, Max: 10 * time.Second}
	// Statement is how long a caller waits before it runs again one
	// statement whose batch has otherwise committed, within the deadline
	// it already has: 50 ms, up to 1 s.
	Statement = Policy{Base: 50 * time.Millisecond, Max: time.Second}
)

// SessionResetAfter is how long a session must have lasted for the next
// reconnect to start from Session.Base again.
const SessionResetAfter = time.Minute

// Failures counts a loop's failures in a row and backs off after each one
// by its Policy. The zero value of a Failures with a Policy is ready.
type Failures struct {
	Policy Policy
	n      int
}

// Reset records a success: the next failure waits Policy.Base again.
func (f *Failures) Reset() { f.n = 0 }

// Count returns the failures in a row so far.
func (f *Failures) Count() int { return f.n }

// Next records one failure and returns the delay before the next try.
func (f *Failures) Next() time.Duration {
	f.n++
	return f.Policy.Delay(f.n)
}

// Wait records one failure of err, logs msg at error level with the error
// and the delay, and sleeps that long. It returns false without logging when
// ctx has ended, and false when ctx ends during the sleep.
func (f *Failures) Wait(ctx context.Context, logger *slog.Logger, msg string, err error, attrs ...any) bool {
	if ctx.Err() != nil {
		return false
	}
	delay := f.Next()
	logger.ErrorContext(ctx, msg, append([]any{slog.String("error", err.Error()), slog.Duration("retry_in", delay)}, attrs...)...)
	return Sleep(ctx, delay)
}
