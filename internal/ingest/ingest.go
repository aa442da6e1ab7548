// Package ingest moves deliveries from the broker into the inbox table,
// acknowledging each only once its row has committed.
package ingest

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// maxMessageIDBytes is the longest message_id (and type) ingest stores.
const maxMessageIDBytes = 255

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

// Config configures a Ingest.
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
	// ahead. Defaults to MaxInflightBytes / MaxMessageBytes (256 with the
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
}

func (c *Config) withDefaults() (*Config, error) {
	out := *c
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.ConnectionName = cmp.Or(out.ConnectionName, "inboxd ingest")
	out.QueueType = cmp.Or(out.QueueType, broker.QueueTypeQuorum)
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
	case out.BatchSize < 1, out.Prefetch < 1, out.MaxMessageBytes < 1, out.MaxInflightBytes < 1:
		return nil, errors.New("ingest: BatchSize, Prefetch, MaxMessageBytes and MaxInflightBytes must be positive")
	case out.Linger <= 0, out.Heartbeat <= 0, out.StoreTimeout <= 0:
		return nil, errors.New("ingest: Linger, Heartbeat and StoreTimeout must be positive")
	}
	return &out, nil
}

// Ingest is the ingest side of the inbox. It consumes broker.QueueInbox, stores
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
	pool    *pgxpool.Pool
	cfg     *Config
	logger  *slog.Logger
	queries *dbsqlc.Queries

	consuming atomic.Bool

	service startstop.Service
}

// New returns a Ingest that stores deliveries through pool.
func New(pool *pgxpool.Pool, cfg *Config) (*Ingest, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Ingest{
		pool:    pool,
		cfg:     c,
		logger:  c.Logger.With(slog.String("component", "inbox.ingest")),
		queries: dbsqlc.New(),
	}, nil
}

// Consuming reports whether the consumer is registered with the broker:
// receiving, or standing by while another process is the queue's single
// active consumer.
func (c *Ingest) Consuming() bool { return c.consuming.Load() }

// Start connects in the background and returns at once.
func (c *Ingest) Start(ctx context.Context) error {
	return c.service.Start(ctx, c.run)
}

// Stop stores and acknowledges the batch in hand and closes the connection;
// the broker requeues the deliveries it had sent ahead, for the next
// consumer. When ctx ends first, the batches in
// flight are abandoned unacknowledged (the broker redelivers them), and Stop
// returns once the connection is closed.
func (c *Ingest) Stop(ctx context.Context) {
	c.service.StopOrLog(ctx, c.logger)
}

func (c *Ingest) run(fetchCtx, workCtx context.Context) {
	retry.Reconnect(fetchCtx, retry.ReconnectConfig{
		ResetAfter: retry.SessionResetAfter,
		Logger:     c.logger, Message: "broker session ended, reconnecting",
	}, func(fetchCtx context.Context) error { return c.session(fetchCtx, workCtx) })
}

// session runs one connection: it declares the topology and consumes on one
// channel until the connection or the channel fails, or until fetchCtx ends.
func (c *Ingest) session(fetchCtx, workCtx context.Context) error {
	conn, err := broker.Dial(c.cfg.URL, c.cfg.ConnectionName, c.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	// Dead letters go out on a connection of their own: under a memory or
	// disk alarm the broker blocks publishing connections, and this one
	// carries the acks of everything ingest stores.
	pubConn, err := broker.Dial(c.cfg.URL, c.cfg.ConnectionName+" dead letters", c.cfg.Heartbeat)
	if err != nil {
		return err
	}
	defer func() { _ = pubConn.Close() }()
	pubClosed := pubConn.NotifyClose(make(chan *amqp.Error, 1))
	// Past the grace period nothing waits on the broker: closing the
	// connections ends every publish, confirm and read in flight.
	defer context.AfterFunc(workCtx, func() { broker.CloseHard(conn, pubConn) })()

	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := broker.DeclareTopology(ch, c.cfg.QueueType); err != nil {
		return err
	}
	_ = ch.Close()

	sessCtx, cancel := context.WithCancelCause(fetchCtx)
	defer cancel(nil)
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		err := c.consume(sessCtx, workCtx, conn, pubConn)
		if err == nil && fetchCtx.Err() == nil {
			err = errors.New("consumer stopped")
		}
		cancel(err)
	}()
	c.logger.Info("connected to broker")
	select {
	case amqpErr := <-connClosed:
		cancel(closedError("connection", amqpErr))
	case amqpErr := <-pubClosed:
		cancel(closedError("dead-letter connection", amqpErr))
	case <-sessCtx.Done():
	}
	<-consumed
	if fetchCtx.Err() != nil {
		return nil
	}
	return context.Cause(sessCtx)
}

