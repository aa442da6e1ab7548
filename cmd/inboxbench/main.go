// Command inboxbench is the benchmark suite: on this machine's PostgreSQL
// and RabbitMQ, each scenario in a fresh schema and virtual host, it
// measures
//
//  1. the core path (ingest and workers in this process, a handler that
//     does nothing): messages per second from publish to processed;
//  2. the whole domain: a real inboxd process, orders per second to the last
//     event published;
//  3. ingest alone and the workers alone;
//  4. latency from publish to processed commit at a steady rate (p50, p99,
//     p99.9), and
//  5. inboxd's memory over that run;
//  6. the claim's cost as processed rows pile up (0, 1M, 10M);
//  7. the same messages through the broker alone, acked and nothing else:
//     the ceiling (1) is compared with;
//  8. a real inboxd draining a backlog, without and with 200 clients
//     probing /readyz in a loop: what readiness probes cost the workers.
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
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
	"github.com/orderconfirm/inboxd/internal/sandbox"
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
	preload        bool
	skus           int
	serviceEnv     string
	only           []string
	steadyRate     float64
	steadyDuration time.Duration
	claimRows      []int
	probeClients   int
	probeMessages  int
}

// scenarios lists what the suite measures, in the order it runs them.
var scenarios = []struct {
	name string
	run  func(context.Context, *options, *report) error
}{
	{"core", benchCore},
	{"passthrough", benchPassthrough},
	{"split", benchIngestAndWorker},
	{"domain", benchDomain},
	{"domainruler", benchDomainRuler},
	{"steady", benchSteady},
	{"claim", benchClaim},
	{"probes", benchProbes},
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	var o options
	var only, claimRows, cpuProfile string
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
	fs.IntVar(&o.skus, "skus", 1000, "distinct SKUs the orders draw from (each stocked so that no order is rejected)")
	fs.BoolVar(&o.preload, "preload", false, "domain: publish everything before starting inboxd, and time how fast it drains the queue")
	fs.StringVar(&o.serviceEnv, "env", "", "extra environment for inboxd, comma-separated KEY=VALUE pairs")
	fs.StringVar(&only, "only", "", "comma-separated scenarios to run: core, passthrough, split, domain, domainruler, steady, claim, probes (default: all)")
	fs.Float64Var(&o.steadyRate, "steady-rate", 1000, "steady: messages per second")
	fs.DurationVar(&o.steadyDuration, "steady-duration", 5*time.Minute, "steady: how long to publish")
	fs.IntVar(&o.probeClients, "probe-clients", 200, "probes: concurrent clients sending GET /readyz in a loop")
	fs.IntVar(&o.probeMessages, "probe-messages", 20_000, "probes: the backlog drained, without and with the probes")
	fs.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the bench process (which runs ingest and the workers of core and split) to this file")
	fs.StringVar(&claimRows, "claim-rows", "0,1000000,10000000", "claim: processed rows in the inbox at each measurement, ascending")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if only != "" {
		o.only = strings.Split(only, ",")
	}
	for _, v := range strings.Split(claimRows, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 0 || (len(o.claimRows) > 0 && n < o.claimRows[len(o.claimRows)-1]) {
			return fmt.Errorf("-claim-rows: want ascending counts, got %q", claimRows)
		}
		o.claimRows = append(o.claimRows, n)
	}
	if cpuProfile != "" {
		f, err := os.Create(cpuProfile)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()

	r := &report{}
	if err := r.describeMachine(ctx, &o); err != nil {
		return err
	}
	for _, sc := range scenarios {
		if o.only != nil && !slices.Contains(o.only, sc.name) {
			continue
		}
		fmt.Fprintf(os.Stderr, "inboxbench: %s...\n", sc.name)
		started := time.Now()
		if err := sc.run(ctx, &o, r); err != nil {
			return fmt.Errorf("%s: %w", sc.name, err)
		}
		fmt.Fprintf(os.Stderr, "inboxbench: %s took %s\n", sc.name, time.Since(started).Round(time.Second))
	}
	return r.print(stdout)
}

// report collects the suite's results, one row each.
type report struct {
	rows              [][2]string
	core, passthrough float64
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

// benchDomain measures (2): orders per second through a real inboxd process
// with the orders handler, from the first publish to the last event
// published.
func benchDomain(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "domain")
	if err != nil {
		return err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})

	var start time.Time
	var publishTook time.Duration
	published := make(chan error, 1)
	publish := func() {
		started := time.Now()
		err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window)
		publishTook = time.Since(started)
		published <- err
	}
	if o.preload {
		publish()
	}
	svc, httpAddr, err := e.startInboxd(o)
	if err != nil {
		return err
	}
	defer svc.stop()
	if o.preload {
		start = time.Now() // the drain includes inboxd's start
	}
	if err := waitReady(ctx, httpAddr); err != nil {
		return err
	}
	if !o.preload {
		start = time.Now()
		go publish()
	}
	processed, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
	if err != nil {
		return err
	}
	took := processed.Sub(start)
	// Every order is confirmed: an order.confirmed and an email.requested each.
	lastEvent, err := waitCount(ctx, e.pool, countPublished, 2*w.UniqueMessageIDs, lastPublished)
	if err != nil {
		return err
	}
	tookPublished := lastEvent.Sub(start)
	if err := <-published; err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	from := "first publish"
	if o.preload {
		from = "inboxd start, queue preloaded"
	}
	r.domainPublished = float64(w.UniqueMessageIDs) / tookPublished.Seconds()
	r.domainProcessed = float64(w.UniqueMessageIDs) / took.Seconds()
	defer r.domainRatios()
	r.add("2. whole domain (inboxd)", "%.0f orders/s (%d orders, %s from %s to the last of %d events published)",
		r.domainPublished, w.UniqueMessageIDs, tookPublished.Round(time.Millisecond), from, 2*w.UniqueMessageIDs)
	r.add("   of which processed", "%.0f orders/s (%s to the last processed); publishing alone %.0f msg/s",
		r.domainProcessed, took.Round(time.Millisecond), float64(len(w.Messages))/publishTook.Seconds())
	return nil
}

