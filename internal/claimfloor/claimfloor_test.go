package claimfloor_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// keeper raises one floor by hand, a round at a time, as Keeper.Run does.
type keeper struct {
	raise claimfloor.Raise
	note  claimfloor.Note
}

// settle raises the floor for 20 rounds, 25 ms apart, and returns where it
// ended: time enough for the transactions each round notes (other tests',
// too: the note holds the whole server's) to end.
func (k *keeper) settle(t *testing.T) int64 {
	t.Helper()
	var floor int64
	for range 20 {
		var err error
		floor, k.note, err = k.raise(t.Context(), k.note)
		require.NoError(t, err)
		time.Sleep(25 * time.Millisecond)
	}
	return floor
}

// replayOpen replays row id (replay, with $1 for it) in a transaction of
// its own, raises the floor while that transaction is open, and commits
// it: the keeper raises nothing past a replay it cannot see yet.
func (k *keeper) replayOpen(t *testing.T, db *testenv.DB, replay string, id int64) {
	t.Helper()
	tx, err := db.Session(t).Begin(t.Context())
	require.NoError(t, err)
	_, err = tx.Exec(t.Context(), replay, id)
	require.NoError(t, err)
	require.LessOrEqual(t, k.settle(t), id, "the keeper raises nothing past a replay it cannot see yet")
	require.NoError(t, tx.Commit(t.Context()))
}

var q = dbsqlc.New()

func claimInbox(t *testing.T, db dbsqlc.DBTX) []int64 {
	t.Helper()
	rows, err := q.InboxClaimBatch(t.Context(), db, dbsqlc.InboxClaimBatchParams{Process: "test", Build: "test", MaxRows: 100})
	require.NoError(t, err)
	var ids []int64
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	slices.Sort(ids)
	return ids
}

// claimAndLockInbox claims as claimInbox does, then locks the claimed
// rows as the worker's transaction does (InboxLockClaimed).
func claimAndLockInbox(t *testing.T, db dbsqlc.DBTX) []int64 {
	t.Helper()
	rows, err := q.InboxClaimBatch(t.Context(), db, dbsqlc.InboxClaimBatchParams{Process: "test", Build: "test", MaxRows: 100})
	require.NoError(t, err)
	var p dbsqlc.InboxLockClaimedParams
	for _, r := range rows {
		p.Ids = append(p.Ids, r.ID)
		p.ClaimedAts = append(p.ClaimedAts, r.ClaimedAt)
	}
	locked, err := q.InboxLockClaimed(t.Context(), db, p)
	require.NoError(t, err)
	var ids []int64
	for _, r := range locked {
		ids = append(ids, r.ID)
	}
	return ids
}

func claimOutbox(t *testing.T, db dbsqlc.DBTX) []int64 {
	t.Helper()
	rows, err := q.OutboxClaimBatch(t.Context(), db, dbsqlc.OutboxClaimBatchParams{LeaseMs: 60_000, MaxRows: 100})
	require.NoError(t, err)
	var ids []int64
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	slices.Sort(ids)
	return ids
}

func processed(t *testing.T, db dbsqlc.DBTX, n int, prefix string) []int64 {
	t.Helper()
	now := time.Now()
	var ids []int64
	for i := range n {
		ids = append(ids, testfactory.InboxRow(t.Context(), t, db, &testfactory.InboxRowOpts{
			MessageID: fmt.Sprintf("%s-%d", prefix, i), Status: "processed", ProcessedAt: &now,
		}))
	}
	return ids
}

