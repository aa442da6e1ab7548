// Command consumer is a downstream service of inboxd's events, meant to be
// copied. It shows the pattern inboxd itself follows, on the receiving side:
//
//   - it declares a durable queue of its own and binds it to the
//     `order-confirmation.events` topic exchange with the routing keys it
//     needs (`order.confirmed`, `order.rejected`, `order.cancelled`,
//     `email.requested`; `#` for all);
//   - it acks by hand, and only after its database transaction committed:
//     a crash before the ack means the broker delivers the event again;
//   - it dedupes by the AMQP message_id, the event's idempotency key
//     (`<inbox message id>:<event>`): inboxd publishes an event at least
//     once, and a republish after a crash carries the same id. The key is
//     inserted into its own table with INSERT … ON CONFLICT DO NOTHING in
//     the SAME transaction as the event's effect, so the effect and the
//     "seen" mark commit together or not at all; a key already there means
//     the effect is committed already, and the copy is acked and skipped.
//
// It prints one line per distinct event, logs each duplicate it skips, and
// at the end prints how many of each it saw.
//
//	go run ./examples/consumer -database-url postgres://…/downstream -count 41 -timeout 1m
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

// schema is the consumer's own tables, in its own database.
const schema = `
-- The idempotency keys of the events whose effect is committed.
-- (Delete old keys after the longest time an event may come again.)
CREATE TABLE IF NOT EXISTS processed_events (
    message_id   text PRIMARY KEY,
    routing_key  text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now()
);
-- The effect: this service's history of each order. It has no key of its
-- own, so only the dedupe above keeps an event from being recorded twice.
CREATE TABLE IF NOT EXISTS order_history (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    text NOT NULL,
    event       text NOT NULL,
    detail      text NOT NULL DEFAULT '',
    recorded_at timestamptz NOT NULL DEFAULT now()
);`

// event is what the consumer reads of an event body (docs/contract.md):
// every event carries eventType, orderId and messageId (the inbox message
// that caused it); the others depend on the event.
type event struct {
	EventType string `json:"eventType"`
	OrderID   string `json:"orderId"`
	MessageID string `json:"messageId"`
	Reason    string `json:"reason,omitempty"` // order.rejected, order.cancelled
	Email     string `json:"email,omitempty"`  // order.confirmed
	To        string `json:"to,omitempty"`     // email.requested
}

// config is what the flags set.
type config struct {
	url         string
	databaseURL string
	exchange    string
	queue       string
	keys        string
	count       int
	timeout     time.Duration
}

