// Package ingest moves deliveries from the broker into the inbox table,
// acknowledging each only once its row has committed.
package ingest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Defaults of Config.
const (
	// MaxMessageBytesDefault is the largest body ingest stores.
	MaxMessageBytesDefault = 1 << 20
	// MaxInflightBytesDefault bounds the bodies ingest holds unacked.
	MaxInflightBytesDefault = 256 << 20
	BatchSizeDefault        = 500
	LingerDefault           = 5 * time.Millisecond
	StoreTimeoutDefault     = 10 * time.Second
)

// Config configures an Ingest.
type Config struct {
	// URL is the AMQP URL of the broker. Required.
	URL string
	// Logger receives the consumer's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// ConnectionName is shown by the broker for the consumer's connection.
	// Defaults to "inboxd ingest".
	ConnectionName string
	// QueueType is the type of the declared queues, broker.QueueTypeQuorum or
	// broker.QueueTypeClassic. Defaults to broker.QueueTypeQuorum.
	QueueType string
	// Partitions is the number of inbox queues (see broker.Topology), each
	// consumed on a channel of its own. Defaults to 1. With more than one,
	// a delivery without broker.HeaderOrderID, or whose header is not its
	// order key, is dead-lettered: it may sit in another queue than the
	// rest of its order.
	Partitions int
	// BatchSize is the most deliveries stored per insert. Defaults to 500.
	BatchSize int
	// Linger is how long a batch that is not full waits for more deliveries
	// before it is stored. Defaults to 5 milliseconds.
	Linger time.Duration
	// MaxInflightBytes bounds the bodies ingest holds at once, received and
	// not yet acknowledged: it sizes Prefetch, and a batch is stored once
	// its bodies reach half of it. The bound holds when the broker's own
	// max_message_size is MaxMessageBytes. Defaults to
	// MaxInflightBytesDefault (256 MiB).
	MaxInflightBytes int
	// Prefetch is the number of unacknowledged deliveries the broker may send
	// ahead, shared by the inbox queues (Prefetch/Partitions each, at least
	// 1). Defaults to MaxInflightBytes / MaxMessageBytes (256 with the
	// defaults), and at least 1.
	Prefetch int
	// MaxMessageBytes is the largest body stored; larger deliveries are
	// dead-lettered. Defaults to MaxMessageBytesDefault (1 MiB).
	MaxMessageBytes int
	// DeriveMissingMessageID, when true, gives a delivery without a
	// message_id the id "sha256:" + hex(SHA-256(type, NUL, body)), so identical
	// bodies of one type are treated as one message. When false (the default)
	// such deliveries are dead-lettered.
	DeriveMissingMessageID bool
	// Heartbeat is the AMQP heartbeat interval, which detects half-open
	// connections. Defaults to 10 seconds.
	Heartbeat time.Duration
	// StoreTimeout bounds one insert of a batch. Defaults to 10 seconds.
	StoreTimeout time.Duration
	// OnStored, when set, is called after a batch that added new rows has
	// committed. It must not block.
	OnStored func()
	// OrderingKey, when set, names the group a message belongs to (for
	// order messages, its order id): workers handle the messages of one
	// group one at a time, in the order ingest stored them. An empty key
	// orders the message with no other. It must not fail or block; a body
	// it cannot read has no key.
	OrderingKey func(messageType string, body []byte) string
	// Observe, when set, is told about every batch ingest acknowledged. It
	// must not block.
	Observe func(Stats)
	// ReplyPolicy says which reply_to addresses are answered: a request for
	// a reply to any other is not stored, and its message is handled as
	// usual. Defaults to direct reply-to only. A dead-lettered delivery's
	// requester is told so under the same policy.
	ReplyPolicy broker.ReplyPolicy
	// Tracer starts the receive span of each batch. Defaults to
	// tracing.PropagateOnly(). Whatever it is, the trace context of each
	// delivery is stored with its inbox row.
	Tracer *tracing.Tracer
}

// Stats describes one acknowledged ingest batch.
type Stats struct {
	// Deliveries is the size of the batch.
	Deliveries int
	// Inserted counts the new inbox rows, Duplicates the deliveries whose
	// message id was already stored, DeadLettered those sent to the
	// dead-letter exchange.
	Inserted, Duplicates, DeadLettered int
	// Conflicts counts the duplicates whose payload differs from the
	// stored one (recorded in inbox_conflicts; the stored payload stays).
	Conflicts int
	// RepliesNotAllowed counts the requests for a reply to an address
	// Config.ReplyPolicy does not allow; RepliesOfAnotherUser the copies
	// that asked for a reply under another AMQP user_id than the message's
	// first delivery. Neither is answered.
	RepliesNotAllowed, RepliesOfAnotherUser int
}

