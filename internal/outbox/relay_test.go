package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type bundle struct {
	db       *testenv.DB
	broker   *testenv.Broker
	received <-chan amqp.Delivery
}

// setup gives a schema, a vhost with the topology, and a queue bound to
// every event, as a downstream consumer would have.
func setup(t *testing.T) *bundle {
	t.Helper()
	b := &bundle{db: testenv.NewDB(t), broker: testenv.NewBroker(t)}
	require.NoError(t, loadgen.DeclareTopology(b.broker.URL, broker.QueueTypeQuorum))
	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclare("downstream", true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q.Name, "#", broker.ExchangeEvents, false, nil))
	b.received, err = ch.Consume(q.Name, "", true, false, false, false, nil)
	require.NoError(t, err)
	return b
}

func (b *bundle) insertRows(t *testing.T, n int) map[string]bool {
	t.Helper()
	return b.insertRowsOf(t, "m", n)
}

// insertRowsOf inserts n order.confirmed effects of the messages prefix-0,
// prefix-1, ..., and returns their keys.
func (b *bundle) insertRowsOf(t *testing.T, prefix string, n int) map[string]bool {
	t.Helper()
	keys := map[string]bool{}
	var p dbsqlc.OutboxInsertManyParams
	for i := range n {
		key := fmt.Sprintf("%s-%d:order.confirmed", prefix, i)
		keys[key] = true
		p.IdempotencyKeys = append(p.IdempotencyKeys, key)
		p.RoutingKeys = append(p.RoutingKeys, "order.confirmed")
		p.Payloads = append(p.Payloads, fmt.Sprintf(`{"orderId":"o-%d"}`, i))
		p.MessageIds = append(p.MessageIds, fmt.Sprintf("%s-%d", prefix, i))
	}
	require.NoError(t, dbsqlc.New().OutboxInsertMany(t.Context(), b.db.Pool, p))
	require.NoError(t, dbsqlc.New().OutboxInsertMany(t.Context(), b.db.Pool, p), "inserting the same effects again adds nothing")
	return keys
}

func (b *bundle) startRelay(t *testing.T, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	cfg.URL = b.broker.URL
	cfg.Logger = testenv.Logger(t)
	cfg.PollInterval = cmpOr(cfg.PollInterval, 50*time.Millisecond)
	r, err := outbox.NewRelay(b.db.Pool, &cfg)
	require.NoError(t, err)
	require.NoError(t, r.Start(t.Context()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 10*time.Second)
		defer cancel()
		r.Stop(ctx)
	})
	return r
}

