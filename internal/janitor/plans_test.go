package janitor_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The janitor's pass over undeliverable replies reads those replies, not
// the outbox's other rows. Through the unpublished rows' index, in id
// order, it read every entry there that is not such a reply, and a
// snapshot held open keeps there the entry of every row published since it
// began: at 1,000 orders/s, 4.8 s and 111,472 buffers a pass with nothing
// to delete, one core's worth while the flow needed both.
//
// Counted, not timed: the index entries the pass's statements read, from
// the schema's own statistics, under a snapshot held while 20,000 rows are
// published, without statistics (as a new table) and then analyzed.
func TestTheUndeliverablePassReadsOnlyUndeliverableReplies(t *testing.T) {
	t.Parallel()
	db := testenv.NewDBAlone(t)
	ctx := t.Context()
	db.HoldSnapshot(t)

	const published, undeliverable = 20000, 10
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		SELECT 'p-' || i || ':order.confirmed', 'p-' || i, 'order.confirmed', '{}', 'order-' || i
		FROM generate_series(1, $1) AS i ORDER BY i`, published)
	db.Exec(t, "UPDATE outbox SET published_at = now()")
	// Replies whose requester was gone: old ones past the retention, and as
	// many young ones that stay.
	db.Exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, reply_to, dead_at)
		SELECT 'r-' || i || ':reply', 'r-' || i, 'reply', '{}', 'gone', now() - CASE WHEN i % 2 = 0 THEN interval '2 days' ELSE interval '1 minute' END
		FROM generate_series(1, $1) AS i ORDER BY i`, 2*undeliverable)

	conn := db.Session(t)
	read := func() int {
		return testenv.SessionStat(t, conn, `
			SELECT coalesce(sum(idx_tup_read), 0)::int FROM pg_stat_user_indexes
			WHERE schemaname = current_schema() AND relname = 'outbox'`)
	}
	pass := func(what string, want int64) {
		t.Helper()
		before := read()
		n, err := dbsqlc.New().JanitorDeleteUndeliverable(ctx, conn, dbsqlc.JanitorDeleteUndeliverableParams{
			OlderThanSeconds: 86400, MaxRows: 1000,
		})
		require.NoError(t, err)
		require.Equal(t, want, n, "%s: the replies past their retention are deleted, the young ones stay", what)
		entries := read() - before
		t.Logf("%s: the pass read %d index entries of an outbox of %d published rows", what, entries, published)
		require.Less(t, entries, 10*undeliverable,
			"%s: the pass reads the undeliverable replies' entries, not those of the rows published under the held snapshot", what)
	}
	pass("without statistics", undeliverable)
	db.Exec(t, "ANALYZE outbox")
	pass("analyzed, with nothing left to delete", 0)
	require.Equal(t, undeliverable, db.Int(t, "SELECT count(*) FROM outbox WHERE reply_to IS NOT NULL"))
}
