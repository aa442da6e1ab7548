package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// silentProxy forwards TCP connections to target until silence is called;
// from then on it forwards nothing, either way, and closes nothing, as a
// network that loses every packet would, while both sockets stay open.
// What each side sends meanwhile is held, not dropped, so that a silence
// can be lifted again at once (unsilence) without breaking the streams;
// a silence that is never lifted is a lost network.
type silentProxy struct {
	ln     net.Listener
	target string
	silent atomic.Bool
	closed atomic.Bool

	mu    sync.Mutex
	conns []net.Conn
}

func startSilentProxy(t *testing.T, target string) *silentProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &silentProxy{ln: ln, target: target}
	go p.accept()
	t.Cleanup(func() {
		p.closed.Store(true)
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// silence stops all forwarding, and new connections with it.
func (p *silentProxy) silence() { p.silent.Store(true) }

// unsilence forwards again what was held, and what comes.
func (p *silentProxy) unsilence() { p.silent.Store(false) }

// quiet waits while the proxy is silenced, and reports whether it may go
// on (it is not closed).
func (p *silentProxy) quiet() bool {
	for p.silent.Load() && !p.closed.Load() {
		time.Sleep(time.Millisecond)
	}
	return !p.closed.Load()
}

func (p *silentProxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.conns = append(p.conns, client)
		p.mu.Unlock()
		go func() {
			if !p.quiet() {
				return
			}
			server, err := net.Dial("tcp", p.target)
			if err != nil {
				_ = client.Close()
				return
			}
			p.mu.Lock()
			p.conns = append(p.conns, server)
			p.mu.Unlock()
			go p.forward(client, server)
			go p.forward(server, client)
		}()
	}
}

// forward copies from src to dst, holding what it read while the proxy is
// silenced. A side that closes is passed on only once the silence is over.
func (p *silentProxy) forward(src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if !p.quiet() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			_ = dst.Close()
			return
		}
	}
}

// viaProxy returns rawURL with its host and port replaced by addr.
func viaProxy(t *testing.T, rawURL, addr string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	u.Host = addr
	return u.String()
}

// Acceptance: of two replicas under 100 orders a second, the one that is
// the inbox queue's active consumer and the leader goes quiet while it
// holds claims: its network goes silent, to PostgreSQL and to RabbitMQ at
// once, as a partition that drops packets would (nothing it sends
// arrives, nothing is refused, its sockets stay open), or its process is
// frozen (SIGSTOP, as a VM pause) for 15 s, longer than every timeout,
// and then resumed. The other keeps the flow: PostgreSQL ends the quiet
// replica's sessions (its batch's transaction after
// INBOX_WORKER_IDLE_IN_TX_TIMEOUT, its liveness and leader sessions after
// 5 s without a ping), so its claims and the rows it locked are free and
// the other leads; RabbitMQ closes its connection once its heartbeats stop
// (INBOX_AMQP_HEARTBEAT, 2 s here), and hands the queue to the other's
// ingest, with the deliveries the quiet one had not acked. Over all
// orders, publish → processed stays within p50 1 s and p99 10 s, and
// every order is confirmed once. A frozen replica, resumed, drops what it
// held and handles messages again.
func TestAQuietReplicaHoldsTheFlowBackSecondsOnly(t *testing.T) {
	if raceEnabled {
		t.Skip("the bounds are in seconds, and a race-built inboxd keeps up with 100 orders a second only at times")
	}
	for _, c := range []quietCase{
		{name: "network silent holding claims", caught: "claims"},
		{name: "process frozen holding claims", freeze: true, caught: "claims"},
		{name: "process frozen holding the relay's batch", freeze: true, caught: "relay"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			quietReplicaHoldsTheFlowBackSecondsOnly(t, c)
		})
	}
}

// quietCase is how a replica goes quiet: its network silenced or its
// process frozen, while it holds claims or while its relay's transaction
// waits for the broker's confirms.
type quietCase struct {
	name   string
	freeze bool
	caught string // "claims" or "relay"
}

