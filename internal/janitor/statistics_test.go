package janitor_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A table the service writes is analyzed once it holds 1,000 rows, and
// again each time it has grown tenfold since, and not in between: where
// autovacuum does not run, those ANALYZEs are what make the sessions plan
// again what they keep plans for (pipeline.KeepPlans), and they cost a
// handful over a table's life.
func TestAGrowingTableIsAnalyzedAtEachTenfold(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	writer := db.Session(t)
	grow := func(to int) {
		t.Helper()
		_, err := writer.Exec(t.Context(), `INSERT INTO order_confirmations (order_id, status, message_id)
			SELECT 'o-' || g, 'confirmed', 'm-' || g FROM generate_series((SELECT count(*) FROM order_confirmations) + 1, $1) g`, to)
		require.NoError(t, err)
		// The rows the rule counts: the writer's counts reach the shared
		// statistics once it is idle, at once when forced.
		_, err = writer.Exec(t.Context(), "SELECT pg_stat_force_next_flush()")
		require.NoError(t, err)
	}
	// The rows order_confirmations held at its last ANALYZE, 0 before any.
	analyzedAt := func() int {
		return db.Int(t, `SELECT coalesce((SELECT reltuples::bigint FROM pg_class
			WHERE oid = 'order_confirmations'::regclass AND reltuples >= 0), 0)`)
	}
	keep := func() int { return db.Int(t, "SELECT inbox_keep_statistics()") }

	grow(999)
	require.Zero(t, keep(), "999 rows: not yet")
	require.Zero(t, analyzedAt())
	grow(1000)
	require.Equal(t, 1, keep(), "1,000 rows, never analyzed")
	require.Equal(t, 1000, analyzedAt())
	grow(9999)
	require.Zero(t, keep(), "grown less than tenfold")
	grow(10000)
	require.Equal(t, 1, keep(), "grown tenfold")
	require.Equal(t, 10000, analyzedAt())
	require.Zero(t, keep(), "once")
}
