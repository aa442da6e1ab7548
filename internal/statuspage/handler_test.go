package statuspage_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/statuspage"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// testBundle is a status page on a seeded schema, served over HTTP.
type testBundle struct {
	db     *testenv.DB
	page   *statuspage.Handler
	server *httptest.Server
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	return setupIn(t, testenv.NewDB(t))
}

// setupIn is setup in db, for a test or a benchmark.
func setupIn(t testing.TB, db *testenv.DB) *testBundle {
	t.Helper()
	seedKnownStates(t, db)
	pc, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	pc.MaxConns = statuspage.PoolSizeDefault
	pool, err := pgxpool.NewWithConfig(t.Context(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	page := newPage(t, pool)
	server := httptest.NewServer(page)
	t.Cleanup(server.Close)
	return &testBundle{db: db, page: page, server: server}
}

// overview is the page's overview once it has read the database. Under
// -race on a busy machine a read may outlast the page's deadline, which
// the page shows as the database unreachable (tested apart); these tests
// compare what it read.
func (b *testBundle) overview(t *testing.T) *statuspage.Overview {
	t.Helper()
	var o *statuspage.Overview
	require.Eventually(t, func() bool {
		o = b.page.Overview()
		return o.Database.Reachable && o.Outbox != nil && o.Inbox != nil
	}, 30*time.Second, 100*time.Millisecond, "the status page reads the database")
	return o
}

// testDurability is what the test page is told an ack's commit waits for.
const testDurability = "commits wait for a standby (test)"

func newPage(t testing.TB, pool *pgxpool.Pool) *statuspage.Handler {
	t.Helper()
	page, err := statuspage.New(pool, &statuspage.Config{
		Logger:  testenv.Logger(t),
		Build:   "test-build",
		Started: time.Now().Add(-90 * time.Minute),
		State: func() statuspage.ServiceState {
			return statuspage.ServiceState{IngestConsuming: true, RelayConnected: true, Workers: 2, Durability: testDurability}
		},
	})
	require.NoError(t, err)
	return page
}

// seedKnownStates fills a fresh schema with messages in every state the
// page shows, as the service would have left them, all within the chart's
// 15 minutes: processed, pending, retrying, dead of two errors in two
// builds, an order held back behind a dead message, a conflicting id and a
// replay. One payload holds an e-mail address, which must never show.
func seedKnownStates(t testing.TB, db *testenv.DB) {
	t.Helper()
	now := time.Now()
	at := func(d time.Duration) *time.Time { v := now.Add(d); return &v }
	for _, row := range []testfactory.InboxRowOpts{
		{MessageID: "new", OrderKey: "o-1", ReceivedAt: at(-2 * time.Minute)},
		{MessageID: "handling", Attempts: 1, OrderKey: "o-2", ReceivedAt: at(-time.Minute), ClaimedAt: at(0), ClaimedBy: "host/7", ClaimedBuild: "b2"},
		{MessageID: "retrying", Attempts: 2, LastError: "deadlock", OrderKey: "o-3", ReceivedAt: at(-3 * time.Minute), NextAttemptAt: at(time.Minute)},
		{MessageID: "done-1", Payload: `{"orderId":"o-4","email":"alice@example.com"}`, Status: "processed", Attempts: 1, OrderKey: "o-4", ReceivedAt: at(-30 * time.Second), ProcessedAt: at(-10 * time.Second)},
		{MessageID: "done-2", Status: "processed", Attempts: 1, OrderKey: "o-5", ReceivedAt: at(-40 * time.Second), ProcessedAt: at(-20 * time.Second)},
		{MessageID: "done-3", MessageType: "order.cancelled", Status: "processed", Attempts: 1, OrderKey: "o-5", ReceivedAt: at(-4 * time.Minute), ProcessedAt: at(-3 * time.Minute)},
		{MessageID: "done-4", Status: "processed", Attempts: 1, OrderKey: "o-6", ReceivedAt: at(-9 * time.Minute), ProcessedAt: at(-8 * time.Minute)},
		{MessageID: "to-replay", Status: "processed", Attempts: 1, OrderKey: "o-7", ReceivedAt: at(-20 * time.Minute), ProcessedAt: at(-15 * time.Minute)},
		{MessageID: "dead-json", Payload: `x`, Status: "dead", Attempts: 1, LastError: "invalid JSON", ReceivedAt: at(-7 * time.Minute), ProcessedAt: at(-6 * time.Minute)},
		{MessageID: "dead-sku", Status: "dead", Attempts: 10, LastError: "unknown sku: SKU-9", OrderKey: "o-9", ReceivedAt: at(-11 * time.Minute), ProcessedAt: at(-5 * time.Minute)},
		{MessageID: "dead-sku2", Status: "dead", Attempts: 10, LastError: "unknown sku: SKU-9", OrderKey: "o-10", ReceivedAt: at(-10 * time.Minute), ProcessedAt: at(-4 * time.Minute)},
		{MessageID: "held", MessageType: "order.cancelled", OrderKey: "o-9", ReceivedAt: at(-6 * time.Minute)},
	} {
		testfactory.InboxRow(t.Context(), t, db.Pool, &row)
	}
	_, err := db.Pool.Exec(t.Context(), `
		INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, error, process, build, finished_at)
		SELECT id, 0, a.attempt, message_id, a.outcome, a.error, 'host/1', a.build, now() - a.ago
		FROM inbox
		JOIN (VALUES
		  ('retrying',  1, 'retry',     'deadlock',           'b2', interval '2 minutes'),
		  ('retrying',  2, 'retry',     'deadlock',           'b2', interval '1 minute'),
		  ('done-1',    1, 'processed', NULL,                 'b1', interval '10 seconds'),
		  ('done-2',    1, 'processed', NULL,                 'b1', interval '20 seconds'),
		  ('done-3',    1, 'processed', NULL,                 'b1', interval '3 minutes'),
		  ('done-4',    1, 'processed', NULL,                 'b1', interval '8 minutes'),
		  ('dead-json', 1, 'dead',      'invalid JSON',       'b1', interval '6 minutes'),
		  ('dead-sku',  9, 'abandoned', 'crashed',            'b2', interval '6 minutes'),
		  ('dead-sku',  10, 'dead',     'unknown sku: SKU-9', 'b2', interval '5 minutes'),
		  ('dead-sku2', 10, 'dead',     'unknown sku: SKU-9', 'b2', interval '4 minutes')
		) AS a (mid, attempt, outcome, error, build, ago) ON a.mid = inbox.message_id;

		UPDATE inbox SET replay_requested = true, replay_reason = 'stock data fixed' WHERE message_id = 'to-replay';

		INSERT INTO inbox_conflicts (message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload)
		VALUES ('done-1', 'order.created', 'aa', 'bb', '{"email":"mallory@example.com"}');

		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, created_at, published_at, last_error)
		VALUES ('done-1:order.confirmed', 'done-1', 'order.confirmed', '{}', now() - interval '10 seconds', now(), NULL),
		       ('done-2:order.confirmed', 'done-2', 'order.confirmed', '{}', now() - interval '20 seconds', NULL, NULL),
		       ('done-2:email.requested', 'done-2', 'email.requested', '{"to":"bob@example.com"}', now() - interval '30 seconds', NULL, 'broker refused');`)
	require.NoError(t, err)
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// The JSON says what the views say, its replay statements replay exactly
// the messages of their group, and nothing shows a payload.
func TestStatusPageJSON(t *testing.T) {
	t.Parallel()
	b := setup(t)

	status, body := get(t, b.server.URL+"/api/overview")
	require.Equal(t, http.StatusOK, status, body)
	require.NotContains(t, body, "@example.com", "no payload, no e-mail address")
	var o statuspage.Overview
	require.NoError(t, json.Unmarshal([]byte(body), &o))
	require.True(t, o.Database.Reachable)
	require.Equal(t, "test-build", o.Service.Build)
	require.True(t, o.Service.RabbitMQConnected())
	require.Equal(t, testDurability, o.Service.Durability)

	var want statuspage.InboxNow
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), `
		SELECT pending, in_progress, waiting_retry, replays_waiting, dead, processed, processed_last_minute,
		       failed_attempts_last_5_minutes, conflicting_ids
		FROM inbox_overview`).Scan(&want.Pending, &want.InProgress, &want.WaitingRetry, &want.ReplaysWaiting,
		&want.Dead, &want.Processed, &want.ProcessedLastMinute, &want.FailedAttemptsLast5Minutes, &want.ConflictingIDs))
	got := *o.Inbox
	got.OldestPendingSeconds, got.PerSecondLast5Minutes, got.LastProcessedAt = 0, 0, nil
	require.Equal(t, want, got)
	require.Len(t, o.Throughput, 15)
	require.Equal(t, []string{"dead-sku2", "dead-sku", "dead-json"}, func() (ids []string) {
		for _, d := range o.Dead {
			ids = append(ids, d.MessageID)
		}
		return ids
	}())

	// Each group's statement replays exactly its messages.
	require.Len(t, o.DeadByError, 2)
	for _, g := range o.DeadByError {
		require.Equal(t, g.Messages, replayed(t, b.db, g.ReplaySQL), g.ReplaySQL)
	}
	builds := map[string]bool{}
	for _, f := range o.FailuresByBuild {
		builds[f.Build] = true
		wantDead := b.db.Int(t, `SELECT count(DISTINCT inbox_id) FROM inbox_attempts a JOIN inbox i ON i.id = a.inbox_id
			WHERE a.build = $1 AND a.outcome <> 'processed' AND i.status = 'dead'`, f.Build)
		require.EqualValues(t, wantDead, replayed(t, b.db, f.ReplaySQL), f.ReplaySQL)
	}
	require.Equal(t, map[string]bool{"b1": true, "b2": true}, builds)

	t.Run("Message", func(t *testing.T) {
		status, body := get(t, b.server.URL+"/api/messages/done-1")
		require.Equal(t, http.StatusOK, status, body)
		require.NotContains(t, body, "@example.com")
		var m statuspage.Message
		require.NoError(t, json.Unmarshal([]byte(body), &m))
		require.True(t, m.Found)
		require.Equal(t, "processed", m.Inbox.Status)
		require.Len(t, m.Attempts, 1)

		status, _ = get(t, b.server.URL+"/api/messages/no-such-id")
		require.Equal(t, http.StatusNotFound, status)
		status, body = get(t, b.server.URL+"/messages/no-such-id")
		require.Equal(t, http.StatusNotFound, status)
		require.Contains(t, body, "No message with this id")
	})
}

