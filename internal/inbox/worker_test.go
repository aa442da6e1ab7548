package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// effectHandler records each handled message in the effects table (unique
// per message id) inside the worker's transaction, and fails, panics or
// breaks the transaction for the message ids it is told to.
type effectHandler struct {
	failing   map[string]error // message id → error outcome
	breaking  map[string]bool  // message id → run an SQL statement that fails
	panicking map[string]bool

	mu       sync.Mutex
	inFlight map[string]bool
	overlaps []string
	calls    map[string]int
}

func newEffectHandler() *effectHandler {
	return &effectHandler{
		failing: map[string]error{}, breaking: map[string]bool{}, panicking: map[string]bool{},
		inFlight: map[string]bool{}, calls: map[string]int{},
	}
}

func (h *effectHandler) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	h.enter(msgs)
	defer h.leave(msgs)
	out := make([]inbox.Outcome, len(msgs))
	for i, m := range msgs {
		switch {
		case h.panicking[m.MessageID]:
			panic("handler bug for " + m.MessageID)
		case h.breaking[m.MessageID]:
			if _, err := tx.Exec(ctx, "SELECT 1/0"); err != nil {
				return nil, err
			}
		case h.failing[m.MessageID] != nil:
			out[i].Err = h.failing[m.MessageID]
			continue
		}
		if _, err := tx.Exec(ctx, "INSERT INTO effects (message_id) VALUES ($1)", m.MessageID); err != nil {
			return nil, err
		}
		out[i].Result = "done"
	}
	return out, nil
}

func (h *effectHandler) enter(msgs []inbox.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range msgs {
		if h.inFlight[m.MessageID] {
			h.overlaps = append(h.overlaps, m.MessageID)
		}
		h.inFlight[m.MessageID] = true
		h.calls[m.MessageID]++
	}
}

func (h *effectHandler) leave(msgs []inbox.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range msgs {
		delete(h.inFlight, m.MessageID)
	}
}

type workerBundle struct {
	db      *testenv.DB
	handler *effectHandler
}

// leaseEnded is a worker clock that stands lease ahead of the time it was
// made: the claims made before then are past a lease of that length, those
// made since are not. It stands still, so a message stored more than lease
// after it was made is not due by it.
func leaseEnded(lease time.Duration) func() time.Time {
	at := time.Now().Add(lease)
	return func() time.Time { return at }
}

func setupWorker(t *testing.T) *workerBundle {
	t.Helper()
	db := testenv.NewDB(t)
	_, err := db.Pool.Exec(t.Context(), "CREATE TABLE effects (message_id text PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
	require.NoError(t, err)
	return &workerBundle{db: db, handler: newEffectHandler()}
}

func (b *workerBundle) newWorker(t *testing.T, pool *pgxpool.Pool, cfg inbox.WorkerConfig) *inbox.Worker {
	t.Helper()
	cfg.Handler = b.handler
	cfg.Logger = testenv.Logger(t)
	w, err := inbox.NewWorker(pool, &cfg)
	require.NoError(t, err)
	return w
}

// insertMessages stores messages m-0 … m-(n-1) directly, as ingest would,
// each of an order of its own.
func insertMessages(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	var idsAndKeys []string
	for i := range n {
		idsAndKeys = append(idsAndKeys, fmt.Sprintf("m-%d", i), "")
	}
	insertOrdered(t, pool, idsAndKeys...)
}

type inboxRow struct {
	Status     string
	Attempts   int
	LastError  *string
	Result     *string
	Processed  bool
	NextDueInF float64
	// RetryDelay is next_attempt_at less the recorded end of the last
	// attempt: the delay a retry waits from its outcome.
	RetryDelay time.Duration
}

func readRow(t *testing.T, pool *pgxpool.Pool, messageID string) inboxRow {
	t.Helper()
	var r inboxRow
	err := pool.QueryRow(t.Context(), `
		SELECT status, attempts, last_error, result, processed_at IS NOT NULL,
		       extract(epoch FROM next_attempt_at - now())::float8,
		       coalesce(next_attempt_at - (SELECT max(a.finished_at) FROM inbox_attempts a WHERE a.inbox_id = i.id), '0')
		FROM inbox i WHERE message_id = $1`, messageID).
		Scan(&r.Status, &r.Attempts, &r.LastError, &r.Result, &r.Processed, &r.NextDueInF, &r.RetryDelay)
	require.NoError(t, err)
	return r
}

// attemptHistorySQL lists a message's attempts as "attempt outcome process
// build", in order.
const attemptHistorySQL = `
	SELECT format('%s %s %s %s', attempt, outcome, process, build)
	FROM inbox_attempts WHERE message_id = $1 ORDER BY run, attempt`

// runUntilDead runs w's batches until messageID is dead.
func runUntilDead(t *testing.T, w *inbox.Worker, pool *pgxpool.Pool, messageID string) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		return readRow(t, pool, messageID).Status == inbox.StatusDead
	}, 10*time.Second, 5*time.Millisecond)
}

