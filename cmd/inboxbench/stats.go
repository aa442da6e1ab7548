package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
)

// report collects the suite's results, one row each.
type report struct {
	rows              [][2]string
	core, passthrough float64
	// pairs counts the runs of inboxd and the simplest inbox side by side,
	// to alternate which goes first (pairOrder).
	pairs int
	// domainPublished and domainProcessed are scenario 2's orders/s to the
	// last event published and to the last processed; domainRuler is
	// scenario 9's.
	domainPublished, domainProcessed, domainRuler float64
}

func (r *report) add(name, format string, args ...any) {
	r.rows = append(r.rows, [2]string{name, fmt.Sprintf(format, args...)})
}

func (r *report) describeMachine(ctx context.Context, o *options) error {
	conn, err := pgx.Connect(ctx, o.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	var pgVersion, fsync, syncCommit, autovacuum, sharedBuffers string
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit'),
	                                     current_setting('autovacuum'), current_setting('shared_buffers')`).
		Scan(&pgVersion, &fsync, &syncCommit, &autovacuum, &sharedBuffers); err != nil {
		return err
	}
	r.add("machine", "%d CPUs, %s %s/%s; PostgreSQL %s (fsync %s, synchronous_commit %s, autovacuum %s, shared_buffers %s); persistent messages, publisher confirms, quorum queue",
		runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH, pgVersion, fsync, syncCommit, autovacuum, sharedBuffers)
	return nil
}

func (r *report) print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	for _, row := range r.rows {
		fmt.Fprintf(tw, "%s\t%s\n", row[0], row[1])
	}
	return tw.Flush()
}

// quantile returns the p-quantile of ds (which it sorts), rounded to 100 µs.
func quantile(ds []time.Duration, p float64) string {
	return quantileTo(ds, p, 100*time.Microsecond)
}

// quantileTo returns the p-quantile of ds (which it sorts), rounded to unit.
func quantileTo(ds []time.Duration, p float64, unit time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	return quantileOf(ds, p).Round(unit).String()
}

// quantileOf returns the p-quantile of ds (which it sorts), 0 when ds is
// empty.
func quantileOf(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(p*float64(len(ds))))]
}

// perWindow gives the p99 of latency for the messages published in each
// window of the run (a minute, or a fifth of a shorter run): flat, or not.
func perWindow(sent map[string]time.Time, latency map[string]time.Duration, run time.Duration) string {
	var start time.Time
	for _, at := range sent {
		if start.IsZero() || at.Before(start) {
			start = at
		}
	}
	window := min(time.Minute, max(run/5, time.Second))
	var buckets [][]time.Duration
	for id, d := range latency {
		i := int(sent[id].Sub(start) / window)
		for len(buckets) <= i {
			buckets = append(buckets, nil)
		}
		buckets[i] = append(buckets[i], d)
	}
	parts := make([]string, len(buckets))
	for i, b := range buckets {
		parts[i] = quantile(b, 0.99)
	}
	return fmt.Sprintf("%s (each %s)", strings.Join(parts, ", "), window)
}

// sinceSent returns, for each message that arrived, the time from its send
// to its arrival.
func sinceSent(sent, arrived map[string]time.Time) []time.Duration {
	var ds []time.Duration
	for id, at := range arrived {
		ds = append(ds, at.Sub(sent[id]))
	}
	return ds
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