// An id the inbox cannot hold (a NUL, invalid UTF-8, over 255 bytes) is
// answered 400 with the reason, without a database call: PostgreSQL would
// refuse the NUL, and the page would say the database is unreachable.
func TestStatusPageRefusesIDsTheInboxCannotHold(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, id := range []string{"%00", "a%00b", "%FF", strings.Repeat("x", 256)} {
		for _, path := range []string{"/api/messages/", "/messages/"} {
			status, body := get(t, b.server.URL+path+id)
			require.Equal(t, http.StatusBadRequest, status, "%s%s: %s", path, id, body)
			require.Contains(t, body, "message id")
		}
	}
	require.Zero(t, b.page.QueryCounts()["inbox"], "no id was looked up")
	status, _ := get(t, b.server.URL+"/api/messages/"+strings.Repeat("x", 255))
	require.Equal(t, http.StatusNotFound, status, "the longest legal id is looked up")
	require.Equal(t, int64(1), b.page.QueryCounts()["inbox"])
}

// A dead outbox row is counted on the page and in its JSON, and needs a
// person.
func TestStatusPageCountsDeadOutboxRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.overview(t)
	_, err := b.db.Pool.Exec(t.Context(), `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key, dead_at, last_error)
		VALUES ('x:order.confirmed', 'x', 'order.confirmed', '{}', 'o-x', now(), 'refused: test')`)
	require.NoError(t, err)
	time.Sleep(statuspage.CacheTTLDefault + 100*time.Millisecond) // the cache's answer ages out
	o := b.overview(t)
	require.Equal(t, before.Outbox.Dead+1, o.Outbox.Dead)
	require.True(t, o.NeedsAttention())
	status, body := get(t, b.server.URL+"/")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, `data-metric="outbox_dead"`)
}

