package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
)

// A copy of a message asking for a reply, stored while the message is
// being handled, is seen neither by the handler's transaction (it commits
// first) nor by the statement that stores it (the message is still pending
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
