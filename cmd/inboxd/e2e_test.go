package main

import (
	"context"
	"encoding/json"

	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

type e2eBundle struct {
	db     *testenv.DB
	broker *testenv.Broker
	events <-chan amqp.Delivery // everything the relay publishes
	seen   map[string]int       // event message ids received so far
	// arrivals lists, per order id, the routing keys of the events of the
	// order in the order the downstream queue delivered them, each event
	// (message id) at its first arrival.
	arrivals map[string][]string
}

// newBundle is an e2eBundle on db and mq, with no downstream subscription
// yet.
func newBundle(db *testenv.DB, mq *testenv.Broker) *e2eBundle {
	return &e2eBundle{db: db, broker: mq, seen: map[string]int{}, arrivals: map[string][]string{}}
}

// stockUp stocks initialStock of each SKU loadgen's orders take.
func stockUp(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for _, sku := range []string{"SKU-1", "SKU-2", "SKU-3"} {
		_, err := pool.Exec(t.Context(), "INSERT INTO stock (sku, available) VALUES ($1, $2)", sku, initialStock)
		require.NoError(t, err)
	}
}

func setup(t *testing.T) *e2eBundle {
	t.Helper()
	return setupIn(t, testenv.NewDB(t))
}

// setupIn is setup in db: the bundle of a test that needs a database of
// its own (testenv.NewDBAlone).
func setupIn(t *testing.T, db *testenv.DB) *e2eBundle {
	t.Helper()
	b := newBundle(db, testenv.NewBroker(t))
	// Declared up front so that nothing published before inboxd connects
	// is unroutable.
	require.NoError(t, loadgen.DeclareTopology(b.broker.URL, broker.QueueTypeQuorum))
	b.subscribeDownstream(t)
	stockUp(t, b.db.Pool)
	return b
}

// subscribeDownstream consumes every event, as a downstream service would,
// from a durable queue of its own. Deliveries are acked as the test reads
// them, so a connection lost to a broker restart loses none: subscribe again.
func (b *e2eBundle) subscribeDownstream(t *testing.T) {
	t.Helper()
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare("downstream", true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind("downstream", "#", broker.ExchangeEvents, false, nil))
	require.NoError(t, ch.Qos(100, 0, false))
	b.events, err = ch.Consume("downstream", "", false, false, false, false, nil)
	require.NoError(t, err)
}

// requireEventsOnce checks that the relay published every outbox row, that
// no effect of an order exists under two keys, that every order still
// confirmed has its order.confirmed and email.requested, and that the
// downstream queue received exactly the outbox's keys as message ids (a
// republish after a crash may deliver an id twice, never a second id for one
// effect).
func (b *e2eBundle) requireEventsOnce(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL AND reply_to IS NULL") == 0
	}, 60*time.Second, 20*time.Millisecond, "the relay published every event")
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM (
			SELECT payload->>'orderId', routing_key FROM outbox WHERE reply_to IS NULL GROUP BY 1, 2 HAVING count(*) > 1
		) AS doubled`), "an effect under two keys")
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM order_confirmations c
		LEFT JOIN (
			SELECT payload->>'orderId' AS order_id, count(*) AS events
			FROM outbox WHERE routing_key IN ('order.confirmed', 'email.requested')
			GROUP BY 1
		) AS o USING (order_id)
		WHERE c.status = 'confirmed' AND coalesce(o.events, 0) <> 2`), "a confirmed order without its events")

	rows, err := b.db.Pool.Query(t.Context(), "SELECT idempotency_key FROM outbox WHERE reply_to IS NULL")
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
	}
	timeout := time.After(60 * time.Second)
	for len(b.seen) < len(want) {
		select {
		case d := <-b.events:
			require.NoError(t, d.Ack(false))
			require.True(t, want[d.MessageId], "unexpected event id %q", d.MessageId)
			if b.seen[d.MessageId] == 0 {
				var ev struct {
					OrderID string `json:"orderId"`
				}
				require.NoError(t, json.Unmarshal(d.Body, &ev), "event %q", d.MessageId)
				b.arrivals[ev.OrderID] = append(b.arrivals[ev.OrderID], d.RoutingKey)
			}
			b.seen[d.MessageId]++
		case <-timeout:
			t.Fatalf("%d of %d events arrived", len(b.seen), len(want))
		}
	}
}

