package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A copy of a message asking for a reply, stored while the message is
// being handled, is seen neither by the handler's transaction (it commits
// first) nor by the transaction that stores it (the message is still pending
// to it): the worker's next step answers it, with the stored result.
func TestARequestStoredWhileItsMessageIsHandledIsAnswered(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 1)
	ctx := context.WithoutCancel(t.Context())

	// Ingest stores a copy that asks for a reply while the message is
	// still pending, and commits last.
	storing, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = storing.Rollback(ctx) }()
	_, err = dbsqlc.New().InboxInsertMany(ctx, storing, dbsqlc.InboxInsertManyParams{
		MessageIds: []string{"m-0"}, MessageTypes: []string{"test"}, RoutingKeys: []string{"test"},
		Payloads: [][]byte{[]byte("{}")}, OrderKeys: []string{""}, Traceparents: []string{""}, Tracestates: []string{""},
		ReplyTos: []string{"requester"}, CorrelationIds: []string{"c-1"}, Redelivered: []bool{false},
	})
	require.NoError(t, err)
	// Meanwhile the handler's transaction ends the message, and answers
	// the requests it sees: none yet.
	handling, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = handling.Rollback(ctx) }()
	_, err = handling.Exec(ctx, `UPDATE inbox SET status = 'processed', result = 'done', reply = '{"outcome":"done"}' WHERE message_id = 'm-0'`)
	require.NoError(t, err)
	var seen []int64 // the requests the batch's lock found
	require.NoError(t, handling.QueryRow(ctx, `SELECT array(SELECT id FROM inbox_reply_requests WHERE message_id = 'm-0')`).Scan(&seen))
	queued, err := dbsqlc.New().InboxReplyAnswer(ctx, handling, seen)
	require.NoError(t, err)
	require.Zero(t, queued)
	require.NoError(t, handling.Commit(ctx))
	require.NoError(t, storing.Commit(ctx))
	require.Zero(t, b.db.Int(t, "SELECT count(*) FROM outbox"), "neither answered it")
	require.Equal(t, []string{"waiting for the message"}, b.db.Strings(t, "SELECT state FROM inbox_replies"))

	w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{`requester c-1 {"run": 0, "status": "processed", "orderId": null, "outcome": "done", "messageId": "m-0"}`},
		b.db.Strings(t, "SELECT format('%s %s %s', reply_to, correlation_id, payload) FROM outbox"))
	require.Equal(t, []string{"sending"}, b.db.Strings(t, "SELECT state FROM inbox_replies"))

	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, b.db.Int(t, "SELECT count(*) FROM outbox"), "answered once")
}

// A redelivered copy of a request already stored (the broker's, after a
// lost ack; or ingest's own retry of a store whose outcome was unknown) is
// not stored again: its requester gets one reply. A copy the producer sent
// again is a request of its own.
func TestARedeliveredRequestIsStoredOnce(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	ctx := t.Context()
	store := func(redelivered bool) {
		t.Helper()
		_, err := dbsqlc.New().InboxInsertMany(ctx, b.db.Pool, dbsqlc.InboxInsertManyParams{
			MessageIds: []string{"m-0"}, MessageTypes: []string{"test"}, RoutingKeys: []string{"test"},
			Payloads: [][]byte{[]byte("{}")}, OrderKeys: []string{""}, Traceparents: []string{""}, Tracestates: []string{""},
			ReplyTos: []string{"requester"}, CorrelationIds: []string{"c-1"}, Redelivered: []bool{redelivered},
		})
		require.NoError(t, err)
	}
	store(false)
	store(true)
	require.Equal(t, 1, b.db.Int(t, "SELECT count(*) FROM inbox_reply_requests"))
	store(false)
	require.Equal(t, 2, b.db.Int(t, "SELECT count(*) FROM inbox_reply_requests"))
}

