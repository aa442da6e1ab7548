package main

import (
	"context"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// tableReads is what the statements of every session read of one table:
// rows returned by its sequential scans (pg_stat_user_tables; the row
// versions a scan steps over unseen are not counted), how many sequential
// scans there were, and entries returned by scans of its indexes, whether
// or not their rows were then fetched (pg_stat_user_indexes.idx_tup_read).
type tableReads struct{ seq, scans, idx int }

// readsByTable returns the cumulative reads of every table of the test's
// schema, read afresh.
func (b *e2eBundle) readsByTable(t *testing.T) map[string]tableReads {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	conn, err := b.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "SELECT pg_stat_clear_snapshot()")
	require.NoError(t, err)
	rows, err := conn.Query(ctx, `
		SELECT t.relname::text, coalesce(t.seq_tup_read, 0), coalesce(t.seq_scan, 0),
		       coalesce((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i WHERE i.relid = t.relid), 0)::bigint
		FROM pg_stat_user_tables t WHERE t.schemaname = current_schema()`)
	require.NoError(t, err)
	out := map[string]tableReads{}
	var name string
	var r tableReads
	_, err = pgx.ForEachRow(rows, []any{&name, &r.seq, &r.scans, &r.idx}, func() error {
		out[name] = r
		return nil
	})
	require.NoError(t, err)
	return out
}

// settledReads is readsByTable once the sessions that just ended have
// reported what they read: two readings 300 ms apart agree.
func (b *e2eBundle) settledReads(t *testing.T) map[string]tableReads {
	t.Helper()
	last := b.readsByTable(t)
	for {
		time.Sleep(300 * time.Millisecond)
		next := b.readsByTable(t)
		if maps.Equal(next, last) {
			return next
		}
		last = next
	}
}

// readsWhile counts what the sessions read of each table while run runs,
// then stops inboxd p: a backend reports what it read at the end of a
// transaction at most once a second, and all of it when it ends. Work
// done before must have been reported already (a backend idle for 10
// seconds has reported all it did).
func (b *e2eBundle) readsWhile(t *testing.T, p *process, run func()) map[string]tableReads {
	t.Helper()
	before := b.readsByTable(t)
	run()
	p.terminate(30 * time.Second)
	after := b.settledReads(t)
	out := map[string]tableReads{}
	for table, a := range after {
		r := before[table]
		out[table] = tableReads{seq: a.seq - r.seq, scans: a.scans - r.scans, idx: a.idx - r.idx}
	}
	return out
}

// publishOrders publishes n orders (a tenth of them cancelled, a tenth of
// the messages sent twice), their ids starting with prefix, and waits for
// every event they make downstream: order.confirmed and email.requested
// for each order, order.cancelled for each cancellation.
func (b *e2eBundle) publishOrders(t *testing.T, n int, seed uint64, prefix string) {
	t.Helper()
	w := loadgen.Generate(loadgen.Spec{Orders: n, CancelRate: 0.1, DuplicateRate: 0.1, Seed: seed, Prefix: prefix})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 20))
	b.awaitEvents(t, 2*n+len(w.Cancelled), 2*time.Minute)
}

// awaitEvents waits until n more events have arrived downstream, without a
// statement of its own on the database.
func (b *e2eBundle) awaitEvents(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	got := 0
	for got < n {
		select {
		case d := <-b.events:
			require.NoError(t, d.Ack(false))
			if b.seen[d.MessageId] == 0 {
				got++
			}
			b.seen[d.MessageId]++
		case <-deadline:
			t.Fatalf("%d of %d events arrived", got, n)
		}
	}
}

// The service's statements, whose plans its pools keep (pipeline.KeepPlans),
// must not read the tables whole once they have grown, on a server that
// never analyzes them (this one: autovacuum is off in CI, and nothing else
// runs ANALYZE): inboxd handles orders on an empty schema, the tables grow
// by 100,000 rows of history each, and the next orders, cancellations
// among them, read about what they read before, not the history. Before
// stock_reservations_by_sku_idx the cancellations read every reservation: 7.1 million index entries, or
// 608,547 rows by sequential scans, for 300 orders. With the plans kept
// for a day instead of 10 s, three statements that joined a batch's keys
// to a table read it whole: completing a batch (15.8 million rows of
// inbox for 300 orders), recording conflicting duplicates, and looking for
// abandoned claims (907,544 rows of inbox_attempts); the last two now
// probe an index per key whatever the plan, and the first is planned at
// each call (dbsqlc.PlanEachCall). The plans are now kept for good.
func TestStatementsReadIndexesOnceTheTablesHaveGrown(t *testing.T) {
	if raceEnabled {
		t.Skip("counts what the SQL reads: skipped with the race detector, whose scheduling only adds noise")
	}
	t.Parallel()
	b := setup(t)
	// Small batches, so that each session runs each statement often enough
	// to keep a plan for it (PostgreSQL keeps a named statement's generic
	// plan from its sixth execution on, unless it looks dearer than the
	// plans made for the first five's parameters).
	p := startProcess(t, serviceEnv(b.db, b.broker,
		"INBOX_WORKER_BATCH_SIZE=5", "INBOX_INGEST_BATCH_SIZE=5", "INBOX_RELAY_BATCH_SIZE=10"))

	const orders = 300
	publish := func(round int) { b.publishOrders(t, orders, uint64(round), fmt.Sprintf("round%d", round)) }
	publish(1)
	publish(2)

	const history = 100_000
	for _, q := range []string{
		`INSERT INTO inbox (message_id, message_type, payload, status, attempts, order_key, received_at, processed_at)
		 SELECT 'history-' || g, 'order.created', '\x7b7d', 'processed', 1, 'history-order-' || g, now(), now()
		 FROM generate_series(1, $1) AS g`,
		`INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, order_key, published_at, attempts)
		 SELECT 'history-' || g, 'order.confirmed', '{}', 'history-' || g, 'history-order-' || g, now(), 1
		 FROM generate_series(1, $1) AS g`,
		`INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, process, build)
		 SELECT i.id, 0, 1, i.message_id, 'processed', 'history', 'history' FROM inbox i WHERE i.message_id LIKE 'history-%' LIMIT $1`,
		`INSERT INTO order_confirmations (order_id, status, user_id, message_id)
		 SELECT 'history-order-' || g, 'confirmed', 'user', 'history-' || g FROM generate_series(1, $1) AS g`,
		`INSERT INTO stock_reservations (order_id, sku, quantity)
		 SELECT 'history-order-' || g, 'SKU-1', 1 FROM generate_series(1, $1) AS g`,
	} {
		_, err := b.db.Pool.Exec(t.Context(), q, history)
		require.NoError(t, err, q)
	}

	// inboxd's connections keep their plans (pipeline.KeepPlans). A
	// backend reports what its statements read once it has been idle for
	// 10 seconds at most, and when it ends: wait that long for inboxd's
	// sessions to report the rounds before, then stop inboxd to count the
	// next one. The claim floors rise past the history meanwhile, as they
	// do within a second of a batch.
	time.Sleep(11 * time.Second)
	reads := b.readsWhile(t, p, func() { publish(3) })

	for table, r := range reads {
		t.Logf("%s: %d rows by sequential scans, %d by index, for %d orders", table, r.seq, r.idx, orders)
		require.Less(t, r.seq, history/10, fmt.Sprintf("%s: rows read by sequential scans for %d orders", table, orders))
		require.Less(t, r.idx, 100*orders, fmt.Sprintf("%s: entries read by index scans for %d orders", table, orders))
	}
}
