package main

import (
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// simplest is the simplest correct inbox for the orders domain: the ruler
// the domain and steady scenarios hold inboxd against, on the same traffic
// in the same run, so that each inboxd figure reads as a ratio to what the
// textbook pattern costs on this machine. It runs in the bench process, on
// a schema of its own (simplest.sql) and a virtual host of its own:
//
//   - Ingest consumes its queue on one channel with inboxd's default
//     prefetch (ingest's 256 MiB in-flight budget over 1 MiB bodies: 256)
//     and stores a batch as inboxd's ingest does, at half the prefetch
//     (128) or after ingest.LingerDefault, with one INSERT … ON CONFLICT
//     (message_id) DO NOTHING over unnest arrays; it acknowledges the batch
//     with one multiple ack after that statement has committed.
//   - Workers, as many as inboxd's default (inbox.ConcurrencyDefault), each
//     claim up to 500 pending rows in id order FOR UPDATE SKIP LOCKED, and
//     in the same transaction handle them set-based (decoded by
//     internal/orders' decoders, as inboxd's handler decodes them), write
//     the orders, stock, reservations and events, and mark them processed.
//   - The relay claims up to 500 unpublished outbox rows FOR UPDATE SKIP
//     LOCKED, publishes them with publisher confirms to an events exchange
//     of its own, and marks them published in the same transaction once
//     the broker has confirmed them all.
//   - Wake-ups are LISTEN/NOTIFY: the statement that stores deliveries, and
//     the one that adds events, notify at commit (the payload is the
//     schema, so the ruler ignores other schemas' wake-ups); a poll every
//     inbox.PollIntervalDefault is the fallback.
//
// Its sessions are set up as inboxd's (pipeline.ConfigureSession): on a
// schema nobody analyzes (this machine runs without autovacuum) their plans
// are the same shape as inboxd's, and neither side is measured with a plan
// the other was spared.
//
// Why it is correct, exactly-once effects: a delivery is acknowledged only
// after its row has committed, so none is lost; a redelivered or duplicate
// message id meets the unique message_id and is dropped; a message's
// effects and its processed mark commit in one transaction, and its row
// stays locked until then, so a crash or a rollback leaves it pending with
// no effect and nothing is done twice. The orders, reservations and outbox
// keep their own uniqueness too: an order re-sent under a new message id
// is confirmed and reserved once. Events leave at least once, each with its
// idempotency key (message id and event type) as its AMQP message_id, for
// consumers to dedupe on. A deadlock between two workers (an order's
// cancellation and its order.created in two batches at once) rolls one
// batch back whole, and it is claimed again.
//
// What it leaves out of inboxd's promises, none of which the bench's
// traffic needs to come out right:
//
//   - ordering per order: two workers may handle an order's messages out of
//     order. A cancellation handled before its order records the order
//     cancelled, and the order.created then does nothing.
//   - attempts, backoff and dead messages: a message that does not decode,
//     or has an unknown type, is marked processed with no effect; any other
//     failure stops the ruler, and the bench with it.
//   - the dedupe window past the inbox rows (the key ledger), retention,
//     replay, claim floors and leases, lock timeouts and the stock rows'
//     bounded waits, replies, tracing, metrics.
//   - dead letters: a delivery without a message id is rejected without
//     requeue, and the ruler's queue has no dead-letter exchange.
//   - reconnects: a lost connection stops the ruler.
type simplest struct {
	pool     *pgxpool.Pool
	listener *pgx.Conn
	// consumeConn carries ingest, publishConn the relay: publishing and
	// consuming on one connection would let a blocked publisher block acks.
	consumeConn, publishConn *amqp.Connection
	deliveries               <-chan amqp.Delivery
	events                   *amqp.Channel
	schema                   string

	// ctx ends when the ruler stops or fails; its cause is the failure.
	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	workerWake []chan struct{}
	relayWake  chan struct{}

	// delivered counts the deliveries acknowledged, dropped those rejected
	// (no message id), retried the batches rolled back by a deadlock.
	delivered, dropped, retried atomic.Int64
}

// The ruler's RabbitMQ names, in a virtual host of its own.
const (
	// simplestQueue is its inbox queue, bound to broker.ExchangeOrders as
	// inboxd's is.
	simplestQueue = "simplest.inbox"
	// simplestEvents is the exchange its relay publishes to; an event no
	// binding takes goes through simplestUnroutable to its queue, as
	// inboxd's do, so that the broker does the same work for either.
	simplestEvents     = "simplest.events"
	simplestUnroutable = "simplest.unroutable"
)

// The ruler's sizes: inboxd's defaults, and the batch of 500 its claims
// take (inboxd's worker and relay take up to 1,000; in the steady scenario
// both take far fewer at a time).
var (
	simplestPrefetch   = ingest.MaxInflightBytesDefault / ingest.MaxMessageBytesDefault
	simplestStoreBatch = min(ingest.BatchSizeDefault, simplestPrefetch/2)
	simplestWorkers    = inbox.ConcurrencyDefault
)

const (
	simplestClaim = 500
	// The channels the ruler's statements notify at commit.
	simplestInboxTopic  = "simplest_inbox"
	simplestOutboxTopic = "simplest_outbox"
)

//go:embed simplest.sql
var simplestSchema string

// createSimplest creates the ruler's tables in the schema pool's sessions
// use, and its exchanges and queues in the virtual host at amqpURL.
func createSimplest(ctx context.Context, pool *pgxpool.Pool, amqpURL string) error {
	if _, err := pool.Exec(ctx, simplestSchema); err != nil {
		return fmt.Errorf("create the simplest inbox's tables: %w", err)
	}
	conn, err := broker.Dial(amqpURL, "inboxbench simplest topology", 0)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := declareSimplest(ch); err != nil {
		return fmt.Errorf("declare the simplest inbox's topology: %w", err)
	}
	return nil
}

// declareSimplest declares on ch the orders exchange, the ruler's inbox
// queue bound to it as inboxd's is, and its events exchange, whose
// unroutable events go to a queue as inboxd's do.
func declareSimplest(ch *amqp.Channel) error {
	quorum := amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	if err := ch.ExchangeDeclare(broker.ExchangeOrders, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(simplestQueue, true, false, false, false, quorum); err != nil {
		return err
	}
	for _, key := range []string{orders.TypeOrderCreated, orders.TypeOrderCancelled} {
		if err := ch.QueueBind(simplestQueue, key, broker.ExchangeOrders, false, nil); err != nil {
			return err
		}
	}
	if err := ch.ExchangeDeclare(simplestUnroutable, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(simplestUnroutable, true, false, false, false, quorum); err != nil {
		return err
	}
	if err := ch.QueueBind(simplestUnroutable, "", simplestUnroutable, false, nil); err != nil {
		return err
	}
	return ch.ExchangeDeclare(simplestEvents, amqp.ExchangeTopic, true, false, false, false, amqp.Table{"alternate-exchange": simplestUnroutable})
}

// startSimplest starts the ruler on the schema at dbURL and the virtual
// host at amqpURL, both made by createSimplest. It runs until stop, or
// until it fails: then its ctx ends, with the failure as the cause.
func startSimplest(ctx context.Context, dbURL, amqpURL string) (s *simplest, err error) {
	s = &simplest{relayWake: make(chan struct{}, 1)}
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	defer func() {
		if err != nil {
			s.cancel(err)
			s.close()
		}
	}()
	// A batch's transaction each for the workers, and one each for ingest
	// and the relay.
	if s.pool, err = openPool(ctx, dbURL, int32(simplestWorkers+2)); err != nil {
		return s, err
	}
	if err = s.pool.QueryRow(ctx, "SELECT current_schema()").Scan(&s.schema); err != nil {
		return s, err
	}
	if s.listener, err = pgx.Connect(ctx, dbURL); err != nil {
		return s, err
	}
	for _, topic := range []string{simplestInboxTopic, simplestOutboxTopic} {
		if _, err = s.listener.Exec(ctx, "LISTEN "+topic); err != nil {
			return s, err
		}
	}
	if err = s.openBroker(amqpURL); err != nil {
		return s, err
	}
	for range simplestWorkers {
		s.workerWake = append(s.workerWake, make(chan struct{}, 1))
	}
	s.run(s.listen)
	s.run(s.ingest)
	for _, wake := range s.workerWake {
		s.run(func(ctx context.Context) error { return s.loop(ctx, wake, s.workOnce) })
	}
	s.run(func(ctx context.Context) error { return s.loop(ctx, s.relayWake, s.relayOnce) })
	return s, nil
}

// openBroker opens the consuming and the publishing connections.
func (s *simplest) openBroker(amqpURL string) (err error) {
	if s.consumeConn, err = broker.Dial(amqpURL, "inboxbench simplest ingest", broker.HeartbeatDefault); err != nil {
		return err
	}
	if s.deliveries, err = consume(s.consumeConn, simplestQueue, simplestPrefetch); err != nil {
		return err
	}
	if s.publishConn, err = broker.Dial(amqpURL, "inboxbench simplest relay", broker.HeartbeatDefault); err != nil {
		return err
	}
	if s.events, err = s.publishConn.Channel(); err != nil {
		return err
	}
	return s.events.Confirm(false)
}

// run runs loop until the ruler stops; an error it returns before then
// stops the ruler, as its cause.
func (s *simplest) run(loop func(context.Context) error) {
	s.wg.Go(func() {
		if err := loop(s.ctx); err != nil && s.ctx.Err() == nil {
			s.cancel(err)
		}
	})
}

// errSimplestStopped is the cause of the ruler's end when stop ended it.
var errSimplestStopped = errors.New("simplest inbox stopped")

// stop stops the ruler, waits for its loops and closes its connections. It
// returns what made it fail before, if anything did.
func (s *simplest) stop() error {
	s.cancel(errSimplestStopped)
	s.wg.Wait()
	s.close()
	fmt.Fprintf(os.Stderr, "inboxbench: simplest inbox: %d deliveries stored or dropped as duplicates, %d rejected without a message id, %d batches rolled back by a deadlock and retried\n",
		s.delivered.Load(), s.dropped.Load(), s.retried.Load())
	if err := context.Cause(s.ctx); !errors.Is(err, errSimplestStopped) {
		return fmt.Errorf("simplest inbox: %w", err)
	}
	return nil
}

func (s *simplest) close() {
	for _, c := range []*amqp.Connection{s.consumeConn, s.publishConn} {
		if c != nil {
			_ = c.Close()
		}
	}
	if s.listener != nil {
		_ = s.listener.Close(context.Background())
	}
	if s.pool != nil {
		s.pool.Close()
	}
}

// listen wakes the workers when new messages were stored, and the relay
// when events were added.
func (s *simplest) listen(ctx context.Context) error {
	for {
		n, err := s.listener.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for a notification: %w", err)
		}
		if n.Payload != s.schema {
			continue
		}
		wakes := []chan struct{}{s.relayWake}
		if n.Channel == simplestInboxTopic {
			wakes = s.workerWake
		}
		for _, w := range wakes {
			select {
			case w <- struct{}{}:
			default:
			}
		}
	}
}

// loop runs once (a worker's or the relay's batch) again at once while it
// takes full batches, else when woken or polled; a deadlock rolls back the
// batch, which is tried again.
func (s *simplest) loop(ctx context.Context, wake <-chan struct{}, once func(context.Context) (int, error)) error {
	poll := time.NewTicker(inbox.PollIntervalDefault)
	defer poll.Stop()
	for {
		n, err := once(ctx)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "40P01" { // deadlock_detected
			s.retried.Add(1)
			continue
		}
		if err != nil {
			return err
		}
		if n == simplestClaim {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-poll.C:
		}
	}
}

// ingest stores the deliveries in batches, each acknowledged once stored.
func (s *simplest) ingest(ctx context.Context) error {
	var batch []amqp.Delivery
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case d, ok := <-s.deliveries:
			if !ok {
				return errors.New("delivery channel closed")
			}
			batch = append(batch, d)
			if len(batch) == 1 {
				linger.Reset(ingest.LingerDefault)
			}
			if len(batch) < simplestStoreBatch {
				continue
			}
			linger.Stop()
		case <-linger.C:
		}
		if err := s.store(ctx, batch); err != nil {
			return err
		}
		clear(batch)
		batch = batch[:0]
	}
}