func TestWorker(t *testing.T) {
	t.Parallel()

	t.Run("ProcessesABatchInOneTransaction", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 10)
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{BatchSize: 100})

		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 10, n)
		require.Equal(t, 10, b.db.Int(t, "SELECT count(*) FROM effects"))
		r := readRow(t, b.db.Pool, "m-3")
		require.Equal(t, inbox.StatusProcessed, r.Status)
		require.Equal(t, 1, r.Attempts)
		require.True(t, r.Processed)
		require.Equal(t, "done", *r.Result)

		n, err = w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Zero(t, n, "processed rows are never claimed again")
	})

	t.Run("OneBadMessageDoesNotUndoTheOthers", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 20)
		b.handler.breaking["m-7"] = true // aborts the transaction: forces per-message savepoints
		b.handler.failing["m-12"] = inbox.Permanentf("bad payload")
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{BatchSize: 100, RetryBase: time.Hour, RetryMax: time.Hour})

		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 20, n)

		require.Equal(t, 18, b.db.Int(t, "SELECT count(*) FROM effects"), "every good message committed its effect once")
		broken := readRow(t, b.db.Pool, "m-7")
		require.Equal(t, inbox.StatusPending, broken.Status)
		require.Equal(t, 1, broken.Attempts)
		require.Contains(t, *broken.LastError, "division by zero")
		require.Greater(t, broken.NextDueInF, 60.0, "retried later, not at once")
		dead := readRow(t, b.db.Pool, "m-12")
		require.Equal(t, inbox.StatusDead, dead.Status)
		require.Equal(t, "bad payload", *dead.LastError)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-8").Status)
	})

	t.Run("RetriesThenDeadAfterMaxAttempts", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 2)
		b.handler.failing["m-0"] = errors.New("downstream unavailable")
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: 3, RetryBase: time.Millisecond, RetryMax: 2 * time.Millisecond})

		runUntilDead(t, w, b.db.Pool, "m-0")
		r := readRow(t, b.db.Pool, "m-0")
		require.Equal(t, 3, r.Attempts)
		require.Equal(t, "downstream unavailable", *r.LastError)
		require.Equal(t, 3, b.handler.calls["m-0"])
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-1").Status)
		require.Equal(t, 1, b.db.Int(t, "SELECT count(*) FROM effects"))
	})

	t.Run("TheHistoryRecordsWhenEachAttemptWasClaimed", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		// Every claim as the claim statement set it, whatever clears it after.
		b.db.Exec(t, `CREATE TABLE claims_seen (inbox_id bigint, attempt integer, claimed_at timestamptz);
			CREATE FUNCTION claims_seen() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN INSERT INTO claims_seen VALUES (NEW.id, NEW.attempts, NEW.claimed_at); RETURN NULL; END $$;
			CREATE TRIGGER claims_seen AFTER UPDATE OF claimed_at ON inbox FOR EACH ROW
			WHEN (NEW.claimed_at IS NOT NULL) EXECUTE FUNCTION claims_seen()`)
		insertMessages(t, b.db.Pool, 3)
		b.handler.failing["m-0"] = errors.New("downstream unavailable")
		b.handler.failing["m-1"] = inbox.Permanentf("bad payload")
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: 3, RetryBase: time.Millisecond, RetryMax: 2 * time.Millisecond})

		runUntilDead(t, w, b.db.Pool, "m-0")
		require.Equal(t, 5, b.db.Int(t, "SELECT count(*) FROM inbox_attempts"), "three attempts of m-0, one each of m-1 and m-2")
		require.Equal(t, 5, b.db.Int(t, "SELECT count(*) FROM claims_seen"))
		require.Zero(t, b.db.Int(t, `SELECT count(*) FROM inbox_attempts a
			LEFT JOIN claims_seen c ON c.inbox_id = a.inbox_id AND c.attempt = a.attempt
			WHERE a.started_at IS DISTINCT FROM c.claimed_at OR a.finished_at < a.started_at`),
			"each attempt began when its claim was made")
	})

	t.Run("PanicIsAFailedAttempt", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 3)
		b.handler.panicking["m-1"] = true
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{RetryBase: time.Hour, RetryMax: time.Hour})

		_, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		r := readRow(t, b.db.Pool, "m-1")
		require.Equal(t, inbox.StatusPending, r.Status)
		require.Contains(t, *r.LastError, "handler panicked")
		require.Equal(t, 2, b.db.Int(t, "SELECT count(*) FROM effects"))
	})

	t.Run("WorkersNeverHandleTheSameRowAtOnce", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		const n = 3000
		insertMessages(t, b.db.Pool, n)

		// Two workers on pools of their own, as two processes would have.
		var workers []*inbox.Worker
		for range 2 {
			pool, err := pgxpool.New(t.Context(), b.db.URL)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			w := b.newWorker(t, pool, inbox.WorkerConfig{Concurrency: 4, BatchSize: 50, PollInterval: 10 * time.Millisecond})
			require.NoError(t, w.Start(t.Context()))
			workers = append(workers, w)
		}
		for _, w := range workers {
			w.Notify()
		}
		require.Eventually(t, func() bool { return b.db.Int(t, "SELECT count(*) FROM effects") == n }, 60*time.Second, 20*time.Millisecond)
		for _, w := range workers {
			w.Stop(t.Context())
		}

		b.handler.mu.Lock()
		defer b.handler.mu.Unlock()
		require.Zero(t, len(b.handler.overlaps), "messages handled by two workers at once, e.g. %v",
			b.handler.overlaps[:min(10, len(b.handler.overlaps))])
		require.Len(t, b.handler.calls, n)
		for id, c := range b.handler.calls {
			require.Equal(t, 1, c, "message %s handled %d times", id, c)
		}
		var multi int
		require.NoError(t, b.db.Pool.QueryRow(t.Context(),
			"SELECT count(*) FROM inbox WHERE attempts <> 1 OR status <> 'processed'").Scan(&multi))
		require.Zero(t, multi)
	})

	// What SKIP LOCKED is for: without it, the claim waits for any row
	// lock, here an operator's open transaction, and claims nothing else.
	t.Run("ARowLockedByAnotherSessionDoesNotStallTheClaim", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 10)
		tx, err := b.db.Pool.Begin(t.Context())
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(context.WithoutCancel(t.Context())) }()
		_, err = tx.Exec(t.Context(), "SELECT * FROM inbox WHERE message_id = 'm-0' FOR UPDATE")
		require.NoError(t, err)

		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
		// Bounded only so that a stalled claim fails the test instead of
		// hanging it.
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		n, err := w.RunOnce(ctx)
		require.NoError(t, err, "the claim waited for the locked row")
		require.Equal(t, 9, n, "every unlocked message claimed and handled")
		require.Equal(t, inbox.StatusPending, readRow(t, b.db.Pool, "m-0").Status)
	})

	t.Run("StopRollsBackWhenTheGraceEnds", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		block := make(chan struct{})
		w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
			Logger: testenv.Logger(t),
			Handler: handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
				close(block)
				<-ctx.Done() // a handler stuck until cancelled
				return nil, ctx.Err()
			}),
		})
		require.NoError(t, err)
		require.NoError(t, w.Start(t.Context()))
		w.Notify()
		<-block
		stopCtx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		started := time.Now()
		w.Stop(stopCtx)
		require.Less(t, time.Since(started), 10*time.Second)
		r := readRow(t, b.db.Pool, "m-0")
		require.Equal(t, inbox.StatusPending, r.Status, "an unfinished message stays pending")
	})
}

