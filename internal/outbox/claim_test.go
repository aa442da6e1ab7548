package outbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A claim looks up each candidate's earlier open rows among its own
// order's rows, not through the rows of other orders queued between the
// floor and it. Through an index of the open rows (or the primary key), a
// claim of a backlog of n orders read about n/2 index entries a look-up,
// two look-ups a row: 300 orders cost 90,000 entries and ten times the
// time, and a backlog made every claim slower.
//
// Counted, not timed: the index entries the claim's statement read, from
// the schema's own statistics. The outbox is shaped as the flow leaves it:
// 20,000 rows published and not vacuumed, then the backlog, each row an
// order of its own with a UUID for a key; without statistics (as a new
// table, and as the planner took the range from the floor) and analyzed
// (as autovacuum leaves it in production).
func TestAClaimReadsOnlyItsOrdersRows(t *testing.T) {
	t.Parallel()
	for _, analyzed := range []bool{false, true} {
		t.Run(fmt.Sprintf("analyzed=%v", analyzed), func(t *testing.T) {
			t.Parallel()
			db := testenv.NewDB(t) // the claim alone: no broker
			const orders = 300
			db.Exec(t, `
				INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
				SELECT 'p-' || i || ':order.confirmed', 'p-' || i, 'order.confirmed', '{}', gen_random_uuid()::text
				FROM generate_series(1, 20000) AS i ORDER BY i`)
			db.Exec(t, "UPDATE outbox SET published_at = now()")
			db.Exec(t, "SELECT setval('outbox_claim_floor_seq', (SELECT max(id) FROM outbox))")
			db.Exec(t, `
				INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
				SELECT 'c-' || i || ':order.confirmed', 'c-' || i, 'order.confirmed', '{}', gen_random_uuid()::text
				FROM generate_series(1, $1) AS i ORDER BY i`, orders)
			if analyzed {
				db.Exec(t, "ANALYZE outbox")
			}
			conn := db.SessionWith(t, pipeline.ConfigureSession)
			read := func() int {
				return testenv.SessionStat(t, conn, `
					SELECT coalesce(sum(idx_tup_read), 0)::int FROM pg_stat_user_indexes
					WHERE schemaname = current_schema() AND relname = 'outbox'`)
			}
			before := read()
			tx, err := conn.Begin(t.Context())
			require.NoError(t, err)
			rows, err := dbsqlc.New().OutboxClaimBatch(t.Context(), tx, dbsqlc.OutboxClaimBatchParams{LeaseMs: 30_000, MaxRows: orders})
			require.NoError(t, err)
			require.Len(t, rows, orders, "every order's row is claimed")
			require.NoError(t, tx.Rollback(t.Context()))
			entries := read() - before
			t.Logf("a claim of %d rows of %d orders read %d index entries", orders, orders, entries)
			require.Less(t, entries, 10*orders,
				"a claim reads a bounded number of index entries a row, not the other orders' rows once a row")
		})
	}
}

// A claim holds an order's later rows back behind an earlier row open in
// its snapshot, wherever the floor stands. The floor lives in a sequence,
// which no snapshot holds still: a row open when a claim's snapshot was
// taken can end (published, or dead) before the claim reads the floor, and
// a keeper raise the floor past it. Bounded by the floor, the claim's
// look-ups missed that row and took the order's later rows: once the dead
// row was replayed, it went out after them. (With the floor read at each
// look-up, two relays did the same to each other: see
// TestRelay/PublishesEachOrdersRowsInIDOrderWithTwoRelays.)
//
// The claim runs under REPEATABLE READ here only to hold its snapshot from
// before the row's death; under the relay's READ COMMITTED the same comes
// about when the death and the raise land between the statement's
// snapshot and its read of the floor.
func TestAClaimHoldsAnOrderBackBehindARowTheFloorPassed(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t) // the claim alone: no broker
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		SELECT k || ':order.event', k, 'order.event', '{}', o
		FROM (VALUES ('o-1', 'o'), ('o-2', 'o'), ('o-3', 'o'), ('p-1', 'p')) AS v (k, o)`)
	first := db.Int(t, "SELECT id FROM outbox WHERE message_id = 'o-1'")

	claim, err := db.Pool.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = claim.Rollback(context.WithoutCancel(t.Context())) }()
	var open int
	require.NoError(t, claim.QueryRow(t.Context(), "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL").Scan(&open))
	require.Equal(t, 4, open, "the claim's snapshot: every row open")

	// Then o's first row ends dead (the broker refused it to its last
	// attempt), and a keeper raises the floor past it.
	db.Exec(t, "UPDATE outbox SET dead_at = now(), last_error = 'refused' WHERE id = $1", first)
	raise := claimfloor.Outbox(db.Pool)
	_, note, err := raise(t.Context(), claimfloor.Note{})
	require.NoError(t, err)
	floor, _, err := raise(t.Context(), note)
	require.NoError(t, err)
	require.Equal(t, int64(first+1), floor, "the floor stands on o's second row")

	rows, err := dbsqlc.New().OutboxClaimBatch(t.Context(), claim, dbsqlc.OutboxClaimBatchParams{LeaseMs: 30_000, MaxRows: 100})
	require.NoError(t, err)
	var claimed []string
	for _, r := range rows {
		claimed = append(claimed, r.IdempotencyKey)
	}
	require.Equal(t, []string{"p-1:order.event"}, claimed,
		"o's later rows wait behind its first, open in the claim's snapshot though under the floor")
}