// simplestStore stores a batch of messages in delivery order, skipping the
// ids stored already, and notifies the workers at commit when it stored
// any.
const simplestStore = `
WITH stored AS (
    INSERT INTO inbox (message_id, message_type, payload)
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[])
    ON CONFLICT (message_id) DO NOTHING
    RETURNING 1)
SELECT pg_notify('` + simplestInboxTopic + `', current_schema()) FROM (SELECT 1 FROM stored LIMIT 1) AS any_stored`

// store inserts batch with one statement (its own transaction), then
// acknowledges it with one multiple ack. A delivery without a message id
// is rejected, without requeue.
func (s *simplest) store(ctx context.Context, batch []amqp.Delivery) error {
	var ids, types []string
	var payloads [][]byte
	var last *amqp.Delivery
	for i, d := range batch {
		if d.MessageId == "" {
			if err := d.Nack(false, false); err != nil {
				return err
			}
			s.dropped.Add(1)
			continue
		}
		ids = append(ids, d.MessageId)
		types = append(types, cmp.Or(d.Type, d.RoutingKey))
		payloads = append(payloads, d.Body)
		last = &batch[i]
	}
	if last == nil {
		return nil
	}
	if _, err := s.pool.Exec(ctx, simplestStore, ids, types, payloads); err != nil {
		return fmt.Errorf("store %d deliveries: %w", len(ids), err)
	}
	if err := last.Ack(true); err != nil {
		return fmt.Errorf("ack: %w", err)
	}
	s.delivered.Add(int64(len(ids)))
	return nil
}

