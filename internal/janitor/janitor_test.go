package janitor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func newJanitor(t *testing.T, pool *pgxpool.Pool, cfg janitor.Config) *janitor.Janitor {
	t.Helper()
	cfg.Logger = testenv.Logger(t)
	j, err := janitor.New(pool, &cfg)
	require.NoError(t, err)
	return j
}

func exec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := pool.Exec(context.WithoutCancel(t.Context()), sql, args...)
	require.NoError(t, err)
}

// seedMessage stores one message in the given status, processed (or died)
// age ago, with one attempt in its history.
func seedMessage(t *testing.T, pool *pgxpool.Pool, id, status string, age time.Duration) {
	t.Helper()
	at := time.Now().Add(-age)
	row := testfactory.InboxRowOpts{MessageID: id, Status: status, Attempts: 1, ReceivedAt: &at}
	if status != "pending" {
		row.ProcessedAt = &at
	}
	ctx := context.WithoutCancel(t.Context())
	inboxID := testfactory.InboxRow(ctx, t, pool, &row)
	exec(t, pool, `
		INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, process, build, finished_at)
		VALUES ($1, 0, 1, $2, CASE $3 WHEN 'pending' THEN 'retry' ELSE $3 END, 'test/1', 'b1', $4)`,
		inboxID, id, status, at)
}

// The janitor deletes exactly what is past its retention, and nothing that
// an operator or the service still needs.
func TestJanitorDeletesOnlyWhatIsPastItsRetention(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const day = 24 * time.Hour
	for _, m := range []struct {
		id     string
		status string
		age    time.Duration
	}{
		{"processed-old", "processed", 8 * day},
		{"processed-young", "processed", 6 * day},
		{"dead-old", "dead", 31 * day},
		{"dead-past-retention", "dead", 8 * day}, // dead rows have a retention of their own
		{"pending-old", "pending", 40 * day},     // never deleted, however old
	} {
		seedMessage(t, db.Pool, m.id, m.status, m.age)
	}
	// A dead message that holds back a later message of its order stays,
	// however old: deleting it would let the order run out of order.
	now := time.Now()
	at := func(d time.Duration) *time.Time { v := now.Add(d); return &v }
	testfactory.InboxRow(t.Context(), t, db.Pool, &testfactory.InboxRowOpts{
		MessageID: "dead-blocking", Status: "dead", Attempts: 10, OrderKey: "o-1", ReceivedAt: at(-40 * day), ProcessedAt: at(-40 * day),
	})
	testfactory.InboxRow(t.Context(), t, db.Pool, &testfactory.InboxRowOpts{
		MessageID: "held", MessageType: "order.cancelled", OrderKey: "o-1", ReceivedAt: at(-39 * day),
	})
	exec(t, db.Pool, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, created_at, published_at)
		VALUES ('e-old', 'processed-old', 'order.confirmed', '{}', now() - interval '9 days', now() - interval '8 days'),
		       ('e-young', 'processed-young', 'order.confirmed', '{}', now() - interval '6 days', now() - interval '6 days'),
		       ('e-unpublished', 'pending-old', 'order.confirmed', '{}', now() - interval '40 days', NULL)`)
	exec(t, db.Pool, `
		INSERT INTO inbox_conflicts (message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload, first_seen_at, last_seen_at)
		VALUES ('processed-old', 'order.created', 'a', 'b', '{}', now() - interval '9 days', now() - interval '8 days'),
		       ('processed-young', 'order.created', 'a', 'c', '{}', now() - interval '9 days', now() - interval '1 day')`)

	// Reply requests go with their message; a reply that ended
	// undeliverable goes after the dead retention.
	exec(t, db.Pool, `
		INSERT INTO inbox_reply_requests (message_id, reply_to)
		VALUES ('processed-old', 'requester'), ('pending-old', 'requester')`)
	// Answered as ingest answers the requests it stores: processed-old's.
	queued, err := dbsqlc.New().InboxReplyAnswer(t.Context(), db.Pool,
		[]int64{int64(db.Int(t, "SELECT min(id) FROM inbox_reply_requests")), int64(db.Int(t, "SELECT max(id) FROM inbox_reply_requests"))})
	require.NoError(t, err)
	require.EqualValues(t, 1, queued)
	// One whose message left without it goes after the dead retention.
	exec(t, db.Pool, `
		INSERT INTO inbox_reply_requests (message_id, reply_to, received_at)
		VALUES ('gone-long-ago', 'requester', now() - interval '31 days'), ('gone-lately', 'requester', now() - interval '29 days')`)
	exec(t, db.Pool, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, reply_to, created_at, dead_at, last_error)
		VALUES ('reply:old', 'gone-old', 'reply', '{}', 'gone', now() - interval '32 days', now() - interval '31 days', 'undeliverable'),
		       ('reply:young', 'gone-young', 'reply', '{}', 'gone', now() - interval '2 days', now() - interval '1 day', 'undeliverable')`)

	observed := map[string]int{}
	j := newJanitor(t, db.Pool, janitor.Config{
		Retention: 7 * day, DeadRetention: 30 * day, BatchSize: 1,
		Observe: func(rows string, n int, _ time.Duration) { observed[rows] += n },
	})
	res, err := j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, janitor.Result{janitor.RowsProcessed: 1, janitor.RowsDead: 1, janitor.RowsPublished: 1, janitor.RowsConflicts: 1, janitor.RowsUndeliverable: 1, janitor.RowsReplyRequests: 1}, res)
	require.Equal(t, map[string]int{janitor.RowsProcessed: 1, janitor.RowsDead: 1, janitor.RowsPublished: 1, janitor.RowsConflicts: 1, janitor.RowsUndeliverable: 1, janitor.RowsReplyRequests: 1}, observed)
	require.Equal(t, []string{"gone-lately", "pending-old"}, db.Strings(t, "SELECT message_id FROM inbox_reply_requests ORDER BY 1"),
		"a request goes with its message, or after the dead retention")
	require.Equal(t, []string{"reply:1:0", "reply:young"},
		db.Strings(t, "SELECT idempotency_key FROM outbox WHERE reply_to IS NOT NULL ORDER BY 1"),
		"the reply processed-old's request was answered with stays to be sent; the undeliverable one past its retention goes")

	require.Equal(t, []string{"dead-blocking", "dead-past-retention", "held", "pending-old", "processed-young"},
		db.Strings(t, "SELECT message_id FROM inbox ORDER BY message_id"))
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox_attempts WHERE message_id IN ('processed-old', 'dead-old')"),
		"the history goes with its message")
	require.Equal(t, 3, db.Int(t, "SELECT count(*) FROM inbox_attempts"))
	require.Equal(t, 2, db.Int(t, "SELECT count(*) FROM outbox WHERE reply_to IS NULL"), "unpublished rows stay")
	require.Equal(t, 1, db.Int(t, "SELECT count(*) FROM inbox_conflicts"))

	res, err = j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, janitor.Result{janitor.RowsProcessed: 0, janitor.RowsDead: 0, janitor.RowsPublished: 0, janitor.RowsConflicts: 0, janitor.RowsUndeliverable: 0, janitor.RowsReplyRequests: 0}, res)
}

func TestJanitorConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]janitor.Config{
		"NoRetention":              {DeadRetention: time.Hour},
		"DeadShorterThanRetention": {Retention: 2 * time.Hour, DeadRetention: time.Hour},
		"NegativeBatch":            {Retention: time.Hour, DeadRetention: time.Hour, BatchSize: -1},
	} {
		_, err := janitor.New(nil, &cfg)
		require.Error(t, err, name)
	}
}

// On a million processed rows, two janitors at once delete exactly the
// rows past the window, in batches, while ingest keeps inserting. The test
// reports (it does not assert) how long batches and ingest inserts took.
func TestJanitorOnAMillionRows(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds a million rows")
	}
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	const total, old = 1_000_000, 600_000
	// Rows 1..600,000 were processed 8 to 10 days ago, the rest in the
	// last 6 days; each has one attempt in its history.
	seedStart := time.Now()
	exec(t, db.Pool, `
		INSERT INTO inbox (message_id, message_type, payload, status, attempts, received_at, processed_at)
		SELECT 'seed-' || g, 'order.created', '{"orderId":"o"}', 'processed', 1, t, t
		FROM generate_series(1, $1::int) g,
		     LATERAL (SELECT CASE WHEN g <= $2 THEN now() - interval '10 days' + (g::float8 / $2) * interval '2 days'
		                          ELSE now() - interval '6 days' + ((g - $2)::float8 / ($1 - $2)) * interval '6 days' END AS t) AS at`,
		total, old)
	exec(t, db.Pool, `
		INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, process, build, finished_at)
		SELECT id, 0, 1, message_id, 'processed', 'seed/1', 'b1', processed_at FROM inbox`)
	exec(t, db.Pool, "VACUUM ANALYZE inbox")
	exec(t, db.Pool, "VACUUM ANALYZE inbox_attempts")
	t.Logf("seeded %d processed messages with their history in %s", total, time.Since(seedStart).Round(time.Millisecond))

	// Ingest: batches of 500 new messages, one insert statement each, as
	// long as the janitors run, then as long again without them.
	var ingestMu sync.Mutex
	var during, after []time.Duration
	ingest := func(ctx context.Context, prefix string, into *[]time.Duration) {
		q := dbsqlc.New()
		for n := 0; ctx.Err() == nil; n++ {
			p := dbsqlc.InboxInsertManyParams{}
			for i := range 500 {
				id := fmt.Sprintf("%s-%d-%d", prefix, n, i)
				p.MessageIds = append(p.MessageIds, id)
				p.MessageTypes = append(p.MessageTypes, "order.created")
				p.RoutingKeys = append(p.RoutingKeys, "order.created")
				p.Payloads = append(p.Payloads, []byte(`{"orderId":"x"}`))
				p.OrderKeys = append(p.OrderKeys, id)
			}
			started := time.Now()
			if _, err := q.InboxInsertMany(ctx, db.Pool, p); err != nil {
				if ctx.Err() == nil {
					t.Errorf("ingest insert: %v", err)
				}
				return
			}
			ingestMu.Lock()
			*into = append(*into, time.Since(started))
			ingestMu.Unlock()
		}
	}

	var batchMu sync.Mutex
	var batches []time.Duration
	observe := func(rows string, n int, took time.Duration) {
		if rows == janitor.RowsProcessed {
			batchMu.Lock()
			batches = append(batches, took)
			batchMu.Unlock()
		}
	}
	ingestCtx, stopIngest := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { ingest(ingestCtx, "during", &during) })
	started := time.Now()
	results := make([]janitor.Result, 2)
	errs := make([]error, 2)
	var janitors sync.WaitGroup
	for i := range results {
		j := newJanitor(t, db.Pool, janitor.Config{Retention: 7 * 24 * time.Hour, DeadRetention: 30 * 24 * time.Hour, Observe: observe})
		janitors.Go(func() { results[i], errs[i] = j.RunOnce(ctx) })
	}
	janitors.Wait()
	require.NoError(t, errors.Join(errs...))
	took := time.Since(started)
	stopIngest()
	wg.Wait()
	afterCtx, stopAfter := context.WithTimeout(ctx, min(took, 5*time.Second))
	ingest(afterCtx, "after", &after)
	stopAfter()

	require.EqualValues(t, old, results[0][janitor.RowsProcessed]+results[1][janitor.RowsProcessed],
		"the janitors' reported counts add up to the rows past the window")
	require.Positive(t, results[0][janitor.RowsProcessed], "both janitors took part")
	require.Positive(t, results[1][janitor.RowsProcessed], "both janitors took part")
	require.Equal(t, total-old, db.Int(t, "SELECT count(*) FROM inbox WHERE message_id LIKE 'seed-%'"))
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox WHERE processed_at < now() - interval '7 days'"))
	require.Equal(t, total-old, db.Int(t, "SELECT count(*) FROM inbox_attempts"), "the history went with its messages")
	// An insert cut off by the end of its phase may have committed too.
	ingested := db.Int(t, "SELECT count(*) FROM inbox WHERE message_id NOT LIKE 'seed-%'")
	require.GreaterOrEqual(t, ingested, 500*(len(during)+len(after)), "the janitors deleted no new message")

	t.Logf("deleted %d rows in %d batches of up to 1000 by 2 janitors in %s (%.0f rows/s); batch p50 %s, p99 %s, max %s",
		old, len(batches), took.Round(time.Millisecond), float64(old)/took.Seconds(),
		percentile(batches, 0.50), percentile(batches, 0.99), percentile(batches, 1))
	t.Logf("ingest inserts of 500: during cleanup %d, p50 %s, p99 %s, max %s; without cleanup %d, p50 %s, p99 %s, max %s",
		len(during), percentile(during, 0.50), percentile(during, 0.99), percentile(during, 1),
		len(after), percentile(after, 0.50), percentile(after, 0.99), percentile(after, 1))
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))].Round(10 * time.Microsecond)
}

// The running service cleans up at once when it starts, and again each
// Interval: it runs the RunOnce the other tests call.
func TestJanitorServiceCleansUpAtStartAndEachInterval(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const day = 24 * time.Hour
	seedMessage(t, db.Pool, "processed-old", "processed", 8*day)
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 7 * day, DeadRetention: 30 * day, Interval: 50 * time.Millisecond})
	j.TestSignals.CleanedUp.Init()
	require.NoError(t, j.Start(t.Context()))
	t.Cleanup(func() { j.Stop(context.WithoutCancel(t.Context())) })

	require.Equal(t, int64(1), j.TestSignals.CleanedUp.Wait(t)[janitor.RowsProcessed], "the first cleanup runs at start")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))

	seedMessage(t, db.Pool, "processed-later", "processed", 9*day)
	for {
		if res := j.TestSignals.CleanedUp.Wait(t); res[janitor.RowsProcessed] == 1 {
			break
		}
	}
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"), "a later cleanup deletes what aged since")
}
