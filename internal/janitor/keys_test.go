package janitor_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

// ageLedger moves the key ledger's times d into the past, as if d had
// passed since each generation opened and closed. For a test that
// compares them with the database's clock; the others set the janitor's
// clock forward (ahead, later).
func ageLedger(t *testing.T, pool *pgxpool.Pool, d time.Duration) {
	t.Helper()
	exec(t, pool, `UPDATE inbox_key_generations
		SET opened_at = opened_at - make_interval(secs => $1), closed_at = closed_at - make_interval(secs => $1)`,
		d.Seconds())
}

// store stores messages with the ids as ingest does, and returns the ids
// it inserted (the others were duplicates).
func store(t *testing.T, db dbsqlc.DBTX, ids ...string) []string {
	t.Helper()
	inserted, err := storeOrFail(context.WithoutCancel(t.Context()), db, ids...)
	require.NoError(t, err)
	return inserted
}

func storeOrFail(ctx context.Context, db dbsqlc.DBTX, ids ...string) ([]string, error) {
	p := dbsqlc.InboxInsertManyParams{}
	for _, id := range ids {
		p.MessageIds = append(p.MessageIds, id)
		p.MessageTypes = append(p.MessageTypes, "order.created")
		p.RoutingKeys = append(p.RoutingKeys, "order.created")
		p.Payloads = append(p.Payloads, []byte(`{"orderId":"`+id+`"}`))
		p.OrderKeys = append(p.OrderKeys, id)
	}
	out, err := dbsqlc.New().InboxInsertMany(ctx, db, p)
	ids = ids[:0:0]
	for _, o := range out {
		ids = append(ids, o.MessageID)
	}
	return ids, err
}

// ahead is a janitor clock d ahead of the real one.
func ahead(d time.Duration) func() time.Time {
	return func() time.Time { return time.Now().Add(d) }
}

// later is the time d from now, a rotation's clock (janitor.RotateKeys).
func later(d time.Duration) *time.Time {
	t := time.Now().Add(d)
	return &t
}

// requireSQLState requires err to be PostgreSQL's, with SQLSTATE code, and
// returns it.
func requireSQLState(t *testing.T, err error, code, msg string) *pgconn.PgError {
	t.Helper()
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%s: %v", msg, err)
	require.Equal(t, code, pgErr.Code, msg)
	return pgErr
}

func remembered(t *testing.T, db *testenv.DB, id string) bool {
	t.Helper()
	return db.Int(t, "SELECT count(*) FROM inbox_keys WHERE message_id = $1", id) == 1
}

// An id whose row has left the inbox (past INBOX_RETENTION) is still a
// duplicate within the dedupe window: the key ledger remembers it.
func TestAnIdIsADuplicateAfterItsRowLeft(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const window = 84 * time.Hour

	require.Equal(t, []string{"m-1"}, store(t, db.Pool, "m-1"))
	exec(t, db.Pool, "UPDATE inbox SET status = 'processed', processed_at = now()")
	// A window and an hour later: the ledger has covered a window, the row
	// is past its retention.
	res, err := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, DedupeWindow: window,
		Now: ahead(window + time.Hour)}).RunOnce(t.Context())
	require.NoError(t, err)
	require.EqualValues(t, 1, res[janitor.RowsProcessed], "the row left after INBOX_RETENTION")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))

	require.Empty(t, store(t, db.Pool, "m-1"), "the redelivery within the window is a duplicate")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))
	// An earlier inboxd, rolled back to or still running, or an operator:
	// an insert that does not ask the ledger itself is refused.
	_, err = db.Pool.Exec(t.Context(), `INSERT INTO inbox (message_id, message_type, payload) VALUES ('m-1', 'order.created', '{}')
		ON CONFLICT (message_id) DO NOTHING`)
	pgErr := requireSQLState(t, err, "23505", "an insert of its own is refused as unique_violation")
	require.Contains(t, pgErr.Message, "message id m-1 is a duplicate")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))
	require.Equal(t, []string{"m-2"}, store(t, db.Pool, "m-2"), "another id is stored")
}