func quietReplicaHoldsTheFlowBackSecondsOnly(t *testing.T, c quietCase) {
	freeze := c.freeze
	// The relay's transaction, idle while it waits for confirms, is ended
	// after INBOX_IDLE_IN_TX_TIMEOUT: 15 s, the least it may be, here.
	const perSecond, heartbeat, relayIdle, frozenFor = 100, 2 * time.Second, 15 * time.Second, 20 * time.Second
	b := setupIn(t, testenv.NewDBAlone(t))
	dbURL, err := url.Parse(b.db.URL)
	require.NoError(t, err)
	amqpURL, err := url.Parse(b.broker.URL)
	require.NoError(t, err)
	pgProxy, mqProxy := startSilentProxy(t, dbURL.Host), startSilentProxy(t, amqpURL.Host)
	env := func(name, db, mq string) []string {
		return serviceEnv(b.db, b.broker, "DATABASE_URL="+withApplicationName(t, db, name), "AMQP_URL="+mq,
			"INBOX_AMQP_HEARTBEAT="+heartbeat.String(), "INBOX_WORKER_BATCH_SIZE=50", "INBOX_IDLE_IN_TX_TIMEOUT="+relayIdle.String())
	}
	// The quiet one first: it is the queue's active consumer and leads.
	quiet := startProcess(t, env("quiet", viaProxy(t, b.db.URL, pgProxy.ln.Addr().String()), viaProxy(t, b.broker.URL, mqProxy.ln.Addr().String())))
	t.Cleanup(func() { _ = quiet.cmd.Process.Signal(syscall.SIGCONT) })
	require.Eventually(t, func() bool { return b.leader(t) == "quiet leader" }, 30*time.Second, 50*time.Millisecond, "the first replica leads")
	startProcess(t, env("stable", b.db.URL, b.broker.URL))

	// 30 s of messages: orders, every seventh cancelled right behind it.
	// Each message's publish time is its place in the paced stream.
	const total = 30 * perSecond
	var msgs []loadgen.Message
	place := map[string]int{}
	cancels := 0
	for i := 0; len(msgs) < total; i++ {
		id := fmt.Sprintf("s-%05d", i)
		body, err := json.Marshal(orders.OrderCreated{OrderID: id, UserID: "u", Email: "u@example.com",
			Items: []orders.Item{{SKU: fmt.Sprintf("SKU-%d", 1+i%3), Quantity: 1}}})
		require.NoError(t, err)
		place[id] = len(msgs)
		msgs = append(msgs, loadgen.Message{MessageID: id, RoutingKey: orders.TypeOrderCreated, OrderID: id, Body: body})
		if i%7 == 3 && len(msgs) < total {
			body, err := json.Marshal(orders.OrderCancelled{OrderID: id, Reason: "customer request"})
			require.NoError(t, err)
			place[id+"-cancelled"] = len(msgs)
			msgs = append(msgs, loadgen.Message{MessageID: id + "-cancelled", RoutingKey: orders.TypeOrderCancelled, OrderID: id, Body: body})
			cancels++
		}
	}
	orderCount := total - cancels
	var started time.Time
	publishedAt := func(id string) time.Time {
		n, ok := place[id]
		require.True(t, ok, id)
		return started.Add(time.Duration(n) * time.Second / perSecond)
	}
	// Every event's first arrival downstream.
	var arrivedMu sync.Mutex
	arrived := map[string]time.Time{}
	go func() {
		for d := range b.events {
			_ = d.Ack(false)
			arrivedMu.Lock()
			if _, ok := arrived[d.MessageId]; !ok {
				arrived[d.MessageId] = time.Now()
			}
			arrivedMu.Unlock()
		}
	}()
	started = time.Now()
	published := make(chan error, 1)
	go func() {
		published <- loadgen.PublishPaced(context.WithoutCancel(t.Context()), b.broker.URL, msgs, 10, perSecond)
	}()
	time.Sleep(5 * time.Second)
	// Quiet while it holds claims: looked for without pause, as a batch
	// holds its claims for milliseconds, and let go again at once when it
	// held none (the proxies hold what they get meanwhile; a frozen
	// process holds its own).
	goQuiet, goOn := func() { pgProxy.silence(); mqProxy.silence() }, func() { pgProxy.unsilence(); mqProxy.unsilence() }
	if freeze {
		goQuiet = func() { require.NoError(t, quiet.cmd.Process.Signal(syscall.SIGSTOP)) }
		goOn = func() { require.NoError(t, quiet.cmd.Process.Signal(syscall.SIGCONT)) }
	}
	holding := fmt.Sprintf("SELECT message_id FROM inbox WHERE status = 'pending' AND claimed_by LIKE '%%/%d'", quiet.cmd.Process.Pid)
	if c.caught == "relay" {
		// Outbox rows locked by the relay's open transaction.
		holding = `SELECT o.message_id FROM outbox o
			JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid::text = o.xmax::text AND l.granted
			JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE a.application_name = 'quiet relay' AND o.published_at IS NULL`
	}
	var held []string
	for deadline := time.Now().Add(20 * time.Second); len(held) == 0; {
		require.True(t, time.Now().Before(deadline), "the replica was never caught holding %s", c.caught)
		goQuiet()
		if held = b.db.Strings(t, holding); len(held) == 0 {
			goOn()
			time.Sleep(time.Millisecond)
		}
	}
	quietAt := time.Now()
	var resumedAt time.Time
	if freeze {
		time.Sleep(frozenFor)
		goOn()
		resumedAt = time.Now()
	}

	require.NoError(t, <-published)
	b.waitDrained(t, total, time.Minute)
	require.Equal(t, orderCount-cancels, b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'"), "every order confirmed once")
	require.Equal(t, cancels, b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'cancelled'"), "every cancellation after its order")

	// Publish → processed, each order's publish time taken from its place
	// in the paced stream.
	rows, err := b.db.Pool.Query(t.Context(), "SELECT message_id, processed_at FROM inbox")
	require.NoError(t, err)
	var latencies []time.Duration
	for rows.Next() {
		var id string
		var at time.Time
		require.NoError(t, rows.Scan(&id, &at))
		latencies = append(latencies, at.Sub(publishedAt(id)))
	}
	require.NoError(t, rows.Err())
	slices.Sort(latencies)
	p50, p99, worst := latencies[len(latencies)/2], latencies[len(latencies)*99/100], latencies[len(latencies)-1]
	t.Logf("quiet %s after the first publish, holding %d (%s); publish → processed over %d messages: p50 %s, p99 %s, max %s",
		quietAt.Sub(started).Round(time.Millisecond), len(held), c.caught, len(latencies), p50.Round(time.Millisecond), p99.Round(time.Millisecond), worst.Round(time.Millisecond))
	require.LessOrEqual(t, p50, time.Second, "p50")
	require.LessOrEqual(t, p99, 10*time.Second, "p99")

	// Publish → event downstream, for every event (an order's confirmation
	// and email request, a cancellation's order.cancelled): those the quiet
	// relay held wait for its transaction to be ended, the rest do not
	// wait for them. A cancellation's event comes after its order's.
	require.Eventually(t, func() bool {
		arrivedMu.Lock()
		defer arrivedMu.Unlock()
		return len(arrived) == 2*orderCount+cancels
	}, relayIdle+time.Minute, 100*time.Millisecond, "every event arrives downstream")
	// An event waits for a quiet relay when that relay held it, or held
	// an earlier event of its order (a cancellation's order.cancelled
	// comes after its order's events). The others are the flow the other
	// replica keeps: their p99 is held to the bound. (Over every event the
	// p99 would say only whether the quiet relay's batch happened to hold
	// more than one event in a hundred: 59 of 5,625 once.) A replica
	// caught holding claims held no event: every one is held to it.
	heldOrders := map[string]bool{}
	if c.caught == "relay" {
		for _, message := range held {
			heldOrders[message] = true
		}
	}
	arrivedMu.Lock()
	var eventLatencies, keptLatencies []time.Duration
	for id, at := range arrived {
		message, _, ok := strings.Cut(id, ":")
		require.True(t, ok, id)
		latency := at.Sub(publishedAt(message))
		eventLatencies = append(eventLatencies, latency)
		order, cancellation := strings.CutSuffix(message, "-cancelled")
		if !heldOrders[order] {
			keptLatencies = append(keptLatencies, latency)
		}
		if cancellation {
			confirmed, ok := arrived[order+":"+orders.EventOrderConfirmed]
			require.True(t, ok && !at.Before(confirmed), "%s's order.cancelled after its order.confirmed", order)
		}
	}
	arrivedMu.Unlock()
	slices.Sort(eventLatencies)
	slices.Sort(keptLatencies)
	ep99, eworst := eventLatencies[len(eventLatencies)*99/100], eventLatencies[len(eventLatencies)-1]
	kp99 := keptLatencies[len(keptLatencies)*99/100]
	t.Logf("publish → event downstream over %d events: p99 %s, max %s; over the %d of orders a quiet relay held nothing of: p99 %s",
		len(eventLatencies), ep99.Round(time.Millisecond), eworst.Round(time.Millisecond), len(keptLatencies), kp99.Round(time.Millisecond))
	require.LessOrEqual(t, kp99, 10*time.Second, "events p99, the orders a quiet relay held nothing of")
	require.LessOrEqual(t, eworst, relayIdle+10*time.Second, "an event the quiet relay held waits for its transaction to end, no more")

	if freeze {
		require.False(t, quiet.exited(), "the resumed replica goes on")
		require.Eventually(t, func() bool {
			return b.count(t, fmt.Sprintf("SELECT count(*) FROM inbox_attempts WHERE outcome = 'processed' AND process LIKE '%%/%d' AND finished_at > $1", quiet.cmd.Process.Pid), resumedAt) > 0
		}, 30*time.Second, 100*time.Millisecond, "the resumed replica handles messages again")
	}
}
