package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// TestDefaultsAgree checks that a configuration with nothing set passes the
// packages' own defaults, so that serve and a package left to its defaults
// (a test, the bench) behave alike, and help prints what serve uses.
func TestDefaultsAgree(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"DATABASE_URL": "postgres://u@localhost/db",
		"AMQP_URL":     "amqp://guest:guest@localhost:5672/",
	}
	cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
	require.NoError(t, err)

	require.Equal(t, broker.QueueTypeQuorum, cfg.queueType)
	require.Equal(t, broker.HeartbeatDefault, cfg.amqpHeartbeat)

	require.Equal(t, ingest.BatchSizeDefault, cfg.ingestBatchSize)
	require.Equal(t, ingest.LingerDefault, cfg.ingestLinger)
	require.Zero(t, cfg.prefetch, "ingest derives the prefetch")
	require.Equal(t, ingest.MaxInflightBytesDefault, cfg.maxInflightBytes)
	require.Equal(t, ingest.MaxMessageBytesDefault, cfg.maxMessageBytes)
	require.Equal(t, ingest.StoreTimeoutDefault, cfg.ingestStoreTimeout)

	require.Equal(t, inbox.ConcurrencyDefault, cfg.workers)
	require.Equal(t, inbox.BatchSizeDefault, cfg.workerBatchSize)
	require.Equal(t, inbox.PollIntervalDefault, cfg.pollInterval)
	require.Equal(t, inbox.HandlerTimeoutDefault, cfg.handlerTimeout)
	require.Equal(t, inbox.MaxAttemptsDefault, cfg.maxAttempts)
	require.Equal(t, inbox.ClaimLeaseDefault, cfg.claimLease)
	require.Equal(t, retry.BaseDefault, cfg.retryBase)
	require.Equal(t, retry.MaxDefault, cfg.retryMax)

	require.Equal(t, outbox.BatchSizeDefault, cfg.relayBatchSize)
	require.Equal(t, outbox.PollIntervalDefault, cfg.pollInterval)
	require.Equal(t, outbox.LeaseDefault, cfg.relayLease)

	require.Equal(t, janitor.IntervalDefault, cfg.janitorInterval)
	require.Equal(t, janitor.BatchSizeDefault, cfg.janitorBatch)
	require.Equal(t, janitor.RetentionDefault, cfg.retention)
	require.Equal(t, janitor.DeadRetentionDefault, cfg.deadRetention)
}
