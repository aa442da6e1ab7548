// Package examples_test runs the examples, built as a user would build them,
// against a real inboxd, PostgreSQL and RabbitMQ, so that an example that no
// longer works with inboxd fails the build.
package examples_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// The binaries TestMain builds: inboxd, and the two examples.
var inboxdPath, producerPath, consumerPath string

func TestMain(m *testing.M) {
	// The prefix of cmd/inboxd's tests: a leaked inboxd of a killed run is
	// found by it.
	dir, err := os.MkdirTemp("", "inboxd-test-examples-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	inboxdPath = filepath.Join(dir, "inboxd")
	producerPath = filepath.Join(dir, "producer")
	consumerPath = filepath.Join(dir, "consumer")
	for path, pkg := range map[string]string{inboxdPath: "../cmd/inboxd", producerPath: "./producer", consumerPath: "./consumer"} {
		if out, err := exec.Command("go", "build", "-o", path, pkg).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s: %v\n%s", pkg, err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	testenv.Stop()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// The run below: orders1 orders, each published twice (-duplicate); then
// orders2 orders, the first orders1 of them again (the same message ids),
// and a cancellation of the first; copies of copiedEvents events are
// republished on the events exchange between the two, as a relay that
// crashed after publishing would.
const (
	orders1      = 10
	orders2      = 20
	copiedEvents = 5
	sku          = "BOOK-1"
	prefix       = "ex"
)

// The producer publishes what inboxd takes and the consumer takes what
// inboxd publishes: every order is stored and handled once, however often
// it is published, and every event has its effect downstream once, however
// often it arrives.
func TestExamplesRunAgainstInboxd(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	mq := testenv.NewBroker(t)
	// The consumer's own database: a schema of its own (testenv migrates
	// every schema for inboxd; the consumer leaves those tables alone).
	downstream := testenv.NewDB(t)
	db.Exec(t, "INSERT INTO stock (sku, available) VALUES ($1, 1000)", sku)

	startInboxd(t, db, mq)
	// inboxd declares the topology before it consumes.
	waitConsumed(t, mq.URL, broker.QueueInbox)
	tap := tapOrders(t, mq.URL)

	consumerOut := &syncBuffer{}
	consumer := start(t, consumerOut, consumerPath,
		"-url", mq.URL, "-database-url", downstream.URL, "-queue", "downstream.events",
		"-count", fmt.Sprint(2*orders2+1), "-timeout", "3m")
	waitConsumed(t, mq.URL, "downstream.events")

	runProducer(t, "-url", mq.URL, "-prefix", prefix, "-sku", sku, "-count", fmt.Sprint(orders1), "-duplicate")
	require.Eventually(t, func() bool { return len(eventLines(consumerOut.String())) == 2*orders1 }, time.Minute, 50*time.Millisecond,
		"the consumer printed the events of the first %d orders:\n%s", orders1, consumerOut)
	republishEvents(t, db, mq.URL, copiedEvents)
	runProducer(t, "-url", mq.URL, "-prefix", prefix, "-sku", sku, "-count", fmt.Sprint(orders2), "-cancel")

	select {
	case <-consumer.done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("the consumer did not finish:\n%s", consumerOut)
	}
	require.NoError(t, consumer.err, "consumer:\n%s", consumerOut)
	out := consumerOut.String()

	// What the producer published, as the broker routed it.
	published := tap.receive(t, 2*orders1+orders2+1)
	traces := map[string][]string{} // message id → the trace ids it was published with
	for _, d := range published {
		requireProducerContract(t, d)
		traces[d.MessageId] = append(traces[d.MessageId], traceOf(t, d.Headers))
	}

	// inboxd stored each message once and handled it.
	var wantMessages []string
	for i := 1; i <= orders2; i++ {
		wantMessages = append(wantMessages, fmt.Sprintf("%s-%d:order.created", prefix, i))
	}
	wantMessages = append(wantMessages, prefix+"-1:order.cancelled")
	require.ElementsMatch(t, wantMessages, db.Strings(t, "SELECT message_id FROM inbox"), "one inbox row per message id")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"), "every message processed")
	require.Equal(t, orders2, db.Int(t, "SELECT count(DISTINCT order_id) FROM order_confirmations"))
	require.Equal(t, []string{prefix + "-1"}, db.Strings(t, "SELECT order_id FROM order_confirmations WHERE status = 'cancelled'"))
	require.Equal(t, orders2-1, db.Int(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'"))
	// The stored trace context is what the producer sent (its first copy's).
	for _, row := range db.Strings(t, "SELECT message_id || ' ' || coalesce(traceparent, '') FROM inbox") {
		id, tp, _ := strings.Cut(row, " ")
		require.Contains(t, traces[id], traceOf(t, amqp.Table{tracing.HeaderTraceparent: tp}), "the trace of %s", id)
	}

	// The consumer printed every event once, with the producer's trace.
	var wantEvents []string
	for i := 1; i <= orders2; i++ {
		created := fmt.Sprintf("%s-%d:order.created", prefix, i)
		wantEvents = append(wantEvents, orders.IdempotencyKey(created, orders.EventOrderConfirmed), orders.IdempotencyKey(created, orders.EventEmailRequested))
	}
	wantEvents = append(wantEvents, orders.IdempotencyKey(prefix+"-1:order.cancelled", orders.EventOrderCancelled))
	lines := eventLines(out)
	var gotEvents []string
	for _, l := range lines {
		gotEvents = append(gotEvents, l.messageID)
	}
	require.ElementsMatch(t, wantEvents, gotEvents, "the consumer's events:\n%s", out)
	require.Contains(t, out, fmt.Sprintf("%d events, %d duplicates skipped\n", len(wantEvents), copiedEvents))
	for _, l := range lines {
		cause := strings.TrimSuffix(l.messageID, ":"+l.routingKey) // the inbox message id (msgid.EventID)
		require.Contains(t, traces[cause], l.trace, "the trace of event %s, caused by %s", l.messageID, cause)
	}

	// Its effect happened once per event.
	require.Equal(t, len(wantEvents), downstream.Int(t, "SELECT count(*) FROM processed_events"))
	require.Equal(t, len(wantEvents), downstream.Int(t, "SELECT count(*) FROM order_history"))
	require.Equal(t, 3, downstream.Int(t, "SELECT count(*) FROM order_history WHERE order_id = $1", prefix+"-1"),
		"order.confirmed, email.requested, order.cancelled")
}

// The producer exits non-zero, saying why, when its orders reach no inbox:
// with no orders exchange (inboxd never ran on the broker), and with the
// exchange but no queue bound (the broker confirms such a publish: only
// the mandatory flag's return tells).
func TestProducerFailsWhenNoInboxTakesItsOrders(t *testing.T) {
	t.Parallel()
	mq := testenv.NewBroker(t)
	args := []string{"-url", mq.URL, "-count", "3", "-attempts", "2", "-confirm-timeout", "2s"}

	out, err := exec.CommandContext(t.Context(), producerPath, args...).CombinedOutput()
	require.Error(t, err, "no exchange:\n%s", out)
	require.Contains(t, string(out), "is inboxd running against this broker?")
	t.Logf("no exchange:\n%s", out)

	conn, err := amqp.Dial(mq.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare(broker.ExchangeOrders, amqp.ExchangeTopic, true, false, false, false, nil))
	out, err = exec.CommandContext(t.Context(), producerPath, args...).CombinedOutput()
	require.Error(t, err, "no queue bound:\n%s", out)
	require.Contains(t, string(out), "3 of 3 messages not confirmed after 2 attempts")
	require.Contains(t, string(out), "NO_ROUTE")
	t.Logf("no queue bound:\n%s", out)
}

// requireProducerContract checks one delivery of the producer against the
// contract of docs/contract.md and README's "Producing orders".
func requireProducerContract(t *testing.T, d amqp.Delivery) {
	t.Helper()
	require.Equal(t, amqp.Persistent, d.DeliveryMode, "persistent")
	require.Equal(t, "application/json", d.ContentType)
	require.Equal(t, d.RoutingKey, d.Type, "the AMQP type names the message type")
	orderID, ok := d.Headers[broker.HeaderOrderID].(string)
	require.True(t, ok, "%s header on %s: %v", broker.HeaderOrderID, d.MessageId, d.Headers)
	switch d.RoutingKey {
	case orders.TypeOrderCreated:
		o, err := orders.DecodeOrderCreated(d.Body)
		require.NoError(t, err)
		require.Equal(t, o.OrderID, orderID)
		require.Equal(t, []orders.Item{{SKU: sku, Quantity: 1}}, o.Items)
	case orders.TypeOrderCancelled:
		c, err := orders.DecodeOrderCancelled(d.Body)
		require.NoError(t, err)
		require.Equal(t, c.OrderID, orderID)
	default:
		t.Fatalf("routing key %q", d.RoutingKey)
	}
	require.Equal(t, orderID+":"+d.RoutingKey, d.MessageId, "a message id stable for the order's command")
	require.True(t, tracing.FromHeaders(d.Headers).SpanContext().IsValid(), "a valid traceparent: %v", d.Headers)
}

// traceOf is the trace id of the W3C trace context in h.
func traceOf(t *testing.T, h amqp.Table) string {
	t.Helper()
	sc := tracing.FromHeaders(h).SpanContext()
	require.True(t, sc.IsValid(), "trace context %v", h)
	return sc.TraceID().String()
}

// eventLine is a line the consumer printed for an event.
type eventLine struct{ routingKey, orderID, messageID, trace string }

var eventLineRE = regexp.MustCompile(`(?m)^(\S+)\s+order=(\S+) message_id=(\S+) trace=(\S+)$`)

func eventLines(out string) []eventLine {
	var lines []eventLine
	for _, m := range eventLineRE.FindAllStringSubmatch(out, -1) {
		lines = append(lines, eventLine{m[1], m[2], m[3], m[4]})
	}
	return lines
}

// republishEvents publishes again n events the relay published, each as the
// relay did (routing key, message id, trace context, body), as a relay that
// crashed between publishing and recording it would.
func republishEvents(t *testing.T, db *testenv.DB, amqpURL string, n int) {
	t.Helper()
	rows := db.Strings(t, `SELECT json_build_array(idempotency_key, routing_key, traceparent, payload)::text FROM outbox
		WHERE published_at IS NOT NULL AND reply_to IS NULL ORDER BY id LIMIT $1`, n)
	require.Len(t, rows, n)
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	pub := broker.Publisher{Ch: ch}
	for _, row := range rows {
		var ev []json.RawMessage
		require.NoError(t, json.Unmarshal([]byte(row), &ev))
		var id, key, traceparent string
		require.NoError(t, json.Unmarshal(ev[0], &id))
		require.NoError(t, json.Unmarshal(ev[1], &key))
		require.NoError(t, json.Unmarshal(ev[2], &traceparent))
		require.NoError(t, pub.Publish(t.Context(), broker.ExchangeEvents, key, true, amqp.Publishing{
			MessageId: id, DeliveryMode: amqp.Persistent, ContentType: "application/json",
			Headers: amqp.Table{tracing.HeaderTraceparent: traceparent}, Body: ev[3],
		}))
	}
	require.NoError(t, pub.Wait(t.Context()))
}

// tap is a queue of the test's own bound to everything on the orders
// exchange: a copy of each message the producer published.
type tap struct {
	deliveries <-chan amqp.Delivery
}

func tapOrders(t *testing.T, amqpURL string) *tap {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q.Name, "#", broker.ExchangeOrders, false, nil))
	deliveries, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	require.NoError(t, err)
	return &tap{deliveries: deliveries}
}

// receive returns the n deliveries the tap holds, and fails if there are
// more within a moment.
func (tp *tap) receive(t *testing.T, n int) []amqp.Delivery {
	t.Helper()
	var got []amqp.Delivery
	for {
		select {
		case d := <-tp.deliveries:
			got = append(got, d)
			require.LessOrEqual(t, len(got), n, "more publishes than expected")
		case <-time.After(time.Second):
			require.Len(t, got, n, "publishes the orders exchange routed")
			return got
		}
	}
}

// startInboxd runs `inboxd serve` on db and mq, as cmd/inboxd's tests do,
// until the test ends; its log is printed if the test fails.
func startInboxd(t *testing.T, db *testenv.DB, mq *testenv.Broker) {
	t.Helper()
	env := []string{
		"DATABASE_URL=" + db.URL,
		"AMQP_URL=" + mq.URL,
		"HTTP_ADDR=127.0.0.1:0",
		"INBOX_POLL_INTERVAL=200ms",
		"INBOX_SHUTDOWN_TIMEOUT=10s",
		"PATH=" + os.Getenv("PATH"),
	}
	startWithEnv(t, &syncBuffer{}, env, inboxdPath, "serve")
}

// process is a child process of the test.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// start runs path with args, its stdout and stderr going to out, and kills
// it when the test ends; out is logged if the test fails.
func start(t *testing.T, out *syncBuffer, path string, args ...string) *process {
	t.Helper()
	return startWithEnv(t, out, nil, path, args...)
}

func startWithEnv(t *testing.T, out *syncBuffer, env []string, path string, args ...string) *process {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s (pid %d) output:\n%s", filepath.Base(path), cmd.Process.Pid, tail(out.String()))
		}
	})
	return p
}

// runProducer runs the producer with args and fails the test if it fails.
func runProducer(t *testing.T, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, producerPath, args...).CombinedOutput()
	require.NoError(t, err, "producer %s:\n%s", strings.Join(args, " "), out)
	t.Logf("producer %s:\n%s", strings.Join(args, " "), out)
}

// waitConsumed waits until queue exists on the broker at amqpURL and has a
// consumer.
func waitConsumed(t *testing.T, amqpURL, queue string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	var last error
	ok := assert.Eventually(t, func() bool {
		q, err := broker.InspectQueue(conn, queue)
		last = err
		return err == nil && q.Consumers > 0
	}, time.Minute, 50*time.Millisecond)
	require.True(t, ok, "queue %q never had a consumer (last error: %v)", queue, last)
}

// syncBuffer is a bytes.Buffer that a child process's output and the test
// may use at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// tail is the end of s, at most 20,000 bytes.
func tail(s string) string {
	return s[max(0, len(s)-20000):]
}