func main() {
	cfg := config{}
	flag.StringVar(&cfg.url, "url", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL (default $AMQP_URL)")
	flag.StringVar(&cfg.databaseURL, "database-url", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"),
		"this consumer's own PostgreSQL database (default $DATABASE_URL)")
	flag.StringVar(&cfg.exchange, "exchange", "order-confirmation.events", "the exchange inboxd publishes its events to")
	flag.StringVar(&cfg.queue, "queue", "example-consumer.events", "this consumer's queue (declared durable, quorum)")
	flag.StringVar(&cfg.keys, "keys", "#", "routing keys to bind, comma-separated")
	flag.IntVar(&cfg.count, "count", 0, "stop after this many distinct events (0: run until interrupted)")
	flag.DurationVar(&cfg.timeout, "timeout", 0, "fail if -count events have not arrived by then (0: no limit)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	db, err := pgx.Connect(ctx, cfg.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = db.Close(context.Background()) }()
	if _, err := db.Exec(ctx, schema); err != nil {
		return fmt.Errorf("create tables: %w", err)
	}

	conn, err := amqp.DialConfig(cfg.url, amqp.Config{
		Heartbeat:  10 * time.Second,
		Properties: amqp.Table{"connection_name": "example-consumer"},
	})
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	// inboxd declares the exchange; the consumer only checks it is there.
	if err := ch.ExchangeDeclarePassive(cfg.exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("exchange %q: %w (inboxd declares it at start: is inboxd running against this broker?)", cfg.exchange, err)
	}
	// Durable and quorum: events wait here while the consumer is down, and
	// survive a broker node. Bind before inboxd publishes what you need:
	// an event no binding routes waits in order-confirmation.unroutable.
	if _, err := ch.QueueDeclare(cfg.queue, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}); err != nil {
		return fmt.Errorf("declare queue %q: %w", cfg.queue, err)
	}
	for key := range strings.SplitSeq(cfg.keys, ",") {
		if err := ch.QueueBind(cfg.queue, strings.TrimSpace(key), cfg.exchange, false, nil); err != nil {
			return fmt.Errorf("bind queue %q with %q: %w", cfg.queue, key, err)
		}
	}
	if err := ch.Qos(50, 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	deliveries, err := ch.Consume(cfg.queue, "example-consumer", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %q: %w", cfg.queue, err)
	}
	log.Printf("consuming %q, bound to %q with %s", cfg.queue, cfg.exchange, cfg.keys)

	var deadline <-chan time.Time
	if cfg.timeout > 0 {
		deadline = time.After(cfg.timeout)
	}
	distinct, duplicates := 0, 0
	defer func() { fmt.Printf("%d events, %d duplicates skipped\n", distinct, duplicates) }()
	for cfg.count == 0 || distinct < cfg.count {
		var d amqp.Delivery
		var ok bool
		select {
		case d, ok = <-deliveries:
			if !ok {
				// The channel or connection closed. Unacked deliveries go
				// back to the queue, and the dedupe skips whatever of them
				// was committed: run again (a supervisor would restart it).
				return fmt.Errorf("the broker closed the consumer after %d events: %v", distinct, <-closed)
			}
		case <-deadline:
			return fmt.Errorf("timed out after %s: %d of %d events", cfg.timeout, distinct, cfg.count)
		case <-ctx.Done():
			return nil
		}

		// An interrupt lets the event in hand finish.
		ev, dup, err := handle(context.WithoutCancel(ctx), db, d)
		if err != nil {
			// Not committed: back to the queue, for this run or the next.
			_ = d.Nack(false, true)
			return fmt.Errorf("event %q: %w", d.MessageId, err)
		}
		// Acked only now that the effect (or the proof of an earlier one)
		// is committed. If the ack is lost, the copy the broker sends
		// again is skipped as a duplicate.
		if err := d.Ack(false); err != nil {
			return fmt.Errorf("ack %q: %w", d.MessageId, err)
		}
		if dup {
			duplicates++
			log.Printf("duplicate skipped: %s", d.MessageId)
			continue
		}
		distinct++
		fmt.Printf("%-16s order=%s message_id=%s trace=%s\n", d.RoutingKey, ev.OrderID, d.MessageId, traceID(d.Headers))
	}
	return nil
}

// errNoMessageID is returned for a delivery without a message_id: it cannot
// be deduped. inboxd always sets one.
var errNoMessageID = errors.New("no message_id: cannot dedupe it")

// handle applies the effect of the event d, once: it records the event's
// message_id and the effect in one transaction. dup is true when the id was
// recorded already, by an earlier delivery whose effect is committed.
//
// Two consumers on the same queue are safe too: a second INSERT of the same
// key waits for the first transaction, then does nothing.
func handle(ctx context.Context, db *pgx.Conn, d amqp.Delivery) (ev event, dup bool, err error) {
	if d.MessageId == "" {
		return ev, false, errNoMessageID
	}
	if err := json.Unmarshal(d.Body, &ev); err != nil {
		return ev, false, fmt.Errorf("decode body: %w", err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return ev, false, err
	}
	defer func() { _ = tx.Rollback(ctx) }()

	tag, err := tx.Exec(ctx, `INSERT INTO processed_events (message_id, routing_key) VALUES ($1, $2)
		ON CONFLICT (message_id) DO NOTHING`, d.MessageId, d.RoutingKey)
	if err != nil {
		return ev, false, fmt.Errorf("record message_id: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return ev, true, nil // seen: its effect is committed already
	}

	// The effect. A real service would update its own view of the order
	// here, or queue the email in an outbox of its own: never call out
	// (send the email) inside the transaction.
	detail := ev.Reason + ev.To
	if _, err := tx.Exec(ctx, `INSERT INTO order_history (order_id, event, detail) VALUES ($1, $2, $3)`,
		ev.OrderID, d.RoutingKey, detail); err != nil {
		return ev, false, fmt.Errorf("record effect: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return ev, false, fmt.Errorf("commit: %w", err)
	}
	return ev, false, nil
}

// traceID is the trace id of the W3C traceparent header inboxd puts on every
// event (the trace of the message that caused it), or "-". A service
// instrumented with OpenTelemetry would extract it and start its span as a
// child.
func traceID(h amqp.Table) string {
	tp, _ := h["traceparent"].(string)
	if parts := strings.Split(tp, "-"); len(parts) == 4 {
		return parts[1]
	}
	return "-"
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