// consume runs the consuming channel and its batches. Batches are stored one
// after the other, each after the one before it has committed, so that the
// inbox's ids follow the order in which the broker delivered the messages.
func (c *Ingest) consume(sessCtx, workCtx context.Context, conn, pubConn *amqp.Connection) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	cancelled := ch.NotifyCancel(make(chan string, 1))
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}

	// Dead letters are published in confirm mode, on the other connection.
	dlch, err := pubConn.Channel()
	if err != nil {
		return fmt.Errorf("open dead-letter channel: %w", err)
	}
	defer func() { _ = dlch.Close() }()
	if err := dlch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	// A dead letter no queue takes comes back (mandatory); a batch has at
	// most BatchSize of them, drained after each.
	dlReturns := dlch.NotifyReturn(make(chan amqp.Return, c.cfg.BatchSize))

	tag := c.cfg.ConnectionName
	deliveries, err := ch.Consume(broker.QueueInbox, tag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %q: %w", broker.QueueInbox, err)
	}
	c.consuming.Store(true)
	defer c.consuming.Store(false)

	b := &batch{consumer: c, ch: ch, dlch: dlch, dlReturns: dlReturns, stopping: sessCtx.Done()}
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return c.channelError(chClosed, "delivery channel closed")
			}
			b.add(d)
			if len(b.deliveries) == 1 {
				linger.Reset(c.cfg.Linger)
			}
			// Stored at once when full, when it holds half of what the
			// broker may send ahead (the other half keeps coming while it
			// is stored), when its bodies reach half the budget, or
			// when it holds a body over the limit (dead-lettered, and so
			// released, at once).
			if len(b.deliveries) >= min(c.cfg.BatchSize, max(c.cfg.Prefetch/2, 1)) ||
				b.bytes >= c.cfg.MaxInflightBytes/2 || len(d.Body) > c.cfg.MaxMessageBytes {
				linger.Stop()
				if err := b.flush(workCtx); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := b.flush(workCtx); err != nil {
				return err
			}
		case amqpErr := <-chClosed:
			return closedError("channel", amqpErr)
		case <-cancelled:
			return errors.New("consumer cancelled by the broker (queue deleted?)")
		case <-sessCtx.Done():
			// Store the batch in hand, then close the channel without
			// cancelling first: the broker requeues what it sent ahead and
			// gives it, before anything newer, to the next consumer. After a
			// cancel it would pick the next consumer at once, which could
			// store newer messages of an order before these.
			return b.flush(workCtx)
		}
	}
}

// closedError says what closed, and why when the broker said.
func closedError(what string, amqpErr *amqp.Error) error {
	if amqpErr == nil {
		return errors.New(what + " closed")
	}
	return fmt.Errorf("%s closed: %w", what, amqpErr)
}

func (c *Ingest) channelError(chClosed <-chan *amqp.Error, fallback string) error {
	select {
	case amqpErr := <-chClosed:
		if amqpErr != nil {
			return fmt.Errorf("channel closed: %w", amqpErr)
		}
	default:
	}
	return errors.New(fallback)
}

// batch accumulates deliveries of one channel until they are flushed.
type batch struct {
	consumer   *Ingest
	ch         *amqp.Channel
	dlch       *amqp.Channel
	dlReturns  <-chan amqp.Return
	deliveries []amqp.Delivery
	bytes      int // of the deliveries' bodies
	// stopping is closed when the session ends: a failing store is then not
	// retried, and its deliveries go back to the queue.
	stopping <-chan struct{}
}

func (b *batch) add(d amqp.Delivery) {
	b.deliveries = append(b.deliveries, d)
	b.bytes += len(d.Body)
}

