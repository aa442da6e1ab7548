package main

import (
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/metrics"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/statuspage"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// testPipelineDeps are the dependencies of a pipeline configuration under
// test: nothing in them connects anywhere.
func testPipelineDeps() pipelineDeps {
	logger := slog.New(slog.DiscardHandler)
	return pipelineDeps{
		logger:  logger,
		handler: orders.NewHandler(logger),
		build:   "test-build",
		process: "host:42",
		metrics: metrics.New(nil, logger, time.Second, "test-build", metrics.Options{}),
		tracer:  tracing.PropagateOnly(),
	}
}

// loadTestConfig is the serve configuration of env and nothing else.
func loadTestConfig(t *testing.T, env map[string]string) *config {
	t.Helper()
	cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
	require.NoError(t, err)
	return cfg
}

// withoutFuncs checks that pc's functions are set and clears them, with its
// listener's connection config (which it returns), so that the rest
// compares with require.Equal.
func withoutFuncs(t *testing.T, pc *pipeline.Config) (listenApplicationName string) {
	t.Helper()
	require.NotNil(t, pc.Worker.Observe, "the worker's Observe")
	require.NotNil(t, pc.Ingest.Observe, "ingest's Observe")
	require.NotNil(t, pc.Relay.OnPublished, "the relay's OnPublished")
	require.Equal(t, reflect.ValueOf(orders.OrderingKey).Pointer(), reflect.ValueOf(pc.Ingest.OrderingKey).Pointer(), "ingest's OrderingKey")
	pc.Worker.Observe, pc.Ingest.Observe, pc.Ingest.OrderingKey, pc.Relay.OnPublished = nil, nil, nil, nil
	if pc.Janitor != nil {
		require.NotNil(t, pc.Janitor.Observe, "the janitor's Observe")
		pc.Janitor.Observe = nil
	}
	require.NotNil(t, pc.Listen)
	name := pc.Listen.RuntimeParams["application_name"]
	pc.Listen = nil
	return name
}

func TestServePipelineConfigDefaults(t *testing.T) {
	cfg := loadTestConfig(t, map[string]string{
		"DATABASE_URL": "postgres://inboxd@db.example:5432/shop",
		"AMQP_URL":     "amqp://guest@mq.example:5672/",
	})
	d := testPipelineDeps()
	got := pipelineConfig(cfg, d)
	require.Equal(t, "inboxd listener", withoutFuncs(t, got))
	require.Equal(t, "inboxd", cfg.dbConfig.ConnConfig.RuntimeParams["application_name"], "the listener's config is a copy")
	require.Equal(t, &pipeline.Config{
		Logger: d.logger,
		Worker: &inbox.WorkerConfig{
			Handler:        d.handler,
			Logger:         d.logger,
			Concurrency:    inbox.ConcurrencyDefault,
			BatchSize:      inbox.BatchSizeDefault,
			PollInterval:   inbox.PollIntervalDefault,
			HandlerTimeout: inbox.HandlerTimeoutDefault,
			MaxAttempts:    inbox.MaxAttemptsDefault,
			RetryBase:      retry.BaseDefault,
			RetryMax:       retry.MaxDefault,
			ClaimLease:     inbox.ClaimLeaseDefault,
			Process:        "host:42",
			Build:          "test-build",
			Tracer:         d.tracer,
		},
		Ingest: &ingest.Config{
			URL:              "amqp://guest@mq.example:5672/",
			Logger:           d.logger,
			ConnectionName:   "inboxd ingest host:42",
			QueueType:        broker.QueueTypeQuorum,
			Partitions:       1,
			BatchSize:        ingest.BatchSizeDefault,
			Linger:           ingest.LingerDefault,
			MaxInflightBytes: ingest.MaxInflightBytesDefault,
			MaxMessageBytes:  ingest.MaxMessageBytesDefault,
			Heartbeat:        broker.HeartbeatDefault,
			StoreTimeout:     ingest.StoreTimeoutDefault,
			Tracer:           d.tracer,
		},
		Relay: &outbox.RelayConfig{
			URL:            "amqp://guest@mq.example:5672/",
			Logger:         d.logger,
			ConnectionName: "inboxd relay host:42",
			QueueType:      broker.QueueTypeQuorum,
			BatchSize:      outbox.BatchSizeDefault,
			MaxAttempts:    outbox.MaxAttemptsDefault,
			PollInterval:   inbox.PollIntervalDefault,
			Lease:          outbox.LeaseDefault,
			RetryBase:      retry.BaseDefault,
			RetryMax:       retry.MaxDefault,
			Heartbeat:      broker.HeartbeatDefault,
			Tracer:         d.tracer,
		},
		Janitor: &janitor.Config{
			Logger:        d.logger,
			Retention:     janitor.RetentionDefault,
			DeadRetention: janitor.DeadRetentionDefault,
			DedupeWindow:  janitor.DedupeWindowDefault,
			Interval:      janitor.IntervalDefault,
			BatchSize:     janitor.BatchSizeDefault,
		},
	}, got)
	require.Equal(t, poolSizes{
		ingest:      ingestPoolSize,
		worker:      inbox.ConcurrencyDefault + 2,
		relay:       relayPoolSize,
		maintenance: maintenancePoolSize,
		gauges:      gaugesPoolSize,
		status:      statuspage.PoolSizeDefault,
		ready:       readyPoolSize,
	}, poolSizesFor(cfg))
}

func TestServePipelineConfigFromEverySetting(t *testing.T) {
	cfg := loadTestConfig(t, map[string]string{
		"DATABASE_URL":                    "postgres://inboxd@db.example:5432/shop?application_name=shop",
		"AMQP_URL":                        "amqps://inboxd@mq.example:5671/orders",
		"INBOX_STATUS_PAGE":               "false",
		"INBOX_QUEUE_TYPE":                "classic",
		"INBOX_PARTITIONS":                "6",
		"INBOX_INGEST_BATCH_SIZE":         "123",
		"INBOX_INGEST_LINGER":             "7ms",
		"INBOX_INGEST_MAX_INFLIGHT_BYTES": "33554432",
		"INBOX_PREFETCH":                  "17",
		"INBOX_MAX_MESSAGE_BYTES":         "65536",
		"INBOX_DERIVE_MISSING_MESSAGE_ID": "true",
		"INBOX_AMQP_HEARTBEAT":            "3s",
		"INBOX_INGEST_STORE_TIMEOUT":      "4s",
		"INBOX_WORKERS":                   "7",
		"INBOX_WORKER_BATCH_SIZE":         "250",
		"INBOX_POLL_INTERVAL":             "300ms",
		"INBOX_HANDLER_TIMEOUT":           "11s",
		"INBOX_MAX_ATTEMPTS":              "6",
		"INBOX_RETRY_BASE":                "200ms",
		"INBOX_RETRY_MAX":                 "90s",
		"INBOX_CLAIM_LEASE":               "8s",
		"INBOX_RELAY_MAX_ATTEMPTS":        "7",
		"INBOX_RELAY_BATCH_SIZE":          "400",
		"INBOX_RELAY_LEASE":               "45s",
		"INBOX_RETENTION":                 "100h",
		"INBOX_DEDUPE_WINDOW":             "168h",
		"INBOX_DEAD_RETENTION":            "200h",
		"INBOX_JANITOR_INTERVAL":          "2m",
		"INBOX_JANITOR_BATCH_SIZE":        "500",
	})
	d := testPipelineDeps()
	got := pipelineConfig(cfg, d)
	require.Equal(t, "shop listener", withoutFuncs(t, got))
	require.Equal(t, &pipeline.Config{
		Logger: d.logger,
		Worker: &inbox.WorkerConfig{
			Handler:        d.handler,
			Logger:         d.logger,
			Concurrency:    7,
			BatchSize:      250,
			PollInterval:   300 * time.Millisecond,
			HandlerTimeout: 11 * time.Second,
			MaxAttempts:    6,
			RetryBase:      200 * time.Millisecond,
			RetryMax:       90 * time.Second,
			ClaimLease:     8 * time.Second,
			Process:        "host:42",
			Build:          "test-build",
			Tracer:         d.tracer,
		},
		Ingest: &ingest.Config{
			URL:                    "amqps://inboxd@mq.example:5671/orders",
			Logger:                 d.logger,
			ConnectionName:         "inboxd ingest host:42",
			QueueType:              broker.QueueTypeClassic,
			Partitions:             6,
			BatchSize:              123,
			Linger:                 7 * time.Millisecond,
			Prefetch:               17,
			MaxInflightBytes:       32 << 20,
			MaxMessageBytes:        64 << 10,
			DeriveMissingMessageID: true,
			Heartbeat:              3 * time.Second,
			StoreTimeout:           4 * time.Second,
			Tracer:                 d.tracer,
		},
		Relay: &outbox.RelayConfig{
			URL:            "amqps://inboxd@mq.example:5671/orders",
			Logger:         d.logger,
			ConnectionName: "inboxd relay host:42",
			QueueType:      broker.QueueTypeClassic,
			BatchSize:      400,
			MaxAttempts:    7,
			PollInterval:   300 * time.Millisecond,
			Lease:          45 * time.Second,
			RetryBase:      200 * time.Millisecond,
			RetryMax:       90 * time.Second,
			Heartbeat:      3 * time.Second,
			Tracer:         d.tracer,
		},
		Janitor: &janitor.Config{
			Logger:        d.logger,
			Retention:     100 * time.Hour,
			DeadRetention: 200 * time.Hour,
			DedupeWindow:  168 * time.Hour,
			Interval:      2 * time.Minute,
			BatchSize:     500,
		},
	}, got)
	// Seven batches in flight, the takeover and the answer of left requests; no status page.
	require.Equal(t, poolSizes{ingest: ingestPoolSize, worker: 9, relay: relayPoolSize, maintenance: maintenancePoolSize,
		gauges: gaugesPoolSize, ready: readyPoolSize}, poolSizesFor(cfg))
}

func TestServePipelineConfigWithoutJanitor(t *testing.T) {
	cfg := loadTestConfig(t, map[string]string{
		"DATABASE_URL":           "postgres://inboxd@db.example:5432/shop",
		"AMQP_URL":               "amqp://guest@mq.example:5672/",
		"INBOX_JANITOR_INTERVAL": "0",
	})
	require.Nil(t, pipelineConfig(cfg, testPipelineDeps()).Janitor)
}

func TestServePoolsAttached(t *testing.T) {
	ps := &pools{ingest: &pgxpool.Pool{}, worker: &pgxpool.Pool{}, relay: &pgxpool.Pool{}, maintenance: &pgxpool.Pool{},
		gauges: &pgxpool.Pool{}, status: &pgxpool.Pool{}, ready: &pgxpool.Pool{}}
	pc := &pipeline.Config{}
	ps.attach(pc)
	require.Same(t, ps.ingest, pc.IngestPool)
	require.Same(t, ps.worker, pc.WorkerPool)
	require.Same(t, ps.relay, pc.RelayPool)
	require.Same(t, ps.maintenance, pc.MaintenancePool, "the janitor and the leader's other maintenance have a pool of their own")
	measured := ps.measured()
	require.Len(t, measured, 5)
	require.Same(t, ps.ingest, measured["ingest"])
	require.Same(t, ps.worker, measured["worker"])
	require.Same(t, ps.relay, measured["relay"])
	require.Same(t, ps.maintenance, measured["maintenance"])
	require.Same(t, ps.gauges, measured["gauges"])
}

// Every connection serve makes watches its network at both ends (see
// pgsession.WatchNetwork), and checks its client while a statement runs.
func TestServeSessionsWatchTheirNetwork(t *testing.T) {
	cfg := loadTestConfig(t, map[string]string{
		"DATABASE_URL": "postgres://inboxd@db.example:5432/shop",
		"AMQP_URL":     "amqp://guest@mq.example:5672/",
	})
	cc := cfg.dbConfig.Copy().ConnConfig
	require.NotNil(t, cc.DialFunc, "dialled with keepalive and a user timeout")
	for name, want := range map[string]string{
		"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2", "tcp_keepalives_count": "3",
		"tcp_user_timeout": "10000", "client_connection_check_interval": "1000",
	} {
		require.Equal(t, want, cc.RuntimeParams[name], name)
	}
}

// Only the relay's transactions wait on something outside PostgreSQL (the
// broker's confirms): every other pool's sessions carry the short
// idle-in-transaction limit, so that a frozen replica holds what they
// locked for seconds (TestAFrozenLeaderHoldsUpInsertsForSecondsOnly shows
// it of the maintenance's from outside).
func TestOnlyTheRelaysTransactionsMayIdleLong(t *testing.T) {
	cfg := loadTestConfig(t, map[string]string{
		"DATABASE_URL":                    "postgres://inboxd@db.example:5432/shop",
		"AMQP_URL":                        "amqp://guest@mq.example:5672/",
		"INBOX_STATUS_PAGE":               "true",
		"INBOX_IDLE_IN_TX_TIMEOUT":        "60s",
		"INBOX_WORKER_IDLE_IN_TX_TIMEOUT": "5s",
	})
	ps, err := openPools(t.Context(), cfg) // connects nothing yet
	require.NoError(t, err)
	defer ps.close()
	for name, pool := range map[string]*pgxpool.Pool{
		"ingest": ps.ingest, "worker": ps.worker, "relay": ps.relay, "maintenance": ps.maintenance,
		"gauges": ps.gauges, "status": ps.status, "ready": ps.ready,
	} {
		require.NotNil(t, pool, name)
		want := "5000"
		if name == "relay" {
			want = "60000"
		}
		require.Equal(t, want, pool.Config().ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"], name)
	}
}
