// Package outbox publishes the effects that leave the service. Handlers write
// them to the outbox table in the same transaction as the state they follow
// from; the Relay publishes them to RabbitMQ afterwards, marking them
// published in a transaction of its own that commits once the broker has
// confirmed them.
package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Defaults of RelayConfig.
const (
	BatchSizeDefault      = 1000
	PollIntervalDefault   = time.Second
	LeaseDefault          = 30 * time.Second
	ConfirmTimeoutDefault = 10 * time.Second
	MaxAttemptsDefault    = 5
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// URL is the AMQP URL of the broker. Required.
	URL string
	// Logger receives the relay's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// ConnectionName is shown by the broker for the relay's connection.
	// Defaults to "inboxd relay".
	ConnectionName string
	// QueueType is the type of the queues the relay declares with the rest
	// of the topology. Defaults to broker.QueueTypeQuorum.
	QueueType string
	// ReplyPolicy says where replies may go; a reply row whose reply_to it
	// does not allow (stored by an earlier build, or written by hand) is
	// refused, not sent, and ends undeliverable after MaxAttempts. Ingest
	// stores no request for such an address. Defaults to direct reply-to
	// only.
	ReplyPolicy broker.ReplyPolicy
	// BatchSize is the most rows claimed and published at once. Defaults to
	// BatchSizeDefault (1,000): a round of confirms costs the same for one row as for a thousand.
	BatchSize int
	// PollInterval is how often the relay looks for rows when nothing has
	// woken it. Defaults to 1 second.
	PollInterval time.Duration
	// Lease is how long a claim left by a relay of an earlier release (which
	// claimed rows in a transaction of their own) is respected; a row whose
	// relay died is published again, under the same message id, once it has
	// passed. This release's relays hold their rows by a row lock, which
	// ends with their connection. Defaults to 30 seconds.
	Lease time.Duration
	// Now, when set, is the clock the Lease and the retry delays are
	// measured against; tests set it forward instead of waiting a lease or
	// a delay out. Nil, as the service leaves it, means the database's clock
	// (now()).
	Now func() time.Time
	// FloorKeptElsewhere leaves the outbox's claim floor to a keeper run
	// elsewhere (claimfloor.OutboxKeeper, run by the elected leader: see
	// internal/pipeline). When false, the relay raises the floor itself.
	FloorKeptElsewhere bool
	// ConfirmTimeout bounds the wait for the broker's confirms of a batch.
	// Defaults to 10 seconds.
	ConfirmTimeout time.Duration
	// RetryBase and RetryMax bound the delay before a row whose publish
	// failed is tried again. Default to retry.BaseDefault and
	// retry.MaxDefault (1 second and 5 minutes), as the inbox worker's.
	RetryBase, RetryMax time.Duration
	// MaxAttempts is how many attempts a row the relay refuses to send (see
	// outbox_dead) gets before it ends dead, holding back the later rows of
	// its order until an operator replays it, and how many a reply the
	// broker returns (its requester is gone) gets before it ends
	// undeliverable. Failures that retrying may cure (the broker away, a
	// missing confirm, an event's return) never end an event.
	// Defaults to MaxAttemptsDefault (5).
	MaxAttempts int
	// Heartbeat is the AMQP heartbeat interval. Defaults to 10 seconds.
	Heartbeat time.Duration
	// OnPublished, when set, is told how many rows each batch published
	// (confirmed and marked). It must not block.
	OnPublished func(n int)
	// Tracer starts the send span of each batch. Defaults to
	// tracing.PropagateOnly(). Whatever it is, each event carries the trace
	// context stored with its row as its traceparent and tracestate headers.
	Tracer *tracing.Tracer
}