// Replies waiting and undeliverable are counted on the page and in its
// JSON apart from the events, and need no person: a requester may leave.
func TestStatusPageCountsReplies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.overview(t)
	_, err := b.db.Pool.Exec(t.Context(), `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, reply_to, dead_at, last_error)
		VALUES ('reply:1:0', 'x', 'reply', '{}', 'gone', now(), 'undeliverable: test'),
		       ('reply:2:0', 'x', 'reply', '{}', 'here', NULL, NULL),
		       ('reply:3:0', 'x', 'reply', '{}', 'here', NULL, NULL)`)
	require.NoError(t, err)
	time.Sleep(statuspage.CacheTTLDefault + 100*time.Millisecond) // the cache's answer ages out
	o := b.overview(t)
	require.Equal(t, before.Outbox.RepliesUndeliverable+1, o.Outbox.RepliesUndeliverable)
	require.Equal(t, before.Outbox.RepliesUnpublished+2, o.Outbox.RepliesUnpublished)
	require.Equal(t, before.Outbox.Dead, o.Outbox.Dead, "a reply is not a dead event")
	require.Equal(t, before.Outbox.Unpublished, o.Outbox.Unpublished, "nor an event backlog")
	require.Equal(t, before.NeedsAttention(), o.NeedsAttention(), "replies need no person")
	replies := *o.Outbox // the replies' counts, and no dead event
	replies.Dead = 0
	quiet := &statuspage.Overview{Database: statuspage.Database{Reachable: true}, Outbox: &replies, Inbox: &statuspage.InboxNow{}}
	require.False(t, quiet.NeedsAttention(), "undeliverable replies alone ask for no one")
	status, body := get(t, b.server.URL+"/")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, `<span data-metric="replies_undeliverable">1</span>`)
	require.Contains(t, body, `<span class="value" data-metric="replies_unpublished">2</span>`)
}

