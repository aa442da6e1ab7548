// Command inboxbench measures inboxd end to end on this machine: it runs a
// real inboxd process against a fresh schema and RabbitMQ virtual host,
// stocks the SKUs, publishes order.created messages (persistent, with
// publisher confirms) and times how long they take to be processed, and for
// their events (order.confirmed, email.requested) to be published.
//
// Usage:
//
//	inboxbench -inboxd bin/inboxd [-messages 100000] [-publishers 4]
//
// `make bench` builds both binaries and runs it against the local services.
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
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
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
	inboxd      string
	databaseURL string
	amqpURL     string
	adminURL    string
	messages    int
	publishers  int
	window      int
	timeout     time.Duration
	keep        bool
	preload     bool
	skus        int
	serviceEnv  string
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	var o options
	fs := flag.NewFlagSet("inboxbench", flag.ContinueOnError)
	fs.StringVar(&o.inboxd, "inboxd", "bin/inboxd", "path of the inboxd binary to measure")
	fs.StringVar(&o.databaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "PostgreSQL URL; a fresh schema is created in this database")
	fs.StringVar(&o.amqpURL, "amqp-url", cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL; a fresh virtual host is created on this broker")
	fs.StringVar(&o.adminURL, "amqp-admin-url", "", "RabbitMQ management API URL (default: port 15672 of the AMQP host, same credentials)")
	fs.IntVar(&o.messages, "messages", 100_000, "order.created messages to publish, one order each")
	fs.IntVar(&o.publishers, "publishers", 4, "publishing connections")
	fs.IntVar(&o.window, "window", 500, "unconfirmed publishes per publisher")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up after this long")
	fs.BoolVar(&o.keep, "keep", false, "keep the schema and virtual host afterwards")
	fs.IntVar(&o.skus, "skus", 1000, "distinct SKUs the orders draw from (each stocked so that no order is rejected)")
	fs.BoolVar(&o.preload, "preload", false, "publish everything before starting inboxd, and time how fast it drains the queue")
	fs.StringVar(&o.serviceEnv, "env", "", "extra environment for inboxd, comma-separated KEY=VALUE pairs")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	return bench(ctx, &o, stdout)
}

func bench(ctx context.Context, o *options, stdout io.Writer) error {
	name := fmt.Sprintf("bench_%d", time.Now().Unix())
	dbURL, cleanupDB, err := createSchema(ctx, o.databaseURL, name)
	if err != nil {
		return err
	}
	amqpURL, cleanupBroker, err := createVhost(ctx, o.amqpURL, o.adminURL, name)
	if err != nil {
		cleanupDB()
		return err
	}
	if !o.keep {
		defer cleanupDB()
		defer cleanupBroker()
	}
	if err := loadgen.DeclareTopology(amqpURL, inbox.QueueTypeQuorum); err != nil {
		return fmt.Errorf("declare topology: %w", err)
	}

	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: name, SKUs: o.skus})
	if err := seedStock(ctx, pool, o.skus); err != nil {
		return err
	}

	var start time.Time
	var publishTook time.Duration
	published := make(chan error, 1)
	publish := func() {
		started := time.Now()
		err := loadgen.PublishParallel(ctx, amqpURL, w.Messages, o.publishers, o.window)
		publishTook = time.Since(started)
		published <- err
	}
	if o.preload {
		fmt.Fprintf(stdout, "publishing %d messages on %d connections before inboxd starts\n", len(w.Messages), o.publishers)
		publish()
	}

	httpAddr, err := freeAddr()
	if err != nil {
		return err
	}
	svc, err := startInboxd(o, dbURL, amqpURL, httpAddr, name)
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
		fmt.Fprintf(stdout, "publishing %d messages on %d connections; inboxd pid %d, HTTP on %s\n", len(w.Messages), o.publishers, svc.cmd.Process.Pid, httpAddr)
		start = time.Now()
		go publish()
	}
	if err := waitProcessed(ctx, pool, w.UniqueMessageIDs); err != nil {
		return err
	}
	took := time.Since(start)
	// Every order is confirmed: an order.confirmed and an email.requested each.
	if err := waitPublished(ctx, pool, 2*w.UniqueMessageIDs); err != nil {
		return err
	}
	tookPublished := time.Since(start)
	if err := <-published; err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	var pgVersion string
	_ = pool.QueryRow(ctx, "SHOW server_version").Scan(&pgVersion)
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "machine\t%d CPUs, %s %s/%s, PostgreSQL %s\n", runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH, pgVersion)
	fmt.Fprintf(tw, "messages\t%d (persistent, publisher confirms, quorum queue)\n", w.UniqueMessageIDs)
	fmt.Fprintf(tw, "publish\t%.0f msg/s (%s)\n", float64(len(w.Messages))/publishTook.Seconds(), publishTook.Round(time.Millisecond))
	from := "first publish"
	if o.preload {
		from = "inboxd start"
	}
	fmt.Fprintf(tw, "processed\t%.0f msg/s (%s from %s to last processed)\n", float64(w.UniqueMessageIDs)/took.Seconds(), took.Round(time.Millisecond), from)
	fmt.Fprintf(tw, "whole domain\t%.0f orders/s (%s from %s to the last of %d events published)\n",
		float64(w.UniqueMessageIDs)/tookPublished.Seconds(), tookPublished.Round(time.Millisecond), from, 2*w.UniqueMessageIDs)
	return tw.Flush()
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

// waitPublished polls until the outbox holds want rows, all published.
func waitPublished(ctx context.Context, pool *pgxpool.Pool, want int) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var published int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").Scan(&published); err != nil {
			return fmt.Errorf("count published: %w", err)
		}
		if published >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d events published: %w", published, want, ctx.Err())
		case <-tick.C:
		}
	}
}

// waitProcessed polls until want messages are processed.
func waitProcessed(ctx context.Context, pool *pgxpool.Pool, want int) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM inbox WHERE status = 'processed'").Scan(&n); err != nil {
			return fmt.Errorf("count processed: %w", err)
		}
		if n >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("only %d of %d messages processed: %w", n, want, ctx.Err())
		case <-tick.C:
		}
	}
}

func createSchema(ctx context.Context, databaseURL, schema string) (string, func(), error) {
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return "", nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return "", nil, err
	}
	cleanup := func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if c, err := pgx.Connect(ctx, databaseURL); err == nil {
			_, _ = c.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			_ = c.Close(ctx)
		}
	}
	u, err := url.Parse(databaseURL)
	if err != nil {
		cleanup()
		return "", nil, err
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), cleanup, nil
}

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
	if err := admin.CreateVhost(ctx, vhost, u.User.Username()); err != nil {
		return "", nil, err
	}
	u.Path, u.RawPath = "/"+vhost, "/"+url.PathEscape(vhost)
	cleanup := func() {
		_ = admin.DeleteVhost(context.Background(), vhost)
		admin.Close()
	}
	return u.String(), cleanup, nil
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
