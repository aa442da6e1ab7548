package main

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// chaosEnvInt reads a positive integer setting of the chaos test.
func chaosEnvInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err, name)
	require.Positive(t, n, name)
	return n
}

// The faults the chaos test injects, each at least this many times.
var chaosFaults = map[string]int{
	"SIGKILL a process":             5,
	"close RabbitMQ connections":    2,
	"terminate PostgreSQL backends": 2,
	"SIGTERM and restart":           1,
}

// TestChaos runs two inboxd processes while orders arrive with duplicates,
// re-sent ids and cancellations, and meanwhile, at random moments, kills
// them, closes their RabbitMQ connections, terminates their PostgreSQL
// backends and stops one gracefully. Then it checks that nothing was lost
// and nothing doubled, and prints the summary as one table.
//
// make test runs it with 2,000 orders; make chaos with CHAOS_ORDERS=20000.
// CHAOS_SEED replays a run's workload and fault schedule.
func TestChaos(t *testing.T) {
	t.Parallel()
	nOrders := chaosEnvInt(t, "CHAOS_ORDERS", 2000)
	seed := uint64(chaosEnvInt(t, "CHAOS_SEED", int(time.Now().UnixNano()%1_000_000_000)))
	rng := rand.New(rand.NewPCG(seed, 6))

	b := setup(t)
	appName := "inboxd-" + b.db.Schema
	env := serviceEnv(b.db, b.broker, "DATABASE_URL="+b.db.URL+"&application_name="+appName,
		"INBOX_CLAIM_LEASE=1s", "INBOX_RELAY_LEASE=2s")
	procs := []*process{startProcess(t, env), startProcess(t, env)}

	w := loadgen.Generate(loadgen.Spec{Orders: nOrders, DuplicateRate: 0.2, ResendRate: 0.05, CancelRate: 0.1, Seed: seed})
	// Publish at about 1,500 messages a second, for at least 12 seconds, so
	// that every fault lands while messages still arrive.
	window := max(12*time.Second, time.Duration(len(w.Messages))*time.Second/1500)
	published := publishSlowly(t, b.broker.URL, w, window/time.Duration(len(w.Messages)/100+1))

	// The schedule: each fault at a random moment of the publishing window.
	type fault struct {
		at   time.Duration
		kind string
	}
	var schedule []fault
	for _, kind := range slices.Sorted(maps.Keys(chaosFaults)) { // map order would defeat CHAOS_SEED
		for range chaosFaults[kind] {
			schedule = append(schedule, fault{at: time.Duration((0.05 + 0.85*rng.Float64()) * float64(window)), kind: kind})
		}
	}
	slices.SortFunc(schedule, func(a, b fault) int { return cmp.Compare(a.at, b.at) })

	started := time.Now()
	injected := map[string]int{}
	var log []string
	for _, f := range schedule {
		time.Sleep(time.Until(started.Add(f.at)))
		i := rng.IntN(len(procs))
		detail := ""
		switch f.kind {
		case "SIGKILL a process":
			procs[i].kill()
			procs[i] = startProcess(t, env)
			detail = fmt.Sprintf("process %d", i)
		case "SIGTERM and restart":
			// A graceful stop of a serving process: one restarted a moment
			// ago may not have installed its signal handler yet.
			require.Eventually(t, func() bool { return procs[i].logContains(`"inboxd serving"`) },
				30*time.Second, 10*time.Millisecond, "process %d serves", i)
			took := procs[i].terminate(30 * time.Second)
			procs[i] = startProcess(t, env)
			detail = fmt.Sprintf("process %d stopped in %s", i, took.Round(time.Millisecond))
		case "close RabbitMQ connections":
			n := b.broker.CloseConnections(t, "inboxd")
			require.Positive(t, n, "connections to close")
			detail = fmt.Sprintf("%d connections", n)
		case "terminate PostgreSQL backends":
			// Processes restarted a moment ago may not have connected yet.
			n := 0
			require.Eventually(t, func() bool {
				n = b.count(t, `
					SELECT count(*) FROM (
						SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE $1 || '%'
					) AS t`, appName)
				return n > 0
			}, 30*time.Second, 10*time.Millisecond, "backends to terminate")
			detail = fmt.Sprintf("%d backends", n)
		}
		injected[f.kind]++
		log = append(log, fmt.Sprintf("%7s  %s (%s)", time.Since(started).Round(time.Millisecond), f.kind, detail))
	}
	lastFault := time.Now()
	require.NoError(t, <-published)
	publishEnded := time.Since(lastFault)
	t.Logf("faults (seed %d):\n%s", seed, strings.Join(log, "\n"))

	b.waitDrained(t, w.UniqueMessageIDs, 3*time.Minute)
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
	}, 3*time.Minute, 20*time.Millisecond, "the relay published every outbox row")
	drained := time.Since(lastFault)
	b.requireEventsOnce(t)
	cancelled := slices.Sorted(maps.Keys(w.Cancelled))
	unseen := b.count(t, "SELECT count(*) FROM inbox WHERE result = $1", orders.ResultCancelledUnseen)

	// The summary.
	ids := make([]string, 0, len(w.Messages))
	for _, m := range w.Messages {
		ids = append(ids, m.MessageID)
	}
	lost := b.count(t, `
		SELECT count(DISTINCT p.mid) FROM unnest($1::text[]) AS p (mid)
		WHERE NOT EXISTS (SELECT 1 FROM inbox i WHERE i.message_id = p.mid)`, ids)
	doubledOutcomes := b.count(t, `
		SELECT count(*) FROM (
			SELECT order_key FROM inbox WHERE result = $1 GROUP BY order_key HAVING count(*) > 1
		) AS d`, orders.ResultConfirmed)
	doubledReservations := b.count(t, `
		SELECT count(*) FROM stock_overview WHERE available + reserved <> $1`, initialStock)
	doubledEvents := b.count(t, `
		SELECT count(*) FROM (
			SELECT payload->>'orderId', routing_key FROM outbox GROUP BY 1, 2 HAVING count(DISTINCT idempotency_key) > 1
		) AS d`)
	redelivered := 0
	for _, n := range b.seen {
		redelivered += n - 1
	}
	rows := [][2]string{
		{"messages published (confirmed)", strconv.Itoa(len(w.Messages))},
		{"unique message ids", strconv.Itoa(w.UniqueMessageIDs)},
		{"inbox rows", strconv.Itoa(b.count(t, "SELECT count(*) FROM inbox"))},
		{"processed", strconv.Itoa(b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"))},
		{"dead", strconv.Itoa(b.count(t, "SELECT count(*) FROM inbox WHERE status = 'dead'"))},
		{"lost (published, not in the inbox)", strconv.Itoa(lost)},
		{"doubled order outcomes", strconv.Itoa(doubledOutcomes)},
		{"SKUs whose stock does not add up", strconv.Itoa(doubledReservations)},
		{"effects published under two ids", strconv.Itoa(doubledEvents)},
		{"events received again under the same id", strconv.Itoa(redelivered)},
		{"cancellations handled before their order", strconv.Itoa(unseen)},
		{"abandoned attempts (crashes)", strconv.Itoa(b.count(t, "SELECT count(*) FROM inbox_attempts WHERE outcome = 'abandoned'"))},
		{"faults injected", fmt.Sprintf("%d SIGKILL, %d connection closes, %d backend terminations, %d SIGTERM",
			injected["SIGKILL a process"], injected["close RabbitMQ connections"],
			injected["terminate PostgreSQL backends"], injected["SIGTERM and restart"])},
		{"publishing ended after the last fault", publishEnded.Round(time.Millisecond).String()},
		{"time to drain after the last fault", drained.Round(time.Millisecond).String() + " (every message handled, every event published)"},
	}
	var table strings.Builder
	fmt.Fprintf(&table, "chaos: %d orders, 2 inboxd processes, seed %d\n", nOrders, seed)
	for _, r := range rows {
		fmt.Fprintf(&table, "  %-42s %s\n", r[0], r[1])
	}
	t.Log("\n" + table.String())

	require.Zero(t, lost, "lost messages")
	require.Zero(t, doubledOutcomes, "doubled order outcomes")
	require.Zero(t, doubledEvents, "effects published under two ids")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'dead'"), "nothing in this workload should die")
	require.Equal(t, w.UniqueMessageIDs, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per unique id")
	require.Equal(t, len(w.OrderIDs), b.count(t, "SELECT count(*) FROM order_confirmations"), "one outcome per order")
	b.requireStockAddsUp(t)
	b.requireOrderKept(t, cancelled)
	for kind, n := range chaosFaults {
		require.GreaterOrEqual(t, injected[kind], n, kind)
	}
	require.Zero(t, b.count(t, `
		SELECT count(*) FROM inbox i
		WHERE (SELECT count(*) FROM inbox_attempts a WHERE a.inbox_id = i.id AND a.run = i.replay_count) <> i.attempts`),
		"every attempt, crashed ones included, is in the history")
}