func cmpOr(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// receive collects published messages until every key has arrived, and
// returns how often each message id came.
func (b *bundle) receive(t *testing.T, keys map[string]bool) map[string]int {
	t.Helper()
	seen := map[string]int{}
	distinct := 0
	timeout := time.After(60 * time.Second)
	for distinct < len(keys) {
		select {
		case d := <-b.received:
			require.True(t, keys[d.MessageId], "unexpected message id %q", d.MessageId)
			require.Equal(t, uint8(amqp.Persistent), d.DeliveryMode)
			require.Equal(t, "application/json", d.ContentType)
			if seen[d.MessageId] == 0 {
				distinct++
			}
			seen[d.MessageId]++
		case <-timeout:
			t.Fatalf("%d of %d events arrived", distinct, len(keys))
		}
	}
	return seen
}

func (b *bundle) unpublished(t *testing.T) int {
	t.Helper()
	return b.db.Int(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL")
}

func TestRelay(t *testing.T) {
	t.Parallel()

	t.Run("PublishesEachRowOnceUnderItsKey", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		keys := b.insertRows(t, 600)
		b.startRelay(t, outbox.RelayConfig{BatchSize: 100})
		seen := b.receive(t, keys)
		for id, n := range seen {
			require.Equal(t, 1, n, "%s published %d times", id, n)
		}
		require.Eventually(t, func() bool { return b.unpublished(t) == 0 }, 10*time.Second, 20*time.Millisecond)
	})

	t.Run("RepublishesUnderTheSameIDAfterARelayDied", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		keys := b.insertRows(t, 50)
		// A relay claimed the rows, marking them published in its open
		// transaction, and is publishing them: they stay locked, and no
		// other relay takes them.
		dead := b.db.Session(t)
		tx, err := dead.Begin(t.Context())
		require.NoError(t, err)
		claimed, err := dbsqlc.New().OutboxClaimBatch(t.Context(), tx, dbsqlc.OutboxClaimBatchParams{LeaseMs: 30_000, MaxRows: 1000})
		require.NoError(t, err)
		require.Len(t, claimed, 50)
		require.Equal(t, 50, b.unpublished(t), "others see the rows unpublished until the claim commits")

		// Rows written since are published meanwhile: the held ones are
		// skipped, not waited for.
		free := b.insertRowsOf(t, "n", 20)
		b.startRelay(t, outbox.RelayConfig{})
		for range free {
			select {
			case d := <-b.received:
				require.True(t, free[d.MessageId], "%s published while another relay holds it", d.MessageId)
			case <-time.After(30 * time.Second):
				t.Fatal("the rows nobody holds were not published")
			}
		}

		// Then it dies: its connection ends without a commit.
		require.NoError(t, dead.Close(t.Context()))
		seen := b.receive(t, keys)
		require.Len(t, seen, 50)
		require.Eventually(t, func() bool { return b.unpublished(t) == 0 }, 10*time.Second, 20*time.Millisecond)
		require.Equal(t, 1, b.db.Int(t, "SELECT max(attempts) FROM outbox"), "the dead relay's claim was rolled back with it")
	})

	t.Run("RepublishesAnEarlierReleasesClaimAfterTheLease", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		keys := b.insertRows(t, 50)
		// A relay of an earlier release claimed the rows in a transaction
		// of their own, and died before marking them published.
		_, err := b.db.Pool.Exec(t.Context(), "UPDATE outbox SET claimed_at = now(), attempts = attempts + 1")
		require.NoError(t, err)

		// The relay's clock stands a minute short of the lease, then past it.
		var clock testenv.Clock
		clock.SetAhead(time.Hour - time.Minute)
		r := b.startRelay(t, outbox.RelayConfig{Lease: time.Hour,
			Now: clock.Now})
		require.Eventually(t, r.Connected, 10*time.Second, 10*time.Millisecond)
		for range 3 { // three claims at the poll interval (50 ms)
			r.Notify()
			time.Sleep(50 * time.Millisecond)
		}
		require.Equal(t, 50, b.unpublished(t), "published before the lease passed")
		clock.SetAhead(time.Hour + time.Second)
		r.Notify()
		seen := b.receive(t, keys)
		require.Len(t, seen, 50)
		require.Eventually(t, func() bool { return b.unpublished(t) == 0 }, 10*time.Second, 20*time.Millisecond)
		require.Equal(t, 2, b.db.Int(t, "SELECT min(attempts) FROM outbox"), "taken over after the lease")
	})

	t.Run("SurvivesItsConnectionClosed", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		r := b.startRelay(t, outbox.RelayConfig{BatchSize: 10})
		require.Eventually(t, r.Connected, 10*time.Second, 10*time.Millisecond)
		keys := b.insertRows(t, 200)
		require.Positive(t, b.broker.CloseConnections(t, "inboxd relay"))
		var p dbsqlc.OutboxInsertManyParams
		for i := range 200 {
			key := fmt.Sprintf("n-%d:email.requested", i)
			keys[key] = true
			p.IdempotencyKeys = append(p.IdempotencyKeys, key)
			p.RoutingKeys = append(p.RoutingKeys, "email.requested")
			p.Payloads = append(p.Payloads, `{"orderId":"x"}`)
			p.MessageIds = append(p.MessageIds, fmt.Sprintf("n-%d", i))
		}
		require.NoError(t, dbsqlc.New().OutboxInsertMany(t.Context(), b.db.Pool, p))
		r.Notify()
		b.receive(t, keys)
		require.Eventually(t, func() bool { return b.unpublished(t) == 0 }, 20*time.Second, 20*time.Millisecond)
	})

	t.Run("PublishesEachOrdersRowsInIDOrderWithTwoRelays", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		// 30 orders of 10 events each, interleaved at random as handlers
		// would write them, some runs of one order back to back.
		rng := rand.New(rand.NewPCG(3, 5))
		next := make([]int, 30)
		var p dbsqlc.OutboxInsertManyParams
		keys := map[string]bool{}
		for len(keys) < 300 {
			o := rng.IntN(30)
			for run := 1 + rng.IntN(4); run > 0 && next[o] < 10; run-- {
				key := fmt.Sprintf("o-%d-%d:order.event", o, next[o])
				keys[key] = true
				p.IdempotencyKeys = append(p.IdempotencyKeys, key)
				p.RoutingKeys = append(p.RoutingKeys, "order.event")
				p.Payloads = append(p.Payloads, fmt.Sprintf(`{"orderId":"o-%d","seq":%d}`, o, next[o]))
				p.MessageIds = append(p.MessageIds, fmt.Sprintf("o-%d-%d", o, next[o]))
				p.OrderKeys = append(p.OrderKeys, fmt.Sprintf("o-%d", o))
				next[o]++
			}
		}
		require.NoError(t, dbsqlc.New().OutboxInsertMany(t.Context(), b.db.Pool, p))
		b.startRelay(t, outbox.RelayConfig{BatchSize: 16})
		b.startRelay(t, outbox.RelayConfig{BatchSize: 16})
		// Keepers of other processes raise the floor as well, as often as
		// they can, past rows a claim's snapshot still sees open: the
		// claim's hold-back must not depend on where the floor stands.
		ctx, stop := context.WithCancel(t.Context())
		var keepers sync.WaitGroup
		t.Cleanup(func() { stop(); keepers.Wait() })
		for range 2 {
			keepers.Go(func() {
				raise := claimfloor.Outbox(b.db.Pool)
				var note claimfloor.Note
				for ctx.Err() == nil {
					if _, next, err := raise(ctx, note); err == nil {
						note = next
					}
				}
			})
		}

		// Each order's events, at their first arrival, in arrival order.
		arrived := map[string][]int{}
		seen := map[string]bool{}
		timeout := time.After(60 * time.Second)
		for len(seen) < len(keys) {
			select {
			case d := <-b.received:
				if seen[d.MessageId] {
					continue
				}
				seen[d.MessageId] = true
				var ev struct {
					OrderID string `json:"orderId"`
					Seq     int    `json:"seq"`
				}
				require.NoError(t, json.Unmarshal(d.Body, &ev))
				arrived[ev.OrderID] = append(arrived[ev.OrderID], ev.Seq)
			case <-timeout:
				t.Fatalf("%d of %d events arrived", len(seen), len(keys))
			}
		}
		for o, seqs := range arrived {
			require.True(t, slices.IsSorted(seqs), "order %s published out of order: %v", o, seqs)
		}
	})
}
