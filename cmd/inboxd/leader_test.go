package main

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: of two replicas, one leads: it alone runs the maintenance
// (the janitor, the claim floors' keepers, the stock fold) and exports the
// database gauges. Under load, the leader is killed with SIGKILL: the other
// leads within a few seconds, and the floors and the fold move on in it.
// Then the new leader is frozen (SIGSTOP): the lead goes back to the first
// replica, started again, once PostgreSQL has ended the frozen one's
// quiet session (leader.IdleLimit, 5 s); resumed, the frozen one finds its
// session gone and follows. At each step only the leader exports the
// database gauges, and every order is handled once.
func TestTheLeadMovesWhenTheLeaderDiesOrFreezes(t *testing.T) {
	t.Parallel()
	b := setupIn(t, testenv.NewDBAlone(t))
	start := func(name string) (*process, string) {
		// The heartbeat of the freeze tests: RabbitMQ hands a frozen
		// replica's queue over once it misses two to three of them, which
		// at the default 10 s takes most of the wait for the floor to move.
		return startServing(t, b, "DATABASE_URL="+withApplicationName(t, b.db.URL, name),
			"INBOX_STOCK_FOLD_INTERVAL=1s", "INBOX_AMQP_HEARTBEAT=2s")
	}
	leaderName := func() string { return b.leader(t) }
	waitLeader := func(want string, within time.Duration, since time.Time) time.Duration {
		t.Helper()
		for leaderName() != want {
			require.Less(t, time.Since(since), within, "%q leads within %s", want, within)
			time.Sleep(50 * time.Millisecond)
		}
		return time.Since(since)
	}
	exports := func(addr string) float64 { return scrape(t, addr)["inboxd_inbox_database_gauges_exporter"] }
	// maintained reports the inbox's claim floor and the stock moves
	// folded so far.
	maintained := func() (floor, folded int64) {
		require.NoError(t, b.db.Pool.QueryRow(t.Context(),
			"SELECT inbox_claim_floor(), (SELECT coalesce(sum(folded_through), 0)::bigint FROM stock)").Scan(&floor, &folded))
		return floor, folded
	}
	movesOn := func(who string) {
		t.Helper()
		floor, folded := maintained()
		stored := b.count(t, "SELECT count(*) FROM inbox")
		if !assert.Eventually(t, func() bool {
			f, s := maintained()
			return f > floor && s > folded
		}, 20*time.Second, 100*time.Millisecond, "the claim floor and the stock fold move on with %s leading", who) {
			f, s := maintained()
			t.Fatalf("claim floor %d → %d, moves folded %d → %d, messages stored %d → %d; transactions open for over a second:\n%s",
				floor, f, folded, s, stored, b.count(t, "SELECT count(*) FROM inbox"), strings.Join(b.db.Strings(t, `
				SELECT format('%s pid %s %s for %s, waiting on %s: %s', application_name, pid, state,
					now() - xact_start, coalesce(wait_event_type || '/' || wait_event, 'nothing'), left(query, 200))
				FROM pg_stat_activity
				WHERE datname = current_database() AND xact_start < now() - interval '1 second'
				ORDER BY xact_start`), "\n"))
		}
	}

	a, aAddr := start("a")
	waitLeader("a leader", 30*time.Second, time.Now())
	bp, bAddr := start("b")

	w := loadgen.Generate(loadgen.Spec{Orders: 4000, Seed: 11, DuplicateRate: 0.1})
	published := make(chan error, 1)
	go func() {
		published <- loadgen.PublishPaced(context.WithoutCancel(t.Context()), b.broker.URL, w.Messages, 10, 100)
	}()

	movesOn("a")
	require.Equal(t, "a leader", leaderName(), "the first replica keeps the lead while it lives")
	require.Equal(t, 1.0, exports(aAddr))
	require.Equal(t, 0.0, exports(bAddr), "a follower exports none of the database gauges")

	a.kill()
	took := waitLeader("b leader", 10*time.Second, time.Now())
	t.Logf("the leader killed: the other replica led %s later", took.Round(time.Millisecond))
	movesOn("b")
	require.Equal(t, 1.0, exports(bAddr))

	_, aAddr = start("a")
	require.Equal(t, "b leader", leaderName(), "a replica that starts follows the leader")
	require.NoError(t, bp.cmd.Process.Signal(syscall.SIGSTOP))
	t.Cleanup(func() { _ = bp.cmd.Process.Signal(syscall.SIGCONT) })
	took = waitLeader("a leader", 15*time.Second, time.Now())
	t.Logf("the leader frozen: the other replica led %s later", took.Round(time.Millisecond))
	movesOn("a")
	require.NoError(t, bp.cmd.Process.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool { return exports(bAddr) == 0 }, 15*time.Second, 100*time.Millisecond,
		"the resumed replica follows")
	require.Equal(t, "a leader", leaderName())
	require.Equal(t, 1.0, exports(aAddr))

	require.NoError(t, <-published)
	b.waitDrained(t, w.UniqueMessageIDs, 2*time.Minute)
	b.requireExactlyOnce(t, w)
}

// leader returns the application_name of the session whose key the
// bundle's leader row names ("<name> leader", where each replica's
// DATABASE_URL names it), "" for none or for a key no longer live.
func (b *e2eBundle) leader(t *testing.T) string {
	t.Helper()
	names := b.db.Strings(t, `
		SELECT a.application_name FROM inbox_leader r
		JOIN inbox_sessions s ON s.session = r.session
		JOIN pg_stat_activity a ON a.pid = s.pid
		WHERE r.session IN (SELECT inbox_live_sessions())`)
	if len(names) == 0 {
		return ""
	}
	return names[0]
}