// reset empties the batch, letting go of its bodies.
func (b *batch) reset() {
	clear(b.deliveries)
	b.deliveries, b.bytes = b.deliveries[:0], 0
}

// row is a delivery that can be stored.
type row struct {
	messageID, messageType, routingKey, orderKey string
	payload                                      []byte
	delivery                                     int // index in batch.deliveries
	// trace is the delivery's W3C trace context (zero when it had none, or
	// a malformed one).
	trace tracing.Text
}

// rejection is a delivery that cannot be stored, with the reason.
type rejection struct {
	delivery amqp.Delivery
	reason   string
}

// flush stores the batch, dead-letters what cannot be stored, and then
// acknowledges every delivery of the batch with one multiple ack. It returns
// an error, leaving the batch unacknowledged, only when the channel or the
// stop deadline ended the attempt.
func (b *batch) flush(ctx context.Context) error {
	if len(b.deliveries) == 0 {
		return nil
	}
	c := b.consumer
	rows := make([]row, 0, len(b.deliveries))
	var rejects []rejection
	var origins []tracing.Text
	for i, d := range b.deliveries {
		r, reason := c.classify(d)
		if reason != "" {
			rejects = append(rejects, rejection{delivery: d, reason: reason})
			continue
		}
		r.delivery = i
		rows = append(rows, r)
		if !r.trace.IsZero() {
			origins = append(origins, r.trace)
		}
	}
	ctx, span := c.cfg.Tracer.StartReceive(ctx, broker.QueueInbox, len(b.deliveries), origins)
	defer span.End()

	res, err := c.storeUntilDone(ctx, b, rows)
	if err != nil {
		tracing.Fail(span, err)
		return err
	}
	inserted, dbRejects := res.inserted, res.rejects
	for _, i := range dbRejects {
		rejects = append(rejects, rejection{delivery: b.deliveries[rows[i].delivery], reason: "refused by the database"})
	}
	if len(rejects) > 0 {
		if err := c.deadLetter(ctx, b.dlch, b.dlReturns, rejects); err != nil {
			return fmt.Errorf("dead-letter %d deliveries: %w", len(rejects), err)
		}
	}
	last := b.deliveries[len(b.deliveries)-1]
	if err := last.Ack(true); err != nil {
		return fmt.Errorf("ack batch: %w", err)
	}
	c.logger.DebugContext(ctx, "batch stored",
		slog.Int("deliveries", len(b.deliveries)),
		slog.Int("inserted", inserted),
		slog.Int("duplicates", len(rows)-len(dbRejects)-inserted),
		slog.Int("dead_lettered", len(rejects)))
	if c.cfg.Observe != nil {
		c.cfg.Observe(Stats{
			Deliveries:   len(b.deliveries),
			Inserted:     inserted,
			Duplicates:   len(rows) - len(dbRejects) - inserted,
			DeadLettered: len(rejects),
			Conflicts:    res.conflicts,
		})
	}
	b.reset()
	if inserted > 0 && c.cfg.OnStored != nil {
		c.cfg.OnStored()
	}
	return nil
}

// classify turns a delivery into a row, or says why it cannot be stored.
func (c *Ingest) classify(d amqp.Delivery) (row, string) {
	if len(d.Body) > c.cfg.MaxMessageBytes {
		return row{}, fmt.Sprintf("message too large: %d bytes, the limit is %d", len(d.Body), c.cfg.MaxMessageBytes)
	}
	msgType := cmp.Or(d.Type, d.RoutingKey)
	if msgType == "" {
		return row{}, "no message type: neither a type property nor a routing key"
	}
	if !validText(msgType) {
		return row{}, "message type is not valid UTF-8 text or is too long"
	}
	id := d.MessageId
	if id == "" {
		if !c.cfg.DeriveMissingMessageID {
			return row{}, "missing message_id"
		}
		sum := sha256.New()
		sum.Write([]byte(msgType))
		sum.Write([]byte{0})
		sum.Write(d.Body)
		id = "sha256:" + hex.EncodeToString(sum.Sum(nil))
	}
	if !validText(id) {
		return row{}, "message_id is not valid UTF-8 text or is too long"
	}
	r := row{
		messageID:   id,
		messageType: msgType,
		routingKey:  strings.ToValidUTF8(strings.ReplaceAll(d.RoutingKey, "\x00", ""), "?"),
		payload:     d.Body,
		trace:       tracing.FromHeaders(d.Headers),
	}
	if c.cfg.OrderingKey != nil {
		if key := c.cfg.OrderingKey(msgType, d.Body); validText(key) {
			r.orderKey = key
		}
	}
	return r, ""
}