// A writer in REPEATABLE READ (or SERIALIZABLE) reads the current slot
// under its own snapshot, which may predate a rotation: its keys would go
// to a generation already closed, and be forgotten early. It fails, to be
// tried again, rather than write them there.
func TestAStricterWriterCannotWriteAClosedGeneration(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	writer := db.Session(t)
	tx, err := writer.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "SELECT 1") // its snapshot
	require.NoError(t, err)

	generation, err := janitor.RotateKeys(ctx, db.Pool, 70*time.Hour, janitor.KeysLockWaitDefault, later(11*time.Hour))
	require.NoError(t, err)
	require.EqualValues(t, 2, generation)

	_, err = tx.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('rr-1', 'order.created', '{}')")
	requireSQLState(t, err, "40001", "the insert fails with serialization_failure")
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox_keys WHERE message_id = 'rr-1'"))
}

// A copy that asks for a reply after its message's row has left gets one
// saying the result is no longer kept, and runs nothing again.
func TestACopyOfAForgottenMessageIsAnsweredSo(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	require.Equal(t, []string{"m-1"}, store(t, db.Pool, "m-1"))
	exec(t, db.Pool, "UPDATE inbox SET status = 'processed', processed_at = now()")
	// 85 hours later: past the default window and the retention.
	_, err := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, Now: ahead(85 * time.Hour)}).RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))

	// Stored as ingest does: the requests the insert stored are answered
	// in its transaction.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	out, err := dbsqlc.New().InboxInsertMany(ctx, tx, dbsqlc.InboxInsertManyParams{
		MessageIds: []string{"m-1"}, MessageTypes: []string{"order.created"}, RoutingKeys: []string{"order.created"},
		Payloads: [][]byte{[]byte(`{"orderId":"m-1"}`)}, OrderKeys: []string{"m-1"},
		ReplyTos: []string{"q-1"}, CorrelationIds: []string{"c-1"}, Redelivered: []bool{false},
	})
	require.NoError(t, err)
	var inserted []string
	var requests []int64
	for _, o := range out {
		if o.RequestID != 0 {
			requests = append(requests, o.RequestID)
		} else {
			inserted = append(inserted, o.MessageID)
		}
	}
	require.Empty(t, inserted)
	require.Len(t, requests, 1)
	queued, err := dbsqlc.New().InboxReplyAnswer(ctx, tx, requests)
	require.NoError(t, err)
	require.EqualValues(t, 1, queued)
	require.NoError(t, tx.Commit(ctx))
	var key, replyTo, correlationID, outcome, status string
	require.NoError(t, db.Pool.QueryRow(ctx, `
		SELECT idempotency_key, reply_to, correlation_id, payload->>'outcome', payload->>'status' FROM outbox`).
		Scan(&key, &replyTo, &correlationID, &outcome, &status))
	require.Regexp(t, `^reply:\d+:0$`, key)
	require.Equal(t, []string{"q-1", "c-1", "forgotten", "unknown"}, []string{replyTo, correlationID, outcome, status})
	require.Equal(t, []string{"sending"}, db.Strings(t, "SELECT state FROM inbox_replies"))
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"), "nothing runs again")
}

// Until the ledger has covered a whole window, the rows stored before it
// started are the only record of their ids: they stay for the window,
// whatever INBOX_RETENTION says.
func TestRowsStayForTheWindowUntilTheLedgerCoversIt(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const window = 84 * time.Hour
	seedMessage(t, db.Pool, "before-the-ledger", "processed", 0)
	exec(t, db.Pool, "TRUNCATE inbox_keys") // stored before the ledger started
	later := 48 * time.Hour                 // past the retention, within the window
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, DedupeWindow: window,
		Now: func() time.Time { return time.Now().Add(later) }})

	res, err := j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Zero(t, res[janitor.RowsProcessed], "kept: the ledger started less than a window ago")
	require.Empty(t, store(t, db.Pool, "before-the-ledger"), "its row still makes a redelivery a duplicate")

	later = window // the ledger has covered it
	res, err = j.RunOnce(t.Context())
	require.NoError(t, err)
	require.EqualValues(t, 1, res[janitor.RowsProcessed], "deleted once the ledger has covered the window")
}