// requireAtMostCopies checks that no event id arrived more than copies
// times, counting too those that arrive within settle from now.
func (b *e2eBundle) requireAtMostCopies(t *testing.T, copies int, settle time.Duration) {
	t.Helper()
	quiet := time.After(settle)
	for settled := false; !settled; {
		select {
		case d := <-b.events:
			require.NoError(t, d.Ack(false))
			b.seen[d.MessageId]++
		case <-quiet:
			settled = true
		}
	}
	for id, n := range b.seen {
		require.LessOrEqual(t, n, copies, "copies of event %q", id)
	}
}

// initialStock is what setup puts in stock for each SKU loadgen orders use:
// enough that no order is rejected.
const initialStock = 1_000_000

// requireStockAddsUp checks that, per SKU, what is available plus what
// active reservations hold is what was there at the start, and that the
// active reservations are exactly the items of the orders still confirmed.
func (b *e2eBundle) requireStockAddsUp(t *testing.T) {
	t.Helper()
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM stock_overview WHERE available + reserved <> $1`, initialStock), "stock does not add up")
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM order_confirmations c
		WHERE (c.status = 'confirmed') <> EXISTS (
			SELECT 1 FROM stock_reservations r WHERE r.order_id = c.order_id AND r.released_at IS NULL)`),
		"an order's reservations do not match its status")
}

// count runs a counting query. It retries for a while when PostgreSQL is
// unreachable, as it is while a test restarts it.
func (b *e2eBundle) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if err = b.db.Pool.QueryRow(context.WithoutCancel(t.Context()), query, args...).Scan(&n); err == nil {
			return n
		}
	}
	require.NoError(t, err)
	return n
}

// waitDrained waits until every one of want unique messages is in the inbox
// and none is pending.
func (b *e2eBundle) waitDrained(t *testing.T, want int, timeout time.Duration) {
	t.Helper()
	ok := assert.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'pending'") >= want
	}, timeout, 50*time.Millisecond, "inbox never drained to %d handled messages", want)
	if !ok {
		rows, _ := b.db.Pool.Query(context.WithoutCancel(t.Context()),
			"SELECT status, count(*), min(last_error), max(attempts) FROM inbox GROUP BY status")
		summary, _ := pgx.CollectRows(rows, pgx.RowToMap)
		t.Fatalf("inbox by status: %v", summary)
	}
}

