package main

import (
	"cmp"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The tests in this file restart the shared PostgreSQL and RabbitMQ servers,
// so they run only when TEST_DISRUPTIVE=1, on their own, after the others:
// `make test` does that. The commands that restart the servers can be set
// with TEST_PG_RESTART_CMD, TEST_PG_CRASH_CMD, TEST_RABBITMQ_STOP_CMD and
// TEST_RABBITMQ_START_CMD; the defaults suit a machine running both locally.

func requireDisruptive(t *testing.T) {
	t.Helper()
	if os.Getenv("TEST_DISRUPTIVE") != "1" {
		t.Skip("restarts the shared servers: set TEST_DISRUPTIVE=1 (make test does, in a run of its own)")
	}
}

func runShell(t *testing.T, envName, fallback string) {
	t.Helper()
	command := cmp.Or(os.Getenv(envName), fallback)
	out, err := exec.Command("sh", "-c", command).CombinedOutput()
	require.NoError(t, err, "%s: %s", command, out)
}

// Acceptance: the broker stopped (stop_app) and started again under load:
// nothing lost, nothing doubled, no stale ack, and the relay republishes
// only under the same ids.
func TestDisruptiveBrokerRestart(t *testing.T) {
	requireDisruptive(t)
	b := setup(t)
	// A slow ingest, so the restart lands while messages are still queued.
	p := startProcess(t, serviceEnv(b.db, b.broker,
		"INBOX_PREFETCH=20", "INBOX_INGEST_BATCH_SIZE=10", "INBOX_AMQP_HEARTBEAT=2s"))
	w := loadgen.Generate(loadgen.Spec{Orders: 6000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 9})
	half := len(w.Messages) / 2
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages[:half], 200))
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") > 200 }, 30*time.Second, 10*time.Millisecond)

	runShell(t, "TEST_RABBITMQ_STOP_CMD", "rabbitmqctl stop_app")
	stored := b.count(t, "SELECT count(*) FROM inbox")
	time.Sleep(2 * time.Second)
	runShell(t, "TEST_RABBITMQ_START_CMD", "rabbitmqctl start_app && rabbitmqctl await_startup")
	require.Less(t, stored, w.UniqueMessageIDs/2, "the broker stopped while messages were still queued")

	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages[half:], 200))
	b.waitDrained(t, w.UniqueMessageIDs, 120*time.Second)
	b.requireExactlyOnce(t, w)
	// The relay, too, lived through the restart: every event arrives, only
	// ever under its one id.
	b.subscribeDownstream(t)
	b.requireEventsOnce(t)
	require.True(t, p.logContains("broker session ended, reconnecting"))
	require.False(t, p.logContains("unknown delivery tag"), "no stale ack")
	require.False(t, p.exited())
}

// Acceptance: PostgreSQL restarted under load: nothing lost, nothing
// doubled, and inboxd recovers without a restart.
func TestDisruptivePostgresRestart(t *testing.T) {
	requireDisruptive(t)
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker, "INBOX_CLAIM_LEASE=500ms"))
	w := loadgen.Generate(loadgen.Spec{Orders: 4000, DuplicateRate: 0.3, ResendRate: 0.05, Seed: 10})
	published := publishSlowly(t, b.broker.URL, w, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox WHERE status = 'processed'") > 300
	}, 30*time.Second, 10*time.Millisecond)

	runShell(t, "TEST_PG_RESTART_CMD", "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | head -n1) main restart")

	require.NoError(t, <-published)
	b.waitDrained(t, w.UniqueMessageIDs, 120*time.Second)
	b.requireExactlyOnce(t, w)
	require.False(t, p.exited(), "inboxd recovered without a restart")
	require.Zero(t, b.broker.ReadyMessages(t, broker.QueueDead), "ingest paused instead of dead-lettering")
}