// simplestMessage is a claimed inbox row.
type simplestMessage struct {
	ID          int64
	MessageID   string
	MessageType string
	Payload     []byte
}

// workOnce claims a batch, handles it and marks it processed, in one
// transaction, and returns how many messages it claimed.
func (s *simplest) workOnce(ctx context.Context) (int, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, _ := tx.Query(ctx, `SELECT id, message_id, message_type, payload FROM inbox
		WHERE processed_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED LIMIT `+fmt.Sprint(simplestClaim))
	msgs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[simplestMessage])
	if err != nil || len(msgs) == 0 {
		return 0, err
	}
	if err := handleOrders(ctx, tx, msgs); err != nil {
		return 0, err
	}
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	// The mark's own statement time, after the handling, as inboxd's
	// outcome statement records it: now() would be the transaction's
	// start, before the claim, and leave the claim and the handling out
	// of the ruler's latency.
	if _, err := tx.Exec(ctx, "UPDATE inbox SET processed_at = statement_timestamp() WHERE id = ANY($1)", ids); err != nil {
		return 0, fmt.Errorf("mark processed: %w", err)
	}
	return len(msgs), tx.Commit(ctx)
}

// simplestEvent is a claimed outbox row.
type simplestEvent struct {
	ID             int64
	IdempotencyKey string
	RoutingKey     string
	Payload        []byte
}

