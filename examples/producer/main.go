// Command producer publishes orders to inboxd the way a producing service
// should, and is meant to be copied:
//
//   - it publishes to the `orders` topic exchange with the routing key, and
//     the AMQP type, `order.created` (and `order.cancelled`);
//   - every message is persistent, JSON, and has a message_id that is
//     stable for its command (`<orderId>:order.created`), so a retry of the
//     same command is the same message and inboxd stores it once;
//   - it sends the `x-order-id` header (the body's orderId: partitioned
//     ingest hashes on it) and a W3C `traceparent` header, so inboxd's spans
//     and the events it publishes join the producer's trace;
//   - the channel is in confirm mode and every publish is mandatory: a
//     message counts as sent only once the broker confirmed it AND did not
//     return it as unroutable (a confirm alone is not a delivery: the broker
//     confirms a publish no queue took). A nack, a return, a timeout or a
//     lost connection is retried, with the SAME message_id, after a backoff.
//
// It exits 0 only when every message was confirmed.
//
//	go run ./examples/producer -count 20 -cancel
//
// The order ids are <prefix>-1 … <prefix>-<count>; run it again with the same
// -prefix and inboxd stores nothing new: the message ids are the same.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// orderCreated is the body of an order.created message (docs/contract.md):
// every field required, at least one item, quantities of at least 1.
type orderCreated struct {
	OrderID string `json:"orderId"`
	UserID  string `json:"userId"`
	Email   string `json:"email"`
	Items   []item `json:"items"`
}

// item is one line of an order.
type item struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

// orderCancelled is the body of an order.cancelled message.
type orderCancelled struct {
	OrderID string `json:"orderId"`
	Reason  string `json:"reason"`
}

// message is one message to publish. Its Publishing is built once, so that
// every retry sends exactly the same message: same message_id, same body,
// same traceparent.
type message struct {
	routingKey string
	pub        amqp.Publishing
}

// config is what the flags set.
type config struct {
	url            string
	exchange       string
	count          int
	prefix         string
	sku            string
	cancel         bool
	duplicate      bool
	window         int
	confirmTimeout time.Duration
	attempts       int
}

