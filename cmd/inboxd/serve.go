package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/metrics"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/pipeline"
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

// memoryHeadroom is what serve's memory limit allows beyond the bodies in
// flight: the rest of the process, its pools and batches.
const memoryHeadroom = 64 << 20

// serve runs the service (ingest, workers, the outbox relay, the listener
// that wakes them, the HTTP endpoint) until ctx ends, then stops it within
// cfg.shutdownTimeout. Its spans go to tp, which serve shuts down (flushing
// the spans still buffered) before it returns.
func serve(ctx context.Context, cfg *config, logger *slog.Logger, tp *tracing.Provider) error {
	servingSince := time.Now()
	defer func() {
		flushCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(flushCtx); err != nil {
			logger.Warn("flush spans", slog.String("error", err.Error()))
		}
	}()
	if cfg.goMemLimit == "" {
		// The bodies in flight are bounded by bytes; the garbage each large
		// body leaves as it arrives (its buffer grows frame by frame) is
		// not, unless the collector runs before the heap doubles.
		debug.SetMemoryLimit(int64(cfg.maxInflightBytes) + memoryHeadroom)
	}
	if cfg.migrate {
		if err := migrateUp(ctx, cfg, logger); err != nil {
			return err
		}
	} else if err := migrate.Check(ctx, cfg.dbConfig.ConnConfig); err != nil {
		return err
	}

	// A broker that is down is waited for in the background; a topology
	// that this build cannot use is not.
	if err := broker.Declare(cfg.amqpURL, cfg.queueType); errors.Is(err, broker.ErrInboxQueueOutdated) || errors.Is(err, broker.ErrEventsExchangeOutdated) {
		return err
	} else if err != nil {
		logger.Warn("broker not reachable at start, connecting in the background", slog.String("error", err.Error()))
	}

	// Ingest and workers have pools of their own, so neither can starve the
	// other of connections.
	// Ingest stores one batch at a time, and records conflicts after it.
	ingestPool, err := newPool(ctx, cfg, "ingest", 2)
	if err != nil {
		return err
	}
	defer closePool(ingestPool)
	workerPool, err := newPool(ctx, cfg, "worker", cfg.workers+1)
	if err != nil {
		return err
	}
	defer closePool(workerPool)
	relayPool, err := newPool(ctx, cfg, "relay", 4)
	if err != nil {
		return err
	}
	defer closePool(relayPool)

	// Scrapes read the database through the relay's pool: it is not on the
	// path of ingest or the workers, and the relay holds only one of its
	// connections, for the transaction of the batch it is publishing.
	build, process := buildName(), inbox.DefaultProcessName()
	// Only the process holding the gauge lock exports the gauges read from
	// the database, so that they add up across replicas.
	lockConfig := cfg.dbConfig.ConnConfig.Copy()
	lockConfig.RuntimeParams["application_name"] += " metrics"
	gaugeLock := metrics.NewGaugeLock(lockConfig, logger, 0)
	m := metrics.New(relayPool, logger, 2*time.Second, build, metrics.Options{
		Pools:     map[string]*pgxpool.Pool{"ingest": ingestPool, "worker": workerPool, "relay": relayPool},
		GaugeLock: gaugeLock,
	})

	// The janitor deletes through the relay's pool too: one short
	// statement at a time, off the path of ingest and the workers.
	var janitorConfig *janitor.Config
	if cfg.janitorInterval > 0 {
		janitorConfig = &janitor.Config{
			Logger:        logger,
			Retention:     cfg.retention,
			DeadRetention: cfg.deadRetention,
			Interval:      cfg.janitorInterval,
			BatchSize:     cfg.janitorBatch,
			Observe:       m.ObserveJanitor,
		}
	}
	listenConfig := cfg.dbConfig.ConnConfig.Copy()
	listenConfig.RuntimeParams["application_name"] += " listener"
	p, err := pipeline.New(&pipeline.Config{
		Logger: logger,
		Listen: listenConfig,
		Worker: &inbox.WorkerConfig{
			Handler:        wrapHandler(orders.NewHandler(logger)),
			Logger:         logger,
			Concurrency:    cfg.workers,
			BatchSize:      cfg.workerBatchSize,
			PollInterval:   cfg.pollInterval,
			HandlerTimeout: cfg.handlerTimeout,
			MaxAttempts:    cfg.maxAttempts,
			RetryBase:      cfg.retryBase,
			RetryMax:       cfg.retryMax,
			ClaimLease:     cfg.claimLease,
			Process:        process,
			Build:          build,
			Observe:        m.ObserveBatch,
			Tracer:         tp.Tracer,
		},
		WorkerPool: workerPool,
		Ingest: &ingest.Config{
			URL:                    cfg.amqpURL,
			Logger:                 logger,
			ConnectionName:         "inboxd ingest " + process,
			QueueType:              cfg.queueType,
			BatchSize:              cfg.ingestBatchSize,
			Linger:                 cfg.ingestLinger,
			Prefetch:               cfg.prefetch,
			MaxInflightBytes:       cfg.maxInflightBytes,
			MaxMessageBytes:        cfg.maxMessageBytes,
			DeriveMissingMessageID: cfg.deriveMessageID,
			Heartbeat:              cfg.amqpHeartbeat,
			StoreTimeout:           cfg.ingestStoreTimeout,
			OrderingKey:            orders.OrderingKey,
			Observe:                m.ObserveIngest,
			Tracer:                 tp.Tracer,
		},
		IngestPool: ingestPool,
		Relay: &outbox.RelayConfig{
			URL:            cfg.amqpURL,
			Logger:         logger,
			ConnectionName: "inboxd relay " + process,
			QueueType:      cfg.queueType,
			BatchSize:      cfg.relayBatchSize,
			PollInterval:   cfg.pollInterval,
			Lease:          cfg.relayLease,
			RetryBase:      cfg.retryBase,
			RetryMax:       cfg.retryMax,
			Heartbeat:      cfg.amqpHeartbeat,
			OnPublished:    m.ObservePublished,
			Tracer:         tp.Tracer,
		},
		RelayPool:   relayPool,
		Janitor:     janitorConfig,
		JanitorPool: relayPool,
	})
	if err != nil {
		return err
	}
	consumer, relay := p.Ingest, p.Relay
	m.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "inboxd_events_unroutable",
		Help: "Events waiting in order-confirmation.unroutable because no binding of order-confirmation.events took them, as the relay last saw; redeliver them with inboxd redeliver-unroutable.",
	}, func() float64 { return float64(relay.Unroutable()) }))

	var statusPage http.Handler
	if cfg.statusPage {
		// The status page has a pool of its own, so however many people
		// look, it cannot take a connection from the service's work.
		statusPool, err := newPool(ctx, cfg, "status", statuspage.PoolSizeDefault)
		if err != nil {
			return err
		}
		defer closePool(statusPool)
		statusPage, err = statuspage.New(statusPool, &statuspage.Config{
			Logger:  logger,
			Build:   build,
			Started: servingSince,
			State: func() statuspage.ServiceState {
				return statuspage.ServiceState{
					IngestConsuming: consumer.Consuming(),
					RelayConnected:  relay.Connected(),
					Workers:         cfg.workers,
				}
			},
		})
		if err != nil {
			return err
		}
	}
	// Readiness pings through a pool of its own, so that a flood of probes
	// cannot take a connection from the workers.
	readyPool, err := newPool(ctx, cfg, "ready", 1)
	if err != nil {
		return err
	}
	defer closePool(readyPool)
	httpServer := &httpService{
		setting: "HTTP_ADDR", addr: cfg.httpAddr, graceful: true, logger: logger, failed: "HTTP server failed",
		server: newHTTPServer(newHTTPHandler(readyPool, consumer, relay, m.Registry, statusPage), HTTPWriteTimeout),
	}
	services := []startstop.Startable{httpServer}
	// The profiler listens apart, off HTTP_ADDR, only when asked to.
	if cfg.pprofAddr != "" {
		services = append(services, &httpService{
			setting: "INBOX_PPROF_ADDR", addr: cfg.pprofAddr, logger: logger, failed: "profiler's HTTP server failed",
			server: newHTTPServer(newPprofHandler(), PprofWriteTimeout),
		})
	}
	// The pipeline's work ends a little before the grace does, so that
	// what it then cuts short (a batch rolled back, a broker connection
	// closed hard) is over within it too.
	services = append(services, startstop.Func(gaugeLock.Run), workBeforeGraceEnds{p})
	if err := startstop.StartAll(ctx, services...); err != nil {
		return err
	}
	logger.Info("inboxd serving", slog.String("http_addr", httpServer.Addr()),
		slog.String("build", build), slog.String("process", process),
		slog.Int("workers", cfg.workers),
		slog.Bool("exporting_spans", tp.Exporting), slog.String("otlp_protocol", tp.Protocol))

	<-ctx.Done()
	started := time.Now()
	logger.Info("shutting down", slog.Duration("grace", cfg.shutdownTimeout))
	stopCtx, cancel := context.WithTimeout(context.Background(), cfg.shutdownTimeout)
	defer cancel()
	startstop.StopAll(stopCtx, services...)
	logger.Info("stopped", slog.Duration("took", time.Since(started)))
	return nil
}

func newPool(ctx context.Context, cfg *config, name string, maxConns int) (*pgxpool.Pool, error) {
	pc := cfg.dbConfig.Copy()
	pc.MaxConns = int32(maxConns)
	pc.ConnConfig.RuntimeParams["application_name"] += " " + name
	// A context that ends inside a query cancels the query instead of
	// closing the connection. Not for the LISTEN and lock sessions, which
	// wait idle: an idle backend ignores a cancel, and they would notice
	// their context only after the handler's 5-second deadline.
	pc.ConnConfig.BuildContextWatcherHandler = pipeline.CancelQueryOnContextEnd
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("create %s pool: %w", name, err)
	}
	return pool, nil
}

// closePool closes pool, giving up after a second: a connection held by work
// that was left behind after the grace period (see startstop.AbandonAfter)
// never comes back, and pgxpool's Close waits for every one.
func closePool(pool *pgxpool.Pool) {
	closed := make(chan struct{})
	go func() {
		pool.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(time.Second):
	}
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
