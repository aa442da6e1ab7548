package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
)

// side is what a run of a paired scenario (domain, steady) measures: inboxd,
// or the simplest inbox on the same traffic.
type side int

const (
	sideInboxd side = iota
	sideSimplest
)

func (s side) String() string {
	if s == sideSimplest {
		return "simplest inbox"
	}
	return "inboxd"
}

// pairOrder returns the sides of the next pair in the order they run:
// inboxd alone with -ruler=false; else inboxd first in every other pair,
// counted over the whole invocation, so that neither always runs on the
// machine the other has just warmed (or loaded).
func (r *report) pairOrder(o *options) []side {
	if !o.ruler {
		return []side{sideInboxd}
	}
	r.pairs++
	if r.pairs%2 == 0 {
		return []side{sideSimplest, sideInboxd}
	}
	return []side{sideInboxd, sideSimplest}
}

// roundOf labels a row with its round when there are several.
func roundOf(o *options, round int) string {
	if o.rounds < 2 {
		return ""
	}
	return fmt.Sprintf(" [round %d of %d]", round+1, o.rounds)
}

// startSide starts the side s on the env e: a real inboxd process, waited
// for until ready (with -without's promises then turned off), or the
// simplest inbox in this process. It returns the context to wait under (it
// ends early when the simplest inbox fails), the func that stops what it
// started, once however often it is called, and returns the simplest
// inbox's failure, if any, and the inboxd process's pid (0 for the
// simplest inbox).
func startSide(ctx context.Context, o *options, e *benchEnv, s side) (context.Context, func() error, int, error) {
	if s == sideSimplest {
		ruler, err := startSimplest(ctx, e.dbURL, e.amqpURL)
		if err != nil {
			return nil, nil, 0, err
		}
		return ruler.ctx, sync.OnceValue(ruler.stop), 0, nil
	}
	svc, _, err := e.serve(ctx, o)
	if err != nil {
		return nil, nil, 0, err
	}
	if err := turnOff(ctx, e.pool, o.without); err != nil {
		svc.stop()
		return nil, nil, 0, err
	}
	return ctx, sync.OnceValue(func() error { svc.stop(); return nil }), svc.cmd.Process.Pid, nil
}

// failedSide stops a side after a wait on it failed with err, and returns
// the side's own failure when it has one (the wait ended because of it),
// else err.
func failedSide(stop func() error, err error) error {
	if stopErr := stop(); stopErr != nil {
		return stopErr
	}
	return err
}

// sideCounts are the queries a scenario waits with (see waitCount).
type sideCounts struct {
	processed, lastProcessed, published, lastPublished string
}

// countsOf returns the counts of side s's tables: the simplest inbox has no
// status column.
func countsOf(s side) sideCounts {
	c := sideCounts{processed: countProcessed, lastProcessed: lastProcessed, published: countPublished, lastPublished: lastPublished}
	if s == sideSimplest {
		c.processed = countSimplestProcessed
	}
	return c
}

// countSimplestProcessed is countProcessed of the simplest inbox.
const countSimplestProcessed = "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL"

// spread gives the median of xs and their range.
func spread(xs []float64) string {
	s := slices.Sorted(slices.Values(xs))
	return fmt.Sprintf("median %.0f (%.0f to %.0f)", median(s), s[0], s[len(s)-1])
}

// spreadRatio is spread for ratios.
func spreadRatio(xs []float64) string {
	s := slices.Sorted(slices.Values(xs))
	return fmt.Sprintf("median %.2f (%.2f to %.2f)", median(s), s[0], s[len(s)-1])
}

// median returns the median of sorted.
func median(sorted []float64) float64 {
	n := len(sorted)
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}
