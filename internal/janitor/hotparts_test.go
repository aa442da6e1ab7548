package janitor_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/internal/testfactory"
)

// hotParts lists the key ledger's hot parts as "part state slot".
func hotParts(t *testing.T, db *testenv.DB) []string {
	t.Helper()
	return db.Strings(t, "SELECT part || ' ' || state || ' ' || coalesce(slot::text, '-') FROM inbox_key_hot_parts ORDER BY part")
}

// seal seals the hot part writing whatever its size, as SealKeys does
// once it has grown.
func seal(t *testing.T, db *testenv.DB) {
	t.Helper()
	sealed, err := janitor.SealKeys(t.Context(), db.Pool, 1, 0, janitor.KeysLockWaitDefault)
	require.NoError(t, err)
	require.True(t, sealed, "sealed")
}

// merge merges the next range of the sealed part, about maxBytes of it,
// and returns how many keys it copied, or -1 if no part was sealed.
func merge(t *testing.T, db *testenv.DB, maxBytes int) int {
	t.Helper()
	n, merging, err := janitor.MergeKeys(t.Context(), db.Pool, int64(maxBytes))
	require.NoError(t, err)
	if !merging {
		return -1
	}
	return int(n)
}

// emptyPart empties the merged part, and reports whether there was one.
func emptyPart(t *testing.T, db *testenv.DB) bool {
	t.Helper()
	emptied, err := janitor.EmptyKeys(t.Context(), db.Pool, janitor.KeysLockWaitDefault)
	require.NoError(t, err)
	return emptied
}

// mergeRanges merges the sealed part range by range, at most maxBytes of it
// a range, until MergeKeys finds nothing left to copy, and returns the
// keys copied, the ranges and the most keys one range copied.
func mergeRanges(t *testing.T, db *testenv.DB, maxBytes int) (copied, ranges, largest int) {
	t.Helper()
	for {
		n := merge(t, db, maxBytes)
		if n < 0 {
			return copied, ranges, largest
		}
		copied, ranges, largest = copied+n, ranges+1, max(largest, n)
	}
}

// requireInSlot0Once checks that slot 0 holds keys keys, each once.
func requireInSlot0Once(t *testing.T, db *testenv.DB, keys int) {
	t.Helper()
	require.Equal(t, []string{fmt.Sprintf("%d %d", keys, keys)},
		db.Strings(t, "SELECT count(*) || ' ' || count(DISTINCT message_id) FROM inbox_keys_0"), "every key in slot 0, once")
}

// A key is a duplicate at every step of its way from the hot part to its
// slot: written, sealed, merged (in both), emptied from the part; for
// ingest, which asks the ledger itself, and for any other insert, which
// the trigger checks. Keys stored meanwhile go to the other part.
func TestAKeyIsADuplicateAtEveryStepOfItsHotPart(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	require.Equal(t, []string{"8 writing 0", "9 empty -"}, hotParts(t, db))
	require.Equal(t, []string{"k-1"}, store(t, db.Pool, "k-1"))
	exec(t, db.Pool, "DELETE FROM inbox") // its row left: only the ledger knows it
	inPart := func(id string) string {
		return db.Strings(t, "SELECT string_agg(slot::text, ',' ORDER BY slot) FROM inbox_keys WHERE message_id = $1", id)[0]
	}
	duplicate := func(step string) {
		t.Helper()
		require.Empty(t, store(t, db.Pool, "k-1"), "%s: ingest stores it again", step)
		_, err := db.Pool.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('k-1', 'order.created', '{}')")
		requireSQLState(t, err, "23505", step+": an insert of its own is refused")
	}

	require.Equal(t, "8", inPart("k-1"))
	duplicate("written")
	seal(t, db)
	require.Equal(t, []string{"8 sealed 0", "9 writing 0"}, hotParts(t, db))
	duplicate("sealed")
	require.Equal(t, []string{"k-2"}, store(t, db.Pool, "k-2"))
	require.Equal(t, "9", inPart("k-2"), "a key stored after the seal goes to the other part")

	require.Equal(t, 1, merge(t, db, janitor.MergeBytesDefault), "one key merged")
	require.Equal(t, []string{"8 merged 0", "9 writing 0"}, hotParts(t, db))
	require.Equal(t, "0,8", inPart("k-1"))
	duplicate("merged")
	require.True(t, emptyPart(t, db))
	require.Equal(t, []string{"8 empty -", "9 writing 0"}, hotParts(t, db))
	require.Equal(t, "0", inPart("k-1"))
	duplicate("in its slot")
	require.Empty(t, store(t, db.Pool, "k-2"))
	require.Equal(t, []string{"1 0 2"}, db.Strings(t, "SELECT generation || ' ' || slot || ' ' || keys FROM inbox_key_ledger"),
		"the generation counts its keys in its slot and its part")
}

