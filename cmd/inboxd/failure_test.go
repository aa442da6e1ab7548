package main

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// Acceptance: a message whose handler kills the process every time ends dead
// after the maximum attempts, across restarts of a real inboxd, and the
// other orders keep flowing.
func TestCrashLoopEndsDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const maxAttempts = 3
	// The lease covers only a claim taken before the process's liveness
	// session was up; at 300 ms, a claim a loaded machine took that long
	// to lock was taken over by its own process, spending an attempt
	// without a crash (seen once in CI beside the whole suite).
	env := serviceEnv(b.db, b.broker, "INBOX_MAX_ATTEMPTS=3", "INBOX_CLAIM_LEASE=3s")

	w := loadgen.Generate(loadgen.Spec{Orders: 200, Seed: 5})
	msgs := append([]loadgen.Message{}, w.Messages[:100]...)
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
		{MessageID: "poison", RoutingKey: "order.created", Type: "test.crash", Body: []byte(`{"orderId":"boom"}`)},
	}, 1))
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages[100:], 100))

	crashes := 0
	deadline := time.Now().Add(2 * time.Minute)
	for b.count(t, "SELECT count(*) FROM inbox WHERE message_id = 'poison' AND status = 'dead'") == 0 {
		require.True(t, time.Now().Before(deadline), "poison message never went dead after %d crashes", crashes)
		p := startBinary(t, crashingInboxdPath, env)
		require.Eventually(t, func() bool {
			return p.exited() || b.count(t, "SELECT count(*) FROM inbox WHERE message_id = 'poison' AND status = 'dead'") == 1
		}, time.Minute, 10*time.Millisecond)
		if p.exited() {
			crashes++
		} else {
			// Stopped gracefully: a SIGKILL here would cost the message
			// in flight an attempt the poison message did not.
			p.terminate(30 * time.Second)
		}
	}
	require.Equal(t, maxAttempts, crashes, "the process died once per attempt, then the message was given up")

	var attempts int
	var lastError string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(),
		"SELECT attempts, last_error FROM inbox WHERE message_id = 'poison'").Scan(&attempts, &lastError))
	require.Equal(t, maxAttempts+1, attempts)
	require.Contains(t, lastError, "gave up after 3 attempts")

	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs+1, 60*time.Second)
	require.Equal(t, 200, b.count(t, "SELECT count(*) FROM order_confirmations"))
	require.Equal(t, 200, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"), "its batch-mates were not given up")
}

// publishSlowly publishes w's messages in slices of 100, pausing between
// them, so that faults land while messages still arrive. It returns a
// channel that yields the outcome.
func publishSlowly(t *testing.T, amqpURL string, w *loadgen.Workload, pause time.Duration) <-chan error {
	t.Helper()
	published := make(chan error, 1)
	go func() {
		var err error
		for i := 0; i < len(w.Messages) && err == nil; i += 100 {
			err = loadgen.Publish(t.Context(), amqpURL, w.Messages[i:min(i+100, len(w.Messages))], 100)
			time.Sleep(pause)
		}
		published <- err
	}()
	return published
}

// Acceptance: the service's RabbitMQ connections closed twice under load:
// nothing lost, nothing doubled, and no delivery tag acked on a channel
// that did not deliver it.
func TestSurvivesBrokerConnectionLoss(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker))
	w := loadgen.Generate(loadgen.Spec{Orders: 3000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 6})
	published := publishSlowly(t, b.broker.URL, w, 20*time.Millisecond)

	for range 2 {
		require.Eventually(t, func() bool {
			return b.count(t, "SELECT count(*) FROM inbox") > 0
		}, 30*time.Second, 10*time.Millisecond)
		require.Positive(t, b.broker.CloseConnections(t, "inboxd ingest"))
	}
	require.NoError(t, <-published)
	b.waitDrained(t, w.UniqueMessageIDs, 90*time.Second)
	b.requireExactlyOnce(t, w)
	require.True(t, p.logContains("broker session ended, reconnecting"), "the service saw the connection close")
	require.False(t, p.logContains("unknown delivery tag"), "no stale ack")
	require.False(t, p.logContains("PRECONDITION_FAILED"), "no channel error")
}

// Acceptance: the service's PostgreSQL sessions terminated several times
// under load: nothing lost, nothing doubled, and inboxd recovers by itself.
func TestSurvivesTerminatedBackends(t *testing.T) {
	t.Parallel()
	b := setup(t)
	appName := "inboxd-" + b.db.Schema
	dbURL := b.db.URL + "&application_name=" + appName
	env := append(serviceEnv(b.db, b.broker), "DATABASE_URL="+dbURL, "INBOX_CLAIM_LEASE=500ms")
	p := startProcess(t, env)
	w := loadgen.Generate(loadgen.Spec{Orders: 3000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 7})
	published := publishSlowly(t, b.broker.URL, w, 20*time.Millisecond)

	terminated := 0
	for range 4 {
		before := b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'")
		require.Eventually(t, func() bool {
			return b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'") > before
		}, 30*time.Second, 10*time.Millisecond, "work resumes after the sessions were terminated")
		terminated += b.count(t, `
			SELECT count(*) FROM (
				SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE $1 || '%'
			) AS t`, appName)
	}
	require.NoError(t, <-published)
	b.waitDrained(t, w.UniqueMessageIDs, 90*time.Second)
	b.requireExactlyOnce(t, w)
	require.Greater(t, terminated, 4)
	require.False(t, p.exited(), "inboxd recovered without a restart")
	t.Logf("terminated %d sessions", terminated)
}

// Acceptance: connections dropped around COMMITs and ingest INSERTs, before
// the statement reaches PostgreSQL or after it ran but before the answer
// reaches inboxd: nothing lost, nothing doubled.
func TestCommitWithUnknownOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t)
	u, err := url.Parse(b.db.URL)
	require.NoError(t, err)
	proxy := startPGProxy(t, u.Host, 9)
	u.Host = proxy.addr()
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol")
	u.RawQuery = q.Encode()
	env := append(serviceEnv(b.db, b.broker), "DATABASE_URL="+u.String(), "INBOX_CLAIM_LEASE=500ms", "INBOX_WORKER_BATCH_SIZE=50", "INBOX_INGEST_BATCH_SIZE=50")
	p := startProcess(t, env)

	w := loadgen.Generate(loadgen.Spec{Orders: 2000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 8})
	require.NoError(t, <-publishSlowly(t, b.broker.URL, w, 10*time.Millisecond))
	b.waitDrained(t, w.UniqueMessageIDs, 120*time.Second)
	b.requireExactlyOnce(t, w)
	require.Positive(t, proxy.droppedBefore.Load())
	require.Positive(t, proxy.droppedAfter.Load())
	require.False(t, p.exited())
	t.Logf("dropped %d connections before and %d after the statement, of %d commits and inserts",
		proxy.droppedBefore.Load(), proxy.droppedAfter.Load(), proxy.matched.Load())
}