// However many requests wait for their message, the workers' pass for the
// requests left unanswered looks at a bounded slice each time and goes on
// from where it stopped: one left behind 10,001 waiting requests is
// answered at the second pass.
func TestTheSweepGoesOnPastWaitingRequests(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 2)
	exec := func(sql string) {
		t.Helper()
		_, err := b.db.Pool.Exec(context.WithoutCancel(t.Context()), sql)
		require.NoError(t, err)
	}
	// m-0 waits (a retry an hour away) with 10,001 requests.
	exec(`UPDATE inbox SET next_attempt_at = now() + interval '1 hour' WHERE message_id = 'm-0'`)
	exec(`INSERT INTO inbox_reply_requests (message_id, reply_to) SELECT 'm-0', 'requester' FROM generate_series(1, 10001)`)
	// m-1's request was stored while it was being handled: unanswered.
	exec(`INSERT INTO inbox_reply_requests (message_id, reply_to, correlation_id) VALUES ('m-1', 'requester', 'c-1')`)
	exec(`UPDATE inbox SET status = 'processed', result = 'done' WHERE message_id = 'm-1'`)

	w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
	_, err := w.RunOnce(t.Context())
	require.NoError(t, err)
	require.Zero(t, b.db.Int(t, "SELECT count(*) FROM outbox"), "the first pass saw only waiting requests")
	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"c-1"}, b.db.Strings(t, "SELECT correlation_id FROM outbox"), "the second went on past them")
}

// A reply request another session holds (the schema's owner's open
// transaction) stalls nothing: the batch that ends its message commits at
// once without it, and the request is answered once it is free.
func TestAHeldRequestStallsNothing(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 2)
	ctx := context.WithoutCancel(t.Context())
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO inbox_reply_requests (message_id, reply_to, correlation_id)
		VALUES ('m-0', 'requester', 'c-held'), ('m-1', 'requester', 'c-free')`)
	require.NoError(t, err)
	holder, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM inbox_reply_requests WHERE correlation_id = 'c-held' FOR UPDATE`)
	require.NoError(t, err)

	w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
	runCtx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	n, err := w.RunOnce(runCtx)
	require.NoError(t, err, "the batch did not wait for the held request")
	require.Equal(t, 2, n)
	require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status)
	require.Equal(t, []string{"c-free"}, b.db.Strings(t, "SELECT correlation_id FROM outbox"))

	require.NoError(t, holder.Rollback(ctx))
	_, err = w.RunOnce(runCtx)
	require.NoError(t, err)
	require.Equal(t, []string{"c-free", "c-held"}, b.db.Strings(t, "SELECT correlation_id FROM outbox ORDER BY 1"))
}

