// Command inboxbench is the benchmark suite: on this machine's PostgreSQL
// and RabbitMQ, each scenario in a fresh schema and virtual host, it
// measures
//
//  1. the core path (ingest and workers in this process, a handler that
//     does nothing): messages per second from publish to processed;
//  2. the whole domain: a real inboxd process, orders per second to the last
//     event published, against the simplest correct inbox on the same
//     traffic (simplest.go) in the same run;
//  3. ingest alone and the workers alone;
//  4. latency from publish to processed commit at a steady rate (p50, p99,
//     p99.9), against the simplest inbox at the same rate, and
//  5. inboxd's memory over that run;
//  6. the claim's cost as processed rows pile up (0, 1M, 10M);
//  7. the same messages through the broker alone, acked and nothing else:
//     the ceiling (1) is compared with;
//  8. a real inboxd draining a backlog, without and with 200 clients
//     probing /readyz in a loop: what readiness probes cost the workers;
//     The same with 200 clients scraping /metrics in a loop.
//  9. the same while 200 clients flood the status page's API: how fast
//     /healthz and /readyz are answered meanwhile.
//
// Messages are persistent and published with confirms to a quorum queue.
//
// Usage:
//
//	inboxbench -inboxd bin/inboxd [-only core,domain] [-messages 100000]
//
// `make bench` builds both binaries and runs the whole suite against the
// local services; BENCHMARKS.md holds its results and method.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "inboxbench: %v\n", err)
		os.Exit(1)
	}
}

type options struct {
	inboxd         string
	databaseURL    string
	amqpURL        string
	adminURL       string
	messages       int
	publishers     int
	window         int
	timeout        time.Duration
	keep           bool
	partitionRuns  string
	snapshotRate   float64
	snapshotHold   time.Duration
	windowRate     float64
	windowDuration time.Duration
	windowKeys     int
	windowPrewarm  bool
	preload        bool
	skus           int
	serviceEnv     string
	only           []string
	steadyRate     float64
	steadyDuration time.Duration
	replyDuration  time.Duration
	claimRows      []int
	probeClients   int
	probeMessages  int
	cpuProfile     string
	viewsBefore    string
	ruler          bool
	rounds         int
	// without are the promises turned off in inboxd's schema (promisesOff).
	without []string
}

// scenarios lists what the suite measures, in the order it runs them.
var scenarios = []struct {
	name string
	run  func(context.Context, *options, *report) error
	// optIn scenarios run only when -only names them.
	optIn bool
}{
	{name: "core", run: benchCore},
	{name: "passthrough", run: benchPassthrough},
	{name: "split", run: benchIngestAndWorker},
	{name: "domain", run: benchDomain},
	{name: "domainruler", run: benchDomainRuler},
	{name: "steady", run: benchSteady},
	{name: "claim", run: benchClaim},
	{name: "probes", run: benchProbes},
	{name: "scrapes", run: benchScrapes},
	{name: "flood", run: benchFlood},
	{name: "reply", run: benchReply},
	{name: "partitions", run: benchPartitions},
	{name: "snapshot", run: benchSnapshot},
	{name: "window", run: benchWindow, optIn: true}, // loads 100 M keys: 20 minutes
	{name: "views", run: benchViews, optIn: true},   // needs -views-before
}