// A row whose transaction took its id before later rows committed, and
// commits after them (ingest's transactions commit in any order), is never
// left under the floor.
func TestTheFloorWaitsForATransactionThatHoldsAnEarlierId(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	k := &keeper{raise: claimfloor.Inbox(db.Pool)}

	before := processed(t, db.Pool, 5, "before")
	require.Greater(t, k.settle(t), before[len(before)-1], "the floor rises past ended rows")

	tx, err := db.Session(t).Begin(ctx)
	require.NoError(t, err)
	late := testfactory.InboxRow(ctx, t, tx, &testfactory.InboxRowOpts{MessageID: "late"})
	require.LessOrEqual(t, k.settle(t), late, "an uncommitted row holds the floor, the newest transaction of all")
	after := processed(t, db.Pool, 5, "after")
	require.Greater(t, after[0], late)
	require.LessOrEqual(t, k.settle(t), late, "an uncommitted row holds the floor while later rows end")
	require.NoError(t, tx.Commit(ctx))

	require.LessOrEqual(t, k.settle(t), late)
	require.Equal(t, []int64{late}, claimInbox(t, db.Pool))
}

// A transaction left open on another table, with a transaction id (a
// batch job, an operator's UPDATE), does not hold the floor: it cannot
// hold an id of the inbox.
func TestALongTransactionOnAnotherTableDoesNotHoldTheFloor(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	k := &keeper{raise: claimfloor.Inbox(db.Pool)}

	tx, err := db.Session(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "INSERT INTO stock (sku, available) VALUES ('SKU-1', 1)")
	require.NoError(t, err)
	ids := processed(t, db.Pool, 5, "m")
	require.Greater(t, k.settle(t), ids[4])
}

// A replay opens a row far under the floor, and the keeper may be raising
// it at that very moment: the row is claimed all the same. The same holds
// for a dead outbox row replayed.
func TestAReplayUnderTheFloorIsClaimed(t *testing.T) {
	t.Parallel()

	t.Run("Inbox", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		k := &keeper{raise: claimfloor.Inbox(db.Pool)}
		ids := processed(t, db.Pool, 10, "m")
		require.Greater(t, k.settle(t), ids[9])

		k.replayOpen(t, db, "UPDATE inbox SET replay_requested = true, replay_reason = 'test' WHERE id = $1", ids[3])

		require.Equal(t, []int64{ids[3]}, claimInbox(t, db.Pool))
	})

	// The keeper holds the floor lock, about to raise the floor past the
	// row on a scan that saw it processed, when the replay comes: the
	// replay waits for the lock, then lowers the floor from where the
	// keeper left it.
	t.Run("WhileTheKeeperRaises", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		ctx := t.Context()
		k := &keeper{raise: claimfloor.Inbox(db.Pool)}
		ids := processed(t, db.Pool, 10, "m")
		require.Greater(t, k.settle(t), ids[9])

		raising, err := db.Session(t).Begin(ctx)
		require.NoError(t, err)
		_, err = raising.Exec(ctx, "SELECT claim_floor_lock('inbox', false)")
		require.NoError(t, err)
		replayed := make(chan error, 1)
		go func() {
			_, err := db.Pool.Exec(ctx, "UPDATE inbox SET replay_requested = true, replay_reason = 'test' WHERE id = $1", ids[3])
			replayed <- err
		}()
		select {
		case err := <-replayed:
			t.Fatalf("the replay did not wait for the keeper's lock: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		_, err = raising.Exec(ctx, "SELECT setval('inbox_claim_floor_seq', $1::bigint, true)", ids[9]+1)
		require.NoError(t, err)
		require.NoError(t, raising.Commit(ctx))
		require.NoError(t, <-replayed)

		require.Equal(t, []int64{ids[3]}, claimInbox(t, db.Pool))
	})

	t.Run("Outbox", func(t *testing.T) {
		t.Parallel()
		db := testenv.NewDB(t)
		ctx := t.Context()
		k := &keeper{raise: claimfloor.Outbox(db.Pool)}
		ids := outboxRows(t, db.Pool, "e", 10)
		_, err := db.Pool.Exec(ctx, "UPDATE outbox SET published_at = now()")
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, "UPDATE outbox SET published_at = NULL, dead_at = now(), last_error = 'refused' WHERE id = $1", ids[3])
		require.NoError(t, err)
		require.Greater(t, k.settle(t), ids[9])

		k.replayOpen(t, db, "UPDATE outbox SET replay_requested = true, replay_reason = 'test' WHERE id = $1", ids[3])

		require.Equal(t, []int64{ids[3]}, claimOutbox(t, db.Pool))
	})
}

