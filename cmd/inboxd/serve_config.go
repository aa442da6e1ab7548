package main

import (
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/metrics"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// pipelineDeps is what the pipeline's configuration takes from outside the
// settings: where its services log and trace, what handles the orders, the
// names they record, and the metrics they report to.
type pipelineDeps struct {
	logger  *slog.Logger
	handler inbox.Handler
	build   string
	process string
	metrics *metrics.Metrics
	tracer  *tracing.Tracer
}

// pipelineConfig maps the settings in cfg onto the configuration of each of
// the pipeline's services. It opens nothing: the pools are attached apart
// (pools.attach), so that where each setting lands is tested without a
// server.
func pipelineConfig(cfg *config, d pipelineDeps) *pipeline.Config {
	return &pipeline.Config{
		Logger:  d.logger,
		Listen:  sessionConfig(cfg, "listener"),
		Worker:  workerConfig(cfg, d),
		Ingest:  ingestConfig(cfg, d),
		Relay:   relayConfig(cfg, d),
		Janitor: janitorConfig(cfg, d),
	}
}

// sessionConfig is the connection config of a session of its own outside the
// pools (the notifier's LISTEN, the leader's lock), named for what it is for.
func sessionConfig(cfg *config, name string) *pgx.ConnConfig {
	c := cfg.dbConfig.ConnConfig.Copy()
	c.RuntimeParams["application_name"] += " " + name
	return c
}

func workerConfig(cfg *config, d pipelineDeps) *inbox.WorkerConfig {
	return &inbox.WorkerConfig{
		Handler:        d.handler,
		Logger:         d.logger,
		Concurrency:    cfg.workers,
		BatchSize:      cfg.workerBatchSize,
		PollInterval:   cfg.pollInterval,
		HandlerTimeout: cfg.handlerTimeout,
		MaxAttempts:    cfg.maxAttempts,
		RetryBase:      cfg.retryBase,
		RetryMax:       cfg.retryMax,
		ClaimLease:     cfg.claimLease,
		Process:        d.process,
		Build:          d.build,
		Observe:        d.metrics.ObserveBatch,
		Tracer:         d.tracer,
	}
}

func ingestConfig(cfg *config, d pipelineDeps) *ingest.Config {
	c := ingestSettings(cfg, d.logger, "inboxd ingest "+d.process)
	c.Observe = d.metrics.ObserveIngest
	c.Tracer = d.tracer
	return c
}

// ingestSettings is the ingest configuration the settings in cfg make,
// without the service's metrics and tracer: serve's, and repartition's
// (which drains a former layout with it).
func ingestSettings(cfg *config, logger *slog.Logger, connectionName string) *ingest.Config {
	return &ingest.Config{
		URL:                    cfg.amqpURL,
		Logger:                 logger,
		ConnectionName:         connectionName,
		QueueType:              cfg.queueType,
		Partitions:             cfg.partitions,
		BatchSize:              cfg.ingestBatchSize,
		Linger:                 cfg.ingestLinger,
		Prefetch:               cfg.prefetch,
		MaxInflightBytes:       cfg.maxInflightBytes,
		MaxMessageBytes:        cfg.maxMessageBytes,
		DeriveMissingMessageID: cfg.deriveMessageID,
		Heartbeat:              cfg.amqpHeartbeat,
		StoreTimeout:           cfg.ingestStoreTimeout,
		OrderingKey:            orders.OrderingKey,
		ReplyPolicy:            broker.ReplyPolicy{QueuePrefixes: cfg.replyQueuePrefixes},
	}
}

func relayConfig(cfg *config, d pipelineDeps) *outbox.RelayConfig {
	return &outbox.RelayConfig{
		URL:            cfg.amqpURL,
		Logger:         d.logger,
		ConnectionName: "inboxd relay " + d.process,
		QueueType:      cfg.queueType,
		ReplyPolicy:    broker.ReplyPolicy{QueuePrefixes: cfg.replyQueuePrefixes},
		BatchSize:      cfg.relayBatchSize,
		MaxAttempts:    cfg.relayMaxAttempts,
		PollInterval:   cfg.pollInterval,
		Lease:          cfg.relayLease,
		RetryBase:      cfg.retryBase,
		RetryMax:       cfg.retryMax,
		Heartbeat:      cfg.amqpHeartbeat,
		OnPublished:    d.metrics.ObservePublished,
		Tracer:         d.tracer,
	}
}

// janitorConfig is nil, no janitor in this process, when
// INBOX_JANITOR_INTERVAL is 0.
func janitorConfig(cfg *config, d pipelineDeps) *janitor.Config {
	if cfg.janitorInterval <= 0 {
		return nil
	}
	return &janitor.Config{
		Logger:        d.logger,
		Retention:     cfg.retention,
		DeadRetention: cfg.deadRetention,
		DedupeWindow:  cfg.dedupeWindow,
		Interval:      cfg.janitorInterval,
		BatchSize:     cfg.janitorBatch,
		Observe:       d.metrics.ObserveJanitor,
	}
}