func (c *RelayConfig) withDefaults() (*RelayConfig, error) {
	out := *c
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.ConnectionName = cmp.Or(out.ConnectionName, "inboxd relay")
	out.QueueType = cmp.Or(out.QueueType, broker.QueueTypeQuorum)
	out.BatchSize = cmp.Or(out.BatchSize, BatchSizeDefault)
	out.PollInterval = cmp.Or(out.PollInterval, PollIntervalDefault)
	out.Lease = cmp.Or(out.Lease, LeaseDefault)
	out.ConfirmTimeout = cmp.Or(out.ConfirmTimeout, ConfirmTimeoutDefault)
	out.RetryBase = cmp.Or(out.RetryBase, retry.BaseDefault)
	out.RetryMax = cmp.Or(out.RetryMax, retry.MaxDefault)
	out.Heartbeat = cmp.Or(out.Heartbeat, broker.HeartbeatDefault)
	out.MaxAttempts = cmp.Or(out.MaxAttempts, MaxAttemptsDefault)
	out.Tracer = cmp.Or(out.Tracer, tracing.PropagateOnly())
	switch {
	case out.URL == "":
		return nil, errors.New("relay: URL is required")
	case out.BatchSize < 1:
		return nil, fmt.Errorf("relay: BatchSize must be at least 1, got %d", out.BatchSize)
	case out.MaxAttempts < 1:
		return nil, fmt.Errorf("relay: MaxAttempts must be at least 1, got %d", out.MaxAttempts)
	case out.PollInterval <= 0, out.Lease <= 0, out.ConfirmTimeout <= 0, out.RetryBase <= 0, out.RetryMax < out.RetryBase, out.Heartbeat <= 0:
		return nil, errors.New("relay: durations must be positive, RetryMax at least RetryBase")
	}
	return &out, nil
}

// Relay publishes outbox rows to broker.ExchangeEvents (replies to their
// requesters, through the default exchange) as persistent messages whose
// AMQP message_id is the row's idempotency key, with publisher confirms. It marks a batch published in a transaction that locks the rows
// and commits only once the broker has confirmed them, so each row is
// written once, and nobody sees it published before it is. Several relays,
// in several processes, can share one outbox: each skips the rows another
// holds, and takes an order's rows only once its earlier ones are published
// or taken in the same batch, which it publishes in id order on one
// channel. So the events of one order leave in the order the handler wrote
// them. A relay that dies between publishing and committing leaves its rows
// unpublished and unlocked; they are published again, under the same
// message ids, so consumers can drop the copies.
type Relay struct {
	pool    *pgxpool.Pool
	cfg     *RelayConfig
	logger  *slog.Logger
	queries *dbsqlc.Queries
	wake    chan struct{}

	connected  atomic.Bool
	unroutable atomic.Int64
	// alarm is the current session's: whether the broker blocks its
	// connection.
	alarm atomic.Pointer[broker.Alarm]
	// floor raises the claim floor the claims scan from; nil when it is
	// kept elsewhere (FloorKeptElsewhere).
	floor *claimfloor.Keeper

	service startstop.Service
}

// NewRelay returns a Relay that reads the outbox through pool.
func NewRelay(pool *pgxpool.Pool, cfg *RelayConfig) (*Relay, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Relay{
		pool:    pool,
		cfg:     c,
		logger:  c.Logger.With(slog.String("component", "outbox.relay")),
		queries: dbsqlc.New(),
		wake:    make(chan struct{}, 1),
	}
	if !c.FloorKeptElsewhere {
		r.floor = claimfloor.OutboxKeeper(pool, r.logger)
	}
	return r, nil
}

// Notify wakes the relay to look for rows. It never blocks.
func (r *Relay) Notify() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Unroutable returns how many events wait in broker.QueueUnroutable, as last
// seen: events no binding of broker.ExchangeEvents routed. It is read when the
// relay connects and on every idle poll.
func (r *Relay) Unroutable() int64 { return r.unroutable.Load() }

// countUnroutable reads the depth of broker.QueueUnroutable. An error means
// the channel is gone (a missing queue closes it; the next session
// declares the queue again).
func (r *Relay) countUnroutable(ch *amqp.Channel) error {
	q, err := ch.QueueDeclarePassive(broker.QueueUnroutable, true, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("count unroutable events: %w", err)
	}
	r.unroutable.Store(int64(q.Messages))
	return nil
}

// Connected reports whether the relay holds a broker connection.
func (r *Relay) Connected() bool { return r.connected.Load() }

// Blocked reports whether the broker blocks the relay's connection (a
// memory or disk alarm), and why: the relay then publishes nothing and
// holds no transaction open until the alarm clears.
func (r *Relay) Blocked() (bool, string) { return r.alarm.Load().Active() }