func outboxRows(t *testing.T, db dbsqlc.DBTX, prefix string, n int) []int64 {
	t.Helper()
	var p dbsqlc.OutboxInsertManyParams
	for i := range n {
		id := fmt.Sprintf("%s-%d", prefix, i)
		p.IdempotencyKeys = append(p.IdempotencyKeys, id+":order.confirmed")
		p.RoutingKeys = append(p.RoutingKeys, "order.confirmed")
		p.Payloads = append(p.Payloads, "{}")
		p.MessageIds = append(p.MessageIds, id)
		p.OrderKeys = append(p.OrderKeys, id)
	}
	require.NoError(t, q.OutboxInsertMany(t.Context(), db, p))
	rows, err := db.Query(t.Context(), "SELECT id FROM outbox WHERE message_id LIKE $1 || '-%' ORDER BY id", prefix)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Len(t, ids, n)
	return ids
}

// With a snapshot held open, the index entries of every row ended since
// stay; a claim that starts at the floor reads past a round's worth of
// them, not all of them, with or without statistics (autovacuum's ANALYZE,
// taken while next to nothing is open, changes the plans). Index entries read are counted by PostgreSQL for the
// claim's own transaction, over every index of the table.
func TestAClaimUnderAnOldSnapshotSkipsTheEndedRows(t *testing.T) {
	t.Parallel()
	const ended = 5000
	for _, c := range []struct {
		table string
		raise func(claimfloor.DB) claimfloor.Raise
		end   func(t *testing.T, db *testenv.DB) // rows that end
		open  func(t *testing.T, db *testenv.DB) // then 10 open ones; every row of an order of its own
		claim func(t *testing.T, db dbsqlc.DBTX) []int64
	}{
		{"inbox", claimfloor.Inbox, func(t *testing.T, db *testenv.DB) {
			_, err := db.Pool.Exec(t.Context(), `
				INSERT INTO inbox (message_id, message_type, payload, order_key)
				SELECT 'old-' || g, 'order.created', '{}', 'old-' || g FROM generate_series(1, $1::integer) g`, ended)
			require.NoError(t, err)
			_, err = db.Pool.Exec(t.Context(), "UPDATE inbox SET status = 'processed', processed_at = now()")
			require.NoError(t, err)
		}, func(t *testing.T, db *testenv.DB) {
			for i := range 10 {
				id := fmt.Sprintf("new-%d", i)
				testfactory.InboxRow(t.Context(), t, db.Pool, &testfactory.InboxRowOpts{MessageID: id, OrderKey: id})
			}
		}, claimAndLockInbox},
		{"outbox", claimfloor.Outbox, func(t *testing.T, db *testenv.DB) {
			outboxRows(t, db.Pool, "old", ended)
			_, err := db.Pool.Exec(t.Context(), "UPDATE outbox SET published_at = now()")
			require.NoError(t, err)
		}, func(t *testing.T, db *testenv.DB) {
			outboxRows(t, db.Pool, "new", 10)
		}, claimOutbox},
	} {
		for _, analyzed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/analyzed=%v", c.table, analyzed), func(t *testing.T) {
				t.Parallel()
				db := testenv.NewDBAlone(t)
				ctx := t.Context()
				db.HoldSnapshot(t)

				c.end(t, db)
				if analyzed {
					// As autovacuum does, while next to nothing is open.
					db.Exec(t, "ANALYZE "+c.table)
				}
				c.open(t, db)
				k := &keeper{raise: c.raise(db.Pool)}
				k.settle(t)

				// A session as the service opens it (plain index scans).
				conn := db.SessionWith(t, pipeline.ConfigureSession)
				tx, err := conn.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
				read := func() int {
					var n int
					require.NoError(t, tx.QueryRow(ctx, `SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0)
						FROM pg_index WHERE indrelid = $1::regclass`, c.table).Scan(&n))
					return n
				}
				before := read()
				require.Len(t, c.claim(t, tx), 10)
				require.Less(t, read()-before, ended/10, "index entries the claim read, with %d rows ended under a held snapshot", ended)
			})
		}
	}
}

