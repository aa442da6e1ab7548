package outbox_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

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

// A claim reads the floor once. The floor lives in a sequence, which no
// snapshot holds still, and keepers in every process raise it while a claim
// runs. Read at each look-up, a claim held a row back for an earlier open
// row of its order, then, the floor raised past that row meanwhile, took
// the order's later rows without it: they were published ahead of it (seen
// with two relays and keepers raising the floor beside them, in
// TestRelay/PublishesEachOrdersRowsInIDOrderWithTwoRelays).
//
// The schema's floor is replaced by one that counts its reads.
func TestAClaimReadsTheFloorOnce(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t) // the claim alone: no broker
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		SELECT 'c-' || i || ':order.event', 'c-' || i, 'order.event', '{}', 'o-' || i % 10
		FROM generate_series(1, 100) AS i ORDER BY i`)
	db.Exec(t, "CREATE SEQUENCE floor_reads")
	db.Exec(t, `CREATE OR REPLACE FUNCTION outbox_claim_floor() RETURNS bigint
		LANGUAGE sql STABLE AS $$ SELECT 0 * nextval('floor_reads') $$`)
	for _, analyzed := range []bool{false, true} {
		if analyzed {
			db.Exec(t, "ANALYZE outbox")
		}
		before := db.Int(t, "SELECT coalesce(pg_sequence_last_value('floor_reads'), 0)")
		tx, err := db.Pool.Begin(t.Context())
		require.NoError(t, err)
		rows, err := dbsqlc.New().OutboxClaimBatch(t.Context(), tx, dbsqlc.OutboxClaimBatchParams{LeaseMs: 30_000, MaxRows: 100})
		require.NoError(t, err)
		require.Len(t, rows, 100, "every row is claimed, each after the earlier ones of its order")
		require.NoError(t, tx.Rollback(t.Context()))
		reads := db.Int(t, "SELECT pg_sequence_last_value('floor_reads')") - before
		require.Equal(t, 1, reads, "a claim of 100 rows of 10 orders read the floor %d times (analyzed=%v)", reads, analyzed)
	}
}
