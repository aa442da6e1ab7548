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