// A row left open under its floor, where no claim looks (here as a dump
// restored with its floors past its open rows leaves it), is found by the
// keeper's audit, which lowers the floor to it: the claims then take it,
// and the gauges, which count from the floor, count it. The audit finds
// nothing once the floor is where it should be, and a floor above only
// ended rows is left where it is.
func TestTheAuditFindsARowLeftUnderTheFloor(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		table string
		seq   string
		audit func(claimfloor.Beginner, time.Duration) claimfloor.Audit
		raise func(claimfloor.DB) claimfloor.Raise
		rows  func(t *testing.T, db *testenv.DB) // 100 ended rows, then 3 open ones
		claim func(t *testing.T, db dbsqlc.DBTX) []int64
	}{
		{"inbox", "inbox_claim_floor_seq", claimfloor.InboxAudit, claimfloor.Inbox, func(t *testing.T, db *testenv.DB) {
			processed(t, db.Pool, 100, "ended")
			for i := range 3 {
				testfactory.InboxRow(t.Context(), t, db.Pool, &testfactory.InboxRowOpts{MessageID: fmt.Sprintf("open-%d", i)})
			}
		}, claimInbox},
		{"outbox", "outbox_claim_floor_seq", claimfloor.OutboxAudit, claimfloor.Outbox, func(t *testing.T, db *testenv.DB) {
			outboxRows(t, db.Pool, "ended", 100)
			_, err := db.Pool.Exec(t.Context(), "UPDATE outbox SET published_at = now()")
			require.NoError(t, err)
			outboxRows(t, db.Pool, "open", 3)
		}, claimOutbox},
	} {
		t.Run(c.table, func(t *testing.T) {
			t.Parallel()
			db := testenv.NewDB(t)
			ctx := t.Context()
			c.rows(t, db)
			first := int64(db.Int(t, "SELECT min(id) FROM "+c.table+" WHERE id > (SELECT max(id) - 3 FROM "+c.table+")"))
			k := &keeper{raise: c.raise(db.Pool)}
			require.Equal(t, first, k.settle(t), "the floor rises to the first open row")
			stranded, err := c.audit(db.Pool, time.Minute)(ctx)
			require.NoError(t, err)
			require.Zero(t, stranded, "nothing is open under a floor the keeper raised")
			require.Equal(t, first, k.settle(t), "the audit leaves a sound floor where it is")

			// The restore: the floor past the open rows.
			db.Int(t, "SELECT setval($1::regclass, $2)", c.seq, first+10)
			require.Empty(t, c.claim(t, db.Pool), "no claim looks under the floor")

			stranded, err = c.audit(db.Pool, time.Minute)(ctx)
			require.NoError(t, err)
			require.Equal(t, first, stranded, "the audit finds the oldest row open under the floor")
			require.Equal(t, first, int64(db.Int(t, "SELECT last_value FROM "+c.seq)), "and lowers the floor to it")
			require.Len(t, c.claim(t, db.Pool), 3, "the claims take the rows again")
		})
	}
}

// The keeper audits its floor when it starts, then at every
// AuditInterval, and logs each row it finds as an error.
func TestTheKeeperAuditsItsFloor(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	testfactory.InboxRow(t.Context(), t, db.Pool, &testfactory.InboxRowOpts{MessageID: "stranded"})
	db.Int(t, "SELECT setval('inbox_claim_floor_seq', 1000)")

	var logs lockedBuffer
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		k := &claimfloor.Keeper{Table: "inbox", Raise: claimfloor.Inbox(db.Pool), Audit: claimfloor.InboxAudit(db.Pool, time.Minute),
			Interval: 10 * time.Millisecond, AuditInterval: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
		k.Run(ctx)
	}()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { return len(claimInbox(t, db.Pool)) == 1 }, 10*time.Second, 20*time.Millisecond,
		"the keeper's audit lowers the floor to the stranded message, and the claims take it")
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "a row was open under the claim floor") }, 10*time.Second, 20*time.Millisecond,
		"the keeper logs what its audit found")
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "table=inbox id=")
}

