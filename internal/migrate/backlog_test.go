package migrate_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The gauges and outbox_backlog count what waits, and read only that:
// under a snapshot held open, the entries the partial indexes keep for the
// rows that ended since are not read. Counted through the whole unpublished
// (or pending) rows' index, every count read each of them: a scrape of
// /metrics during a snapshot held ten minutes at 1,000 orders/s read
// millions of entries, slow, or timed out and reported the database down,
// while the backlog it reports is what the operator watches.
//
// Counted, not timed: the index entries a scrape's statement reads, from
// the schema's own statistics, with 20,000 messages processed and 20,000
// rows published under the held snapshot, without statistics (as a new
// table) and analyzed (as autovacuum leaves the tables in production).
// The numbers are checked too: they are those the views counted before,
// the orders held back those inbox_held_back lists, and the held
// snapshot's age that of the transaction holding it.
func TestTheGaugesReadWhatWaitsUnderAHeldSnapshot(t *testing.T) {
	t.Parallel()
	db := testenv.NewDBAlone(t)
	ctx := t.Context()
	beforeHold := time.Now()
	db.HoldSnapshot(t)
	afterHold := time.Now()

	const ended = 20000
	// The flow under the snapshot: messages stored then processed, events
	// written then published; the floors risen past them, as the service
	// raises them.
	db.Exec(t, `
		INSERT INTO inbox (message_id, message_type, payload, order_key)
		SELECT 'm-' || i, 'order.created', '{}', 'order-' || i FROM generate_series(1, $1) AS i ORDER BY i`, ended)
	db.Exec(t, "UPDATE inbox SET status = 'processed', processed_at = now(), attempts = 1")
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		SELECT 'm-' || i || ':order.confirmed', 'm-' || i, 'order.confirmed', '{}', 'order-' || i
		FROM generate_series(1, $1) AS i ORDER BY i`, ended)
	db.Exec(t, "UPDATE outbox SET published_at = now(), attempts = 1")
	db.Exec(t, "SELECT setval('inbox_claim_floor_seq', (SELECT max(id) + 1 FROM inbox))")
	db.Exec(t, "SELECT setval('outbox_claim_floor_seq', (SELECT max(id) + 1 FROM outbox))")
	// What waits: four messages pending and two dead (the dead under the
	// floor, as a message that died long ago is); among the outbox's rows,
	// three events open (one failing) and two dead, two replies open and
	// two undeliverable.
	db.Exec(t, `
		INSERT INTO inbox (message_id, message_type, payload, order_key)
		SELECT 'w-' || i, 'order.created', '{}', 'waiting-' || i FROM generate_series(1, 4) AS i ORDER BY i`)
	db.Exec(t, "UPDATE inbox SET status = 'dead', last_error = 'refused', processed_at = now() WHERE id IN (1, 2)")
	// Two orders held back: w-4 behind the dead message of order-1, and
	// w-3 behind w-2, which failed and waits for its retry.
	db.Exec(t, "UPDATE inbox SET order_key = 'order-1' WHERE message_id = 'w-4'")
	db.Exec(t, "UPDATE inbox SET order_key = 'waiting-2' WHERE message_id = 'w-3'")
	db.Exec(t, "UPDATE inbox SET last_error = 'timeout', next_attempt_at = now() + interval '1 minute' WHERE message_id = 'w-2'")
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key, last_error, reply_to)
		VALUES ('w-1:order.confirmed', 'w-1', 'order.confirmed', '{}', 'waiting-1', NULL, NULL),
		       ('w-2:order.confirmed', 'w-2', 'order.confirmed', '{}', 'waiting-2', 'broker gone', NULL),
		       ('w-3:order.confirmed', 'w-3', 'order.confirmed', '{}', 'waiting-3', NULL, NULL),
		       ('r-1:reply', 'r-1', 'reply', '{}', NULL, NULL, 'requester-1'),
		       ('r-2:reply', 'r-2', 'reply', '{}', NULL, NULL, 'requester-2')`)
	db.Exec(t, "UPDATE outbox SET published_at = NULL, dead_at = now(), last_error = 'refused' WHERE id IN (1, 2)")
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, reply_to, last_error, dead_at)
		SELECT 'u-' || i || ':reply', 'u-' || i, 'reply', '{}', 'gone', 'returned', now()
		FROM generate_series(1, 2) AS i ORDER BY i`)

	conn := db.Session(t)
	read := func() int {
		return testenv.SessionStat(t, conn, `
			SELECT coalesce(sum(idx_tup_read), 0)::int FROM pg_stat_user_indexes
			WHERE schemaname = current_schema() AND relname IN ('inbox', 'outbox')`)
	}
	scrape := func(what string) {
		t.Helper()
		before := read()
		heldAtLeast := time.Since(afterHold).Seconds()
		g, err := dbsqlc.New().MetricsGauges(ctx, conn)
		heldAtMost := time.Since(beforeHold).Seconds()
		require.NoError(t, err)
		entries := read() - before
		t.Logf("%s: a scrape read %d index entries, with %d messages processed and %d rows published under the held snapshot", what, entries, ended, ended)
		require.Equal(t, int64(4), g.Pending, what)
		require.Equal(t, int64(2), g.Dead, what)
		require.Positive(t, g.OldestPendingSeconds, what)
		require.Equal(t, int64(3+2), g.OutboxBacklog, "%s: the events open and dead", what)
		require.Equal(t, int64(2), g.OutboxDead, what)
		require.Positive(t, g.OutboxOldestSeconds, "%s: the oldest event waiting, open or dead", what)
		require.Equal(t, int64(2), g.RepliesUnpublished, what)
		require.Equal(t, int64(2), g.RepliesUndeliverable, what)
		var heldOrders int64
		var heldOldest float64
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*), extract(epoch FROM now() - min(oldest_held_received_at))::float8
			FROM inbox_held_back`).Scan(&heldOrders, &heldOldest))
		require.Equal(t, int64(2), heldOrders, "%s: inbox_held_back", what)
		require.Equal(t, heldOrders, g.HeldBackOrders, "%s: the orders held back", what)
		require.InDelta(t, heldOldest, g.HeldBackOldestSeconds, 0.5, "%s: the oldest message held back", what)
		require.GreaterOrEqual(t, g.OldestSnapshotSeconds, heldAtLeast-0.05, "%s: the held snapshot's age", what)
		require.LessOrEqual(t, g.OldestSnapshotSeconds, heldAtMost+0.05, "%s: the held snapshot's age", what)
		require.Less(t, entries, 200, "%s: a scrape reads the entries of what waits, not those of the rows that ended under the held snapshot", what)
	}
	scrape("without statistics")
	db.Exec(t, "ANALYZE inbox")
	db.Exec(t, "ANALYZE outbox")
	scrape("analyzed")

	var unpublished, failing, dead, repliesUnpublished, repliesUndeliverable int64
	var oldest bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT unpublished, failing, dead, replies_unpublished, replies_undeliverable,
		oldest_created_at = (SELECT min(created_at) FROM outbox WHERE published_at IS NULL AND reply_to IS NULL)
		FROM outbox_backlog`).Scan(&unpublished, &failing, &dead, &repliesUnpublished, &repliesUndeliverable, &oldest))
	require.Equal(t, []int64{5, 1, 2, 2, 2}, []int64{unpublished, failing, dead, repliesUnpublished, repliesUndeliverable},
		"outbox_backlog: unpublished, failing, dead, replies unpublished and undeliverable")
	require.True(t, oldest, "outbox_backlog: the oldest event waiting, open or dead")
}

// The service login reads the held snapshots' age with the other gauges,
// but PostgreSQL shows the transaction start of another login's session
// only to members of pg_read_all_stats: without that role the gauge sees
// the service login's own sessions only, as its help and docs/operations.md
// say.
func TestTheServiceLoginSeesTheSnapshotsItMayRead(t *testing.T) {
	t.Parallel()
	db := testenv.NewDBAlone(t)
	ctx := t.Context()
	service, other := "svc_"+db.Schema, "oth_"+db.Schema
	db.Exec(t, "CREATE ROLE "+service+" LOGIN PASSWORD 'service' IN ROLE inbox_service")
	db.Exec(t, "CREATE ROLE "+other+" LOGIN PASSWORD 'other'")
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.WithoutCancel(ctx), "DROP ROLE IF EXISTS "+service)
		_, _ = db.Pool.Exec(context.WithoutCancel(ctx), "DROP ROLE IF EXISTS "+other)
	})
	connect := func(login, password string) *pgx.Conn {
		u, err := url.Parse(db.URL)
		require.NoError(t, err)
		u.User = url.UserPassword(login, password)
		conn, err := pgx.Connect(ctx, u.String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(ctx)) })
		return conn
	}
	hold := func(conn *pgx.Conn) {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
		_, err = tx.Exec(ctx, "SELECT 1")
		require.NoError(t, err)
	}
	gauges := connect(service, "service")
	snapshotAge := func() float64 {
		g, err := dbsqlc.New().MetricsGauges(ctx, gauges)
		require.NoError(t, err, "the service login reads the gauges")
		return g.OldestSnapshotSeconds
	}

	require.Zero(t, snapshotAge(), "no snapshot held but the scrape's own")
	hold(connect(other, "other"))
	otherHeld := time.Now()
	require.Zero(t, snapshotAge(), "another login's snapshot, whose transaction start is hidden")

	time.Sleep(time.Second)
	ownHeld := time.Now()
	hold(connect(service, "service"))
	age := snapshotAge()
	require.Positive(t, age, "a snapshot of the service login's own")
	require.LessOrEqual(t, age, time.Since(ownHeld).Seconds()+0.05, "the service login's own snapshot, the only one it sees")

	db.Exec(t, "GRANT pg_read_all_stats TO "+service)
	otherAtLeast := time.Since(otherHeld).Seconds()
	require.GreaterOrEqual(t, snapshotAge(), otherAtLeast-0.05, "with pg_read_all_stats, the other login's older snapshot")
}
