package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/leader"
	"github.com/orderconfirm/inboxd/internal/metrics"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/statuspage"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// wrapHandler wraps the order handler; the crashtest build of the tests
// replaces it.
var wrapHandler = func(h inbox.Handler) inbox.Handler { return h }

func migrateUp(ctx context.Context, cfg *config, logger *slog.Logger) error {
	n, err := migrate.UpWithOptions(ctx, cfg.dbConfig.ConnConfig, logger, migrate.Options{LockTimeout: cfg.migrateLockTimeout})
	if err != nil {
		return err
	}
	logger.Info("database migrated", slog.Int("applied", n))
	return nil
}

// schemaRetryFor bounds how long serve tries again to migrate, or check,
// the schema while the database ends its sessions (a restart, a failover,
// pg_terminate_backend): past it, serve exits with the error.
const schemaRetryFor = 30 * time.Second

// errPooledPerTransaction is inboxd's refusal of a database connection
// pooled per transaction or statement.
var errPooledPerTransaction = errors.New("the database connection is pooled per transaction (PgBouncer pool_mode=transaction or statement); " +
	"inboxd needs session pooling or a direct connection: see docs/failure-handling.md")

// requireSessionPooling returns errPooledPerTransaction when the
// connections of DATABASE_URL may be given another server session between
// transactions (pgsession.DetectPooling). inboxd's sessions hold what a
// session holds: LISTEN for the wake-ups, session-level advisory locks
// (the liveness keys, goose's migration lock), the settings set after
// connecting (synchronous_commit, the timeouts, search_path) and the
// prepared statements whose plans the pools keep. Pooled per transaction,
// each of those would stay on a server session other clients then use, or
// be missing from the one a statement runs on.
func requireSessionPooling(ctx context.Context, cfg *config) error {
	cc := cfg.dbConfig.ConnConfig.Copy()
	cc.RuntimeParams["application_name"] += " pooling probe"
	pooling, err := pgsession.DetectPooling(ctx, cc)
	if err != nil {
		return fmt.Errorf("tell how the database connection is pooled: %w", err)
	}
	if pooling != pgsession.PooledPerSession {
		return errPooledPerTransaction
	}
	return nil
}

// readySchema checks that the database connection is not pooled per
// transaction (requireSessionPooling), then migrates the schema
// (INBOX_MIGRATE) or checks that it is migrated, trying again while the
// database ends the session it runs on. Any other error, a database that
// refuses connections included, ends it at once.
func readySchema(ctx context.Context, cfg *config, logger *slog.Logger) error {
	failures := retry.Failures{Policy: retry.Session}
	deadline := time.Now().Add(schemaRetryFor)
	for {
		err := requireSessionPooling(ctx, cfg)
		if err == nil {
			if cfg.migrate {
				err = migrateUp(ctx, cfg, logger)
			} else {
				err = migrate.Check(ctx, cfg.dbConfig.ConnConfig)
			}
		}
		if err == nil || !sessionEnded(err) || time.Now().After(deadline) {
			return err
		}
		delay := failures.Next()
		logger.Warn("the database ended the session readying the schema; trying again",
			slog.String("error", err.Error()), slog.Duration("retry_in", delay))
		if !retry.Sleep(ctx, delay) {
			return err
		}
	}
}

// sessionEnded reports whether err is the database ending the session or
// its connection (classes 57P, shutdown and termination, and 08), not the
// statement's fault.
func sessionEnded(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "57P") || strings.HasPrefix(pgErr.Code, "08"))
}

// memoryHeadroom is what serve's memory limit allows beyond the bodies in
// flight: the rest of the process, its pools and batches.
const memoryHeadroom = 64 << 20

// gaugeScrapeTimeout bounds each scrape's reads of the gauges from the
// database.
const gaugeScrapeTimeout = 2 * time.Second

