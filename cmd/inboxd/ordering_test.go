package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// orderingWorkload is 3,000 orders published as one producer would: each
// order.created followed at once, for 15% of the orders, by its
// order.cancelled, and 30% of all messages published again under the same
// id a few messages later, as redeliveries come.
func orderingWorkload(seed uint64) (msgs []loadgen.Message, unique int, cancelled []string) {
	return orderingWorkloadOf("ord", 3000, seed)
}

// orderingWorkloadOf is orderingWorkload of n orders whose ids start with
// prefix.
func orderingWorkloadOf(prefix string, n int, seed uint64) (msgs []loadgen.Message, unique int, cancelled []string) {
	rng := rand.New(rand.NewPCG(seed, 11))
	var again []loadgen.Message
	for i := range n {
		orderID := fmt.Sprintf("%s-%05d", prefix, i)
		batch := []loadgen.Message{{
			MessageID: orderID + "-created", RoutingKey: orders.TypeOrderCreated, OrderID: orderID,
			Body: loadgen.OrderCreatedBody(orderID, 1+rng.IntN(3)),
		}}
		if rng.Float64() < 0.15 {
			body, _ := json.Marshal(orders.OrderCancelled{OrderID: orderID, Reason: "customer request"})
			batch = append(batch, loadgen.Message{MessageID: orderID + "-cancelled", RoutingKey: orders.TypeOrderCancelled, OrderID: orderID, Body: body})
			cancelled = append(cancelled, orderID)
		}
		for _, m := range batch {
			msgs = append(msgs, m)
			unique++
			if rng.Float64() < 0.3 {
				again = append(again, m)
			}
		}
		for len(again) > 0 && rng.IntN(4) == 0 {
			msgs = append(msgs, again[0])
			again = again[1:]
		}
	}
	return append(msgs, again...), unique, cancelled
}

// Acceptance: one producer channel publishes orders, some followed at once
// by their cancellation, with redeliveries, to two inboxd processes while
// faults land: every order's messages are handled in the order they were
// published, and a downstream consumer receives each cancelled order's
// outcome event before its order.cancelled.
func TestOrderKeptFromProducerToDownstream(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fault func(t *testing.T, b *e2eBundle, procs []*process, env []string, n int)
	}{
		// One process or the other: whichever consumes the queue at first,
		// one of the kills lands on the active consumer.
		{"SIGKILL", func(t *testing.T, _ *e2eBundle, procs []*process, env []string, n int) {
			procs[n%2].kill()
			procs[n%2] = startProcess(t, env)
		}},
		// A rolling restart: the stopping consumer hands over to the other.
		{"SIGTERM", func(t *testing.T, _ *e2eBundle, procs []*process, env []string, n int) {
			require.Eventually(t, func() bool { return procs[n%2].logContains(`"inboxd serving"`) },
				30*time.Second, 10*time.Millisecond, "process %d serves", n%2)
			procs[n%2].terminate(30 * time.Second)
			procs[n%2] = startProcess(t, env)
		}},
		{"ConnectionsClosed", func(t *testing.T, b *e2eBundle, _ []*process, _ []string, _ int) {
			require.Positive(t, b.broker.CloseConnections(t, "inboxd"), "connections to close")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			env := serviceEnv(b.db, b.broker, "INBOX_CLAIM_LEASE=1s", "INBOX_RELAY_LEASE=2s")
			procs := []*process{startProcess(t, env), startProcess(t, env)}
			msgs, unique, cancelled := orderingWorkload(uint64(len(tc.name)))

			const perSecond = 600
			published := make(chan error, 1)
			go func() { published <- loadgen.PublishPaced(t.Context(), b.broker.URL, msgs, 100, perSecond) }()
			window := time.Duration(len(msgs)) * time.Second / perSecond
			started := time.Now()
			for n, at := range []time.Duration{window / 3, 2 * window / 3} {
				time.Sleep(time.Until(started.Add(at)))
				tc.fault(t, b, procs, env, n)
			}
			require.NoError(t, <-published)

			b.waitDrained(t, unique, 3*time.Minute)
			b.requireEventsOnce(t)
			require.Equal(t, unique, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique id")
			require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"), "every message processed")
			require.Equal(t, len(cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
			b.requireStockAddsUp(t)

			b.requireOrderKept(t, cancelled)
		})
	}
}

// requireOrderKept checks, after requireEventsOnce, that no cancellation was
// handled before its order, and that the downstream queue received each
// cancelled order's one outcome event (order.confirmed or order.rejected)
// before its order.cancelled.
func (b *e2eBundle) requireOrderKept(t *testing.T, cancelled []string) {
	t.Helper()
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE result = $1", orders.ResultCancelledUnseen),
		"cancellations handled before their order")
	isOutcome := func(k string) bool { return k == orders.EventOrderConfirmed || k == orders.EventOrderRejected }
	outOfOrder := 0
	for _, orderID := range cancelled {
		got := b.arrivals[orderID]
		cancel := slices.Index(got, orders.EventOrderCancelled)
		require.NotEqual(t, -1, cancel, "order %s: no order.cancelled event in %v", orderID, got)
		require.Len(t, slices.DeleteFunc(slices.Clone(got), func(k string) bool { return !isOutcome(k) }), 1,
			"order %s: one outcome event, got %v", orderID, got)
		if slices.IndexFunc(got, isOutcome) > cancel {
			outOfOrder++
		}
	}
	require.Zero(t, outOfOrder, "of %d cancelled orders, downstream received order.cancelled before the outcome", len(cancelled))
}

// Acceptance: against an order-confirmation.inbox declared by a build
// without single active consumer, serve stops at start with one line that
// says what to do, and leaves the queue and its messages alone.
func TestServeRefusesAnInboxQueueWithoutSingleActiveConsumer(t *testing.T) {
	t.Parallel()
	db, rabbit := testenv.NewDB(t), testenv.NewBroker(t)
	conn, err := amqp.Dial(rabbit.URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(broker.QueueInbox, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg: amqp.QueueTypeQuorum, "x-dead-letter-exchange": broker.ExchangeDeadLetter,
	})
	require.NoError(t, err)
	require.NoError(t, ch.Publish("", broker.QueueInbox, false, false, amqp.Publishing{MessageId: "waiting", Body: []byte("{}")}))

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, inboxdPath, "serve")
	cmd.Env = serviceEnv(db, rabbit)
	out, err := combinedOutput(t, cmd)
	require.Error(t, err, "serve fails at start")
	require.NoError(t, ctx.Err(), "serve fails at start rather than running on")
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	last := lines[len(lines)-1]
	require.True(t, strings.HasPrefix(last, "inboxd: queue order-confirmation.inbox was declared without x-single-active-consumer"), last)
	require.Contains(t, last, `"Upgrading the inbox queue" in docs/ordering.md`)
	require.Equal(t, 1, rabbit.ReadyMessages(t, broker.QueueInbox), "the queue keeps its message")
}