// run parses args, runs the scenarios chosen, and prints the report to
// stdout.
func run(ctx context.Context, args []string, stdout io.Writer) error {
	o, err := parseFlags(args)
	if err != nil {
		return err
	}
	if o.cpuProfile != "" {
		stop, err := startCPUProfile(o.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()

	r := &report{}
	if err := r.describeMachine(ctx, o); err != nil {
		return err
	}
	for _, sc := range scenarios {
		if o.only != nil && !slices.Contains(o.only, sc.name) || o.only == nil && sc.optIn {
			continue
		}
		fmt.Fprintf(os.Stderr, "inboxbench: %s...\n", sc.name)
		started := time.Now()
		if err := sc.run(ctx, o, r); err != nil {
			return fmt.Errorf("%s: %w", sc.name, err)
		}
		fmt.Fprintf(os.Stderr, "inboxbench: %s took %s\n", sc.name, time.Since(started).Round(time.Second))
	}
	return r.print(stdout)
}

// parseFlags reads the options from the command line.
func parseFlags(args []string) (*options, error) {
	o := &options{}
	var only, claimRows, without string
	fs := flag.NewFlagSet("inboxbench", flag.ContinueOnError)
	fs.StringVar(&o.inboxd, "inboxd", "bin/inboxd", "path of the inboxd binary to measure")
	fs.StringVar(&o.databaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "PostgreSQL URL; a fresh schema is created in this database")
	fs.StringVar(&o.amqpURL, "amqp-url", cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL; a fresh virtual host is created on this broker")
	fs.StringVar(&o.adminURL, "amqp-admin-url", "", "RabbitMQ management API URL (default: port 15672 of the AMQP host, same credentials)")
	fs.IntVar(&o.messages, "messages", 100_000, "order.created messages to publish, one order each")
	fs.IntVar(&o.publishers, "publishers", 4, "publishing connections")
	fs.IntVar(&o.window, "window", 500, "unconfirmed publishes per publisher")
	fs.DurationVar(&o.timeout, "timeout", time.Hour, "give up after this long")
	fs.BoolVar(&o.keep, "keep", false, "keep the schemas and virtual hosts afterwards")
	fs.Float64Var(&o.snapshotRate, "snapshot-rate", 500, "snapshot: orders per second")
	fs.DurationVar(&o.snapshotHold, "snapshot-hold", time.Minute, "snapshot: how long the clean phase, then the held snapshot, last")
	fs.Float64Var(&o.windowRate, "window-rate", 1000, "window: orders per second")
	fs.DurationVar(&o.windowDuration, "window-duration", time.Minute, "window: how long each phase, on an empty then on a loaded ledger, publishes")
	fs.IntVar(&o.windowKeys, "window-keys", 100_000_000, "window: keys loaded into the ledger between the phases")
	fs.BoolVar(&o.windowPrewarm, "window-prewarm", false, "window: read the ledger's indexes into shared buffers (pg_prewarm, a superuser's) before the full phase, as on a server whose memory holds them")
	fs.StringVar(&o.partitionRuns, "partition-runs", "1x1,6x1,1x2,6x2", "the partitions scenario's runs, comma-separated PARTITIONSxREPLICAS")
	fs.IntVar(&o.skus, "skus", 1000, "distinct SKUs the orders draw from (each stocked so that no order is rejected)")
	fs.BoolVar(&o.preload, "preload", false, "domain: publish everything before starting inboxd, and time how fast it drains the queue")
	fs.StringVar(&o.serviceEnv, "env", "", "extra environment for inboxd, comma-separated KEY=VALUE pairs")
	fs.StringVar(&only, "only", "", "comma-separated scenarios to run: core, passthrough, split, domain, domainruler, steady, claim, probes, scrapes, flood, reply, partitions, snapshot, window, views (default: all but window and views)")
	fs.Float64Var(&o.steadyRate, "steady-rate", 1000, "steady: messages per second")
	fs.DurationVar(&o.steadyDuration, "steady-duration", 5*time.Minute, "steady: how long to publish")
	fs.DurationVar(&o.replyDuration, "reply-duration", time.Minute, "reply: how long to publish requests, at -steady-rate")
	fs.IntVar(&o.probeClients, "probe-clients", 200, "probes, scrapes, flood: concurrent clients sending GET /readyz (probes), GET /metrics (scrapes) or GET /api/messages/<random> (flood) in a loop")
	fs.IntVar(&o.probeMessages, "probe-messages", 20_000, "probes, scrapes, flood: the backlog drained, without and with the probes, or during the flood")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the bench process (which runs ingest and the workers of core and split) to this file")
	fs.StringVar(&o.viewsBefore, "views-before", "", "views: an earlier build's inboxd binary, whose views, status page and gauges are compared with -inboxd's on the same traffic")
	fs.BoolVar(&o.ruler, "ruler", true, "domain, steady: run the simplest correct inbox (a ruler in this process, on a schema and virtual host of its own) on the same traffic after or before each inboxd run, and report inboxd's figures as ratios to it")
	fs.IntVar(&o.rounds, "rounds", 1, "domain, steady: runs of each (pairs of inboxd and the simplest inbox, alternating which goes first)")
	fs.StringVar(&without, "without", "", "domain, steady: comma-separated promises to turn off in inboxd's schema, for the bench alone, to measure what each costs: "+strings.Join(slices.Sorted(maps.Keys(promisesOff)), ", ")+" (without.go says what each removes)")
	fs.StringVar(&claimRows, "claim-rows", "0,1000000,10000000", "claim: processed rows in the inbox at each measurement, ascending")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if only != "" {
		o.only = strings.Split(only, ",")
	}
	var err error
	if o.without, err = parseWithout(without); err != nil {
		return nil, err
	}
	if len(o.without) > 0 && o.preload {
		// inboxd drains a preloaded queue as soon as it is up, before the
		// promises could be turned off.
		return nil, errors.New("-without and -preload: the promises are turned off once inboxd is ready, and with -preload it is draining by then")
	}
	if o.rounds < 1 {
		return nil, fmt.Errorf("-rounds: want at least 1, got %d", o.rounds)
	}
	for _, v := range strings.Split(claimRows, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 0 || (len(o.claimRows) > 0 && n < o.claimRows[len(o.claimRows)-1]) {
			return nil, fmt.Errorf("-claim-rows: want ascending counts, got %q", claimRows)
		}
		o.claimRows = append(o.claimRows, n)
	}
	return o, nil
}

// startCPUProfile profiles this process's CPU into a file at path until
// the stop it returns is called.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); _ = f.Close() }, nil
}