// serve runs the service (ingest, workers, the outbox relay, the listener
// that wakes them, the HTTP endpoint) until ctx ends, then stops it within
// cfg.shutdownTimeout. Its spans go to tp, which serve shuts down (flushing
// the spans still buffered) before it returns.
func serve(ctx context.Context, cfg *config, logger *slog.Logger, tp *tracing.Provider) error {
	servingSince := time.Now()
	defer flushSpans(tp, logger)
	if err := prepare(ctx, cfg, logger); err != nil {
		return err
	}
	ps, err := openPools(ctx, cfg)
	if err != nil {
		return err
	}
	defer ps.close()

	build, process := buildName(), inbox.DefaultProcessName()
	// One process of the schema, the elected leader, runs the maintenance
	// and exports the gauges read from the database, so that they add up
	// across replicas.
	elector := leader.New(sessionConfig(cfg, "leader"), logger)
	m := metrics.New(ps.gauges, logger, gaugeScrapeTimeout, build, metrics.Options{Pools: ps.measured(), Leader: elector})
	pc := pipelineConfig(cfg, pipelineDeps{
		logger: logger, handler: wrapHandler(orders.NewHandler(logger)),
		build: build, process: process, metrics: m, tracer: tp.Tracer,
	})
	pc.Leader = elector
	if cfg.stockFoldInterval > 0 {
		pc.LeaderTasks = append(pc.LeaderTasks, func(ctx context.Context) {
			orders.FoldStockEvery(ctx, ps.maintenance, logger.With(slog.String("component", "orders.fold")), cfg.stockFoldInterval)
		})
	}
	ps.attach(pc)
	p, err := pipeline.New(pc)
	if err != nil {
		return err
	}
	registerUnroutable(m.Registry, p.Relay)
	registerPartitions(m.Registry, p.Ingest)
	ready := &postgresCheck{pool: ps.ready}
	statusPage, err := newStatusPage(cfg, ps.status, logger, build, servingSince, p, ready)
	if err != nil {
		return err
	}

	httpServer, services := httpServices(cfg, logger, newHTTPHandler(ready, p.Ingest, p.Relay, m.Registry, statusPage))
	// The pipeline's work ends a little before the grace does, so that
	// what it then cuts short (a batch rolled back, a broker connection
	// closed hard) is over within it too.
	services = append(services, workBeforeGraceEnds{p})
	if err := startstop.StartAll(ctx, services...); err != nil {
		return err
	}
	logger.Info("inboxd serving", slog.String("http_addr", httpServer.Addr()),
		slog.String("build", build), slog.String("process", process),
		slog.Int("workers", cfg.workers),
		slog.Bool("exporting_spans", tp.Exporting), slog.String("otlp_protocol", tp.Protocol))

	<-ctx.Done()
	stopWithin(cfg.shutdownTimeout, logger, services)
	return nil
}

// stopWithin stops services, the last started first, within grace.
func stopWithin(grace time.Duration, logger *slog.Logger, services []startstop.Startable) {
	started := time.Now()
	logger.Info("shutting down", slog.Duration("grace", grace))
	stopCtx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	startstop.StopAll(stopCtx, services...)
	logger.Info("stopped", slog.Duration("took", time.Since(started)))
}

// SpanFlushTimeout bounds the export of the spans still buffered when serve
// stops, after INBOX_SHUTDOWN_TIMEOUT: a container's grace period after
// SIGTERM covers both.
const SpanFlushTimeout = 5 * time.Second

// flushSpans shuts tp down, exporting the spans it still buffers, within
// SpanFlushTimeout.
func flushSpans(tp *tracing.Provider, logger *slog.Logger) {
	flushCtx, cancel := context.WithTimeout(context.Background(), SpanFlushTimeout)
	defer cancel()
	if err := tp.Shutdown(flushCtx); err != nil {
		logger.Warn("flush spans", slog.String("error", err.Error()))
	}
}

// prepare readies what serve needs before it opens anything: Go's memory
// limit, the schema (migrated, or checked when INBOX_MIGRATE is false) on
// a connection that is not pooled per transaction, and the broker's
// topology.
func prepare(ctx context.Context, cfg *config, logger *slog.Logger) error {
	if cfg.goMemLimit == "" {
		// The bodies in flight are bounded by bytes; the garbage each large
		// body leaves as it arrives (its buffer grows frame by frame) is
		// not, unless the collector runs before the heap doubles.
		debug.SetMemoryLimit(int64(cfg.maxInflightBytes) + memoryHeadroom)
	}
	if err := readySchema(ctx, cfg, logger); err != nil {
		return err
	}
	// A broker that is down is waited for in the background; a topology
	// that this build cannot use is not.
	var conflict *broker.LayoutConflictError
	err := broker.Declare(cfg.amqpURL, broker.Topology{QueueType: cfg.queueType, Partitions: cfg.partitions})
	if errors.Is(err, broker.ErrInboxQueueOutdated) || errors.Is(err, broker.ErrEventsExchangeOutdated) || errors.As(err, &conflict) {
		return err
	} else if err != nil {
		logger.Warn("broker not reachable at start, connecting in the background", slog.String("error", err.Error()))
	}
	return nil
}