// lockedBuffer is a log sink that a keeper's goroutine writes while the
// test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Under a snapshot held open the audit's scan reads the entries of every
// row ended since the hold began (28 s ten minutes into a hold at 1,000
// orders/s): it gives up at its budget, changes nothing, and the keeper
// says so and goes on raising the floor.
func TestTheAuditGivesUpAtItsBudget(t *testing.T) {
	t.Parallel()
	db := testenv.NewDBAlone(t)
	ctx := t.Context()
	db.HoldSnapshot(t)
	db.Exec(t, `INSERT INTO inbox (message_id, message_type, payload)
		SELECT 'ended-' || g, 'order.created', '{}' FROM generate_series(1, 50000) g`)
	db.Exec(t, "UPDATE inbox SET status = 'processed', processed_at = now()")
	floor := db.Int(t, "SELECT setval('inbox_claim_floor_seq', (SELECT max(id) + 1 FROM inbox))")

	_, err := claimfloor.InboxAudit(db.Pool, time.Millisecond)(ctx)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "57014", pgErr.Code, "the scan is cancelled at its statement_timeout")
	require.Equal(t, floor, db.Int(t, "SELECT last_value FROM inbox_claim_floor_seq"))
	stranded, err := claimfloor.InboxAudit(db.Pool, time.Minute)(ctx)
	require.NoError(t, err, "the connection is sound after the cancel")
	require.Zero(t, stranded)

	var logs lockedBuffer
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		k := &claimfloor.Keeper{Table: "inbox", Raise: claimfloor.Inbox(db.Pool), Audit: claimfloor.InboxAudit(db.Pool, time.Millisecond),
			Interval: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
		k.Run(kctx)
	}()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "gave up at its budget") }, 10*time.Second, 20*time.Millisecond)
	require.Contains(t, logs.String(), "level=INFO")
}

// The keeper's statements read the few open rows, not the ended ones:
// each reads its table's index of open rows within its bounds, with or
// without statistics, planned at each call or prepared and kept (a
// prepared statement gets a plan for any parameters after its fifth call).
// Counted over thousands of ended rows stored ended (no index entry of
// theirs under the open rows' index): the rows sequential scans read and
// the index entries read, over every index of the table, by 20 rounds of
// the keeper and 7 audits.
func TestTheKeepersStatementsReadOnlyOpenRows(t *testing.T) {
	t.Parallel()
	const ended = 10000
	for _, c := range []struct {
		table     string
		seq       string
		raise     func(claimfloor.DB) claimfloor.Raise
		audit     func(claimfloor.Beginner, time.Duration) claimfloor.Audit
		end, open string
	}{
		{"inbox", "inbox_claim_floor_seq", claimfloor.Inbox, claimfloor.InboxAudit,
			`INSERT INTO inbox (message_id, message_type, payload, status, processed_at)
			 SELECT 'ended-' || g, 'order.created', '{}', 'processed', now() FROM generate_series(1, $1::integer) g`,
			`INSERT INTO inbox (message_id, message_type, payload)
			 SELECT 'open-' || g, 'order.created', '{}' FROM generate_series(1, 3) g`},
		{"outbox", "outbox_claim_floor_seq", claimfloor.Outbox, claimfloor.OutboxAudit,
			`INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, published_at)
			 SELECT 'ended-' || g, 'order.confirmed', '{}', 'ended-' || g, now() FROM generate_series(1, $1::integer) g`,
			`INSERT INTO outbox (idempotency_key, routing_key, payload, message_id)
			 SELECT 'open-' || g, 'order.confirmed', '{}', 'open-' || g FROM generate_series(1, 3) g`},
	} {
		eachPlanning(t, c.table, func(t *testing.T, conn *pgx.Conn) {
			_, err := conn.Exec(t.Context(), c.end, ended)
			require.NoError(t, err)
			_, err = conn.Exec(t.Context(), c.open)
			require.NoError(t, err)
		}, func(t *testing.T, conn *pgx.Conn) {
			ctx := t.Context()
			read := tableReads(t, conn, c.table)
			before := read()

			k := &keeper{raise: c.raise(conn)}
			require.Equal(t, int64(ended+1), k.settle(t), "the floor rises to the first open row")
			_, err := conn.Exec(ctx, "SELECT setval($1::regclass, $2)", c.seq, ended+3)
			require.NoError(t, err)
			for i := range 7 {
				stranded, err := c.audit(conn, time.Minute)(ctx)
				require.NoError(t, err)
				if i == 0 {
					require.Equal(t, int64(ended+1), stranded, "the audit finds the first open row under the floor")
				} else {
					require.Zero(t, stranded)
				}
			}

			got := read() - before
			t.Logf("%s: the keeper's rounds and audits read %d rows and index entries of %d ended rows", c.table, got, ended)
			require.Less(t, got, ended/10, "rows and index entries the keeper's statements read")
		})
	}
}