// The seal's guard: a part is sealed only once every transaction writing
// keys into it has ended, so that the merge copies them all before the
// part is emptied. The writer here inserts into the inbox directly, as an
// earlier inboxd or an operator does, and commits while the seal waits.
func TestASealWaitsForTheKeysBeingWritten(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	writer := db.Session(t)
	tx, err := writer.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	testfactory.InboxRow(ctx, t, tx, &testfactory.InboxRowOpts{MessageID: "being-written"})

	keeper := db.Session(t)
	tended := make(chan error, 1)
	go func() {
		tended <- func() error {
			if _, err := janitor.SealKeys(ctx, keeper, 1, 0, 30*time.Second); err != nil {
				return err
			}
			if _, _, err := janitor.MergeKeys(ctx, keeper, janitor.MergeBytesDefault); err != nil {
				return err
			}
			_, err := janitor.EmptyKeys(ctx, keeper, 30*time.Second)
			return err
		}()
	}()
	// Either the seal waits for the writer, or (without its guard) it has
	// gone ahead and the emptying waits.
	require.Eventually(t, func() bool {
		return db.Int(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`,
			int(keeper.PgConn().PID())) > 0
	}, 10*time.Second, 10*time.Millisecond, "the seal waits for the writer")
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-tended)

	require.Equal(t, []string{"8 empty -", "9 writing 0"}, hotParts(t, db))
	require.True(t, remembered(t, db, "being-written"), "the key written while the part was sealed is in its slot")
	exec(t, db.Pool, "DELETE FROM inbox")
	require.Empty(t, store(t, db.Pool, "being-written"))
}

// A checker in REPEATABLE READ whose snapshot predates a part's merge and
// emptying would find the key in neither place (TRUNCATE is not
// MVCC-safe): it fails with a serialization failure, to be tried again,
// rather than store a duplicate.
func TestAStricterCheckerCannotMissAnEmptiedPart(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	require.Equal(t, []string{"rr-1"}, store(t, db.Pool, "rr-1"))
	exec(t, db.Pool, "DELETE FROM inbox") // its row left: only the ledger knows it
	seal(t, db)
	checker := db.Session(t)
	tx, err := checker.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "SELECT 1") // its snapshot
	require.NoError(t, err)

	require.Equal(t, 1, merge(t, db, janitor.MergeBytesDefault))
	require.True(t, emptyPart(t, db))

	_, err = tx.Exec(ctx, "INSERT INTO inbox (message_id, message_type, payload) VALUES ('rr-1', 'order.created', '{}')")
	requireSQLState(t, err, "40001", "the insert fails with serialization_failure")
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox"))
}

// A rotation seals the closing generation's part and opens the next
// generation in the other; while that one still holds keys not emptied,
// the rotation waits. Each generation's keys end in its own slot.
func TestARotationHandsTheHotPartOver(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const window = 70 * time.Hour
	due := window/7 + time.Minute
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, DedupeWindow: window, Now: ahead(due)})
	require.Equal(t, []string{"g1-a"}, store(t, db.Pool, "g1-a"))
	seal(t, db) // part 8 sealed, not yet merged
	require.Equal(t, []string{"g1-b"}, store(t, db.Pool, "g1-b"))

	rotated, err := janitor.RotateKeys(t.Context(), db.Pool, window, janitor.KeysLockWaitDefault, later(due))
	require.NoError(t, err)
	require.Zero(t, rotated, "no empty part for the next generation yet")

	_, err = j.RunOnce(t.Context()) // merges and empties part 8, then rotates
	require.NoError(t, err)
	require.Equal(t, []string{"8 writing 1", "9 sealed 0"}, hotParts(t, db))
	require.Equal(t, []string{"g2-a"}, store(t, db.Pool, "g2-a"))
	_, err = j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"8 writing 1", "9 empty -"}, hotParts(t, db))
	require.Equal(t, []string{"g1-a 0", "g1-b 0", "g2-a 8"}, db.Strings(t, "SELECT message_id || ' ' || slot FROM inbox_keys ORDER BY 1"))
	require.Equal(t, []string{"2 1 1", "1 0 2"}, db.Strings(t, "SELECT generation || ' ' || slot || ' ' || keys FROM inbox_key_ledger"))
	require.Empty(t, store(t, db.Pool, "g1-a", "g1-b", "g2-a"))
}

// A part is sealed once it holds an eighth as many keys as its slot, and
// no sooner: the merge then changes each page of the slot's index for
// many keys. (Sizes are the tables' files: a key of these takes as many
// bytes in either.)
func TestAPartIsSealedAtAnEighthOfItsSlot(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 0, md5(g::text) FROM generate_series(1, 80000) g")
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5((-g)::text) FROM generate_series(1, 9000) g")
	sealed, err := janitor.SealKeys(t.Context(), db.Pool, 8, 0, janitor.KeysLockWaitDefault)
	require.NoError(t, err)
	require.False(t, sealed, "under an eighth")
	require.Equal(t, []string{"8 writing 0", "9 empty -"}, hotParts(t, db))
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5((-g)::text) FROM generate_series(9001, 11000) g")
	sealed, err = janitor.SealKeys(t.Context(), db.Pool, 8, 0, janitor.KeysLockWaitDefault)
	require.NoError(t, err)
	require.True(t, sealed, "over an eighth")
	require.Equal(t, []string{"8 sealed 0", "9 writing 0"}, hotParts(t, db))
}

// The janitor seals the part writing once it has grown (here past the
// least size of a seal, 16 MB, its slot being empty), and merges and
// empties it at its next cleanup.
func TestTheJanitorSealsAGrownPartAndMergesIt(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour})
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 200000) g")
	_, err := j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"8 writing 0", "9 empty -"}, hotParts(t, db), "under 16 MB: not sealed")

	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(200001, 260000) g")
	_, err = j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"8 sealed 0", "9 writing 0"}, hotParts(t, db))
	_, err = j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"8 empty -", "9 writing 0"}, hotParts(t, db))
	require.Equal(t, 260_000, db.Int(t, "SELECT count(*) FROM inbox_keys_0"))
	require.Zero(t, db.Int(t, "SELECT count(*) FROM inbox_keys_8"))
}

// A hot part that holds keys gets statistics from the leader, once, within
// seconds: the planner then takes each probe of it to match one key, not
// one in 200 of the part (which made the ingest statement read the part
// whole, by a sequential scan, for each batch).
func TestAPartThatHoldsKeysGetsStatistics(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	// A few pages of keys: a part gets statistics long before it is large.
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 1000) g")
	probeRows := func() int {
		var plan string
		require.NoError(t, db.Pool.QueryRow(t.Context(),
			"EXPLAIN SELECT 1 FROM inbox_keys_8 WHERE message_id = $1", "some-id").Scan(&plan))
		var rows int
		_, err := fmt.Sscanf(plan[strings.Index(plan, "rows="):], "rows=%d", &rows)
		require.NoError(t, err, plan)
		return rows
	}
	require.Greater(t, probeRows(), 1, "without statistics, a probe is taken to match one key in 200")

	ctx, cancel := context.WithCancel(t.Context())
	kept := make(chan struct{})
	go func() {
		defer close(kept)
		janitor.KeepKeyStatistics(ctx, db.Pool, testenv.Logger(t))
	}()
	analyzed := func() []string {
		return db.Strings(t, `SELECT tablename || ' ' || n_distinct FROM pg_stats
			WHERE schemaname = current_schema() AND tablename LIKE 'inbox\_keys\__' AND attname = 'message_id'`)
	}
	require.Eventually(t, func() bool { return len(analyzed()) > 0 }, 3*janitor.KeyStatisticsEvery, 50*time.Millisecond)
	cancel()
	<-kept
	require.Equal(t, 1, probeRows())
	require.Equal(t, []string{"inbox_keys_8 -1"}, analyzed())
	require.Zero(t, db.Int(t, "SELECT inbox_keys_analyze_parts()"), "once")
}

// The gauge inboxd_inbox_key_hot_part_waiting_seconds says how long a part has
// waited sealed or merged: 0 while none does.
func TestTheGaugeShowsAPartWaitingToBeMerged(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	waiting := func() float64 {
		row, err := dbsqlc.New().MetricsGauges(t.Context(), db.Pool)
		require.NoError(t, err)
		return row.KeyHotPartWaitingSeconds
	}
	require.Equal(t, []string{"g-1"}, store(t, db.Pool, "g-1"))
	require.Zero(t, waiting())
	seal(t, db)
	exec(t, db.Pool, "UPDATE inbox_key_hot_parts SET since = since - interval '1 hour' WHERE state = 'sealed'")
	require.InDelta(t, 3600, waiting(), 60)
	require.Equal(t, 1, merge(t, db, janitor.MergeBytesDefault))
	exec(t, db.Pool, "UPDATE inbox_key_hot_parts SET since = since - interval '2 hours' WHERE state = 'merged'")
	require.InDelta(t, 7200, waiting(), 60)
	require.True(t, emptyPart(t, db))
	require.Zero(t, waiting())
}

// A merge goes a range of hash buckets at a time, each range a transaction
// of its own: until the last, the part stays sealed, every key is still a
// duplicate (in its part, and those copied so far in their slot too), and
// the ledger counts each key once. Then the slot holds every key once.
func TestAMergeGoesARangeOfBucketsAtATime(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 20000) g")
	seal(t, db)
	quarter := db.Int(t, "SELECT pg_relation_size('inbox_keys_8') / 4")

	first := merge(t, db, quarter)
	require.Positive(t, first)
	require.Less(t, first, 20000/2, "a range, not the whole part")
	require.Equal(t, []string{"8 sealed 0", "9 writing 0"}, hotParts(t, db))
	require.Equal(t, first, db.Int(t, "SELECT count(*) FROM inbox_keys_0"), "the range's keys are in their slot")
	require.Equal(t, []string{"1 0 20000"}, db.Strings(t, "SELECT generation || ' ' || slot || ' ' || keys FROM inbox_key_ledger"),
		"each key counted once, copied or not")
	merged := db.Strings(t, "SELECT message_id FROM inbox_keys_0 LIMIT 1")[0]
	notYet := db.Strings(t, "SELECT message_id FROM inbox_keys_8 EXCEPT SELECT message_id FROM inbox_keys_0 LIMIT 1")[0]
	require.Empty(t, store(t, db.Pool, merged, notYet), "both still duplicates")

	copied, ranges, _ := mergeRanges(t, db, quarter)
	require.Equal(t, 20000, first+copied)
	require.GreaterOrEqual(t, 1+ranges, 4)
	require.Equal(t, []string{"8 merged 0", "9 writing 0"}, hotParts(t, db))
	requireInSlot0Once(t, db, 20000)
	require.Equal(t, []string{"- 0"}, db.Strings(t, "SELECT coalesce(merge_mask::text, '-') || ' ' || merged_buckets FROM inbox_key_hot_parts WHERE part = 8"))
	require.Equal(t, []string{"1 0 20000"}, db.Strings(t, "SELECT generation || ' ' || slot || ' ' || keys FROM inbox_key_ledger"))
}

// The janitor merges a sealed part a range at a time, all of them in one
// cleanup, and empties it.
func TestTheJanitorMergesARangeAtATime(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	j := newJanitor(t, db.Pool, janitor.Config{Retention: 24 * time.Hour, DeadRetention: 24 * time.Hour, MergeBytes: 256 << 10})
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 20000) g")
	require.Greater(t, db.Int(t, "SELECT pg_relation_size('inbox_keys_8')"), 3*256<<10, "more than three ranges")
	seal(t, db)
	_, err := j.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, []string{"8 empty -", "9 writing 0"}, hotParts(t, db))
	requireInSlot0Once(t, db, 20000)
}

// A part merged into a slot just emptied, whose index is a few pages, is
// still split into ranges of about max_bytes: the buckets are as many as
// the ranges need, not as few as the slot's index has pages.
func TestAMergeIntoASmallSlotStillGoesByRanges(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 20000) g")
	seal(t, db)
	maxBytes := db.Int(t, "SELECT pg_relation_size('inbox_keys_8') / 64")
	_, ranges, largest := mergeRanges(t, db, maxBytes)
	require.GreaterOrEqual(t, ranges, 32)
	require.LessOrEqual(t, largest, 2*20000/64, "no range much over max_bytes")
	requireInSlot0Once(t, db, 20000)
}

// killWhileWaiting runs step on a session of its own, waits until the
// session waits for a lock (the step stopped in the middle), and ends
// that session (pg_terminate_backend), as a crash or a failover would; it
// returns step's error.
func killWhileWaiting(t *testing.T, db *testenv.DB, step func(*pgx.Conn) error) error {
	t.Helper()
	conn := db.Session(t)
	pid := int(conn.PgConn().PID())
	done := make(chan error, 1)
	go func() { done <- step(conn) }()
	require.Eventually(t, func() bool {
		return db.Int(t, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'", pid) > 0
	}, 10*time.Second, 10*time.Millisecond, "the step waits for its lock")
	// Waits until the session has ended, and released its locks.
	require.Equal(t, []string{"true"}, db.Strings(t, "SELECT pg_terminate_backend($1, 10000)::text", pid))
	return <-done
}

// A merge whose connection is killed in the middle of a range (here while
// its copy waits for the slot) has copied and recorded nothing of that
// range: the next merge goes on from the last range committed, and the
// slot ends with every key once.
func TestAMergeCutShortGoesOnFromItsLastRange(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	exec(t, db.Pool, "INSERT INTO inbox_keys (slot, message_id) SELECT 8, md5(g::text) FROM generate_series(1, 20000) g")
	seal(t, db)
	quarter := db.Int(t, "SELECT pg_relation_size('inbox_keys_8') / 4")
	first := merge(t, db, quarter)
	require.Positive(t, first)
	progress := func() []string {
		return db.Strings(t, "SELECT state || ' ' || merge_mask || ' ' || merged_buckets FROM inbox_key_hot_parts WHERE part = 8")
	}
	before := progress()

	// The slot held by another session, so that the next range's copy waits.
	holder := db.Session(t)
	tx, err := holder.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "LOCK TABLE inbox_keys_0 IN EXCLUSIVE MODE")
	require.NoError(t, err)
	err = killWhileWaiting(t, db, func(conn *pgx.Conn) error {
		_, _, err := janitor.MergeKeys(ctx, conn, int64(quarter))
		return err
	})
	require.Error(t, err, "the merge was cut short")
	require.NoError(t, tx.Rollback(ctx))

	require.Equal(t, before, progress(), "the range cut short is not recorded")
	require.Equal(t, first, db.Int(t, "SELECT count(*) FROM inbox_keys_0"), "nor copied")
	copied, _, _ := mergeRanges(t, db, quarter)
	require.Equal(t, 20000, first+copied)
	require.Equal(t, []string{"8 merged 0", "9 writing 0"}, hotParts(t, db))
	requireInSlot0Once(t, db, 20000)
}
