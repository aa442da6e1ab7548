package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// withApplicationName returns the database URL with application_name set,
// so that the test can tell the two replicas' sessions apart.
func withApplicationName(t *testing.T, dbURL, name string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	return u.String()
}

// Acceptance: a replica frozen (SIGSTOP, as a VM pause or a stuck node
// would; its sockets stay open) while its batch holds stock rows stalls the
// other replica's orders of those SKUs for INBOX_WORKER_IDLE_IN_TX_TIMEOUT,
// not for as long as it is frozen: PostgreSQL ends its idle transaction and
// the rows are free. The messages it had claimed are taken over once its
// liveness session has been quiet for a few seconds, and handled by the
// other replica before it resumes. Every order published once that timeout has passed
// is processed by the other replica before the frozen one resumes; resumed,
// it drops its broken batch and goes on, and nothing is lost or doubled.
func TestAFrozenReplicaHoldsTheRowsItLockedForSecondsOnly(t *testing.T) {
	if raceEnabled {
		t.Skip("the bound is in seconds, and a race-built inboxd keeps up with 100 orders a second only at times")
	}
	t.Parallel()
	// search is how long it looks for the replica holding a stock row: its
	// batches hold one for milliseconds, and on a loaded machine (CI, the
	// whole suite beside it) 20 s of looking once caught none.
	const idle, freeze, search, perSecond = 2 * time.Second, 20 * time.Second, 30 * time.Second, 100
	b := setupIn(t, testenv.NewDBAlone(t)) // a frozen transaction holds back cleanup
	env := func(name string, extra ...string) []string {
		return serviceEnv(b.db, b.broker, append(extra, "DATABASE_URL="+withApplicationName(t, b.db.URL, name),
			"INBOX_WORKER_BATCH_SIZE=50")...)
	}
	order := func(i int) loadgen.Message {
		body, err := json.Marshal(orders.OrderCreated{OrderID: fmt.Sprintf("f-%05d", i), UserID: "u", Email: "u@example.com",
			Items: []orders.Item{{SKU: fmt.Sprintf("SKU-%d", 1+i%3), Quantity: 1}}})
		require.NoError(t, err)
		return loadgen.Message{MessageID: fmt.Sprintf("f-%05d", i), RoutingKey: orders.TypeOrderCreated, Body: body}
	}
	// The stable replica first, so that it is the queue's active consumer:
	// the frozen one only claims and handles.
	startProcess(t, env("stable"))
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{order(0)}, 1))
	b.waitDrained(t, 1, 30*time.Second)
	frozen := startProcess(t, env("frozen", fmt.Sprintf("INBOX_WORKER_IDLE_IN_TX_TIMEOUT=%s", idle)))
	t.Cleanup(func() { _ = frozen.cmd.Process.Signal(syscall.SIGCONT) })

	// Orders keep arriving through the search and the freeze, whenever it
	// lands.
	total := int((search + freeze + 10*time.Second).Seconds()) * perSecond
	flow := make([]loadgen.Message, total)
	for i := range flow {
		flow[i] = order(i + 1)
	}
	published := make(chan error, 1)
	go func() {
		published <- loadgen.PublishPaced(context.WithoutCancel(t.Context()), b.broker.URL, flow, 10, perSecond)
	}()

	// Freeze the replica while one of its batches holds a stock row: a row
	// whose xmax is a transaction id (a subtransaction's, under a
	// savepoint) one of its worker sessions holds.
	heldByFrozen := func() int {
		return b.count(t, `
			SELECT count(*) FROM stock s
			JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid::text = s.xmax::text AND l.granted
			JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE a.application_name = 'frozen worker' AND s.sku IN ('SKU-1', 'SKU-2', 'SKU-3')`)
	}
	var frozenAt time.Time
	for deadline := time.Now().Add(search); frozenAt.IsZero(); {
		// A batch holds its stock rows for milliseconds: look without pause.
		require.True(t, time.Now().Before(deadline), "the replica was never caught holding a stock row")
		if heldByFrozen() == 0 {
			continue
		}
		require.NoError(t, frozen.cmd.Process.Signal(syscall.SIGSTOP))
		time.Sleep(100 * time.Millisecond) // a COMMIT sent just before is through by now
		if heldByFrozen() > 0 {
			frozenAt = time.Now()
			break
		}
		require.NoError(t, frozen.cmd.Process.Signal(syscall.SIGCONT))
	}
	// The messages it had claimed: its liveness session goes quiet, and
	// PostgreSQL ends it after a few seconds, so the other replica takes
	// them over.
	claimedByFrozen := b.db.Strings(t, fmt.Sprintf("SELECT message_id FROM inbox WHERE status = 'pending' AND claimed_by LIKE '%%/%d'", frozen.cmd.Process.Pid))
	const claimsLeftQuery = "SELECT count(*) FROM inbox WHERE message_id = ANY($1) AND status <> 'processed'"
	for time.Since(frozenAt) < freeze && b.count(t, claimsLeftQuery, claimedByFrozen) > 0 {
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the %d messages the frozen replica had claimed were processed %s after the freeze", len(claimedByFrozen), time.Since(frozenAt).Round(100*time.Millisecond))
	time.Sleep(freeze - time.Since(frozenAt))
	// Before it resumes: every order that arrived once the idle timeout (and
	// a margin for the waits' retries) had passed, and long enough ago to be
	// handled on a busy machine (8 s), is processed already.
	from, to := frozenAt.Add(idle+2*time.Second), time.Now().Add(-8*time.Second)
	due := b.count(t, "SELECT count(*) FROM inbox WHERE received_at BETWEEN $1 AND $2", from, to)
	pendingBeforeResume := b.count(t, "SELECT count(*) FROM inbox WHERE received_at BETWEEN $1 AND $2 AND status <> 'processed'", from, to)
	claimsLeft := b.count(t, claimsLeftQuery, claimedByFrozen)
	require.NoError(t, frozen.cmd.Process.Signal(syscall.SIGCONT))
	require.NotEmpty(t, claimedByFrozen, "the frozen replica held claims")
	require.Zero(t, claimsLeft, "of the %d messages the frozen replica had claimed, some waited for it to resume", len(claimedByFrozen))
	require.Positive(t, due, "orders arrived while it was frozen")
	require.Zero(t, pendingBeforeResume, "of %d orders that arrived from %s after the freeze on, some waited for the frozen replica", due, idle+2*time.Second)

	require.NoError(t, <-published)
	b.waitDrained(t, total+1, time.Minute)
	require.Equal(t, total+1, b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'"), "every order confirmed once")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status <> 'processed'"))
	require.False(t, frozen.exited(), "the resumed replica goes on")
}

// Acceptance: a leader frozen (SIGSTOP) in the middle of a key-ledger
// rotation, which empties the next slot with TRUNCATE and so holds a lock
// every insert into the inbox waits for, holds up inserts for
// INBOX_WORKER_IDLE_IN_TX_TIMEOUT only, not for the relay's
// INBOX_IDLE_IN_TX_TIMEOUT (60 s): the maintenance's transactions wait on
// nothing outside PostgreSQL, as the workers' do. Every transaction the
// frozen process holds, but its relay's, ends as soon.
func TestAFrozenLeaderHoldsUpInsertsForSecondsOnly(t *testing.T) {
	t.Parallel()
	const idle, search = 2 * time.Second, 60 * time.Second
	b := setupIn(t, testenv.NewDBAlone(t))
	// A window of a second rotates the ledger every seventh of it, and the
	// janitor looks every 50 ms: a rotation every few hundred ms.
	leader := startProcess(t, serviceEnv(b.db, b.broker, "DATABASE_URL="+withApplicationName(t, b.db.URL, "frozen"),
		"INBOX_DEDUPE_WINDOW=1s", "INBOX_JANITOR_INTERVAL=50ms",
		fmt.Sprintf("INBOX_WORKER_IDLE_IN_TX_TIMEOUT=%s", idle), "INBOX_IDLE_IN_TX_TIMEOUT=60s"))
	t.Cleanup(func() { _ = leader.cmd.Process.Signal(syscall.SIGCONT) })

	// A lock on a partition of the ledger held exclusively by one of its
	// sessions: a rotation between its TRUNCATE and its commit.
	const heldQuery = `
		SELECT count(*) FROM pg_locks l
		JOIN pg_stat_activity a ON a.pid = l.pid
		JOIN pg_class c ON c.oid = l.relation
		WHERE a.application_name LIKE 'frozen %' AND l.granted AND l.mode = 'AccessExclusiveLock'
		  AND c.relname LIKE 'inbox\_keys\_%'`
	var frozenAt time.Time
	for deadline := time.Now().Add(search); frozenAt.IsZero(); {
		require.True(t, time.Now().Before(deadline), "the leader was never caught in a rotation")
		if b.count(t, heldQuery) == 0 {
			continue
		}
		require.NoError(t, leader.cmd.Process.Signal(syscall.SIGSTOP))
		time.Sleep(100 * time.Millisecond) // a COMMIT sent just before is through by now
		if b.count(t, heldQuery) > 0 {
			frozenAt = time.Now()
			break
		}
		require.NoError(t, leader.cmd.Process.Signal(syscall.SIGCONT))
	}

	// Another writer's insert (another replica's ingest, an operator's)
	// waits for the frozen rotation, until PostgreSQL ends it.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := b.db.Pool.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('after-the-freeze', 'order.created', '{}')")
	require.NoError(t, err, "an insert %s after the leader froze in a rotation", time.Since(frozenAt).Round(time.Millisecond))
	t.Logf("an insert went through %s after the leader froze in a rotation", time.Since(frozenAt).Round(time.Millisecond))
	// By then, or soon after, no transaction of the frozen process is open
	// but its relay's, which waits for the broker's confirms.
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name LIKE 'frozen %' AND application_name <> 'frozen relay' AND xact_start IS NOT NULL`) == 0
	}, idle+5*time.Second, 100*time.Millisecond, "the frozen leader's transactions end")
	require.Less(t, time.Since(frozenAt), idle+8*time.Second, "the frozen leader's transactions end within the idle limit")
}