// Acceptance: a broker memory alarm (every publishing connection blocked)
// while orders and a message without an id wait in the queue. Ingest goes
// on storing and acking on its consuming connection, the dead letter waits
// on a connection of its own, SIGTERM during the alarm exits within the
// grace period, and once the alarm clears nothing is lost.
func TestDisruptiveMemoryAlarm(t *testing.T) {
	requireDisruptive(t)
	b := setup(t)
	out, err := exec.Command("rabbitmqctl", "eval", "vm_memory_monitor:get_vm_memory_high_watermark().").CombinedOutput()
	require.NoError(t, err, "%s", out)
	watermark := strings.TrimSpace(string(out))
	clear := func() { _ = exec.Command("rabbitmqctl", "set_vm_memory_high_watermark", watermark).Run() }
	t.Cleanup(clear)

	w := loadgen.Generate(loadgen.Spec{Orders: 300, Seed: 13})
	msgs := append([]loadgen.Message{}, w.Messages[:150]...)
	msgs = append(msgs, loadgen.Message{RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-noid", 1)})
	msgs = append(msgs, w.Messages[150:]...)
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))

	runShell(t, "TEST_RABBITMQ_ALARM_CMD", "rabbitmqctl set_vm_memory_high_watermark 0.000001")
	require.Eventually(t, func() bool {
		return exec.Command("rabbitmq-diagnostics", "-q", "check_local_alarms").Run() != nil
	}, 30*time.Second, 100*time.Millisecond, "the memory alarm is on")

	addr := testenv.FreeAddr(t)
	env := serviceEnv(b.db, b.broker, "INBOX_SHUTDOWN_TIMEOUT=5s", "INBOX_INGEST_BATCH_SIZE=50", "HTTP_ADDR="+addr)
	p := startProcess(t, env)
	// Every order is stored (and acked) though nothing can be published,
	// those behind the message without an id too: consuming is not
	// blocked, and the dead letter waits, unacknowledged, for the alarm to
	// clear.
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") == w.UniqueMessageIDs },
		30*time.Second, 20*time.Millisecond, "ingest stores every order during the alarm")
	// /readyz says so, and the relay holds no claim's transaction open
	// meanwhile: a claim would keep its rows locked and its snapshot for as
	// long as the alarm lasts. The relay's pool also serves the outbox's
	// claim floor keeper, whose short transactions (its statements sent
	// from Go, one round trip each) are no claim: a session is the relay's
	// claim when its last statement is the claim or a release.
	require.Eventually(t, func() bool {
		_, body := httpGet(t, "http://"+addr+"/readyz")
		return strings.Contains(body, "broker_alarm")
	}, 30*time.Second, 100*time.Millisecond, "/readyz reports the alarm")
	relayTx := `SELECT count(*) FROM pg_stat_activity
		WHERE application_name = 'inboxd relay' AND state LIKE 'idle in transaction%'
		  AND (query LIKE '-- name: OutboxClaimBatch %' OR query LIKE '-- name: OutboxRelease %')`
	require.Eventually(t, func() bool { return b.count(t, relayTx) == 0 }, 2*time.Second, 50*time.Millisecond,
		"the relay's transaction ends once the broker blocks its connection")
	for range 40 {
		require.Zero(t, b.count(t, relayTx), "no relay transaction open during the alarm")
		time.Sleep(50 * time.Millisecond)
	}
	took := p.terminate(30 * time.Second)
	require.Less(t, took, 5*time.Second+2*time.Second, "SIGTERM during the alarm exits within the grace period")

	clear()
	require.Eventually(t, func() bool {
		return exec.Command("rabbitmq-diagnostics", "-q", "check_local_alarms").Run() == nil
	}, 30*time.Second, 100*time.Millisecond, "the memory alarm is off")
	startProcess(t, env)
	b.waitDrained(t, w.UniqueMessageIDs, time.Minute)
	b.requireExactlyOnce(t, w)
	dead := b.broker.Receive(t, broker.QueueDead, 1)
	require.Equal(t, "missing message_id", dead[0].Headers[broker.HeaderRejectReason])
	b.requireEventsOnce(t)
	b.requireAtMostCopies(t, 2, time.Second)
	t.Logf("stopped in %s during the alarm", took)
}