// seedStock stocks every SKU the workload uses, so that no order is
// rejected.
func seedStock(ctx context.Context, pool *pgxpool.Pool, skus int) error {
	if _, err := migrate.Up(ctx, pool.Config().ConnConfig, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		return err
	}
	names := make([]string, skus)
	for i := range names {
		names[i] = loadgen.SKUName(i)
	}
	_, err := pool.Exec(ctx, "INSERT INTO stock (sku, available) SELECT unnest($1::text[]), 1000000000", names)
	if err != nil {
		return fmt.Errorf("seed stock: %w", err)
	}
	return nil
}

// createVhost creates a virtual host through the management API at adminURL
// (by default port 15672 of the AMQP host, with the same credentials).
func createVhost(ctx context.Context, amqpURL, adminURL, vhost string) (string, func(), error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", nil, fmt.Errorf("parse AMQP URL: %w", err)
	}
	if adminURL == "" {
		adminURL = (&url.URL{Scheme: "http", User: u.User, Host: u.Hostname() + ":15672"}).String()
	}
	admin, err := rabbitadmin.New(adminURL)
	if err != nil {
		return "", nil, err
	}
	vhostURL, drop, err := sandbox.CreateVhost(ctx, admin, amqpURL, vhost)
	if err != nil {
		admin.Close()
		return "", nil, err
	}
	return vhostURL, func() { drop(); admin.Close() }, nil
}

type service struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func startInboxd(o *options, dbURL, amqpURL, httpAddr, name string) (*service, error) {
	logPath := fmt.Sprintf("%s/%s-inboxd.log", os.TempDir(), name)
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(o.inboxd, "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL, "AMQP_URL="+amqpURL, "HTTP_ADDR="+httpAddr)
	if o.serviceEnv != "" {
		cmd.Env = append(cmd.Env, strings.Split(o.serviceEnv, ",")...)
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start inboxd: %w", err)
	}
	s := &service{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		_ = logFile.Close()
		close(s.done)
	}()
	return s, nil
}

func (s *service) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func waitReady(ctx context.Context, httpAddr string) error {
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		resp, err := httpGet(ctx, "http://"+httpAddr+"/readyz")
		if err == nil && resp == 200 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return errors.New("inboxd did not become ready within 60s")
}