// A key is remembered for at least the window after it was stored, and at
// most a seventh longer, through the generations' rotations: hour by hour
// over 100 hours of a 70-hour window.
func TestAKeyIsRememberedForTheWindowAcrossRotations(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const window, step = 70 * time.Hour, time.Hour
	start := time.Now()
	var elapsed time.Duration
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, DedupeWindow: window,
		Now: func() time.Time { return start.Add(elapsed) }})
	storedAt := map[string]time.Duration{}
	forgottenAt := map[string]time.Duration{}
	rotations := 0
	for ; elapsed <= 100*time.Hour; elapsed += step {
		// Keys stored at the start of the first generation, at its end, and
		// mid-way through a later one.
		for id, at := range map[string]time.Duration{"k-first": 0, "k-end-of-first": 9 * time.Hour, "k-later": 33 * time.Hour} {
			if at == elapsed {
				require.Equal(t, []string{id}, store(t, db.Pool, id))
				storedAt[id] = elapsed
			}
		}
		// A cleanup: it merges the hot part sealed at the last rotation,
		// and rotates when a rotation is due.
		before := db.Int(t, "SELECT max(generation) FROM inbox_key_generations")
		_, err := j.RunOnce(t.Context())
		require.NoError(t, err)
		rotations += db.Int(t, "SELECT max(generation) FROM inbox_key_generations") - before
		for id, at := range storedAt {
			if _, gone := forgottenAt[id]; gone {
				continue
			}
			if !remembered(t, db, id) {
				forgottenAt[id] = elapsed
				require.GreaterOrEqual(t, elapsed-at, window, "%s forgotten %s after it was stored, within the window", id, elapsed-at)
				continue
			}
			require.Empty(t, store(t, db.Pool, id), "%s stored again %s after it was first", id, elapsed-at)
			require.LessOrEqual(t, elapsed-at, window+window/7, "%s still remembered %s after it was stored", id, elapsed-at)
		}
	}
	require.Len(t, forgottenAt, 2, "the keys of the first generation left; k-later is remembered still")
	require.Equal(t, 10, rotations, "a generation lasts a seventh of the window: 100 hours hold ten")
	require.Equal(t, 8, db.Int(t, "SELECT count(*) FROM inbox_key_ledger"), "the view shows the eight generations held")
}