// registerUnroutable exports how many events wait in the unroutable queue,
// as relay last saw.
func registerUnroutable(registry *prometheus.Registry, relay *outbox.Relay) {
	registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "inboxd_events_unroutable",
		Help: "Events waiting in order-confirmation.unroutable because no binding of order-confirmation.events took them, as the relay last saw; redeliver them with inboxd redeliver-unroutable.",
	}, func() float64 { return float64(relay.Unroutable()) }))
}

// registerPartitions exports how many inbox queues this process's ingest
// is the active consumer of.
func registerPartitions(registry *prometheus.Registry, ingest *ingest.Ingest) {
	registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "inboxd_ingest_partitions_active",
		Help: "Inbox queues (INBOX_PARTITIONS) this process's ingest is the active consumer of, as far as it knows (it received a delivery since it subscribed); summed over the replicas, the partitions that carried traffic.",
	}, func() float64 { return float64(ingest.ActivePartitions()) }))
}

// newStatusPage returns the status page, which reads the database through
// pool and the service's own state from p, or nil when it is off.
func newStatusPage(cfg *config, pool *pgxpool.Pool, logger *slog.Logger, build string, started time.Time, p *pipeline.Pipeline, ready *postgresCheck) (http.Handler, error) {
	if !cfg.statusPage {
		return nil, nil
	}
	ingest, relay := p.Ingest, p.Relay
	page, err := statuspage.New(pool, &statuspage.Config{
		Logger:  logger,
		Build:   build,
		Started: started,
		State: func() statuspage.ServiceState {
			state := statuspage.ServiceState{
				IngestConsuming:  ingest.Consuming(),
				Partitions:       cfg.partitions,
				PartitionsActive: ingest.ActivePartitions(),
				RelayConnected:   relay.Connected(),
				Workers:          cfg.workers,
			}
			if blocked, reason := relay.Blocked(); blocked {
				state.BrokerAlarm = cmp.Or(reason, "alarm")
			}
			if d, err := ready.check(context.Background()); err == nil {
				state.Durability = d.String()
			}
			return state
		},
	})
	if err != nil {
		return nil, err
	}
	return page, nil
}

func newPool(ctx context.Context, cfg *config, name string, maxConns int, shortIdle bool) (*pgxpool.Pool, error) {
	pc := cfg.dbConfig.Copy()
	pc.MaxConns = int32(maxConns)
	if shortIdle {
		pc.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(cfg.workerIdleInTx.Milliseconds(), 10)
	}
	pc.ConnConfig.RuntimeParams["application_name"] += " " + name
	// A context that ends inside a query cancels the query instead of
	// closing the connection. Not for the LISTEN and lock sessions, which
	// wait idle: an idle backend ignores a cancel, and they would notice
	// their context only after the handler's 5-second deadline.
	pc.ConnConfig.BuildContextWatcherHandler = pipeline.CancelQueryOnContextEnd
	if !plansEachCall[name] {
		pipeline.KeepPlans(pc)
	}
	pgsession.SetAfterConnectInPool(pc)
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("create %s pool: %w", name, err)
	}
	return pool, nil
}

// workBeforeGraceEnds stops the pipeline with a context that ends a little
// before the one it is given: by min(a second and a half, a quarter) of
// what is left of the grace.
type workBeforeGraceEnds struct{ *pipeline.Pipeline }

func (w workBeforeGraceEnds) Stop(ctx context.Context) {
	if deadline, ok := ctx.Deadline(); ok {
		grace := time.Until(deadline)
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, grace-min(time.Second+startstop.AbandonAfter/2, grace/4))
		defer cancel()
	}
	w.Pipeline.Stop(ctx)
}
