package migrate_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

// seedKnownStates fills a fresh schema with messages in every state an
// operator asks about, as the service would have left them.
func seedKnownStates(t *testing.T, db *testenv.DB) {
	t.Helper()
	now := time.Now()
	at := func(d time.Duration) *time.Time { v := now.Add(d); return &v }
	for _, row := range []testfactory.InboxRowOpts{
		// pending: one new, one being handled, one waiting for a retry
		{MessageID: "new", OrderKey: "o-1", ReceivedAt: at(-2 * time.Minute)},
		{MessageID: "handling", Attempts: 1, OrderKey: "o-2", ReceivedAt: at(-time.Minute), ClaimedAt: at(0), ClaimedBy: "host/7", ClaimedBuild: "b2"},
		{MessageID: "retrying", Attempts: 2, LastError: "deadlock", OrderKey: "o-3", ReceivedAt: at(-30 * time.Second), NextAttemptAt: at(time.Minute)},
		// processed at known times
		{MessageID: "done-1", Status: "processed", Attempts: 1, OrderKey: "o-4", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-10 * time.Second)},
		{MessageID: "done-2", Status: "processed", Attempts: 1, OrderKey: "o-5", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-20 * time.Second)},
		{MessageID: "done-3", MessageType: "order.cancelled", Status: "processed", Attempts: 1, OrderKey: "o-5", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-3 * time.Minute)},
		{MessageID: "done-4", Status: "processed", Attempts: 1, OrderKey: "o-6", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-10 * time.Minute)},
		{MessageID: "to-replay", Status: "processed", Attempts: 1, OrderKey: "o-7", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-15 * time.Minute)},
		// dead: two for one reason, one for another; dead-sku holds back a later message of its order
		{MessageID: "dead-json", Payload: `x`, Status: "dead", Attempts: 1, LastError: "invalid JSON", ReceivedAt: at(-time.Hour), ProcessedAt: at(-50 * time.Minute)},
		{MessageID: "dead-sku", Status: "dead", Attempts: 10, LastError: "unknown SKU", OrderKey: "o-9", ReceivedAt: at(-time.Hour), ProcessedAt: at(-40 * time.Minute)},
		{MessageID: "dead-sku2", Status: "dead", Attempts: 10, LastError: "unknown SKU", OrderKey: "o-10", ReceivedAt: at(-time.Hour), ProcessedAt: at(-30 * time.Minute)},
		{MessageID: "held", MessageType: "order.cancelled", OrderKey: "o-9", ReceivedAt: at(-5 * time.Minute)},
	} {
		testfactory.InboxRow(t.Context(), t, db.Pool, &row)
	}
	_, err := db.Pool.Exec(t.Context(), `
		INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, error, process, build, finished_at)
		SELECT id, 0, a.attempt, message_id, a.outcome, a.error, 'host/1', a.build, now() - a.ago
		FROM inbox
		JOIN (VALUES
		  ('retrying',  1, 'retry',     'deadlock',     'b2', interval '2 minutes'),
		  ('retrying',  2, 'retry',     'deadlock',     'b2', interval '1 minute'),
		  ('done-1',    1, 'processed', NULL,           'b1', interval '10 seconds'),
		  ('done-2',    1, 'processed', NULL,           'b1', interval '20 seconds'),
		  ('done-3',    1, 'processed', NULL,           'b1', interval '3 minutes'),
		  ('done-4',    1, 'processed', NULL,           'b1', interval '10 minutes'),
		  ('dead-json', 1, 'dead',      'invalid JSON', 'b1', interval '50 minutes'),
		  ('dead-sku',  9, 'abandoned', 'crashed',      'b2', interval '41 minutes'),
		  ('dead-sku',  10, 'dead',     'unknown SKU',  'b2', interval '40 minutes'),
		  ('dead-sku2', 10, 'dead',     'unknown SKU',  'b2', interval '30 minutes')
		) AS a (mid, attempt, outcome, error, build, ago) ON a.mid = inbox.message_id;

		UPDATE inbox SET replay_requested = true, replay_reason = 'check' WHERE message_id = 'to-replay';

		INSERT INTO inbox_conflicts (message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload)
		VALUES ('done-1', 'order.created', 'aa', 'bb', '{"other":true}');

		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, created_at, published_at, last_error)
		VALUES ('done-1:order.confirmed', 'done-1', 'order.confirmed', '{}', now() - interval '10 seconds', now(), NULL),
		       ('done-2:order.confirmed', 'done-2', 'order.confirmed', '{}', now() - interval '20 seconds', NULL, NULL),
		       ('done-2:email.requested', 'done-2', 'email.requested', '{}', now() - interval '30 seconds', NULL, 'broker refused');

		INSERT INTO stock (sku, available) VALUES ('SKU-1', 7), ('SKU-2', 0);
		INSERT INTO stock_reservations (order_id, sku, quantity, released_at)
		VALUES ('o-4', 'SKU-1', 2, NULL), ('o-5', 'SKU-1', 1, now()), ('o-6', 'SKU-1', 3, NULL);`)
	require.NoError(t, err)
}