// A session that has held rows of the service's tables, any of them, for
// over 5 seconds (an operator's SELECT … FOR UPDATE left open, its
// timeouts set to 0) is listed, with the statement that ends it, in inbox_lock_holders and on the
// page; a session that only reads is not.
func TestStatusPageShowsSessionsHoldingRows(t *testing.T) {
	t.Parallel()
	b := setupIn(t, testenv.NewDBAlone(t))
	ctx := context.WithoutCancel(t.Context())
	holder := b.db.Session(t)
	_, err := holder.Exec(ctx, "SET application_name = 'psql-alice'")
	require.NoError(t, err)
	_, err = holder.Exec(ctx, "SET idle_in_transaction_session_timeout = 0")
	require.NoError(t, err)
	tx, err := holder.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT * FROM inbox WHERE status = 'dead' LIMIT 1 FOR UPDATE")
	require.NoError(t, err)
	// Any table of the service's counts: a lock on stock_moves holds back
	// the stock fold and the orders of its SKUs.
	_, err = tx.Exec(ctx, "SELECT * FROM stock_moves LIMIT 1 FOR UPDATE")
	require.NoError(t, err)
	reader := b.db.Session(t)
	rtx, err := reader.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = rtx.Rollback(ctx) }()
	_, err = rtx.Exec(ctx, "SELECT count(*) FROM inbox")
	require.NoError(t, err)

	var pid int32
	require.NoError(t, holder.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	time.Sleep(5500 * time.Millisecond) // past the view's 5 seconds
	o := b.overview(t)
	require.Len(t, o.LockHolders, 1, "the holder, not the reader")
	h := o.LockHolders[0]
	require.Equal(t, pid, h.Pid)
	require.Equal(t, "psql-alice", h.ApplicationName)
	require.Equal(t, []string{"inbox", "stock_moves"}, h.Tables)
	require.Equal(t, fmt.Sprintf("SELECT pg_terminate_backend(%d);", pid), h.EndSQL)
	require.GreaterOrEqual(t, h.OpenSeconds, 5.0)
	status, body := get(t, b.server.URL+"/")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, body, "psql-alice")
	require.Contains(t, body, h.EndSQL)
}