// Acceptance: with synchronous_commit = off on the service's login (a common
// tuning), PostgreSQL crashing (stopped immediately, then recovered) while
// ingest stores and acks loses no acked message: the service's sessions
// commit synchronously whatever the role says, so an ack never runs ahead of
// a durable commit.
func TestDisruptivePostgresCrashLosesNoAckedMessage(t *testing.T) {
	requireDisruptive(t)
	b := setup(t)
	serviceURL := asyncServiceLogin(t, b.db)
	p := startProcess(t, serviceEnv(b.db, b.broker, "DATABASE_URL="+serviceURL, "INBOX_MIGRATE=false", "INBOX_CLAIM_LEASE=500ms"))
	w := loadgen.Generate(loadgen.Spec{Orders: 4000, Seed: 14})
	published := publishSlowly(t, b.broker.URL, w, 5*time.Millisecond)
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") > 500 },
		30*time.Second, 5*time.Millisecond)

	runShell(t, "TEST_PG_CRASH_CMD", "pg_ctlcluster --skip-systemctl-redirect -m immediate $(ls /etc/postgresql | head -n1) main restart")
	require.NoError(t, <-published)
	b.waitDrained(t, w.UniqueMessageIDs, 2*time.Minute)
	b.requireExactlyOnce(t, w)
	require.False(t, p.exited())
}

// Acceptance: PostgreSQL stopped (immediately, as by a crash or a lost
// node) for TEST_PG_STOPPED_FOR (30 s by default; the figure is
// 2m) while a backlog drains, messages in flight: once it is back, every
// message is processed, none dead, and none spent more than the one
// attempt that handled it. The database lost the work transactions, not
// the messages: the replica gives its lost claims back, and a claim whose
// replica did not (here one held by a session of the test, a replica that
// never came back) is taken over without counting the lost attempt, as it
// was made before the server started.
func TestDisruptivePostgresStoppedSpendsNoAttempt(t *testing.T) {
	requireDisruptive(t)
	stoppedFor := 30 * time.Second
	if v := os.Getenv("TEST_PG_STOPPED_FOR"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err)
		stoppedFor = d
	}
	const start = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | head -n1) main start"
	t.Cleanup(func() { _ = exec.Command("sh", "-c", cmp.Or(os.Getenv("TEST_PG_START_CMD"), start)).Run() })
	b := setup(t)
	p := startProcess(t, serviceEnv(b.db, b.broker, "INBOX_CLAIM_LEASE=500ms"))
	// Enough that the workers are still far from the newest when every
	// message is stored (with 3,000 they had handled all of them once, and
	// no pending row was left to claim).
	w := loadgen.Generate(loadgen.Spec{Orders: 12000, Seed: 15})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 500))
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM inbox") == w.UniqueMessageIDs },
		time.Minute, 10*time.Millisecond)

	// Another replica's claims, under a liveness key a session of the
	// test holds: the newest messages, which the worker reaches last.
	const ghostKey = 4242424242
	ghost, err := b.db.Pool.Acquire(t.Context())
	require.NoError(t, err)
	defer ghost.Release()
	_, err = dbsqlc.New().InboxHoldLiveness(t.Context(), ghost, ghostKey)
	require.NoError(t, err)
	ghosted := b.count(t, `WITH c AS (
		UPDATE inbox SET attempts = attempts + 1, claimed_at = now(), claimed_by = 'ghost/1',
		       claimed_build = 'test', claimed_session = $1
		WHERE id IN (SELECT id FROM inbox WHERE status = 'pending' AND claimed_at IS NULL
		             ORDER BY id DESC LIMIT 50 FOR UPDATE SKIP LOCKED)
		RETURNING 1) SELECT count(*) FROM c`, int64(ghostKey))
	require.Equal(t, 50, ghosted)

	const inFlight = "SELECT count(*) FROM inbox WHERE claimed_at IS NOT NULL AND claimed_by <> 'ghost/1'"
	require.Eventually(t, func() bool { return b.count(t, inFlight) > 0 }, time.Minute, time.Millisecond)
	runShell(t, "TEST_PG_STOP_CMD", "pg_ctlcluster --skip-systemctl-redirect -m immediate $(ls /etc/postgresql | head -n1) main stop")
	time.Sleep(stoppedFor)
	runShell(t, "TEST_PG_START_CMD", start)

	b.waitDrained(t, w.UniqueMessageIDs, 3*time.Minute)
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE status = 'dead'"), "no message died of the database's absence")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox WHERE attempts > 1"), "no message spent an attempt on the database's absence")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox_attempts WHERE outcome <> 'processed'"), "only the attempts that handled them")
	require.True(t, p.logContains("the database lost the transaction that was handling it"), "the stop landed while the worker held claims")
	require.False(t, p.exited())
	b.requireExactlyOnce(t, w)
}