type handlerFunc func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error)

func (f handlerFunc) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	return f(ctx, tx, msgs)
}

func TestWorkerFailureIsBounded(t *testing.T) {
	t.Parallel()

	t.Run("RetriesOnTheBackoffScheduleThenSucceedsOnce", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		const base = 20 * time.Second
		fails := 3
		// The worker's clock is set ahead past each delay (the delays are
		// counted from the database's clock), not waited out.
		var clock testenv.Clock
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: 5, RetryBase: base, RetryMax: time.Hour, Now: clock.Now})
		b.handler.failing["m-0"] = errors.New("not yet")
		for attempt := 1; attempt <= fails; attempt++ {
			n, err := w.RunOnce(t.Context())
			require.NoError(t, err)
			require.Equal(t, 1, n, "attempt %d was due", attempt)
			r := readRow(t, b.db.Pool, "m-0")
			require.Equal(t, inbox.StatusPending, r.Status)
			require.Equal(t, attempt, r.Attempts)
			// Backoff: base doubled per attempt, jittered between half and
			// all of it, from the recorded outcome (ms precision).
			full := base << (attempt - 1)
			require.GreaterOrEqual(t, r.RetryDelay, full/2-time.Millisecond, "attempt %d", attempt)
			require.LessOrEqual(t, r.RetryDelay, full, "attempt %d", attempt)
			// Five seconds short of the delay: not due yet.
			clock.SetAhead(r.RetryDelay - 5*time.Second)
			n, err = w.RunOnce(t.Context())
			require.NoError(t, err)
			require.Zero(t, n, "not claimed again before it is due")
			clock.SetAhead(r.RetryDelay + time.Second)
		}
		delete(b.handler.failing, "m-0")
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status)
		require.Equal(t, fails+1, readRow(t, b.db.Pool, "m-0").Attempts)
		require.Equal(t, 1, b.db.Int(t, "SELECT count(*) FROM effects"), "effects once")
	})

	// A message whose retries finished is run once more when
	// INBOX_MAX_ATTEMPTS is lowered below its attempts, never marked dead
	// unrun as one whose attempts never finished.
	t.Run("ALoweredLimitNeverKillsAMessageWithoutRunningIt", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 2)
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: 5, RetryBase: time.Millisecond, RetryMax: time.Millisecond})
		b.handler.failing["m-0"] = errors.New("not yet")
		b.handler.failing["m-1"] = errors.New("not yet")
		for attempt := 1; attempt <= 3; attempt++ {
			require.Eventually(t, func() bool {
				_, err := w.RunOnce(t.Context())
				require.NoError(t, err)
				return readRow(t, b.db.Pool, "m-0").Attempts == attempt && readRow(t, b.db.Pool, "m-1").Attempts == attempt
			}, 10*time.Second, time.Millisecond)
		}
		// The limit is lowered to 2: m-0 now succeeds, m-1 fails again.
		delete(b.handler.failing, "m-0")
		lowered := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: 2, RetryBase: time.Millisecond, RetryMax: time.Millisecond})
		require.Eventually(t, func() bool {
			_, err := lowered.RunOnce(t.Context())
			require.NoError(t, err)
			return readRow(t, b.db.Pool, "m-0").Status != inbox.StatusPending && readRow(t, b.db.Pool, "m-1").Status != inbox.StatusPending
		}, 10*time.Second, time.Millisecond)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status, "run, not given up")
		m1 := readRow(t, b.db.Pool, "m-1")
		require.Equal(t, inbox.StatusDead, m1.Status, "dead after running once more")
		require.Equal(t, "not yet", *m1.LastError)
		require.Equal(t, 4, b.handler.calls["m-1"])
	})

	t.Run("ARetryWaitsItsFullDelayAfterALongBatch", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 2)
		w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
			Logger: testenv.Logger(t),
			Handler: handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
				// A long batch: it outlasts the retry delay it asks for.
				if _, err := tx.Exec(ctx, "SELECT pg_sleep(1.5)"); err != nil {
					return nil, err
				}
				outcomes := make([]inbox.Outcome, len(msgs))
				for i := range outcomes {
					outcomes[i].Err = inbox.RetryAfter(time.Second, errors.New("try later"))
				}
				return outcomes, nil
			}),
		})
		require.NoError(t, err)
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 2, n)
		for _, id := range []string{"m-0", "m-1"} {
			r := readRow(t, b.db.Pool, id)
			require.Equal(t, inbox.StatusPending, r.Status)
			require.Equal(t, time.Second, r.RetryDelay, "%s waits its delay from its outcome", id)
		}
	})

	t.Run("RetryAfterOverridesTheBackoff", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		b.handler.failing["m-0"] = inbox.RetryAfter(time.Hour, errors.New("rate limited"))
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{RetryBase: time.Millisecond, RetryMax: time.Millisecond})
		_, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		r := readRow(t, b.db.Pool, "m-0")
		require.Equal(t, inbox.StatusPending, r.Status)
		require.InDelta(t, time.Hour.Seconds(), r.NextDueInF, 5)
		require.Equal(t, "rate limited", *r.LastError)
	})

	t.Run("AttemptsThatNeverFinishedStillCount", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 2)
		const maxAttempts = 3
		// Three workers claim m-0 and die before recording anything, as a
		// handler that kills its process would leave it.
		q := dbsqlc.New()
		claimed, err := q.InboxClaimBatch(t.Context(), b.db.Pool, dbsqlc.InboxClaimBatchParams{
			Process: "host/1", Build: "v1", MaxRows: 1,
		})
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		for i := range maxAttempts - 1 {
			claimed, err := q.InboxClaimUnfinished(t.Context(), b.db.Pool, dbsqlc.InboxClaimUnfinishedParams{MaxRows: 1,
				Process: fmt.Sprintf("host/%d", i+2), Build: "v1",
			})
			require.NoError(t, err)
			require.Len(t, claimed, 1)
		}
		// The dead workers' lease has ended by the worker's clock.
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{MaxAttempts: maxAttempts, ClaimLease: time.Hour,
			Now: leaseEnded(time.Hour), Process: "host/9", Build: "v2"})
		require.Eventually(t, func() bool {
			_, err := w.RunOnce(t.Context())
			require.NoError(t, err)
			return readRow(t, b.db.Pool, "m-0").Status == inbox.StatusDead && readRow(t, b.db.Pool, "m-1").Status == inbox.StatusProcessed
		}, 10*time.Second, 10*time.Millisecond)
		r := readRow(t, b.db.Pool, "m-0")
		require.Contains(t, *r.LastError, "gave up after 3 attempts")
		require.Zero(t, b.handler.calls["m-0"], "not handled again")
		require.Equal(t, 1, b.db.Int(t, "SELECT count(*) FROM effects"))

		// The history names every lost attempt with the process and build
		// that made it, and the attempt that gave up.
		require.Equal(t, []string{
			"1 abandoned host/1 v1",
			"2 abandoned host/2 v1",
			"3 abandoned host/3 v1",
			"4 dead host/9 v2",
		}, b.db.Strings(t, attemptHistorySQL, "m-0"))
		require.Equal(t, []string{"1 processed host/9 v2"}, b.db.Strings(t, attemptHistorySQL, "m-1"))
	})

	t.Run("AWorkerWhoseClaimWasTakenOverLocksNothing", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		q := dbsqlc.New()
		// Worker A claims m-0, then stalls past its lease.
		stalled, err := q.InboxClaimBatch(t.Context(), b.db.Pool, dbsqlc.InboxClaimBatchParams{Process: "a/1", Build: "b", MaxRows: 1})
		require.NoError(t, err)
		require.Len(t, stalled, 1)
		// Worker B takes the message over, past A's lease by its clock, and
		// handles it.
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{ClaimLease: time.Hour, Now: leaseEnded(time.Hour), Process: "b/2"})
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status)
		// And once more pending (a replay), with B's claim on it again.
		_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_requested = true")
		require.NoError(t, err)
		// A wakes up: its claim is not the row's claim, so it locks nothing.
		tx, err := b.db.Pool.Begin(t.Context())
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(t.Context()) }()
		locked, err := q.InboxLockClaimed(t.Context(), tx, dbsqlc.InboxLockClaimedParams{
			Ids: []int64{stalled[0].ID}, ClaimedAts: []time.Time{stalled[0].ClaimedAt},
		})
		require.NoError(t, err)
		require.Empty(t, locked, "a claim that was taken over is not this worker's any more")
		require.Equal(t, 1, b.handler.calls["m-0"], "handled once")
		require.Equal(t, []string{"1 abandoned a/1 b", "2 processed b/2 unknown"}, b.db.Strings(t, attemptHistorySQL, "m-0"))
	})

	t.Run("AClaimedMessageIsLeftAloneDuringItsLease", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		_, err := dbsqlc.New().InboxClaimBatch(t.Context(), b.db.Pool, dbsqlc.InboxClaimBatchParams{Process: "p", Build: "b", MaxRows: 1})
		require.NoError(t, err)
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{ClaimLease: time.Hour})
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Zero(t, n)
	})

	t.Run("AClaimIsTakenOverOnceItsProcessIsDeadBeforeItsLease", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertMessages(t, b.db.Pool, 1)
		// Another process holds its liveness lock on a session of its own,
		// and claims the message under that key.
		const key = 4_000_000_000_123
		live := b.db.Session(t)
		q := dbsqlc.New()
		_, err := q.InboxHoldLiveness(t.Context(), live, key)
		require.NoError(t, err)
		_, err = q.InboxClaimBatch(t.Context(), b.db.Pool, dbsqlc.InboxClaimBatchParams{Process: "p", Build: "b", MaxRows: 1, Session: key})
		require.NoError(t, err)
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{ClaimLease: time.Hour})
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Zero(t, n, "left alone while its process is alive")

		// The process dies: its session ends, and the lock with it, as soon
		// as the server has seen the connection close. Another session takes
		// the key's lock at once (any login may: the key shows in pg_locks),
		// which keeps nothing alive: the key is live only in the session
		// that registered it.
		squatter := b.db.Session(t)
		squatted := make(chan error, 1)
		go func() {
			_, err := squatter.Exec(context.Background(), "SELECT pg_advisory_lock($1)", int64(key))
			squatted <- err
		}()
		require.NoError(t, live.Close(t.Context()))
		require.NoError(t, <-squatted)
		require.Eventually(t, func() bool {
			n, err := w.RunOnce(t.Context())
			require.NoError(t, err)
			return n == 1
		}, 10*time.Second, 10*time.Millisecond, "taken over at once, an hour before the lease")
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status)
		history := b.db.Strings(t, attemptHistorySQL, "m-0")
		require.Len(t, history, 2)
		require.Equal(t, "1 abandoned p b", history[0])
	})
}