func (c *Config) withDefaults() (*Config, error) {
	out := *c
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.ConnectionName = cmp.Or(out.ConnectionName, "inboxd ingest")
	out.QueueType = cmp.Or(out.QueueType, broker.QueueTypeQuorum)
	out.Partitions = cmp.Or(out.Partitions, 1)
	out.BatchSize = cmp.Or(out.BatchSize, BatchSizeDefault)
	out.Linger = cmp.Or(out.Linger, LingerDefault)
	out.MaxMessageBytes = cmp.Or(out.MaxMessageBytes, MaxMessageBytesDefault)
	out.MaxInflightBytes = cmp.Or(out.MaxInflightBytes, MaxInflightBytesDefault)
	out.Prefetch = cmp.Or(out.Prefetch, min(max(out.MaxInflightBytes/out.MaxMessageBytes, 1), 65535))
	out.Heartbeat = cmp.Or(out.Heartbeat, broker.HeartbeatDefault)
	out.StoreTimeout = cmp.Or(out.StoreTimeout, StoreTimeoutDefault)
	out.Tracer = cmp.Or(out.Tracer, tracing.PropagateOnly())
	switch {
	case out.URL == "":
		return nil, errors.New("ingest: URL is required")
	case out.QueueType != broker.QueueTypeQuorum && out.QueueType != broker.QueueTypeClassic:
		return nil, fmt.Errorf("ingest: QueueType must be %q or %q, got %q", broker.QueueTypeQuorum, broker.QueueTypeClassic, out.QueueType)
	case out.Partitions < 1 || out.Partitions > broker.MaxPartitions:
		return nil, fmt.Errorf("ingest: Partitions must be 1 to %d, got %d", broker.MaxPartitions, out.Partitions)
	case out.BatchSize < 1, out.Prefetch < 1, out.MaxMessageBytes < 1, out.MaxInflightBytes < 1:
		return nil, errors.New("ingest: BatchSize, Prefetch, MaxMessageBytes and MaxInflightBytes must be positive")
	case out.Linger <= 0, out.Heartbeat <= 0, out.StoreTimeout <= 0:
		return nil, errors.New("ingest: Linger, Heartbeat and StoreTimeout must be positive")
	}
	return &out, nil
}

// Ingest is the ingest side of the inbox. It consumes the inbox queues
// (broker.InboxQueues), each on a channel of its own, stores
// each batch of deliveries with one INSERT ... ON CONFLICT DO NOTHING, and
// acknowledges the batch only after that insert has committed. Deliveries
// that cannot be stored (no message id, too large) are published to
// broker.ExchangeDeadLetter with the reason in broker.HeaderRejectReason, and acknowledged
// only once the broker has confirmed that publish.
//
// It reconnects with backoff whenever the connection or a channel closes and
// redeclares the topology each time. A delivery is only ever acknowledged on
// the channel that delivered it.
type Ingest struct {
	cfg    *Config
	logger *slog.Logger
	store  *store

	// notAllowed are the reply_to addresses refused so far (logged once).
	notAllowed onceSet

	// consuming counts the inbox queues whose consumer is registered.
	consuming atomic.Int32
	// parts are the current session's inbox queues.
	parts atomic.Pointer[[]*partition]

	service startstop.Service
}

// New returns an Ingest that stores deliveries through pool.
func New(pool *pgxpool.Pool, cfg *Config) (*Ingest, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	logger := c.Logger.With(slog.String("component", "ingest"))
	return &Ingest{
		cfg:    c,
		logger: logger,
		store:  &store{pool: pool, queries: dbsqlc.New(), logger: logger, timeout: c.StoreTimeout},
	}, nil
}

// Consuming reports whether a consumer of every inbox queue is registered
// with the broker: receiving, or standing by while another process is the
// queue's single active consumer.
func (i *Ingest) Consuming() bool { return int(i.consuming.Load()) == i.cfg.Partitions }

// ActivePartitions returns how many inbox queues this process is the
// active consumer of, as far as it knows: those it received a delivery from
// since it last subscribed.
func (i *Ingest) ActivePartitions() int {
	parts := i.parts.Load()
	if parts == nil {
		return 0
	}
	n := 0
	for _, p := range *parts {
		if p.activeSince.Load() != 0 {
			n++
		}
	}
	return n
}

// Start connects in the background and returns at once.
func (i *Ingest) Start(ctx context.Context) error {
	return i.service.Start(ctx, i.run)
}

// Stop stores and acknowledges the batch in hand and closes the connection;
// the broker requeues the deliveries it had sent ahead, for the next
// consumer. When ctx ends first, the batches in
// flight are abandoned unacknowledged (the broker redelivers them), and Stop
// returns once the connection is closed.
func (i *Ingest) Stop(ctx context.Context) {
	i.service.StopOrLog(ctx, i.logger)
}

func (i *Ingest) run(fetchCtx, workCtx context.Context) {
	retry.Reconnect(fetchCtx, retry.ReconnectConfig{
		ResetAfter: retry.SessionResetAfter,
		Logger:     i.logger, Message: "broker session ended, reconnecting",
	}, func(fetchCtx context.Context) error { return i.session(fetchCtx, workCtx) })
}