// TestARaiseReadsOnlyTheFirstOpenRowOfABacklog: a backlog (a queue drained
// after an outage, a relay behind) leaves many rows open above the floor.
// A raise looks for the first of them: it reads one index entry a round,
// not the whole backlog at every round, with or without statistics, with
// the plan made at each call or kept.
func TestARaiseReadsOnlyTheFirstOpenRowOfABacklog(t *testing.T) {
	t.Parallel()
	const backlog = 10000
	for _, c := range []struct {
		table string
		raise func(claimfloor.DB) claimfloor.Raise
		open  string
	}{
		{"inbox", claimfloor.Inbox, `INSERT INTO inbox (message_id, message_type, payload)
			SELECT 'open-' || g, 'order.created', '{}' FROM generate_series(1, $1::integer) g`},
		{"outbox", claimfloor.Outbox, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id)
			SELECT 'open-' || g, 'order.confirmed', '{}', 'open-' || g FROM generate_series(1, $1::integer) g`},
	} {
		eachPlanning(t, c.table, func(t *testing.T, conn *pgx.Conn) {
			_, err := conn.Exec(t.Context(), c.open, backlog)
			require.NoError(t, err)
		}, func(t *testing.T, conn *pgx.Conn) {
			read := tableReads(t, conn, c.table)
			before := read()
			k := &keeper{raise: c.raise(conn)}
			require.Equal(t, int64(1), k.settle(t), "the floor stays at the first open row")
			got := read() - before
			t.Logf("%s: 20 rounds read %d rows and index entries of a backlog of %d", c.table, got, backlog)
			require.Less(t, got, backlog/10, "rows and index entries the raises read")
		})
	}
}

// eachPlanning runs check in a subtest of t for each way a keeper's
// statements may be planned: on table without and with statistics, each
// statement planned at each call (pipeline.ConfigureSession) or prepared
// once with its plan kept (pgx's default). Each subtest has a schema of
// its own, and a session of it, conn, that fill fills first; only conn
// reads the table, so its counters count it (tableReads).
func eachPlanning(t *testing.T, table string, fill, check func(t *testing.T, conn *pgx.Conn)) {
	for _, analyzed := range []bool{false, true} {
		for _, prepared := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/analyzed=%v/prepared=%v", table, analyzed, prepared), func(t *testing.T) {
				t.Parallel()
				configure := pipeline.ConfigureSession
				if prepared {
					configure = nil
				}
				conn := testenv.NewDB(t).SessionWith(t, configure)
				fill(t, conn)
				if analyzed {
					_, err := conn.Exec(t.Context(), "ANALYZE "+table)
					require.NoError(t, err)
				}
				check(t, conn)
			})
		}
	}
}

// tableReads returns what counts the rows and index entries of table that
// have been read so far, as conn's session sees the counters.
func tableReads(t *testing.T, conn *pgx.Conn, table string) func() int {
	return func() int {
		return testenv.SessionStat(t, conn, `
			SELECT ((SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
			         WHERE schemaname = current_schema() AND relname = '`+table+`')
			      + (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
			         WHERE schemaname = current_schema() AND relname = '`+table+`'))::int`)
	}
}