func TestWorkerHandlerTimeout(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 3)
	inner := b.handler
	// Long enough that the others' shares of what is left (a third each,
	// once m-1 has used half) hold their statements on a loaded machine:
	// with 200 ms, a share of 33 ms ran out inside m-0's insert once in CI,
	// and this pool closes the connection on a context that ends in a query.
	w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
		Logger:         testenv.Logger(t),
		HandlerTimeout: 2 * time.Second,
		RetryBase:      time.Hour,
		RetryMax:       time.Hour,
		Handler: handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
			for _, m := range msgs {
				if m.MessageID == "m-1" {
					<-ctx.Done() // stuck until the timeout
					return nil, ctx.Err()
				}
			}
			return inner.HandleBatch(ctx, tx, msgs)
		}),
	})
	require.NoError(t, err)
	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	stuck := readRow(t, b.db.Pool, "m-1")
	require.Equal(t, inbox.StatusPending, stuck.Status)
	require.Contains(t, *stuck.LastError, "context deadline exceeded")
	require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-0").Status)
	require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-2").Status)
}

// Acceptance: a handler stuck inside a query past the handler timeout. The
// query is cancelled, not the connection: the batch ends within its one
// timeout, the stuck message has failed one attempt, every other message of
// the batch is handled, no attempt is abandoned, and another worker goes on
// meanwhile.
func TestWorkerHandlerStuckInAQuery(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 5)
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.BuildContextWatcherHandler = pipeline.CancelQueryOnContextEnd // as inboxd configures its pools

	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	stuck := make(chan struct{})
	var once sync.Once
	inner := b.handler
	w, err := inbox.NewWorker(pool, &inbox.WorkerConfig{
		Logger:         testenv.Logger(t),
		HandlerTimeout: 2 * time.Second,
		RetryBase:      time.Hour,
		RetryMax:       time.Hour,
		Handler: handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
			for _, m := range msgs {
				if m.MessageID == "m-2" {
					once.Do(func() { close(stuck) })
					if _, err := tx.Exec(ctx, "SELECT pg_sleep(60)"); err != nil {
						return nil, err
					}
				}
			}
			return inner.HandleBatch(ctx, tx, msgs)
		}),
	})
	require.NoError(t, err)

	ran := make(chan error, 1)
	go func() {
		_, err := w.RunOnce(t.Context())
		ran <- err
	}()
	<-stuck
	// Meanwhile another worker handles a message that arrived since.
	insertOrdered(t, b.db.Pool, "other", "")
	other := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
	n, err := other.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "other").Status)

	require.NoError(t, <-ran)
	r := readRow(t, b.db.Pool, "m-2")
	require.Equal(t, inbox.StatusPending, r.Status)
	require.Equal(t, 1, r.Attempts)
	require.Contains(t, *r.LastError, "canceling statement due to user request")
	// The messages after m-2 are handled in the batch's time left; on a
	// loaded machine none may be left, and they then wait a second without
	// an attempt counted, for the next claim.
	require.Eventually(t, func() bool {
		_, err := other.RunOnce(t.Context())
		require.NoError(t, err)
		for _, id := range []string{"m-0", "m-1", "m-3", "m-4"} {
			if readRow(t, b.db.Pool, id).Status != inbox.StatusProcessed {
				return false
			}
		}
		return true
	}, 20*time.Second, 200*time.Millisecond, "every message but m-2 processed")
	for _, id := range []string{"m-0", "m-1", "m-3", "m-4"} {
		require.Zero(t, b.db.Int(t, "SELECT count(*) FROM inbox_attempts WHERE message_id = $1 AND outcome <> 'processed'", id), id)
	}
	require.Equal(t, []string{"1 retry"}, b.db.Strings(t,
		"SELECT format('%s %s', attempt, outcome) FROM inbox_attempts WHERE message_id = 'm-2'"), "one failed attempt, none abandoned")
}