// queryOne returns the single row of query as a map of column to value.
func queryOne(t *testing.T, db *testenv.DB, query string) map[string]any {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), query)
	require.NoError(t, err)
	row, err := pgx.CollectExactlyOneRow(rows, pgx.RowToMap)
	require.NoError(t, err)
	return row
}

// Acceptance: each view returns the right answer on a database seeded with
// known states.
func TestViewsOnKnownStates(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	seedKnownStates(t, db)

	t.Run("inbox_overview", func(t *testing.T) {
		o := queryOne(t, db, `
			SELECT pending, in_progress, waiting_retry, replays_waiting, dead, processed,
			       extract(epoch FROM oldest_pending_age) BETWEEN 1200 AND 1260 AS oldest_pending_20_minutes,
			       processed_last_minute, per_second_last_5_minutes::float8 AS per_second,
			       failed_attempts_last_5_minutes, conflicting_ids
			FROM inbox_overview`)
		require.Equal(t, map[string]any{
			"pending":                        int64(5), // new, handling, retrying, held, to-replay
			"in_progress":                    int64(1),
			"waiting_retry":                  int64(1),
			"replays_waiting":                int64(1),
			"dead":                           int64(3),
			"processed":                      int64(4),
			"oldest_pending_20_minutes":      true, // to-replay, received 20 minutes ago
			"processed_last_minute":          int64(2),
			"per_second":                     0.0, // 3 in 5 minutes = 0.01/s, rounded to 0.0
			"failed_attempts_last_5_minutes": int64(2),
			"conflicting_ids":                int64(1),
		}, o)
	})

	t.Run("inbox_dead", func(t *testing.T) {
		require.Equal(t, []string{
			"dead-sku2 10 unknown SKU host/1 b2",
			"dead-sku 10 unknown SKU host/1 b2",
			"dead-json 1 invalid JSON host/1 b1",
		}, db.Strings(t, "SELECT format('%s %s %s %s %s', message_id, attempts, last_error, last_process, last_build) FROM inbox_dead"))
	})

	t.Run("inbox_dead_by_error", func(t *testing.T) {
		require.Equal(t, []string{"unknown SKU 2 {order.created}", "invalid JSON 1 {order.created}"},
			db.Strings(t, "SELECT format('%s %s %s', last_error, messages, message_types) FROM inbox_dead_by_error"))
	})

	t.Run("inbox_failures_by_build", func(t *testing.T) {
		require.Equal(t, []string{"b2 retry 2 1", "b2 dead 2 2", "b2 abandoned 1 1", "b1 dead 1 1"},
			db.Strings(t, "SELECT format('%s %s %s %s', build, outcome, attempts, messages) FROM inbox_failures_by_build"))
	})

	t.Run("inbox_throughput", func(t *testing.T) {
		var processed, retried int
		require.NoError(t, db.Pool.QueryRow(t.Context(),
			"SELECT sum(processed), sum(retried) FROM inbox_throughput").Scan(&processed, &retried))
		require.Equal(t, 4, processed, "the last 15 minutes' processed attempts")
		require.Equal(t, 2, retried)
	})

	t.Run("inbox_held_back", func(t *testing.T) {
		require.Equal(t, []string{"o-9 dead-sku dead 1"},
			db.Strings(t, "SELECT format('%s %s %s %s', order_key, blocking_message_id, blocking_status, held_messages) FROM inbox_held_back"))
	})

	t.Run("outbox_backlog", func(t *testing.T) {
		o := queryOne(t, db, "SELECT unpublished, failing, extract(epoch FROM oldest_age) BETWEEN 30 AND 90 AS oldest_30_seconds FROM outbox_backlog")
		require.Equal(t, map[string]any{"unpublished": int64(2), "failing": int64(1), "oldest_30_seconds": true}, o)
	})

	t.Run("stock_overview", func(t *testing.T) {
		require.Equal(t, []string{"SKU-1 7 5 2", "SKU-2 0 0 0"},
			db.Strings(t, "SELECT format('%s %s %s %s', sku, available, reserved, orders) FROM stock_overview ORDER BY sku"))
	})

	t.Run("replay of everything a build failed is one statement", func(t *testing.T) {
		tag, err := db.Pool.Exec(t.Context(), `
			UPDATE inbox SET replay_requested = true, replay_reason = 'b2 fixed in b3'
			WHERE status = 'dead' AND id IN (
			    SELECT inbox_id FROM inbox_attempts WHERE build = 'b2' AND outcome <> 'processed')`)
		require.NoError(t, err)
		require.EqualValues(t, 2, tag.RowsAffected())
		require.Equal(t, []string{"dead-sku pending 1 b2 fixed in b3", "dead-sku2 pending 1 b2 fixed in b3"},
			db.Strings(t, `SELECT format('%s %s %s %s', message_id, status, replay_count, replay_reason)
			                     FROM inbox WHERE replay_reason LIKE 'b2%' ORDER BY message_id`))
	})
}
