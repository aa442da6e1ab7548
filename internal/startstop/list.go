package startstop

import (
	"context"
	"sync"
)

// Startable is a long-lived part of a process: Start returns at once and
// runs it in the background, Stop returns once it has stopped (see Service
// for what ctx bounds).
type Startable interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context)
}

// StartAll starts services in order. When one fails to start, it stops the
// ones it started, in reverse order, with their work cancelled at once, and
// returns that error: nothing is left running.
func StartAll(ctx context.Context, services ...Startable) error {
	for i, s := range services {
		if err := s.Start(ctx); err != nil {
			stopCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
			cancel()
			StopAll(stopCtx, services[:i]...)
			return err
		}
	}
	return nil
}

// StopAll stops services in the reverse of the order StartAll started them,
// each once the ones after it have stopped.
func StopAll(ctx context.Context, services ...Startable) {
	for i := len(services) - 1; i >= 0; i-- {
		services[i].Stop(ctx)
	}
}

// stopAllParallel stops services at once and returns when all have stopped.
func stopAllParallel(ctx context.Context, services ...Startable) {
	var wg sync.WaitGroup
	for _, s := range services {
		wg.Go(func() { s.Stop(ctx) })
	}
	wg.Wait()
}

// Parallel returns a Startable that starts services in order, as StartAll
// does, and stops them all at once, as stopAllParallel does.
func Parallel(services ...Startable) Startable { return parallel(services) }

type parallel []Startable

func (p parallel) Start(ctx context.Context) error { return StartAll(ctx, p...) }
func (p parallel) Stop(ctx context.Context)        { stopAllParallel(ctx, p...) }

// Func returns a Startable that runs run in the background until Start's
// ctx ends or Stop is called. run must return soon after its context ends.
func Func(run func(ctx context.Context)) Startable {
	return &funcService{run: run}
}

type funcService struct {
	run     func(ctx context.Context)
	service Service
}

func (f *funcService) Start(ctx context.Context) error {
	return f.service.Start(ctx, func(fetchCtx, _ context.Context) { f.run(fetchCtx) })
}

func (f *funcService) Stop(ctx context.Context) { f.service.Stop(ctx) }