// relayOnce claims a batch of unpublished events, publishes them, and marks
// them published once the broker has confirmed every one, in one
// transaction. It returns how many it claimed.
func (s *simplest) relayOnce(ctx context.Context) (int, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, _ := tx.Query(ctx, `SELECT id, idempotency_key, routing_key, payload FROM outbox
		WHERE published_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED LIMIT `+fmt.Sprint(simplestClaim))
	events, err := pgx.CollectRows(rows, pgx.RowToStructByPos[simplestEvent])
	if err != nil || len(events) == 0 {
		return 0, err
	}
	pub := &broker.Publisher{Ch: s.events}
	ids := make([]int64, len(events))
	for i, e := range events {
		ids[i] = e.ID
		if err := pub.Publish(ctx, simplestEvents, e.RoutingKey, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: e.IdempotencyKey, Body: e.Payload,
		}); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
	}
	if err := pub.Wait(ctx); err != nil {
		return 0, fmt.Errorf("events not confirmed: %w", err)
	}
	if _, err := tx.Exec(ctx, "UPDATE outbox SET published_at = now() WHERE id = ANY($1)", ids); err != nil {
		return 0, fmt.Errorf("mark published: %w", err)
	}
	return len(events), tx.Commit(ctx)
}

// orderBatch is a claimed batch's order messages, decoded, and the events
// handling them adds.
type orderBatch struct {
	created   []createdMessage
	cancelled []cancelledMessage
	events    eventRows
}

type createdMessage struct {
	messageID string
	order     orders.OrderCreated
}