// insertOrdered stores messages with the given ids and order keys, in order.
func insertOrdered(t *testing.T, pool *pgxpool.Pool, idsAndKeys ...string) {
	t.Helper()
	p := dbsqlc.InboxInsertManyParams{}
	for i := 0; i < len(idsAndKeys); i += 2 {
		p.MessageIds = append(p.MessageIds, idsAndKeys[i])
		p.OrderKeys = append(p.OrderKeys, idsAndKeys[i+1])
		p.MessageTypes = append(p.MessageTypes, "test")
		p.RoutingKeys = append(p.RoutingKeys, "test")
		p.Payloads = append(p.Payloads, []byte(`{}`))
	}
	ids, err := dbsqlc.New().InboxInsertMany(t.Context(), pool, p)
	require.NoError(t, err)
	require.Len(t, ids, len(p.MessageIds))
}

// orderRecorder records the order in which messages were handled.
type orderRecorder struct {
	*effectHandler
	mu   sync.Mutex
	seen []string
}

func (r *orderRecorder) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	out, err := r.effectHandler.HandleBatch(ctx, tx, msgs)
	if err == nil {
		r.mu.Lock()
		for i, m := range msgs {
			if out[i].Err == nil {
				r.seen = append(r.seen, m.MessageID)
			}
		}
		r.mu.Unlock()
	}
	return out, err
}

func heldBack(t *testing.T, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	rows, err := pool.Query(t.Context(), "SELECT order_key, blocking_message_id FROM inbox_held_back")
	require.NoError(t, err)
	held := map[string]string{}
	for rows.Next() {
		var k, m string
		require.NoError(t, rows.Scan(&k, &m))
		held[k] = m
	}
	require.NoError(t, rows.Err())
	return held
}