// validText reports whether s can be stored in a text column as an id.
func validText(s string) bool {
	return len(s) <= maxMessageIDBytes && utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// stored is what storing a batch of rows came to.
type stored struct {
	// inserted counts the new inbox rows; conflicts the duplicates whose
	// payload differs from the stored one.
	inserted, conflicts int
	// rejects are the indexes of rows the database refused as data (never
	// retried; they are dead-lettered).
	rejects []int
}

// storeUntilDone stores rows, retrying with backoff while the database is
// unreachable: the deliveries stay unacknowledged and no more are taken from
// this channel meanwhile, so ingest pauses instead of failing them. It gives
// up when ctx ends, the session stops or the channel closes (the broker then
// redelivers).
func (c *Ingest) storeUntilDone(ctx context.Context, b *batch, rows []row) (stored, error) {
	for attempt := 1; ; attempt++ {
		res, err := c.store(ctx, rows)
		if err == nil {
			return res, nil
		}
		select {
		case <-b.stopping:
			return stored{}, fmt.Errorf("store batch: %w", err)
		default:
		}
		if ctx.Err() != nil || b.ch.IsClosed() {
			return stored{}, fmt.Errorf("store batch: %w", err)
		}
		delay := retry.Backoff(attempt, 100*time.Millisecond, 5*time.Second)
		c.logger.ErrorContext(ctx, "store batch failed, holding deliveries and retrying",
			slog.Int("rows", len(rows)), slog.String("error", err.Error()), slog.Duration("retry_in", delay))
		if !retry.Sleep(ctx, delay) {
			return stored{}, fmt.Errorf("store batch: %w", err)
		}
	}
}

// store inserts rows in one statement. If the database refuses the batch's
// data, it inserts the rows one by one to find the ones at fault.
//
// A failure whose outcome is unknown (the connection dropped around the
// commit) is safe to retry: rows that did commit come back as duplicates.
func (c *Ingest) store(ctx context.Context, rows []row) (stored, error) {
	if len(rows) == 0 {
		return stored{}, nil
	}
	res, err := c.insert(ctx, rows)
	if err == nil {
		return res, nil
	}
	if !isDataError(err) {
		return stored{}, err
	}
	c.logger.WarnContext(ctx, "database refused a batch, storing its rows one by one", slog.String("error", err.Error()))
	res = stored{}
	for i := range rows {
		one, err := c.insert(ctx, rows[i:i+1])
		switch {
		case isDataError(err):
			c.logger.WarnContext(rows[i].trace.Context(ctx), "database refused a message", slog.String("message_id", rows[i].messageID), slog.String("error", err.Error()))
			res.rejects = append(res.rejects, i)
		case err != nil:
			return stored{}, err
		default:
			res.inserted += one.inserted
			res.conflicts += one.conflicts
		}
	}
	return res, nil
}

// insert stores rows with one INSERT ... ON CONFLICT DO NOTHING, then looks
// at the duplicates, if any, for conflicting payloads.
func (c *Ingest) insert(ctx context.Context, rows []row) (stored, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.StoreTimeout)
	defer cancel()
	p := dbsqlc.InboxInsertManyParams{
		MessageIds:   make([]string, len(rows)),
		MessageTypes: make([]string, len(rows)),
		RoutingKeys:  make([]string, len(rows)),
		Payloads:     make([][]byte, len(rows)),
		OrderKeys:    make([]string, len(rows)),
		Traceparents: make([]string, len(rows)),
		Tracestates:  make([]string, len(rows)),
	}
	for i, r := range rows {
		p.MessageIds[i], p.MessageTypes[i], p.RoutingKeys[i], p.Payloads[i] = r.messageID, r.messageType, r.routingKey, r.payload
		p.OrderKeys[i] = r.orderKey
		p.Traceparents[i], p.Tracestates[i] = r.trace.Traceparent, r.trace.Tracestate
	}
	ids, err := c.queries.InboxInsertMany(ctx, c.pool, p)
	if err != nil {
		return stored{}, err
	}
	res := stored{inserted: len(ids)}
	if len(ids) == len(rows) {
		return res, nil
	}
	// The first row with each inserted id is the one stored; every other
	// row is a duplicate, of a message stored earlier or in this batch.
	fresh := make(map[string]bool, len(ids))
	for _, id := range ids {
		fresh[id] = true
	}
	var dups dbsqlc.InboxRecordConflictsParams
	for _, r := range rows {
		if fresh[r.messageID] {
			delete(fresh, r.messageID)
			continue
		}
		dups.MessageIds = append(dups.MessageIds, r.messageID)
		dups.MessageTypes = append(dups.MessageTypes, r.messageType)
		dups.Payloads = append(dups.Payloads, r.payload)
	}
	// The insert has committed: retry only this statement while the store
	// timeout allows, so that a failure here does not send the whole batch
	// round again (its new rows would then count as duplicates).
	var conflicts []dbsqlc.InboxRecordConflictsRow
	for attempt := 1; ; attempt++ {
		conflicts, err = c.queries.InboxRecordConflicts(ctx, c.pool, dups)
		if err == nil {
			break
		}
		if isDataError(err) || !retry.Sleep(ctx, retry.Backoff(attempt, 50*time.Millisecond, time.Second)) {
			return stored{}, fmt.Errorf("record conflicting duplicates: %w", err)
		}
	}
	for _, cf := range conflicts {
		res.conflicts += int(cf.Deliveries)
		c.logger.WarnContext(ctx, "message id arrived again with a different payload: the stored payload is kept, the delivery recorded in inbox_conflicts",
			slog.String("message_id", cf.MessageID),
			slog.String("stored_sha256", cf.StoredSha256),
			slog.String("conflicting_sha256", cf.ConflictingSha256),
			slog.Int("deliveries", int(cf.Deliveries)))
	}
	return res, nil
}