type cancelledMessage struct {
	messageID string
	cancel    orders.OrderCancelled
}

// handleOrders is the ruler's handler: what inboxd's orders handler does
// for the batch msgs, set-based. An order.created records its order unless
// it is recorded already, then reserves all its items' stock (locked in
// SKU order) or rejects it: order.confirmed and email.requested, or
// order.rejected. An order.cancelled cancels a confirmed order and gives
// its stock back, or records an order not seen yet as cancelled:
// order.cancelled.
func handleOrders(ctx context.Context, tx pgx.Tx, msgs []simplestMessage) error {
	b := decodeOrders(msgs)
	fresh, err := b.record(ctx, tx)
	if err != nil {
		return err
	}
	levels, err := b.lockStock(ctx, tx, fresh)
	if err != nil {
		return err
	}
	if err := b.reserve(ctx, tx, fresh, levels); err != nil {
		return err
	}
	if err := b.cancel(ctx, tx); err != nil {
		return err
	}
	return b.events.insert(ctx, tx)
}

// decodeOrders decodes msgs with the orders package's decoders; a message
// that does not decode, or of another type, is left out (processed, with
// no effect).
func decodeOrders(msgs []simplestMessage) *orderBatch {
	b := &orderBatch{}
	for _, m := range msgs {
		switch m.MessageType {
		case orders.TypeOrderCreated:
			if o, err := orders.DecodeOrderCreated(m.Payload); err == nil {
				b.created = append(b.created, createdMessage{m.MessageID, o})
			}
		case orders.TypeOrderCancelled:
			if c, err := orders.DecodeOrderCancelled(m.Payload); err == nil {
				b.cancelled = append(b.cancelled, cancelledMessage{m.MessageID, c})
			}
		}
	}
	return b
}

// record inserts the order.created messages' orders, in order id order (so
// that two batches inserting the same orders cannot deadlock), and returns
// the messages whose order it recorded.
func (b *orderBatch) record(ctx context.Context, tx pgx.Tx) ([]createdMessage, error) {
	if len(b.created) == 0 {
		return nil, nil
	}
	var orderIDs, messageIDs, userIDs, emails []string
	for _, m := range b.created {
		orderIDs = append(orderIDs, m.order.OrderID)
		messageIDs = append(messageIDs, m.messageID)
		userIDs = append(userIDs, m.order.UserID)
		emails = append(emails, m.order.Email)
	}
	rows, _ := tx.Query(ctx, `INSERT INTO order_confirmations (order_id, message_id, user_id, email, status)
		SELECT o, m, u, e, 'confirmed' FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS t(o, m, u, e) ORDER BY o
		ON CONFLICT (order_id) DO NOTHING
		RETURNING message_id`, orderIDs, messageIDs, userIDs, emails)
	inserted := map[string]bool{}
	var messageID string
	if _, err := pgx.ForEachRow(rows, []any{&messageID}, func() error { inserted[messageID] = true; return nil }); err != nil {
		return nil, fmt.Errorf("record orders: %w", err)
	}
	var fresh []createdMessage
	for _, m := range b.created {
		if inserted[m.messageID] {
			fresh = append(fresh, m)
		}
	}
	return fresh, nil
}

// lockStock locks, in SKU order, the stock rows the batch changes: the
// items of the orders it recorded, and what its cancellations' orders hold
// reserved. It returns their levels.
func (b *orderBatch) lockStock(ctx context.Context, tx pgx.Tx, fresh []createdMessage) (map[string]int64, error) {
	skus := map[string]bool{}
	for _, m := range fresh {
		for _, it := range m.order.Items {
			skus[it.SKU] = true
		}
	}
	if len(b.cancelled) > 0 {
		rows, _ := tx.Query(ctx, "SELECT DISTINCT sku FROM reservations WHERE order_id = ANY($1)", b.cancelledOrders())
		reserved, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("read reservations: %w", err)
		}
		for _, sku := range reserved {
			skus[sku] = true
		}
	}
	levels := map[string]int64{}
	if len(skus) == 0 {
		return levels, nil
	}
	rows, _ := tx.Query(ctx, "SELECT sku, available FROM stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE", slices.Sorted(maps.Keys(skus)))
	var sku string
	var available int64
	_, err := pgx.ForEachRow(rows, []any{&sku, &available}, func() error {
		levels[sku] = available
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("lock stock: %w", err)
	}
	return levels, nil
}