func TestWorkerKeepsEachOrderInArrivalOrder(t *testing.T) {
	t.Parallel()

	t.Run("ARetryHoldsBackOnlyItsOwnOrder", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertOrdered(t, b.db.Pool, "a1", "A", "b1", "B", "a2", "A", "b2", "B", "a3", "A", "x1", "")
		b.handler.failing["a1"] = errors.New("not yet")
		rec := &orderRecorder{effectHandler: b.handler}
		w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
			Handler: rec, Logger: testenv.Logger(t), RetryBase: 300 * time.Millisecond, RetryMax: 300 * time.Millisecond,
		})
		require.NoError(t, err)

		for range 3 {
			_, err := w.RunOnce(t.Context())
			require.NoError(t, err)
		}
		require.ElementsMatch(t, []string{"b1", "b2", "x1"}, rec.seen, "order B and unordered messages flow while A waits")
		require.Equal(t, inbox.StatusPending, readRow(t, b.db.Pool, "a2").Status)
		require.Equal(t, map[string]string{"A": "a1"}, heldBack(t, b.db.Pool), "the view names the held-back order and its blocker")

		delete(b.handler.failing, "a1")
		require.Eventually(t, func() bool {
			_, err := w.RunOnce(t.Context())
			require.NoError(t, err)
			return readRow(t, b.db.Pool, "a3").Status == inbox.StatusProcessed
		}, 10*time.Second, 20*time.Millisecond)
		var a []string
		for _, id := range rec.seen {
			if id[0] == 'a' {
				a = append(a, id)
			}
		}
		require.Equal(t, []string{"a1", "a2", "a3"}, a, "order A in arrival order")
		require.Empty(t, heldBack(t, b.db.Pool))
	})

	t.Run("ADeadMessageHoldsItsOrderUntilSkippedWithSQL", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertOrdered(t, b.db.Pool, "a1", "A", "a2", "A", "b1", "B")
		b.handler.failing["a1"] = inbox.Permanentf("bad")
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
		for range 3 {
			_, err := w.RunOnce(t.Context())
			require.NoError(t, err)
		}
		require.Equal(t, inbox.StatusDead, readRow(t, b.db.Pool, "a1").Status)
		require.Equal(t, inbox.StatusPending, readRow(t, b.db.Pool, "a2").Status)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "b1").Status)
		require.Equal(t, map[string]string{"A": "a1"}, heldBack(t, b.db.Pool))

		// The operator skips the dead message (docs/operations.md's statement).
		_, err := b.db.Pool.Exec(t.Context(), `
			UPDATE inbox SET status = 'processed', result = 'skipped by operator', processed_at = now()
			WHERE message_id = 'a1' AND status = 'dead'`)
		require.NoError(t, err)
		_, err = w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "a2").Status)
		require.Empty(t, heldBack(t, b.db.Pool))
	})

	t.Run("ADeadMessageReplayedWithSQLRunsBeforeTheRest", func(t *testing.T) {
		t.Parallel()
		b := setupWorker(t)
		insertOrdered(t, b.db.Pool, "a1", "A", "a2", "A")
		b.handler.failing["a1"] = inbox.Permanentf("bad")
		w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
		_, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, inbox.StatusDead, readRow(t, b.db.Pool, "a1").Status)

		delete(b.handler.failing, "a1") // the cause is fixed
		_, err = b.db.Pool.Exec(t.Context(), `
			UPDATE inbox SET status = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL
			WHERE message_id = 'a1' AND status = 'dead'`)
		require.NoError(t, err)
		for range 2 {
			_, err = w.RunOnce(t.Context())
			require.NoError(t, err)
		}
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "a1").Status)
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "a2").Status)
	})
}

// replayRecorder records whether each message was handed over as a replay.
type replayRecorder struct {
	*effectHandler
	mu      sync.Mutex
	replays map[string]bool
}

func (r *replayRecorder) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	r.mu.Lock()
	for _, m := range msgs {
		r.replays[m.MessageID] = m.Replay
	}
	r.mu.Unlock()
	out := make([]inbox.Outcome, len(msgs))
	for i, m := range msgs {
		if err := r.failing[m.MessageID]; err != nil {
			out[i].Err = err
			continue
		}
		// The effect is idempotent, as a real handler's must be.
		if _, err := tx.Exec(ctx, "INSERT INTO effects (message_id) VALUES ($1) ON CONFLICT DO NOTHING", m.MessageID); err != nil {
			return nil, err
		}
		out[i].Result = "done"
	}
	return out, nil
}

func TestReplayBySQLFlag(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 3)
	b.handler.failing["m-1"] = inbox.Permanentf("bad")
	rec := &replayRecorder{effectHandler: b.handler, replays: map[string]bool{}}
	w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{Handler: rec, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDead, readRow(t, b.db.Pool, "m-1").Status)
	require.False(t, rec.replays["m-0"])

	// The operator replays the processed m-0 and the dead m-1, with a reason.
	delete(b.handler.failing, "m-1")
	tag, err := b.db.Pool.Exec(t.Context(), `
		UPDATE inbox SET replay_requested = true, replay_reason = 'fixed the data'
		WHERE message_id IN ('m-0', 'm-1')`)
	require.NoError(t, err)
	require.EqualValues(t, 2, tag.RowsAffected())
	var status, by, reason string
	var count, attempts int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), `
		SELECT status, replay_count, replayed_by, replay_reason, attempts FROM inbox WHERE message_id = 'm-1'`).
		Scan(&status, &count, &by, &reason, &attempts))
	require.Equal(t, inbox.StatusPending, status)
	require.Equal(t, 1, count)
	require.NotEmpty(t, by, "recorded by the database: current_user")
	require.Equal(t, "fixed the data", reason)
	require.Zero(t, attempts, "a replay starts with fresh attempts")

	_, err = w.RunOnce(t.Context())
	require.NoError(t, err)
	for _, id := range []string{"m-0", "m-1"} {
		r := readRow(t, b.db.Pool, id)
		require.Equal(t, inbox.StatusProcessed, r.Status, id)
		require.True(t, rec.replays[id], "the handler was told %s is a replay", id)
	}
	var flagged int
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM inbox WHERE replay_requested").Scan(&flagged))
	require.Zero(t, flagged, "flags cleared when done")
	require.Equal(t, 3, b.db.Int(t, "SELECT count(*) FROM effects"), "the replay doubled no effect")

	// Only a replay changes the audit columns; a flag on a pending row is dropped.
	_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_count = 99, replayed_by = 'someone' WHERE message_id = 'm-0'")
	require.NoError(t, err)
	insertMessages2 := dbsqlc.InboxInsertManyParams{MessageIds: []string{"p-0"}, MessageTypes: []string{"test"}, RoutingKeys: []string{""}, Payloads: [][]byte{[]byte("{}")}, OrderKeys: []string{""}}
	_, err = dbsqlc.New().InboxInsertMany(t.Context(), b.db.Pool, insertMessages2)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_requested = true WHERE message_id = 'p-0'")
	require.NoError(t, err)
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT replay_count, replayed_by FROM inbox WHERE message_id = 'm-0'").Scan(&count, &by))
	require.Equal(t, 1, count)
	require.NotEqual(t, "someone", by)
	require.NoError(t, b.db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM inbox WHERE replay_requested").Scan(&flagged))
	require.Zero(t, flagged)
	// The reason goes with its replay: rewritten outside one, it stays.
	_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_reason = 'rewritten' WHERE message_id = 'm-0'")
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_requested = true, replay_reason = 'dropped with its flag' WHERE message_id = 'p-0'")
	require.NoError(t, err)
	require.Equal(t, []string{"m-0 fixed the data", "p-0 "}, b.db.Strings(t,
		"SELECT message_id || ' ' || coalesce(replay_reason, '') FROM inbox WHERE message_id IN ('m-0', 'p-0') ORDER BY message_id"))
}