// The rotation's guard: a generation closes only once every transaction
// writing keys into it has ended, so its keys are all committed by the time
// it closed, from which the window is counted. It waits twice: for the
// next slot, which every insert into the inbox has read (inbox_keys_known),
// and for the remembering lock, which every writer of keys holds. The
// writer here inserts into the inbox directly, as an older inboxd or an
// operator does. A second delivery of the same id, stored by ingest while
// the rotation waits, is a duplicate: one row, one key.
func TestARotationWaitsForTheKeysBeingWritten(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	const window = 70 * time.Hour
	ageLedger(t, db.Pool, window/7+time.Minute) // a rotation is due

	writer := db.Session(t)
	tx, err := writer.Begin(ctx)
	require.NoError(t, err)
	testfactory.InboxRow(ctx, t, tx, &testfactory.InboxRowOpts{MessageID: "at-the-boundary"})

	keeper := db.Session(t)
	rotated := make(chan error, 1)
	go func() {
		// The database's clock: the close is compared with the commit's.
		_, err := janitor.RotateKeys(ctx, keeper, window, 30*time.Second, nil)
		rotated <- err
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE pid = $1 AND wait_event_type = 'Lock')`, int(keeper.PgConn().PID())).Scan(&waiting)
		return err == nil && waiting
	}, 10*time.Second, 10*time.Millisecond, "the rotation waits for the writer")

	// Another delivery of the id, stored by ingest meanwhile.
	type result struct {
		inserted []string
		err      error
	}
	second := make(chan result, 1)
	go func() {
		inserted, err := storeOrFail(ctx, db.Pool, "at-the-boundary")
		second <- result{inserted, err}
	}()

	var committing time.Time
	require.NoError(t, tx.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&committing))
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-rotated)
	got := <-second
	require.NoError(t, got.err)
	require.Empty(t, got.inserted, "the second delivery is a duplicate")

	var closedAt time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT closed_at FROM inbox_key_generations WHERE generation = 1").Scan(&closedAt))
	require.True(t, closedAt.After(committing), "generation 1 closed at %s, before its last key committed at %s", closedAt, committing)
	require.Equal(t, 1, db.Int(t, "SELECT count(*) FROM inbox WHERE message_id = 'at-the-boundary'"))
	// Its key went with generation 1's hot part, sealed by the rotation,
	// and from there into generation 1's slot.
	require.Equal(t, []string{"8 sealed 0", "9 writing 1"}, hotParts(t, db))
	require.Equal(t, 1, merge(t, db, janitor.MergeBytesDefault))
	require.Equal(t, 1, db.Int(t, "SELECT count(*) FROM inbox_keys WHERE message_id = 'at-the-boundary' AND slot = 0"))
}

// A rotation that cannot have its locks in time fails, and leaves the
// generation open, rather than hold up ingest.
func TestARotationGivesUpOnABusyLedger(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	due := later(11 * time.Hour)
	reader := db.Session(t)
	tx, err := reader.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT count(*) FROM inbox_keys") // an operator's query, left open
	require.NoError(t, err)

	_, err = janitor.RotateKeys(ctx, db.Pool, 70*time.Hour, janitor.KeysLockWaitDefault, due)
	requireSQLState(t, err, "55P03", "lock_not_available")
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 1, db.Int(t, "SELECT count(*) FROM inbox_key_generations"))

	generation, err := janitor.RotateKeys(ctx, db.Pool, 70*time.Hour, janitor.KeysLockWaitDefault, due)
	require.NoError(t, err)
	require.EqualValues(t, 2, generation)
}

// Every insert into the inbox looks its id up in the ledger: ingest's for
// its batch, any other's row by row in a trigger. A session that stored
// while the ledger was empty must still look up through the index once the
// ledger holds many keys, both ways.
func TestTheLedgerIsReadThroughItsIndexOnceItHasGrown(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	conn := db.SessionWith(t, pipeline.ConfigureSession)
	for i := range 10 {
		require.Len(t, store(t, conn, fmt.Sprintf("early-%d", i)), 1)
		_, err := conn.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ($1, 'order.created', '{}')", fmt.Sprintf("early-own-%d", i))
		require.NoError(t, err)
	}
	// The slots and the hot part writing (8).
	exec(t, db.Pool, `INSERT INTO inbox_keys (slot, message_id)
		SELECT g % 9, 'grown-' || g FROM generate_series(1, 30000) g`)

	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The session's counts not yet reported to the statistics are in the
	// view too: the store's are the difference.
	scanned := func() int {
		var n int
		require.NoError(t, tx.QueryRow(ctx, `SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_xact_user_tables
			WHERE relname LIKE 'inbox\_keys\_%' AND schemaname = current_schema()`).Scan(&n))
		return n
	}
	before := scanned()
	require.Len(t, store(t, tx, "late-1", "late-2", "grown-7"), 2, "the remembered id is skipped")
	require.Zero(t, scanned()-before, "keys read by scanning the slots")
	_, err = tx.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('late-3', 'order.created', '{}')")
	require.NoError(t, err)
	require.Zero(t, scanned()-before, "keys read by scanning the slots, for an insert of its own")
	_, err = tx.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('grown-8', 'order.created', '{}')")
	require.ErrorContains(t, err, "message id grown-8 is a duplicate", "asked again in a later statement of the transaction")
}

// A rotation whose connection is killed between its steps (here after it
// emptied the next slot, while it waits for the writers of keys) leaves
// the ledger as it was: the generation still open, its part still
// writing, its keys remembered. The next rotation rotates.
func TestARotationCutShortLeavesTheLedgerAsItWas(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	const window = 70 * time.Hour
	require.Equal(t, []string{"g1-a"}, store(t, db.Pool, "g1-a"))
	exec(t, db.Pool, "DELETE FROM inbox") // its row left: only the ledger knows it
	due := later(window/7 + time.Minute)
	generations := func() []string {
		return db.Strings(t, "SELECT generation || ' ' || slot || ' ' || (closed_at IS NULL) FROM inbox_key_generations ORDER BY 1")
	}

	// A writer of keys, as the trigger that remembers them locks: the
	// rotation waits for it after emptying the next slot.
	writer := db.Session(t)
	tx, err := writer.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "LOCK TABLE inbox_key_hot_parts IN ROW EXCLUSIVE MODE")
	require.NoError(t, err)
	err = killWhileWaiting(t, db, func(conn *pgx.Conn) error {
		_, err := janitor.RotateKeys(ctx, conn, window, 30*time.Second, due)
		return err
	})
	require.Error(t, err, "the rotation was cut short")
	require.NoError(t, tx.Rollback(ctx))

	require.Equal(t, []string{"1 0 true"}, generations(), "generation 1 still open")
	require.Equal(t, []string{"8 writing 0", "9 empty -"}, hotParts(t, db), "its part still writing")
	require.Empty(t, store(t, db.Pool, "g1-a"), "its keys remembered")

	generation, err := janitor.RotateKeys(ctx, db.Pool, window, janitor.KeysLockWaitDefault, due)
	require.NoError(t, err)
	require.EqualValues(t, 2, generation)
	require.Equal(t, []string{"1 0 false", "2 1 true"}, generations())
	require.Equal(t, []string{"8 sealed 0", "9 writing 1"}, hotParts(t, db))
	require.Empty(t, store(t, db.Pool, "g1-a"))
}