// reserve decides, in the batch's order, whether each order it recorded
// gets all its items (then their stock is taken and reserved) or is
// rejected, and writes what it decided with one statement each.
func (b *orderBatch) reserve(ctx context.Context, tx pgx.Tx, fresh []createdMessage, levels map[string]int64) error {
	var resOrders, resSKUs, takeSKUs, rejected []string
	var resQty []int64
	take := map[string]int64{}
	for _, m := range fresh {
		need := map[string]int64{}
		for _, it := range m.order.Items {
			need[it.SKU] += int64(it.Quantity)
		}
		if reason := shortOf(need, levels); reason != "" {
			rejected = append(rejected, m.order.OrderID)
			b.events.rejected(m, reason)
			continue
		}
		for _, sku := range slices.Sorted(maps.Keys(need)) {
			levels[sku] -= need[sku]
			take[sku] += need[sku]
			resOrders, resSKUs, resQty = append(resOrders, m.order.OrderID), append(resSKUs, sku), append(resQty, need[sku])
		}
		b.events.confirmed(m)
	}
	takeSKUs = slices.Sorted(maps.Keys(take))
	takeQty := make([]int64, len(takeSKUs))
	for i, sku := range takeSKUs {
		takeQty[i] = take[sku]
	}
	for _, st := range []struct {
		what, sql string
		args      []any
		skip      bool
	}{
		{"take stock", `UPDATE stock SET available = available - t.q
			FROM unnest($1::text[], $2::int8[]) AS t(sku, q) WHERE stock.sku = t.sku`, []any{takeSKUs, takeQty}, len(takeSKUs) == 0},
		{"record reservations", `INSERT INTO reservations (order_id, sku, quantity)
			SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])`, []any{resOrders, resSKUs, resQty}, len(resOrders) == 0},
		{"reject orders", `UPDATE order_confirmations SET status = 'rejected' WHERE order_id = ANY($1)`, []any{rejected}, len(rejected) == 0},
	} {
		if st.skip {
			continue
		}
		if _, err := tx.Exec(ctx, st.sql, st.args...); err != nil {
			return fmt.Errorf("%s: %w", st.what, err)
		}
	}
	return nil
}

// shortOf returns why stock at levels cannot give need (SKU to quantity),
// or "" when it can.
func shortOf(need, levels map[string]int64) string {
	for _, sku := range slices.Sorted(maps.Keys(need)) {
		have, ok := levels[sku]
		switch {
		case !ok:
			return "unknown SKU " + sku
		case have < need[sku]:
			return "insufficient stock for " + sku
		}
	}
	return ""
}

// cancelledOrders returns the orders the batch's cancellations name, once
// each, sorted.
func (b *orderBatch) cancelledOrders() []string {
	ids := map[string]bool{}
	for _, m := range b.cancelled {
		ids[m.cancel.OrderID] = true
	}
	return slices.Sorted(maps.Keys(ids))
}

// cancel applies the batch's cancellations: an order not recorded yet is
// recorded as cancelled; a confirmed one is cancelled and its reservations'
// stock given back. Either adds order.cancelled; a cancelled order's later
// cancellations, and a rejected order's, add nothing.
func (b *orderBatch) cancel(ctx context.Context, tx pgx.Tx) error {
	if len(b.cancelled) == 0 {
		return nil
	}
	first := map[string]cancelledMessage{} // the batch's first cancellation of each order
	for _, m := range slices.Backward(b.cancelled) {
		first[m.cancel.OrderID] = m
	}
	ids := b.cancelledOrders()
	messageIDs := make([]string, len(ids))
	for i, id := range ids {
		messageIDs[i] = first[id].messageID
	}
	rows, _ := tx.Query(ctx, `INSERT INTO order_confirmations (order_id, message_id, status)
		SELECT o, m, 'cancelled' FROM unnest($1::text[], $2::text[]) AS t(o, m) ORDER BY o
		ON CONFLICT (order_id) DO NOTHING
		RETURNING order_id`, ids, messageIDs)
	unseen, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("record cancelled orders: %w", err)
	}
	rows, _ = tx.Query(ctx, `UPDATE order_confirmations SET status = 'cancelled'
		WHERE order_id = ANY($1) AND status = 'confirmed' RETURNING order_id`, ids)
	cancelled, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("cancel orders: %w", err)
	}
	if len(cancelled) > 0 {
		if _, err := tx.Exec(ctx, `UPDATE stock SET available = stock.available + r.q
			FROM (SELECT sku, sum(quantity) AS q FROM reservations WHERE order_id = ANY($1) GROUP BY sku) AS r
			WHERE stock.sku = r.sku`, cancelled); err != nil {
			return fmt.Errorf("release stock: %w", err)
		}
	}
	for _, id := range slices.Sorted(slices.Values(append(unseen, cancelled...))) {
		b.events.cancelled(first[id])
	}
	return nil
}