func TestWorkerStoresAnyErrorText(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 2)
	b.handler.failing["m-0"] = inbox.Permanentf("bad \x00 byte and \xff invalid UTF-8")
	w := b.newWorker(t, b.db.Pool, inbox.WorkerConfig{})
	_, err := w.RunOnce(t.Context())
	require.NoError(t, err)
	r := readRow(t, b.db.Pool, "m-0")
	require.Equal(t, inbox.StatusDead, r.Status)
	require.Equal(t, "bad  byte and \uFFFD invalid UTF-8", *r.LastError)
	require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, "m-1").Status)
}

// slowHandler holds the batch that has the message slow until released,
// and handles every other batch as effectHandler does.
type slowHandler struct {
	*effectHandler
	entered, release chan struct{}
}

func (h *slowHandler) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	for _, m := range msgs {
		if m.MessageID == "slow" {
			close(h.entered)
			select {
			case <-h.release:
			case <-ctx.Done():
			}
		}
	}
	return h.effectHandler.HandleBatch(ctx, tx, msgs)
}

// Acceptance: a batch that runs far past the claim lease (a lock held that
// long) is never taken over and never pauses the worker's other batches:
// the messages that arrive meanwhile are handled while it is still running.
func TestASlowBatchSlowsOnlyItself(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	h := &slowHandler{effectHandler: b.handler, entered: make(chan struct{}), release: make(chan struct{})}
	// The worker's clock is the real one until the slow batch runs, then
	// stands a lease past its start.
	var clock atomic.Pointer[func() time.Time]
	w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
		Now: func() time.Time {
			if c := clock.Load(); c != nil {
				return (*c)()
			}
			return time.Now()
		},
		Handler: h, Logger: testenv.Logger(t), Concurrency: 2, BatchSize: 10,
		PollInterval: 20 * time.Millisecond, HandlerTimeout: time.Minute,
		// The clock below stands a lease ahead, still: the messages stored
		// within a lease after the slow batch began are due by it (a
		// second was too short for the twenty on a loaded machine).
		ClaimLease: time.Minute,
	})
	require.NoError(t, err)
	insertOrdered(t, b.db.Pool, "slow", "")
	require.NoError(t, w.Start(t.Context()))
	t.Cleanup(func() { w.Stop(context.WithoutCancel(t.Context())) })
	<-h.entered
	past := leaseEnded(time.Minute) // the slow batch's claim is past its lease
	clock.Store(&past)

	for i := range 20 {
		insertOrdered(t, b.db.Pool, fmt.Sprintf("m-%d", i), "")
		w.Notify()
		require.Eventually(t, func() bool {
			return b.db.Int(t, "SELECT count(*) FROM effects WHERE message_id = $1", fmt.Sprintf("m-%d", i)) == 1
		}, 5*time.Second, 5*time.Millisecond, "m-%d handled while the slow batch runs", i)
	}
	close(h.release)
	require.Eventually(t, func() bool {
		return readRow(t, b.db.Pool, "slow").Status == inbox.StatusProcessed
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, readRow(t, b.db.Pool, "slow").Attempts, "the live claim was not taken over")
	require.Zero(t, b.db.Int(t, "SELECT count(*) FROM inbox_attempts WHERE outcome = 'abandoned'"))
}

// A worker claims only once its liveness key is held: a claim taken before
// carries none, so it is taken over only once its lease ends, even when
// the process dies at once (TestADeadReplicasClaimsAreTakenOverBeforeTheLease
// failed so on a loaded machine). Here another session keeps the liveness
// session from registering its key for a while.
func TestTheWorkerClaimsOnceItsLivenessKeyIsHeld(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	ctx := t.Context()
	blocker, err := b.db.Session(t).Begin(ctx)
	require.NoError(t, err)
	_, err = blocker.Exec(ctx, "LOCK TABLE inbox_sessions IN EXCLUSIVE MODE")
	require.NoError(t, err)

	w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{
		Handler: b.handler, Logger: testenv.Logger(t), Concurrency: 2, BatchSize: 10,
		PollInterval: 20 * time.Millisecond, HandlerTimeout: time.Minute,
	})
	require.NoError(t, err)
	insertOrdered(t, b.db.Pool, "m-1", "")
	require.NoError(t, w.Start(ctx))
	t.Cleanup(func() { w.Stop(context.WithoutCancel(ctx)) })
	time.Sleep(500 * time.Millisecond)
	require.Zero(t, b.db.Int(t, "SELECT count(*) FROM inbox WHERE claimed_at IS NOT NULL OR status <> 'pending'"),
		"nothing is claimed before the liveness key is held")

	require.NoError(t, blocker.Rollback(ctx))
	require.Eventually(t, func() bool {
		return readRow(t, b.db.Pool, "m-1").Status == inbox.StatusProcessed
	}, 10*time.Second, 10*time.Millisecond)
}

// A batch whose database connection is lost while the handler runs (here
// its backend is terminated, as a failover or a restart does) was not the
// messages' failure: the worker gives the claims back before it claims
// again, and the messages are handled at once, their one attempt the one
// that handled them, with no abandoned attempt for the takeover to count.
func TestAConnectionLostWhileHandlingSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 3)
	var terminated bool
	handler := handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
		if !terminated {
			terminated = true
			_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			return nil, err
		}
		return b.handler.HandleBatch(ctx, tx, msgs)
	})
	w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{Handler: handler, Logger: testenv.Logger(t), BatchSize: 10})
	require.NoError(t, err)

	_, err = w.RunOnce(t.Context())
	require.Error(t, err, "the batch lost its connection")
	// The terminated backend may hold its row locks for a moment after its
	// client has seen the error: the claims are given back once it lets
	// go, within a few steps, not after the lease.
	var n int
	for step := 0; n == 0 && step < 50; step++ {
		n, err = w.RunOnce(t.Context())
		require.NoError(t, err)
		if n == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	require.Equal(t, 3, n, "claimed again at once, not after the lease")
	for i := range 3 {
		id := fmt.Sprintf("m-%d", i)
		r := readRow(t, b.db.Pool, id)
		require.Equal(t, inbox.StatusProcessed, r.Status, id)
		require.Equal(t, 1, r.Attempts, "%s: the lost attempt was given back", id)
		require.Equal(t, []string{"1 processed"}, b.db.Strings(t,
			"SELECT format('%s %s', attempt, outcome) FROM inbox_attempts WHERE message_id = $1 ORDER BY attempt", id))
	}
}

