package main

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: on a three-node RabbitMQ cluster of the test's own, with
// AMQP_URL listing every node, orders flow from a producer on one node
// while the node ingest is connected to is killed with SIGKILL. Ingest,
// the relay and the dead letters connect again to the nodes left (the
// quorum queue moved its leader meanwhile): every order confirmed to the
// producer is stored and handled once, and every event arrives downstream,
// under its one id.
func TestIngestFollowsTheClusterWhenItsNodeIsKilled(t *testing.T) {
	if raceEnabled {
		t.Skip("a broker cluster's failover, a minute and more of it: the race run repeats inboxd's reconnects in TestSurvivesBrokerConnectionLoss and the partitions in TestPartitionedReplicasShareThePartitionsAndKeepOrder")
	}
	t.Parallel()
	c := testenv.NewCluster(t, 3)
	db := testenv.NewDB(t)
	stockUp(t, db.Pool)
	require.NoError(t, loadgen.DeclareTopology(c.URL(), broker.QueueTypeQuorum))
	p := startProcess(t, serviceEnv(db, &testenv.Broker{URL: c.URL()}, "INBOX_AMQP_HEARTBEAT=2s"))

	ingest := func(name string) bool {
		return strings.HasPrefix(name, "inboxd ingest ") && !strings.HasSuffix(name, " dead letters")
	}
	var victim *testenv.ClusterNode
	require.Eventually(t, func() bool { victim = c.NodeOf(t, ingest); return victim != nil },
		time.Minute, 100*time.Millisecond, "ingest connected")
	at := slices.Index(c.Nodes, victim)
	survivor := c.Nodes[(at+1)%len(c.Nodes)]
	b := newBundle(db, &testenv.Broker{URL: survivor.URL})
	b.subscribeDownstream(t)

	w := loadgen.Generate(loadgen.Spec{Orders: 3000, DuplicateRate: 0.1, Seed: 21})
	published := make(chan error, 1)
	go func() { published <- loadgen.PublishPaced(t.Context(), survivor.URL, w.Messages, 100, 300) }()
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") > 500 },
		time.Minute, 10*time.Millisecond)
	victim.Kill(t)
	killed := time.Now()
	t.Logf("killed %s, which held ingest's connection, with %d messages stored", victim.Name, b.count(t, "SELECT count(*) FROM inbox"))

	require.NoError(t, <-published, "every order confirmed to the producer")
	b.waitDrained(t, w.UniqueMessageIDs, 2*time.Minute)
	b.requireExactlyOnce(t, w)
	b.requireEventsOnce(t)
	var gap time.Duration
	require.NoError(t, db.Pool.QueryRow(t.Context(), `
		SELECT coalesce(max(gap), '0') FROM (
			SELECT received_at - lag(received_at) OVER (ORDER BY received_at) AS gap
			FROM inbox WHERE received_at > $1) AS g`, killed.Add(-time.Second)).Scan(&gap))
	t.Logf("the longest pause in storing around the kill: %s; ingest is now on %s", gap.Round(time.Millisecond), c.NodeOf(t, ingest).Name)
	require.False(t, p.exited())
}