// eventRows are the events a batch adds to the outbox, in the order the
// relay publishes them.
type eventRows struct {
	keys, routingKeys, payloads []string
}

// simplestOrderEvent and simplestEmail are the bodies of the events, as
// inboxd's orders handler writes them.
type simplestOrderEvent struct {
	EventType string        `json:"eventType"`
	OrderID   string        `json:"orderId"`
	UserID    string        `json:"userId,omitempty"`
	Email     string        `json:"email,omitempty"`
	Items     []orders.Item `json:"items,omitempty"`
	Reason    string        `json:"reason,omitempty"`
	MessageID string        `json:"messageId"`
}

type simplestEmail struct {
	EventType string `json:"eventType"`
	Template  string `json:"template"`
	OrderID   string `json:"orderId"`
	To        string `json:"to"`
	MessageID string `json:"messageId"`
}

// add adds the event routingKey with body, caused by the message messageID.
func (e *eventRows) add(messageID, routingKey string, body any) {
	b, err := json.Marshal(body)
	if err != nil {
		panic(fmt.Sprintf("marshal %s event: %v", routingKey, err)) // the event types always marshal
	}
	e.keys = append(e.keys, orders.IdempotencyKey(messageID, routingKey))
	e.routingKeys = append(e.routingKeys, routingKey)
	e.payloads = append(e.payloads, string(b))
}

func (e *eventRows) confirmed(m createdMessage) {
	o := m.order
	e.add(m.messageID, orders.EventOrderConfirmed, simplestOrderEvent{
		EventType: orders.EventOrderConfirmed, OrderID: o.OrderID, UserID: o.UserID, Email: o.Email, Items: o.Items, MessageID: m.messageID,
	})
	e.add(m.messageID, orders.EventEmailRequested, simplestEmail{
		EventType: orders.EventEmailRequested, Template: "order-confirmation", OrderID: o.OrderID, To: o.Email, MessageID: m.messageID,
	})
}

func (e *eventRows) rejected(m createdMessage, reason string) {
	o := m.order
	e.add(m.messageID, orders.EventOrderRejected, simplestOrderEvent{
		EventType: orders.EventOrderRejected, OrderID: o.OrderID, UserID: o.UserID, Items: o.Items, Reason: reason, MessageID: m.messageID,
	})
}

func (e *eventRows) cancelled(m cancelledMessage) {
	c := m.cancel
	e.add(m.messageID, orders.EventOrderCancelled, simplestOrderEvent{
		EventType: orders.EventOrderCancelled, OrderID: c.OrderID, Reason: c.Reason, MessageID: m.messageID,
	})
}

// insert writes the events with one statement, skipping keys the outbox
// holds already, and wakes the relay at commit when it wrote any.
func (e *eventRows) insert(ctx context.Context, tx pgx.Tx) error {
	if len(e.keys) == 0 {
		return nil
	}
	_, err := tx.Exec(ctx, `WITH inserted AS (
		    INSERT INTO outbox (idempotency_key, routing_key, payload)
		    SELECT k, r, p::jsonb FROM unnest($1::text[], $2::text[], $3::text[]) AS t(k, r, p)
		    ON CONFLICT (idempotency_key) DO NOTHING
		    RETURNING 1)
		SELECT pg_notify('`+simplestOutboxTopic+`', current_schema()) FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted`,
		e.keys, e.routingKeys, e.payloads)
	if err != nil {
		return fmt.Errorf("add events: %w", err)
	}
	return nil
}