// A row another session holds between a worker's claim and its batch's lock
// (an operator's SELECT … FOR UPDATE left open, no timeout set) is skipped,
// not waited for: the rest of the batch is handled at once, and the held
// message is given back, its attempt not counted, and handled once the row
// is free.
func TestARowHeldBetweenClaimAndLockHoldsOnlyItself(t *testing.T) {
	t.Parallel()
	b := setupWorker(t)
	insertMessages(t, b.db.Pool, 3)
	holder, err := b.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(context.WithoutCancel(t.Context())) }()

	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	var acquired atomic.Int32
	cfg.PrepareConn = func(ctx context.Context, _ *pgx.Conn) (bool, error) {
		// The first acquire is the claim's, the second the batch's: the
		// row is taken between the two.
		if acquired.Add(1) == 2 {
			_, err := holder.Exec(ctx, "SELECT 1 FROM inbox WHERE message_id = 'm-1' FOR UPDATE")
			return err == nil, err
		}
		return true, nil
	}
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	w := b.newWorker(t, pool, inbox.WorkerConfig{BatchSize: 10})

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n, err := w.RunOnce(ctx)
	require.NoError(t, err, "the batch did not wait for the held row")
	require.Equal(t, 3, n)
	for _, id := range []string{"m-0", "m-2"} {
		require.Equal(t, inbox.StatusProcessed, readRow(t, b.db.Pool, id).Status, id)
	}
	require.Equal(t, inbox.StatusPending, readRow(t, b.db.Pool, "m-1").Status)

	// While the row is held its claim cannot be given back either: the
	// worker neither waits for it nor takes it over.
	n, err = w.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "nothing claimed while the row is held")
	require.NoError(t, holder.Rollback(t.Context()))
	n, err = w.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "given back and claimed again once free")
	r := readRow(t, b.db.Pool, "m-1")
	require.Equal(t, inbox.StatusProcessed, r.Status)
	require.Equal(t, 1, r.Attempts, "the attempt given back")
	require.Equal(t, []string{"1 processed"}, b.db.Strings(t,
		"SELECT format('%s %s', attempt, outcome) FROM inbox_attempts WHERE message_id = 'm-1' ORDER BY attempt"))
}

// A handler that tries to end the worker's transaction is refused: its
// effects and the messages' outcomes commit together or not at all, so
// the batch is undone and each message fails an attempt, its effects
// left out.
func TestAHandlerCannotEndTheWorkersTransaction(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			b := setupWorker(t)
			insertMessages(t, b.db.Pool, 2)
			handler := handlerFunc(func(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
				out, err := b.handler.HandleBatch(ctx, tx, msgs)
				if err != nil {
					return nil, err
				}
				if end == "commit" {
					err = tx.Commit(ctx)
				} else {
					err = tx.Rollback(ctx)
				}
				if err != nil {
					return nil, fmt.Errorf("%s: %w", end, err)
				}
				return out, nil
			})
			w, err := inbox.NewWorker(b.db.Pool, &inbox.WorkerConfig{Handler: handler, Logger: testenv.Logger(t), BatchSize: 10,
				MaxAttempts: 5, RetryBase: time.Hour, RetryMax: time.Hour})
			require.NoError(t, err)

			n, err := w.RunOnce(t.Context())
			require.NoError(t, err)
			require.Equal(t, 2, n)
			require.Zero(t, b.db.Int(t, "SELECT count(*) FROM effects"), "no effect committed without its outcome")
			for i := range 2 {
				r := readRow(t, b.db.Pool, fmt.Sprintf("m-%d", i))
				require.Equal(t, inbox.StatusPending, r.Status)
				require.Equal(t, 1, r.Attempts)
				require.Contains(t, *r.LastError, "must not end the worker's transaction")
			}
		})
	}
}

// TestOutcomesTakeNoMultiXact: the work transaction locks the claimed rows
// and then records their outcomes. Recorded inside a subtransaction (the
// batch's savepoint, or a message's), each row would have two lockers,
// the transaction and its subtransaction, and PostgreSQL would write a
// MultiXact for every message: WAL, look-ups of it by every session that
// reads the row, and MultiXact ids spent that anti-wraparound vacuums must
// then freeze. No row version may carry one, whether the batch succeeded
// or went message by message.
func TestOutcomesTakeNoMultiXact(t *testing.T) {
	t.Parallel()
	db := testenv.NewDBAlone(t) // pageinspect, an extension of its own database
	db.Exec(t, "CREATE EXTENSION pageinspect")
	db.Exec(t, "CREATE TABLE effects (message_id text PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
	b := &workerBundle{db: db, handler: newEffectHandler()}
	insertMessages(t, db.Pool, 20)
	b.handler.breaking["m-7"] = true // the batch fails, and goes message by message
	w := b.newWorker(t, db.Pool, inbox.WorkerConfig{BatchSize: 10, MaxAttempts: 5, RetryBase: time.Hour, RetryMax: time.Hour})
	for range 2 {
		n, err := w.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 10, n)
	}
	require.Equal(t, 19, db.Int(t, "SELECT count(*) FROM inbox WHERE status = 'processed'"))
	// HEAP_XMAX_IS_MULTI (0x1000) on any row version of the inbox's pages.
	require.Zero(t, db.Int(t, `
		SELECT count(*)
		FROM generate_series(0, pg_relation_size('inbox') / current_setting('block_size')::int - 1) AS p,
		     heap_page_items(get_raw_page('inbox', p::int))
		WHERE t_infomask & 4096 <> 0`), "row versions whose xmax is a MultiXact")
}
