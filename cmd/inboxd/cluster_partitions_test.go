package main

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: three broker nodes, INBOX_PARTITIONS=6 (every queue a quorum
// queue on the three), two replicas, orders flowing with cancellations
// right behind their orders. The node leading the most inbox partitions is
// killed (SIGKILL) and started again, then the node leading the events'
// downstream queue, then the one leading order-confirmation.unroutable:
// no message is lost, no effect doubled, no
// cancellation handled before its order, every event arrives downstream
// under its id (copies counted), and ingest stores again within 10 seconds
// of each kill.
func TestPartitionedIngestThroughBrokerNodeKills(t *testing.T) {
	if raceEnabled {
		t.Skip("a broker cluster's failover, a minute and more of it: the race run repeats inboxd's reconnects in TestSurvivesBrokerConnectionLoss and the partitions in TestPartitionedReplicasShareThePartitionsAndKeepOrder")
	}
	t.Parallel()
	c := testenv.NewCluster(t, 3)
	db := testenv.NewDB(t)
	stockUp(t, db.Pool)
	require.NoError(t, broker.Declare(c.URL(), partitioned))
	b := newBundle(db, &testenv.Broker{URL: c.URL()})
	b.events = subscribeAcrossNodes(t, c)
	env := serviceEnv(db, b.broker, "INBOX_PARTITIONS=6", "INBOX_AMQP_HEARTBEAT=2s", "INBOX_CLAIM_LEASE=1s", "INBOX_RELAY_LEASE=2s")
	startProcess(t, env)
	startProcess(t, env)

	msgs, unique, cancelled := orderingWorkloadOf("cl", 3000, 4)
	third := len(msgs) / 3
	publishedSoFar := 0
	for phase, part := range [][]loadgen.Message{msgs[:third], msgs[third : 2*third], msgs[2*third:]} {
		publishedSoFar += len(part)
		leaders := c.Leaders(t)
		var victim *testenv.ClusterNode
		if phase == 0 {
			led := map[*testenv.ClusterNode]int{}
			for _, q := range broker.InboxQueues(partitioned.Partitions) {
				led[leaders[q]]++
			}
			victim = slices.MaxFunc(slices.Collect(maps.Keys(led)), func(a, b *testenv.ClusterNode) int { return led[a] - led[b] })
			t.Logf("%s leads %d of the %d inbox partitions", victim.Name, led[victim], partitioned.Partitions)
		} else {
			queue := []string{"downstream", broker.QueueUnroutable}[phase-1]
			victim = leaders[queue]
			require.NotNil(t, victim, "the leader of %s", queue)
			t.Logf("%s leads %s", victim.Name, queue)
		}
		require.NotNil(t, victim)
		producer := c.Nodes[(slices.Index(c.Nodes, victim)+1)%len(c.Nodes)]
		published := make(chan error, 1)
		go func() { published <- loadgen.PublishPaced(t.Context(), producer.URL, part, 100, 300) }()
		time.Sleep(time.Duration(len(part)) * time.Second / 300 / 3)
		victim.Kill(t)
		killed := time.Now()
		require.NoError(t, <-published, "every message confirmed to the producer")
		// Everything published so far stored first: a stall that outlasted
		// the publishing would otherwise go unseen.
		sent := map[string]bool{}
		for _, m := range msgs[:publishedSoFar] {
			sent[m.MessageID] = true
		}
		require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") >= len(sent) },
			time.Minute, 20*time.Millisecond, "everything published so far stored")
		var gap time.Duration
		require.NoError(t, db.Pool.QueryRow(t.Context(), `
			SELECT coalesce(max(gap), '0') FROM (
				SELECT received_at - lag(received_at) OVER (ORDER BY received_at) AS gap
				FROM inbox WHERE received_at > $1) AS g`, killed.Add(-time.Second)).Scan(&gap))
		t.Logf("killed %s; the longest pause in storing after it: %s", victim.Name, gap.Round(time.Millisecond))
		require.Less(t, gap, 10*time.Second, "ingest resumes within 10 s of the kill")
		victim.Restart(t)
	}

	b.waitDrained(t, unique, 3*time.Minute)
	b.requireEventsOnce(t)
	require.Equal(t, unique, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique id")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"), "every message processed")
	require.Equal(t, len(cancelled), b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"))
	b.requireStockAddsUp(t)
	b.requireOrderKept(t, cancelled)
	copies := 0
	for _, n := range b.seen {
		copies += n - 1
	}
	t.Logf("%d events downstream, %d copies", len(b.seen), copies)
}

// subscribeAcrossNodes consumes every event from "downstream", a quorum
// queue on the cluster, connecting again to the next node whenever its
// node goes. Each delivery is acknowledged as it is handed on (one whose
// ack is lost with its node comes again: a copy, which the test counts).
func subscribeAcrossNodes(t *testing.T, c *testenv.Cluster) <-chan amqp.Delivery {
	t.Helper()
	out := make(chan amqp.Delivery, 10000)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	declared := make(chan error, 1)
	go func() {
		first := true
		for n := 0; ctx.Err() == nil; n++ {
			node := c.Nodes[n%len(c.Nodes)]
			conn, err := amqp.Dial(node.URL)
			if err != nil {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			ch, err := conn.Channel()
			if err == nil {
				_, err = ch.QueueDeclare("downstream", true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
			}
			if err == nil {
				err = ch.QueueBind("downstream", "#", broker.ExchangeEvents, false, nil)
			}
			if first {
				first = false
				declared <- err
			}
			var deliveries <-chan amqp.Delivery
			if err == nil {
				deliveries, err = ch.Consume("downstream", "", false, false, false, false, nil)
			}
			for err == nil {
				select {
				case d, ok := <-deliveries:
					if !ok {
						err = amqp.ErrClosed
						break
					}
					_ = d.Ack(false)
					d.Acknowledger = ackedAlready{}
					out <- d
				case <-ctx.Done():
					err = ctx.Err()
				}
			}
			_ = conn.Close()
		}
	}()
	require.NoError(t, <-declared)
	return out
}

// ackedAlready is the acknowledger of a delivery acknowledged already.
type ackedAlready struct{}

func (ackedAlready) Ack(uint64, bool) error        { return nil }
func (ackedAlready) Nack(uint64, bool, bool) error { return nil }
func (ackedAlready) Reject(uint64, bool) error     { return nil }