// replayed runs a replay statement in a transaction it rolls back and
// returns how many rows it changed.
func replayed(t *testing.T, db *testenv.DB, stmt string) int64 {
	t.Helper()
	tx, err := db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(t.Context())) }()
	tag, err := tx.Exec(t.Context(), stmt)
	require.NoError(t, err)
	return tag.RowsAffected()
}

// A hundred requests at once cost one query per view.
func TestStatusPageCoalescesReads(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var wg sync.WaitGroup
	for range 100 {
		wg.Go(func() {
			resp, err := http.Get(b.server.URL + "/")
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		})
	}
	wg.Wait()
	counts := b.page.QueryCounts()
	require.NotEmpty(t, counts)
	for view, n := range counts {
		require.EqualValues(t, 1, n, "queries of %s", view)
	}
}

// With PostgreSQL unreachable the page answers within its timeout and says
// so: a port nothing listens on (refused at once), and one that accepts
// and never answers (bounded by Config.Timeout).
func TestStatusPageDatabaseUnreachable(t *testing.T) {
	t.Parallel()
	for name, addr := range map[string]string{"Refused": closedAddr(t), "Silent": silentAddr(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pc, err := pgxpool.ParseConfig("postgres://postgres@" + addr + "/test?sslmode=disable&connect_timeout=30")
			require.NoError(t, err)
			pc.MaxConns = statuspage.PoolSizeDefault
			pool, err := pgxpool.NewWithConfig(t.Context(), pc)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			server := httptest.NewServer(newPage(t, pool))
			t.Cleanup(server.Close)

			for _, path := range []string{"/", "/messages/dead-sku"} {
				started := time.Now()
				status, body := get(t, server.URL+path)
				require.Less(t, time.Since(started), 3*time.Second, "%s answers within the status page's timeout", path)
				require.Equal(t, http.StatusServiceUnavailable, status, path)
				require.Contains(t, body, "The database is unreachable", path)
				require.Contains(t, body, "test-build", "the service's own state still shows")
			}
			status, body := get(t, server.URL+"/api/overview")
			require.Equal(t, http.StatusServiceUnavailable, status)
			var o statuspage.Overview
			require.NoError(t, json.Unmarshal([]byte(body), &o))
			require.False(t, o.Database.Reachable)
			require.True(t, strings.HasPrefix(o.Database.Error, "database unreachable"), o.Database.Error)
		})
	}
}

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// silentAddr returns a loopback address that accepts connections and never
// answers.
func silentAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// With partitioned ingest the page says how many of the partitions this
// process is the active consumer of; with one partition it says nothing
// of partitions.
func TestStatusPageShowsThePartitionsHeld(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	for _, tc := range []struct {
		state statuspage.ServiceState
		want  string
	}{
		{statuspage.ServiceState{IngestConsuming: true, Partitions: 6, PartitionsActive: 3}, `active on <b data-metric="partitions_active">3 of 6</b> partitions`},
		{statuspage.ServiceState{IngestConsuming: true, Partitions: 1}, ""},
	} {
		page, err := statuspage.New(db.Pool, &statuspage.Config{
			Logger: testenv.Logger(t), Build: "test-build", Started: time.Now(),
			State: func() statuspage.ServiceState { return tc.state },
		})
		require.NoError(t, err)
		server := httptest.NewServer(page)
		status, body := get(t, server.URL+"/")
		server.Close()
		require.Equal(t, http.StatusOK, status)
		if tc.want == "" {
			require.NotContains(t, body, "partitions_active")
		} else {
			require.Contains(t, body, tc.want)
		}
	}
}