// Start connects in the background and returns at once.
func (r *Relay) Start(ctx context.Context) error {
	return r.service.Start(ctx, func(ctx, workCtx context.Context) {
		var wg sync.WaitGroup
		if r.floor != nil {
			wg.Go(startstop.Guard(func() { r.floor.Run(ctx) }))
		}
		r.run(ctx, workCtx)
		wg.Wait()
	})
}

// Stop stops the relay after the batch in flight, or when ctx ends. The rows
// of an unfinished batch stay unpublished, and are published again.
func (r *Relay) Stop(ctx context.Context) {
	r.service.StopOrLog(ctx, r.logger)
}

func (r *Relay) run(ctx, workCtx context.Context) {
	retry.Reconnect(ctx, retry.ReconnectConfig{
		ResetAfter: retry.SessionResetAfter,
		Logger:     r.logger, Message: "relay session ended, reconnecting",
	}, func(ctx context.Context) error {
		defer r.connected.Store(false)
		return r.session(ctx, workCtx)
	})
}

// session publishes on one connection until it fails or ctx ends; workCtx
// bounds finishing the batch in flight.
func (r *Relay) session(ctx, workCtx context.Context) error {
	conn, err := broker.Dial(r.cfg.URL, r.cfg.ConnectionName, r.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	// Past the grace period nothing waits on the broker (a publish blocked
	// by a memory alarm, say): closing the connection ends it.
	defer context.AfterFunc(workCtx, func() { broker.CloseHard(conn) })()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := broker.DeclareShared(ch, r.cfg.QueueType); err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	// Each publish of a batch is returned at most once, and the returns
	// are drained after every batch.
	returns := ch.NotifyReturn(make(chan amqp.Return, r.cfg.BatchSize))
	if err := r.countUnroutable(ch); err != nil {
		return err
	}
	alarm := broker.WatchAlarm(conn, r.logger, "relay")
	r.alarm.Store(alarm)
	defer r.alarm.Store(nil)
	r.connected.Store(true)
	r.logger.Info("relay connected to broker")
	return r.publishLoop(ctx, workCtx, ch, closed, returns, alarm)
}

// waitUnblocked returns once alarm is not active, or with false when ctx
// ends, or with the channel's error when it closes. Nothing is claimed and
// nothing is asked of the broker meanwhile: a blocked connection answers
// nothing, and a claim would hold its rows and a snapshot for as long.
func waitUnblocked(ctx context.Context, alarm *broker.Alarm, closed <-chan *amqp.Error) (bool, error) {
	for {
		changed := alarm.Changed()
		if active, _ := alarm.Active(); !active {
			return true, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false, nil
		case amqpErr := <-closed:
			return false, fmt.Errorf("channel closed: %v", amqpErr)
		}
	}
}

// publishLoop publishes batch after batch on ch, waiting for a wake-up or
// the poll when the outbox has nothing due, until ctx ends or the channel
// fails. A failed claim is retried after a backoff, on the same channel.
func (r *Relay) publishLoop(ctx, workCtx context.Context, ch *amqp.Channel, closed <-chan *amqp.Error, returns <-chan amqp.Return, alarm *broker.Alarm) error {
	// Every PollInterval, busy or not, the unroutable count is read again.
	housekeep := func() error { return r.countUnroutable(ch) }
	poll := time.NewTicker(r.cfg.PollInterval)
	defer poll.Stop()
	claimFailures := retry.Failures{Policy: retry.Transient}
	for {
		if ok, err := waitUnblocked(ctx, alarm, closed); !ok {
			return err
		}
		select {
		case <-poll.C:
			if err := housekeep(); err != nil {
				return err
			}
		default:
		}
		n, err := r.publishBatch(ctx, workCtx, ch, returns, alarm)
		if claimErr := (claimError{}); errors.As(err, &claimErr) {
			if !claimFailures.Wait(ctx, r.logger, "claim outbox rows", claimErr.err) {
				return nil
			}
			continue
		}
		if err != nil {
			return err
		}
		claimFailures.Reset()
		if n > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case amqpErr := <-closed:
			return fmt.Errorf("channel closed: %v", amqpErr)
		case <-r.wake:
		case <-alarm.Changed():
		case <-poll.C:
			if active, _ := alarm.Active(); active {
				continue
			}
			if err := housekeep(); err != nil {
				return err
			}
		}
	}
}