// requireExactlyOnce checks the invariants after a workload without
// cancellations: one inbox row per unique message id, all processed, and one
// confirmation per order, made by exactly one message.
func (b *e2eBundle) requireExactlyOnce(t *testing.T, w *loadgen.Workload) {
	t.Helper()
	require.Equal(t, w.UniqueMessageIDs, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique message id")
	require.Equal(t, w.UniqueMessageIDs, b.count(t, "SELECT count(DISTINCT message_id) FROM inbox"))
	require.Equal(t, w.UniqueMessageIDs, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"), "every message processed")
	require.Equal(t, len(w.OrderIDs), b.count(t, "SELECT count(*) FROM order_confirmations"), "one confirmation per order")
	require.Equal(t, len(w.OrderIDs), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'"))
	require.Equal(t, len(w.OrderIDs), b.count(t, "SELECT count(*) FROM inbox WHERE result = $1", orders.ResultConfirmed),
		"exactly one message confirmed each order")
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM order_confirmations c
		LEFT JOIN inbox i ON i.message_id = c.message_id AND i.result = $1
		WHERE i.id IS NULL`, orders.ResultConfirmed), "each confirmation names the message that made it")
}

// Acceptance: 1,000 orders, 30% re-published under the same message id and
// 5% re-sent under a new one, give exactly 1,000 confirmations.
func TestExactlyOnceUnderRedelivery(t *testing.T) {
	t.Parallel()
	b := setup(t)
	runInProcess(t, serviceEnv(b.db, b.broker))

	w := loadgen.Generate(loadgen.Spec{Orders: 1000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 1})
	require.Greater(t, len(w.Messages), 1300)
	require.NoError(t, loadgen.PublishParallel(t.Context(), b.broker.URL, w.Messages, 2, 200))

	b.waitDrained(t, w.UniqueMessageIDs, 60*time.Second)
	b.requireExactlyOnce(t, w)
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE attempts <> 1"), "nothing was handled twice")
	b.requireEventsOnce(t)
}

// Acceptance: the same while inboxd is killed with SIGKILL and restarted,
// at random moments, at least three times.
func TestExactlyOnceAcrossSIGKILL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker, "INBOX_WORKER_BATCH_SIZE=20", "INBOX_INGEST_BATCH_SIZE=50", "INBOX_RELAY_LEASE=1s", "INBOX_CLAIM_LEASE=500ms")
	w := loadgen.Generate(loadgen.Spec{Orders: 1000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 2})

	published := make(chan error, 1)
	go func() {
		// Publish in slices, so the kills land while messages still arrive.
		var err error
		for i := 0; i < len(w.Messages) && err == nil; i += 100 {
			err = loadgen.Publish(t.Context(), b.broker.URL, w.Messages[i:min(i+100, len(w.Messages))], 100)
			time.Sleep(30 * time.Millisecond)
		}
		published <- err
	}()

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	kills := 0
	for ; kills < 4; kills++ {
		p := startProcess(t, env)
		before := b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'")
		// Kill once it has done some work, after a random extra delay.
		require.Eventually(t, func() bool {
			return b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'") > before
		}, 30*time.Second, 5*time.Millisecond)
		time.Sleep(time.Duration(rng.IntN(150)) * time.Millisecond)
		p.kill()
	}
	require.NoError(t, <-published)
	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs, 90*time.Second)
	b.requireExactlyOnce(t, w)
	b.requireEventsOnce(t)
	t.Logf("killed inboxd %d times; %d unique messages, %d published", kills, w.UniqueMessageIDs, len(w.Messages))
}

// Acceptance: two inboxd processes share the inbox and never handle the
// same row: every row is processed after exactly one attempt.
func TestTwoProcessesShareTheInbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker, "INBOX_WORKER_BATCH_SIZE=10", "INBOX_WORKERS=3")
	startProcess(t, env)
	startProcess(t, env)

	w := loadgen.Generate(loadgen.Spec{Orders: 2000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 3})
	require.NoError(t, loadgen.PublishParallel(t.Context(), b.broker.URL, w.Messages, 2, 200))
	b.waitDrained(t, w.UniqueMessageIDs, 90*time.Second)
	b.requireExactlyOnce(t, w)
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE attempts <> 1"), "no row was handled twice")
}

// Acceptance: a message without id, one over the size limit (1 MiB and 10
// MiB), and bodies that are empty, not JSON, hold NUL bytes or have fields of
// the wrong type each end dead-lettered or dead with a reason, and the
// service keeps consuming.
func TestMalformedInputEndsDeadWithAReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker))

	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
		{RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-noid", 1)},
		{MessageID: "huge", RoutingKey: "order.created", Body: []byte(`{"orderId":"` + strings.Repeat("x", 1<<20) + `"}`)},
		{MessageID: "bad-json", RoutingKey: "order.created", Body: []byte(`{"orderId": "o-1", `)},
		{MessageID: "nul", RoutingKey: "order.created", Body: []byte("{\"orderId\":\"o-\x00\"}")},
		{MessageID: "wrong-type", RoutingKey: "order.cancelled", Body: []byte(`{"orderId": 7}`)},
		{MessageID: "empty", RoutingKey: "order.created", Body: nil},
		{MessageID: "binary", RoutingKey: "order.created", Body: []byte("\x00\xff\xfe{\x00}")},
		{MessageID: "ten-mib", RoutingKey: "order.created", Body: make([]byte, 10<<20)},
		{MessageID: "good", RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-good", 1)},
	}, 1))

	b.waitDrained(t, 6, 30*time.Second)
	require.Equal(t, "processed", b.status(t, "good"), "the service kept consuming")
	for _, id := range []string{"bad-json", "nul", "wrong-type", "empty", "binary"} {
		require.Equal(t, "dead", b.status(t, id), id)
	}
	var lastError string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT last_error FROM inbox_dead WHERE message_id = 'bad-json'").Scan(&lastError))
	require.Contains(t, lastError, "invalid payload: not a JSON object")

	reasons := map[string]string{}
	for _, d := range b.broker.Receive(t, broker.QueueDead, 3) {
		reasons[d.MessageId], _ = d.Headers[broker.HeaderRejectReason].(string)
	}
	require.Equal(t, "missing message_id", reasons[""])
	require.Contains(t, reasons["huge"], "message too large")
	require.Contains(t, reasons["ten-mib"], "message too large: 10485760 bytes")
	require.True(t, p.logContains(`"msg":"delivery dead-lettered"`))
	require.False(t, p.exited(), "the consumer never crashed")
}

// status returns the inbox status of a message.
func (b *e2eBundle) status(t *testing.T, messageID string) string {
	t.Helper()
	return b.inboxText(t, "status", messageID)
}

// inboxText returns a text column of a message's inbox row.
func (b *e2eBundle) inboxText(t *testing.T, column, messageID string) string {
	t.Helper()
	v := b.db.Strings(t, "SELECT "+column+" FROM inbox WHERE message_id = $1", messageID)
	require.Len(t, v, 1, "message %s", messageID)
	return v[0]
}

// SIGTERM under load: inboxd exits within its grace period, and everything
// published is processed once it runs again.
func TestGracefulStopUnderLoad(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker, "INBOX_SHUTDOWN_TIMEOUT=5s")
	p := startProcess(t, env)
	w := loadgen.Generate(loadgen.Spec{Orders: 3000, DuplicateRate: 0.1, Seed: 4})
	published := make(chan error, 1)
	go func() { published <- loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 200) }()
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'") > 200
	}, 30*time.Second, 5*time.Millisecond)
	took := p.terminate(15 * time.Second)
	require.Less(t, took, 6*time.Second, "exits within the grace period")
	require.True(t, p.logContains(`"msg":"stopped"`))
	require.NoError(t, <-published)

	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs, 60*time.Second)
	b.requireExactlyOnce(t, w)
	t.Logf("stopped in %s", took)
}

func TestMain_ConfigurationErrors(t *testing.T) {
	if raceEnabled {
		t.Skip(noRaceToWatch)
	}
	t.Parallel()
	base := map[string]string{
		"DATABASE_URL": "postgres://inbox:s3cr3t-pw@127.0.0.1:5432/inbox",
		"AMQP_URL":     "amqp://guest:an0ther-pw@127.0.0.1:5672/",
	}
	for name, tc := range map[string]struct {
		override map[string]string
		want     string
	}{
		"MissingDatabaseURL":          {map[string]string{"DATABASE_URL": ""}, "DATABASE_URL is required"},
		"BadDatabaseURL":              {map[string]string{"DATABASE_URL": "postgres://inbox:s3cr3t-pw@[::1"}, "DATABASE_URL is invalid"},
		"BadAMQPURL":                  {map[string]string{"AMQP_URL": "http://guest:an0ther-pw@host/"}, "AMQP_URL is invalid"},
		"BadWorkers":                  {map[string]string{"INBOX_WORKERS": "zero"}, `INBOX_WORKERS is invalid: "zero": not an integer`},
		"WorkersOutOfRange":           {map[string]string{"INBOX_WORKERS": "0"}, "INBOX_WORKERS is invalid"},
		"BadDuration":                 {map[string]string{"INBOX_INGEST_LINGER": "5"}, "INBOX_INGEST_LINGER is invalid"},
		"BadQueueType":                {map[string]string{"INBOX_QUEUE_TYPE": "stream"}, "must be one of quorum, classic"},
		"RetryMaxBelowBase":           {map[string]string{"INBOX_RETRY_BASE": "10s", "INBOX_RETRY_MAX": "1s"}, "INBOX_RETRY_MAX is invalid"},
		"BadHTTPAddr":                 {map[string]string{"HTTP_ADDR": "8080"}, "HTTP_ADDR is invalid"},
		"BadPprofAddr":                {map[string]string{"INBOX_PPROF_ADDR": "6060"}, "INBOX_PPROF_ADDR is invalid"},
		"PprofOnHTTPAddr":             {map[string]string{"INBOX_PPROF": "true"}, "INBOX_PPROF is no longer read: the profiler has a listener of its own now, set INBOX_PPROF_ADDR"},
		"BadMigrateFlag":              {map[string]string{"INBOX_MIGRATE": "maybe"}, "INBOX_MIGRATE is invalid"},
		"BadMaxMessageBytes":          {map[string]string{"INBOX_MAX_MESSAGE_BYTES": "-1"}, "INBOX_MAX_MESSAGE_BYTES is invalid"},
		"BadLogLevel":                 {map[string]string{"INBOX_LOG_LEVEL": "loud"}, "INBOX_LOG_LEVEL is invalid"},
		"BadDeriveMessageIDs":         {map[string]string{"INBOX_DERIVE_MISSING_MESSAGE_ID": "yes please"}, "INBOX_DERIVE_MISSING_MESSAGE_ID is invalid"},
		"DeadRetentionBelowRetention": {map[string]string{"INBOX_RETENTION": "48h", "INBOX_DEAD_RETENTION": "24h"}, "INBOX_DEAD_RETENTION is invalid"},
		"IdleInTxBelowConfirmWait":    {map[string]string{"INBOX_IDLE_IN_TX_TIMEOUT": "5s"}, "INBOX_IDLE_IN_TX_TIMEOUT is invalid: 5s is shorter than 15s"},
		"BadOTLPProtocol":             {map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, `OTEL_EXPORTER_OTLP_PROTOCOL is invalid: "http/json"`},
		"BadSDKDisabled":              {map[string]string{"OTEL_SDK_DISABLED": "sometimes"}, "OTEL_SDK_DISABLED is invalid"},
		"BadTracesExporter":           {map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER is invalid"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			env := []string{}
			for k, v := range base {
				if o, ok := tc.override[k]; ok {
					v = o
				}
				env = append(env, k+"="+v)
			}
			for k, v := range tc.override {
				if _, ok := base[k]; !ok {
					env = append(env, k+"="+v)
				}
			}
			cmd := exec.Command(inboxdPath, "serve")
			cmd.Env = env
			out, err := combinedOutput(t, cmd)
			require.Error(t, err, "a bad configuration fails at start")
			text := strings.TrimRight(string(out), "\n")
			require.NotContains(t, text, "\n", "one line")
			require.Contains(t, text, tc.want)
			require.NotContains(t, text, "s3cr3t-pw")
			require.NotContains(t, text, "an0ther-pw")
		})
	}
}

func TestMain_Help(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	require.NoError(t, run(t.Context(), []string{"help"}, func(string) string { return "" }, &out, &out))
	for _, s := range append((&config{}).settings(), otelSettings()...) {
		require.Contains(t, out.String(), s.name)
	}
	require.ErrorIs(t, run(t.Context(), []string{"frobnicate"}, func(string) string { return "" }, &out, &out), errUsage)
}

// docs/configuration.md's configuration table lists every setting with its default.
func TestReadmeDocumentsEverySetting(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../docs/configuration.md")
	require.NoError(t, err)
	for _, s := range (&config{}).settings() {
		def := "required"
		if s.def != "" {
			def = "`" + s.def + "`"
		} else if s.optional {
			def = "(none)"
		}
		require.Contains(t, string(readme), "| `"+s.name+"` | "+def+" |", "docs/configuration.md configuration table row for %s", s.name)
	}
	for _, s := range otelSettings() {
		def := s.def
		if def != "(none)" {
			def = "`" + def + "`"
		}
		require.Contains(t, string(readme), "| `"+s.name+"` | "+def+" |", "docs/configuration.md tracing table row for %s", s.name)
	}
}