// The statements that answer requests read them, and their messages, by
// index, on tables that have grown by 100,000 messages and answered
// requests and that nobody analyzes (as a young table, or a server
// without autovacuum), and once analyzed, whether planned for their
// parameters or with the plan a pool keeps for any (pipeline.KeepPlans;
// here forced from the first call): ingest's transaction answering the
// copies it stores (an ended message's, a forgotten one's, a pending
// one's), the handler's answer of them, and the workers' sweep. Counted,
// not timed: rows of sequential scans and index entries read of the
// tables they touch, from the schema's own statistics.
func TestTheReplyStatementsReadByIndex(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.WithoutCancel(t.Context())
	const history = 100_000
	db.Exec(t, `
		INSERT INTO inbox (message_id, message_type, payload, status, attempts, result, processed_at)
		SELECT 'history-' || g, 'order.created', '\x7b7d', 'processed', 1, 'done', now() FROM generate_series(1, $1) AS g`, history)
	db.Exec(t, `
		INSERT INTO inbox_reply_requests (message_id, reply_to, answered_run, answered_at)
		SELECT 'history-' || g, 'requester', 0, now() FROM generate_series(1, $1) AS g`, history)

	q := dbsqlc.New()
	round := 0
	answerAll := func(what, planCacheMode string) {
		round++
		conn := db.SessionWith(t, func(cc *pgx.ConnConfig) {
			cc.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement // prepared, as KeepPlans does
			cc.RuntimeParams["plan_cache_mode"] = planCacheMode
		})
		reads := func() (seq, idx int) {
			const tables = `relname IN ('inbox', 'inbox_reply_requests', 'outbox') OR relname LIKE 'inbox\_keys\__%'`
			return testenv.SessionStat(t, conn, `SELECT coalesce(sum(seq_tup_read), 0)::int FROM pg_stat_user_tables
					WHERE schemaname = current_schema() AND (`+tables+`)`),
				testenv.SessionStat(t, conn, `SELECT coalesce(sum(idx_tup_read), 0)::int FROM pg_stat_user_indexes
					WHERE schemaname = current_schema() AND (`+tables+`)`)
		}
		// This round's messages: one ended, one whose row has left (the
		// ledger remembers it), one pending.
		ended, forgotten, pending := fmt.Sprintf("ended-%d", round), fmt.Sprintf("forgotten-%d", round), fmt.Sprintf("pending-%d", round)
		p := dbsqlc.InboxInsertManyParams{}
		for _, id := range []string{ended, forgotten, pending} {
			p.MessageIds, p.MessageTypes, p.RoutingKeys = append(p.MessageIds, id), append(p.MessageTypes, "test"), append(p.RoutingKeys, "test")
			p.Payloads, p.OrderKeys = append(p.Payloads, []byte(`{}`)), append(p.OrderKeys, "")
		}
		_, err := q.InboxInsertMany(ctx, db.Pool, p)
		require.NoError(t, err)
		db.Exec(t, `UPDATE inbox SET status = 'processed', result = 'done' WHERE message_id = $1`, ended)
		db.Exec(t, `DELETE FROM inbox WHERE message_id = $1`, forgotten)
		p.ReplyTos, p.CorrelationIds, p.Redelivered = []string{"requester", "requester", "requester"}, []string{"c", "c", "c"}, []bool{false, false, false}

		seq0, idx0 := reads()
		for range 7 { // past the five calls planned for their parameters
			tx, err := conn.Begin(ctx)
			require.NoError(t, err)
			out, err := q.InboxInsertMany(ctx, tx, p)
			require.NoError(t, err)
			var requests []int64
			for _, o := range out {
				if o.RequestID != 0 {
					requests = append(requests, o.RequestID)
				}
			}
			require.Len(t, requests, 3)
			queued, err := q.InboxReplyAnswer(ctx, tx, requests)
			require.NoError(t, err)
			require.EqualValues(t, 2, queued, "%s: the ended message's copy and the forgotten one's are answered", what)
			_, err = q.InboxReplyAnswer(ctx, tx, requests) // the handler's, once more
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			left, err := q.InboxReplyLeft(ctx, conn, dbsqlc.InboxReplyLeftParams{AfterID: 0, MaxScan: 10_000})
			require.NoError(t, err)
			_, err = q.InboxReplyAnswer(ctx, conn, left.DueIds)
			require.NoError(t, err)
		}
		seq, idx := reads()
		t.Logf("%s: %d rows read by sequential scans, %d index entries, for 7 batches", what, seq-seq0, idx-idx0)
		require.Less(t, seq-seq0, history/100, "%s: rows read by sequential scans", what)
		require.Less(t, idx-idx0, history/100, "%s: index entries read", what)
	}
	answerAll("without statistics, planned for the parameters", "force_custom_plan")
	answerAll("without statistics, a plan kept for any", "force_generic_plan")
	db.Exec(t, "ANALYZE inbox, inbox_reply_requests, outbox, inbox_keys")
	answerAll("analyzed, planned for the parameters", "force_custom_plan")
	answerAll("analyzed, a plan kept for any", "force_generic_plan")
}