func main() {
	cfg := config{}
	flag.StringVar(&cfg.url, "url", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL (default $AMQP_URL)")
	flag.StringVar(&cfg.exchange, "exchange", "orders", "the exchange inboxd consumes orders from")
	flag.IntVar(&cfg.count, "count", 10, "orders to publish")
	flag.StringVar(&cfg.prefix, "prefix", "example-"+time.Now().UTC().Format("20060102T150405"),
		"order ids are <prefix>-1 … <prefix>-<count>; the same prefix re-sends the same messages")
	flag.StringVar(&cfg.sku, "sku", "BOOK-1", "the SKU each order takes one of (inboxd rejects an order without stock)")
	flag.BoolVar(&cfg.cancel, "cancel", false, "once the orders are confirmed, cancel the first one")
	flag.BoolVar(&cfg.duplicate, "duplicate", false, "publish every message twice, as a producer retrying after a lost confirm does")
	flag.IntVar(&cfg.window, "window", 50, "publishes in flight before waiting for their confirms")
	flag.DurationVar(&cfg.confirmTimeout, "confirm-timeout", 5*time.Second, "how long to wait for a window's confirms before publishing it again")
	flag.IntVar(&cfg.attempts, "attempts", 5, "attempts per message before giving up")
	flag.Parse()
	if cfg.count < 1 || cfg.window < 1 || cfg.attempts < 1 {
		log.Fatal("producer: -count, -window and -attempts must be at least 1")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "producer:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	p := &producer{url: cfg.url, exchange: cfg.exchange, window: cfg.window, confirmTimeout: cfg.confirmTimeout}
	defer p.close()
	if err := p.connect(); err != nil {
		return err
	}

	var created []message
	for i := 1; i <= cfg.count; i++ {
		orderID := fmt.Sprintf("%s-%d", cfg.prefix, i)
		m, err := newMessage("order.created", orderID, orderCreated{
			OrderID: orderID,
			UserID:  "user-" + orderID,
			Email:   "customer+" + orderID + "@example.com",
			Items:   []item{{SKU: cfg.sku, Quantity: 1}},
		})
		if err != nil {
			return err
		}
		created = append(created, m)
		if cfg.duplicate {
			created = append(created, m)
		}
	}
	if err := p.publishAll(ctx, created, cfg.attempts); err != nil {
		return err
	}
	fmt.Printf("published %d order.created messages, orders %s-1 … %s-%d (-prefix %s), all confirmed\n",
		len(created), cfg.prefix, cfg.prefix, cfg.count, cfg.prefix)

	// A cancellation goes out only after its order's order.created was
	// confirmed: inboxd handles an order's messages in the order the queue
	// holds them. (Had it come first, inboxd would still end the order
	// cancelled, with no stock held.)
	if cfg.cancel {
		orderID := cfg.prefix + "-1"
		m, err := newMessage("order.cancelled", orderID, orderCancelled{OrderID: orderID, Reason: "customer changed their mind"})
		if err != nil {
			return err
		}
		if err := p.publishAll(ctx, []message{m}, cfg.attempts); err != nil {
			return err
		}
		fmt.Printf("published order.cancelled for %s, confirmed\n", orderID)
	}
	return nil
}

// newMessage builds the message of type msgType about orderID with body.
func newMessage(msgType, orderID string, body any) (message, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return message{}, fmt.Errorf("encode %s: %w", msgType, err)
	}
	return message{routingKey: msgType, pub: amqp.Publishing{
		// The idempotency key: one per command, not per attempt. A
		// checkout would use its own command id; here the order id and
		// the type name the command.
		MessageId:    orderID + ":" + msgType,
		Type:         msgType,
		DeliveryMode: amqp.Persistent,
		ContentType:  "application/json",
		Timestamp:    time.Now(),
		AppId:        "example-producer",
		Headers: amqp.Table{
			"x-order-id":  orderID,
			"traceparent": newTraceparent(),
		},
		Body: b,
	}}, nil
}

// newTraceparent starts a new trace: a W3C traceparent with a random trace
// id and span id, sampled. A service instrumented with OpenTelemetry
// injects its current span instead:
// propagation.TraceContext{}.Inject(ctx, carrier) over the headers.
func newTraceparent() string {
	var id [24]byte
	_, _ = rand.Read(id[:]) // crypto/rand.Read never fails
	return "00-" + hex.EncodeToString(id[:16]) + "-" + hex.EncodeToString(id[16:]) + "-01"
}

// producer publishes on one channel in confirm mode, reconnecting when the
// channel or its connection is gone.
type producer struct {
	url            string
	exchange       string
	window         int
	confirmTimeout time.Duration

	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
}

// connect opens the connection and the channel, in confirm mode, with a
// listener for returned (unroutable) publishes, and checks that the
// exchange exists.
func (p *producer) connect() error {
	p.close()
	conn, err := amqp.DialConfig(p.url, amqp.Config{
		Heartbeat:  10 * time.Second,
		Properties: amqp.Table{"connection_name": "example-producer"},
	})
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	p.conn = conn
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	p.ch = ch
	// inboxd declares the exchange; a producer only checks it is there. (A
	// failed passive declare closes the channel, but we give up anyway.)
	if err := ch.ExchangeDeclarePassive(p.exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("exchange %q: %w (inboxd declares it at start: is inboxd running against this broker?)", p.exchange, err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	// The broker sends a mandatory publish's return before its confirm,
	// and the client delivers it here before it hands us the confirm. The
	// buffer holds a whole window's returns, so the client never waits on us.
	p.returns = ch.NotifyReturn(make(chan amqp.Return, p.window))
	return nil
}

func (p *producer) close() {
	if p.conn != nil {
		_ = p.conn.Close()
	}
	p.conn, p.ch = nil, nil
}

// publishAll publishes msgs until the broker has confirmed every one, trying
// each at most attempts times. The messages that failed an attempt are
// published again, unchanged, after a backoff: inboxd dedupes by message_id,
// so a copy that did arrive the first time costs nothing.
func (p *producer) publishAll(ctx context.Context, msgs []message, attempts int) error {
	backoff := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		failed, why := p.publishOnce(ctx, msgs)
		if len(failed) == 0 {
			return nil
		}
		if attempt == attempts || ctx.Err() != nil {
			return fmt.Errorf("%d of %d messages not confirmed after %d attempts, e.g. %s: %w",
				len(failed), len(msgs), attempt, failed[0].pub.MessageId, why)
		}
		log.Printf("%d of %d messages not confirmed (%v); publishing them again with the same message ids in %s",
			len(failed), len(msgs), why, backoff)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
		}
		backoff = min(2*backoff, 5*time.Second)
		msgs = failed
	}
}

// publishOnce publishes msgs, a window at a time, and waits for each
// window's confirms. It returns the messages not confirmed, and why.
func (p *producer) publishOnce(ctx context.Context, msgs []message) (failed []message, why error) {
	for start := 0; start < len(msgs); start += p.window {
		window := msgs[start:min(start+p.window, len(msgs))]
		if p.ch == nil || p.ch.IsClosed() {
			if err := p.connect(); err != nil {
				return append(failed, msgs[start:]...), err
			}
		}
		notConfirmed, err := p.publishWindow(ctx, window)
		if err != nil {
			failed, why = append(failed, notConfirmed...), err
		}
	}
	return failed, why
}

// publishWindow publishes window and waits up to confirmTimeout for its
// confirms, in order.
func (p *producer) publishWindow(ctx context.Context, window []message) (failed []message, why error) {
	confirms := make([]*amqp.DeferredConfirmation, 0, len(window))
	for _, m := range window {
		// mandatory: a publish that no queue takes comes back as a return
		// instead of vanishing behind a positive confirm.
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, p.exchange, m.routingKey, true, false, m.pub)
		if err != nil {
			// The channel is gone: what was published may or may not have
			// arrived. The next attempt re-sends it all on a new channel.
			_ = p.ch.Close()
			return window, fmt.Errorf("publish: %w", err)
		}
		confirms = append(confirms, dc)
	}

	waitCtx, cancel := context.WithTimeout(ctx, p.confirmTimeout)
	defer cancel()
	for i, dc := range confirms {
		acked, err := dc.WaitContext(waitCtx)
		switch {
		case err != nil:
			// No confirm in time: give up on this channel (a late confirm
			// is then never mistaken for a new publish's), and send the
			// rest again.
			_ = p.ch.Close()
			return append(failed, window[i:]...), fmt.Errorf("no confirm within %s: %w", p.confirmTimeout, err)
		case !acked:
			// A nack, or the channel closed before the confirm came.
			failed, why = append(failed, window[i]), errors.New("the broker nacked a publish, or the channel closed")
		}
	}

	// Every confirm is in, so every return is too: a returned message was
	// confirmed but reached no queue.
	returned := map[string]bool{}
	for drained := false; !drained; {
		select {
		case r := <-p.returns:
			returned[r.MessageId] = true
			why = fmt.Errorf("returned by the broker: %d %s (no queue is bound for %q on %q: is inboxd running?)",
				r.ReplyCode, r.ReplyText, r.RoutingKey, r.Exchange)
		default:
			drained = true
		}
	}
	for _, m := range window {
		if returned[m.pub.MessageId] && !slices.ContainsFunc(failed, func(f message) bool { return f.pub.MessageId == m.pub.MessageId }) {
			failed = append(failed, m)
		}
	}
	return failed, why
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
