package main

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// partitioned is the topology of six partitions.
var partitioned = broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: 6}

// requireSpread waits until each of replicas processes' ingest is the
// active consumer of at least least inbox queues.
func (b *e2eBundle) requireSpread(t *testing.T, replicas, least int, timeout time.Duration) {
	t.Helper()
	var active map[string][]string
	require.Eventually(t, func() bool {
		active = b.broker.ActiveQueues(t)
		n := 0
		for tag, queues := range active {
			inbox := slices.DeleteFunc(queues, func(q string) bool { return !slices.Contains(broker.InboxQueues(6), q) })
			if strings.HasPrefix(tag, "inboxd ingest ") && len(inbox) >= least {
				n++
			}
		}
		return n == replicas
	}, timeout, 500*time.Millisecond, "each of %d replicas active on %d partitions or more", replicas, least)
	t.Logf("active consumers: %v", active)
}

// Acceptance: two replicas on six partitions share them (each the active
// consumer of two or more, whichever started first), and orders flowing
// with cancellations right behind them, with redeliveries, while each
// replica in turn is killed (SIGKILL) and started again, are handled once
// each, in their order, and their events arrive once, in their order.
func TestPartitionedReplicasShareThePartitionsAndKeepOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.NoError(t, broker.Declare(b.broker.URL, partitioned))
	env := serviceEnv(b.db, b.broker, "INBOX_PARTITIONS=6", "INBOX_CLAIM_LEASE=1s", "INBOX_RELAY_LEASE=2s")
	procs := []*process{startProcess(t, env)}

	// The first replica is active on all six once orders flow; the second
	// one, started after it, stands by on every queue until handed some.
	warm, warmUnique, warmCancelled := orderingWorkloadOf("warm", 1000, 1)
	warmed := make(chan error, 1)
	go func() { warmed <- loadgen.PublishPaced(t.Context(), b.broker.URL, warm, 100, 100) }()
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") > 50 }, time.Minute, 50*time.Millisecond)
	procs = append(procs, startProcess(t, env))
	b.requireSpread(t, 2, 2, time.Minute)
	require.NoError(t, <-warmed)

	msgs, unique, cancelled := orderingWorkloadOf("ord", 3000, 2)
	const perSecond = 600
	published := make(chan error, 1)
	go func() { published <- loadgen.PublishPaced(t.Context(), b.broker.URL, msgs, 100, perSecond) }()
	window := time.Duration(len(msgs)) * time.Second / perSecond
	started := time.Now()
	for n, at := range []time.Duration{window / 3, 2 * window / 3} {
		time.Sleep(time.Until(started.Add(at)))
		procs[n].kill()
		procs[n] = startProcess(t, env)
	}
	require.NoError(t, <-published)

	total := warmUnique + unique
	b.waitDrained(t, total, 3*time.Minute)
	b.requireEventsOnce(t)
	require.Equal(t, total, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique id")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"), "every message processed")
	cancelled = append(cancelled, warmCancelled...)
	require.Equal(t, len(cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
	b.requireStockAddsUp(t)
	b.requireOrderKept(t, cancelled)
	// Restarted, the two replicas share the partitions again.
	b.requireSpread(t, 2, 2, time.Minute)
}

// Acceptance: INBOX_PARTITIONS changed while messages wait in the queue of
// the former layout: serve refuses to start, naming the docs'
// procedure; the procedure, followed while the producer goes on publishing
// the cancellations of the waiting orders, loses nothing and keeps each
// order's sequence (no cancellation handled before its order).
func TestChangingPartitionsLosesNothingAndKeepsOrder(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../docs/ordering.md")
	require.NoError(t, err)
	require.Contains(t, string(readme), "\n### Changing INBOX_PARTITIONS\n")

	b := setup(t) // the layout of one partition, as serve declared it so far
	msgs, unique, cancelled := orderingWorkloadOf("chg", 2000, 3)
	var before, after []loadgen.Message
	for _, m := range msgs {
		if m.RoutingKey == orders.TypeOrderCancelled {
			after = append(after, m)
		} else {
			before = append(before, m)
		}
	}
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, before, 100))
	require.Positive(t, b.broker.ReadyMessages(t, broker.QueueInbox))

	env := serviceEnv(b.db, b.broker, "INBOX_PARTITIONS=6")
	p := startProcess(t, env)
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		t.Fatal("serve did not refuse to start")
	}
	require.Error(t, p.err)
	require.True(t, p.logContains(`of INBOX_PARTITIONS=1, holds`), "the refusal names the queue")
	require.True(t, p.logContains(`follow "Changing INBOX_PARTITIONS" in docs/ordering.md`), "the refusal names the procedure")
	require.Equal(t, len(before), b.broker.ReadyMessages(t, broker.QueueInbox), "the messages stay")

	// repartition refuses while a replica still consumes an inbox queue.
	replica, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	rch, err := replica.Channel()
	require.NoError(t, err)
	require.NoError(t, rch.Qos(1, 0, false))
	_, err = rch.Consume(broker.QueueInbox, "a replica not stopped", false, false, false, false, nil)
	require.NoError(t, err)
	out, ok := runInboxd(t, "repartition", env...)
	require.False(t, ok, out)
	require.Contains(t, out, "has 1 consumers: stop every replica before inboxd repartition")
	require.NoError(t, replica.Close()) // its delivery goes back, first in line

	// The procedure: with the replicas stopped (none runs), repartition,
	// while every cancellation is being published, then start the replicas
	// on the new layout.
	published := make(chan error, 1)
	go func() { published <- loadgen.PublishPaced(t.Context(), b.broker.URL, after, 50, 1000) }()
	out, ok = runInboxd(t, "repartition", env...)
	require.True(t, ok, out)
	require.Contains(t, out, "start the replicas with INBOX_PARTITIONS=6")
	require.NoError(t, <-published)
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	defer conn.Close()
	others, err := broker.OtherLayouts(conn, 6)
	require.NoError(t, err)
	require.Empty(t, others, "the former layout is deleted")
	startProcess(t, env)
	startProcess(t, env)

	b.waitDrained(t, unique, 3*time.Minute)
	b.requireEventsOnce(t)
	require.Equal(t, unique, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique id")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"), "every message processed")
	require.Equal(t, len(cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
	b.requireOrderKept(t, cancelled)
}
