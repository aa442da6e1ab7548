// Package startstop gives long-lived services the Start and Stop they share:
// Start returns at once and runs the service in the background; Stop first
// asks it to stop taking new work, lets the work in flight finish, and
// cancels that work too when its own context ends.
package startstop

import (
	"context"
	"errors"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
)

// ErrAlreadyStarted is returned by Start on a service that was started.
var ErrAlreadyStarted = errors.New("already started")

// Service runs one background function. The zero value is ready to use.
type Service struct {
	mu         sync.Mutex
	stopFetch  context.CancelFunc
	cancelWork context.CancelFunc
	done       chan struct{}
}

// Start runs run in a goroutine and returns at once. run gets two contexts:
// fetchCtx, which ends when ctx ends or Stop is called, bounds taking new
// work; workCtx, which ends only when Stop's context does, bounds finishing
// the work in flight. run must return soon after fetchCtx ends.
func (s *Service) Start(ctx context.Context, run func(fetchCtx, workCtx context.Context)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done != nil {
		return ErrAlreadyStarted
	}
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	fetchCtx, stopFetch := context.WithCancel(ctx)
	s.stopFetch, s.cancelWork, s.done = stopFetch, cancelWork, make(chan struct{})
	Go(func() {
		defer close(s.done)
		run(fetchCtx, workCtx)
	})
	return nil
}

// panicHandler, when set, is told about a panic of a goroutine started by
// Go (or Start) before the panic goes on.
var panicHandler atomic.Pointer[func(v any, stack []byte)]

// SetPanicHandler makes h see the value and stack of every panic of a
// goroutine started by Go or Start, before the panic goes on as usual. The
// runtime prints a panic to the process's stderr itself, past any writer
// the program puts in front of its logs: inboxd logs it through its
// redacting writer instead, and exits.
func SetPanicHandler(h func(v any, stack []byte)) { panicHandler.Store(&h) }

// Go runs f in a goroutine whose panic the panic handler sees first.
func Go(f func()) { go Guard(f)() }

// Guard returns f wrapped so that a panic of f is seen by the panic handler
// first, for goroutines started otherwise (sync.WaitGroup.Go), and for the
// main goroutine's own work.
func Guard(f func()) func() {
	return func() {
		defer func() {
			if v := recover(); v != nil {
				if h := panicHandler.Load(); h != nil {
					(*h)(v, debug.Stack())
				}
				panic(v)
			}
		}()
		f()
	}
}

// AbandonAfter is how long Stop still waits for run to return once it has
// ended workCtx: a run stuck past that (on a call that ignores its context)
// is left behind, so that a stop never overruns its grace period by more.
const AbandonAfter = time.Second

// Stop ends fetchCtx and waits for run to return. When ctx ends first, it
// ends workCtx as well and waits for run to return then, for at most
// AbandonAfter. Stop on a service never started does nothing. It reports
// whether run returned.
func (s *Service) Stop(ctx context.Context) bool {
	s.mu.Lock()
	stopFetch, cancelWork, done := s.stopFetch, s.cancelWork, s.done
	s.mu.Unlock()
	if done == nil {
		return true
	}
	defer cancelWork()
	stopFetch()
	select {
	case <-done:
		return true
	case <-ctx.Done():
	}
	cancelWork()
	select {
	case <-done:
		return true
	case <-time.After(AbandonAfter):
		return false
	}
}

// StopOrLog is Stop for a service that has nothing to add: when run did not
// return, it logs so on logger, at error level, and returns.
func (s *Service) StopOrLog(ctx context.Context, logger *slog.Logger) {
	if !s.Stop(ctx) {
		logger.ErrorContext(ctx, "did not stop within the grace period; left behind")
	}
}