// isDataError reports whether err is PostgreSQL refusing the data itself
// (SQLSTATE classes 22 and 23), which no retry can fix.
func isDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")
}

// deadLetter publishes rejected deliveries to broker.ExchangeDeadLetter with the
// reason in a header, and waits for the broker to confirm every publish. A
// dead letter that no queue took is an error: the batch then stays
// unacknowledged, and the next session declares broker.QueueDead again.
func (c *Ingest) deadLetter(ctx context.Context, dlch *amqp.Channel, returns <-chan amqp.Return, rejects []rejection) error {
	pub := broker.Publisher{Ch: dlch}
	for _, r := range rejects {
		d := r.delivery
		headers := amqp.Table{}
		for k, v := range d.Headers {
			headers[k] = v
		}
		headers[broker.HeaderRejectReason] = r.reason
		headers[broker.HeaderOriginalExchange] = d.Exchange
		headers[broker.HeaderOriginalRoutingKey] = d.RoutingKey
		err := pub.Publish(ctx, broker.ExchangeDeadLetter, d.RoutingKey, true, amqp.Publishing{
			Headers:         headers,
			ContentType:     d.ContentType,
			ContentEncoding: d.ContentEncoding,
			DeliveryMode:    amqp.Persistent,
			CorrelationId:   d.CorrelationId,
			MessageId:       d.MessageId,
			Timestamp:       d.Timestamp,
			Type:            d.Type,
			AppId:           d.AppId,
			Body:            d.Body,
		})
		if err != nil {
			return err
		}
		c.logger.WarnContext(tracing.FromHeaders(d.Headers).Context(ctx), "delivery dead-lettered",
			slog.String("message_id", d.MessageId), slog.String("routing_key", d.RoutingKey),
			slog.Int("bytes", len(d.Body)), slog.String("reason", r.reason))
	}
	if err := pub.Wait(ctx); err != nil {
		if errors.Is(err, broker.ErrNacked) {
			return errors.New("broker refused a dead letter")
		}
		return err
	}
	// A return comes before the confirm of its publish.
	n := len(broker.DrainReturns(returns))
	if n > 0 {
		return fmt.Errorf("%d dead letters returned unroutable: is %s missing?", n, broker.QueueDead)
	}
	return nil
}
