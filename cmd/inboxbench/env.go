package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/freeport"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
	"github.com/orderconfirm/inboxd/internal/sandbox"
)

// benchEnv is a fresh schema and virtual host for one scenario.
type benchEnv struct {
	name    string
	dbURL   string
	amqpURL string
	pool    *pgxpool.Pool
	cleanup func()
	// inboxd is the binary the scenario runs: -inboxd, or another build's.
	inboxd string
}

// newEnv creates a migrated schema with stocked SKUs and a virtual host with
// the service's topology, named after the scenario.
func newEnv(ctx context.Context, o *options, scenario string) (*benchEnv, error) {
	return newEnvOf(ctx, o, scenario, "")
}

// newEnvOf is newEnv for the inboxd binary at build, which migrates the
// schema with its own migrations ("inboxd migrate"), and which the env's
// startInboxd and serve run; "" is -inboxd, migrated by this source tree.
func newEnvOf(ctx context.Context, o *options, scenario, build string) (*benchEnv, error) {
	e, err := newEmptyEnv(ctx, o, scenario)
	if err != nil {
		return nil, err
	}
	e.inboxd = cmp.Or(build, o.inboxd)
	if err := loadgen.DeclareTopology(e.amqpURL, broker.QueueTypeQuorum); err != nil {
		e.close()
		return nil, fmt.Errorf("declare topology: %w", err)
	}
	if build == "" {
		_, err = migrate.Up(ctx, e.pool.Config().ConnConfig, slog.New(slog.NewTextHandler(io.Discard, nil)))
	} else {
		err = migrateWith(ctx, build, e.dbURL)
	}
	if err != nil {
		e.close()
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if err := seedStock(ctx, e.pool, o.skus); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

// newSimplestEnv creates a schema with the simplest inbox's tables and
// stocked SKUs, and a virtual host with its exchanges and queues (see
// createSimplest), named after the scenario.
func newSimplestEnv(ctx context.Context, o *options, scenario string) (*benchEnv, error) {
	e, err := newEmptyEnv(ctx, o, scenario+"_simplest")
	if err != nil {
		return nil, err
	}
	if err := createSimplest(ctx, e.pool, e.amqpURL); err != nil {
		e.close()
		return nil, err
	}
	if err := seedStock(ctx, e.pool, o.skus); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

// newEmptyEnv creates an empty schema and virtual host named after the
// scenario, and a pool on the schema.
func newEmptyEnv(ctx context.Context, o *options, scenario string) (*benchEnv, error) {
	name := fmt.Sprintf("bench_%s_%d", scenario, time.Now().UnixNano())
	dbURL, cleanupDB, err := sandbox.CreateSchema(ctx, o.databaseURL, name)
	if err != nil {
		return nil, err
	}
	amqpURL, cleanupBroker, err := createVhost(ctx, o.amqpURL, o.adminURL, name)
	if err != nil {
		cleanupDB()
		return nil, err
	}
	e := &benchEnv{name: name, dbURL: dbURL, amqpURL: amqpURL, cleanup: func() {}}
	if !o.keep {
		e.cleanup = func() { cleanupBroker(); cleanupDB() }
	}
	if e.pool, err = pgxpool.New(ctx, dbURL); err != nil {
		e.cleanup()
		return nil, err
	}
	return e, nil
}

func (e *benchEnv) close() {
	e.pool.Close()
	e.cleanup()
}

// startInboxd runs `inboxd serve` on the scenario's schema and virtual
// host, and returns it with its HTTP address.
func (e *benchEnv) startInboxd(o *options, env ...string) (*service, string, error) {
	httpAddr, err := freeport.Addr()
	if err != nil {
		return nil, "", err
	}
	svc, err := startInboxd(o, e.inboxd, e.dbURL, e.amqpURL, httpAddr, e.name+"-"+strings.ReplaceAll(httpAddr, ":", "-"), env...)
	return svc, httpAddr, err
}

// serve runs inboxd as startInboxd does and waits until it is ready; the
// caller stops it.
func (e *benchEnv) serve(ctx context.Context, o *options, env ...string) (*service, string, error) {
	svc, httpAddr, err := e.startInboxd(o, env...)
	if err != nil {
		return nil, "", err
	}
	if err := waitReady(ctx, httpAddr); err != nil {
		svc.stop()
		return nil, "", err
	}
	return svc, httpAddr, nil
}

// newPool opens a pool of its own on the scenario's schema.
func (e *benchEnv) newPool(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	return openPool(ctx, e.dbURL, maxConns)
}

// openPool opens a pool of maxConns connections on the schema at dbURL,
// each session set up as inboxd sets up its own.
func openPool(ctx context.Context, dbURL string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	pipeline.ConfigureSession(cfg.ConnConfig)
	pgsession.SetAfterConnectInPool(cfg)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// seedStock stocks every SKU the workload uses, so that no order is
// rejected.
func seedStock(ctx context.Context, pool *pgxpool.Pool, skus int) error {
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

// migrateWith migrates the schema at dbURL with the inboxd binary at build.
func migrateWith(ctx context.Context, build, dbURL string) error {
	cmd := exec.CommandContext(ctx, build, "migrate")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s migrate: %w: %s", build, err, out)
	}
	return nil
}

func startInboxd(o *options, build, dbURL, amqpURL, httpAddr, name string, env ...string) (*service, error) {
	logPath := fmt.Sprintf("%s/%s-inboxd.log", os.TempDir(), name)
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(build, "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL, "AMQP_URL="+amqpURL, "HTTP_ADDR="+httpAddr)
	if o.serviceEnv != "" {
		cmd.Env = append(cmd.Env, strings.Split(o.serviceEnv, ",")...)
	}
	cmd.Env = append(cmd.Env, env...)
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

// The counts the scenarios wait for, and the time of the last row each
// counts.
const (
	countProcessed = "SELECT count(*) FROM inbox WHERE status = 'processed'"
	lastProcessed  = "SELECT max(processed_at) FROM inbox"
	countPublished = "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
	lastPublished  = "SELECT max(published_at) FROM outbox"
)

// waitCount waits until query counts want rows, then returns what last
// returns: the database's time of the last of them (max of a timestamp
// column). The finish time comes from the rows themselves, so the polls can
// be rare: each count scans the table, and at 100,000 rows one poll every
// 100 ms took 15% of PostgreSQL's time in the core path (0.86 s of 5.7 s,
// pg_stat_statements), which the rulers, counting in memory, do not pay.
func waitCount(ctx context.Context, pool *pgxpool.Pool, query string, want int, last string) (time.Time, error) {
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		var n int
		if err := pool.QueryRow(ctx, query).Scan(&n); err != nil {
			return time.Time{}, fmt.Errorf("%s: %w", query, err)
		}
		if n >= want {
			var at time.Time
			if err := pool.QueryRow(ctx, last).Scan(&at); err != nil {
				return time.Time{}, fmt.Errorf("%s: %w", last, err)
			}
			return at, nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("%d of %d after %q: %w", n, want, query, ctx.Err())
		case <-tick.C:
		}
	}
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))
