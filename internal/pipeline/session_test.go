package pipeline_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The relay's claim, on a schema that nobody vacuums or analyzes, after
// 20,000 events have been published: on a session set up by
// ConfigureSession it reads the open rows' index in order, marking
// the entries of published rows dead as it passes, so that the next claim
// reads a handful of pages instead of every one of them again.
func TestClaimsStayCheapWithoutVacuum(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO outbox (idempotency_key, routing_key, payload, message_id)
		SELECT 'k-' || g, 'order.confirmed', '{}', 'm-' || g FROM generate_series(1, 20000) AS g`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "UPDATE outbox SET published_at = now()")
	require.NoError(t, err)
	// A scan marks an index entry dead only once its row version is dead to
	// every transaction of the database. Other tests share it, and some
	// hold a transaction open for seconds (a relay waiting for confirms, a
	// held stock row): wait until none began before the update.
	updated := db.Int(t, "SELECT xmin::text::bigint FROM outbox LIMIT 1")
	require.Eventually(t, func() bool {
		return db.Int(t, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()
			  AND backend_xmin::text::bigint <= $1`, updated) == 0
	}, time.Minute, 50*time.Millisecond, "a transaction older than the update is still open")

	conn := db.SessionWith(t, pipeline.ConfigureSession)

	// The candidates of OutboxClaimBatch.
	const claim = `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
		SELECT id FROM outbox
		WHERE published_at IS NULL AND dead_at IS NULL
		  AND (claimed_at IS NULL OR claimed_at < now() - interval '30 seconds')
		  AND next_attempt_at <= now()
		ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED`
	buffers := func() int {
		var plan []struct {
			Plan struct {
				SharedHit  int `json:"Shared Hit Blocks"`
				SharedRead int `json:"Shared Read Blocks"`
			}
		}
		var raw []byte
		require.NoError(t, conn.QueryRow(ctx, claim, pgx.QueryExecModeSimpleProtocol).Scan(&raw))
		require.NoError(t, json.Unmarshal(raw, &plan))
		return plan[0].Plan.SharedHit + plan[0].Plan.SharedRead
	}
	first := buffers()
	// Even so, a session of the shared database that the wait above cannot
	// see can hold the horizon back for a while (it was seen in CI, under
	// the race detector): the claims are read again until one is cheap.
	// A claim whose plan does not mark entries dead (a bitmap scan) never
	// gets there: it reads every page, every time.
	later := first
	require.Eventually(t, func() bool { later = buffers(); return later < 100 }, 30*time.Second, 100*time.Millisecond,
		"the claims after the first skip the entries it marked dead (it read %d pages)", first)
	t.Logf("claim over 20,000 published rows: %d pages, then %d", first, later)
}

// A pool set up by KeepPlans prepares each statement once on a connection
// and keeps it for the connection's life; dbsqlc.PlanEachCall runs a
// statement as the unnamed one, prepared and planned anew at each call.
func TestPoolsKeepPlans(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	pc, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	pc.MaxConns = 1
	pipeline.ConfigureSession(pc.ConnConfig)
	pipeline.KeepPlans(pc)
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	// The executions of the statements kept on the pool's one connection.
	const probe = "SELECT $1::int AS kept"
	executions := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(generic_plans + custom_plans), 0)::int
			FROM pg_prepared_statements WHERE statement = $1`, probe).Scan(&n))
		return n
	}
	for range 3 {
		_, err = pool.Exec(ctx, probe, 1)
		require.NoError(t, err)
	}
	require.Equal(t, 3, executions(), "the statement is prepared once and kept")
	for range 3 {
		_, err = dbsqlc.PlanEachCall(pool).Exec(ctx, probe, 1)
		require.NoError(t, err)
	}
	require.Equal(t, 3, executions(), "run through PlanEachCall, the statement is not the kept one")
}
