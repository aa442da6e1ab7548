package statuspage

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// errNotFound is returned for a message id with no inbox row.
var errNotFound = errors.New("no such message")

// reader reads the views, each read in one read-only transaction whose
// statements all run under a short statement_timeout, and counts the
// queries it runs by name.
type reader struct {
	pool    *pgxpool.Pool
	timeout time.Duration
	maxRows int32
	q       *dbsqlc.Queries

	mu     sync.Mutex
	counts map[string]int64
}

func newReader(pool *pgxpool.Pool, timeout time.Duration, maxRows int) *reader {
	return &reader{pool: pool, timeout: timeout, maxRows: int32(maxRows), q: dbsqlc.New(), counts: map[string]int64{}}
}

func (r *reader) count(name string) {
	r.mu.Lock()
	r.counts[name]++
	r.mu.Unlock()
}

// queryCounts returns how many times each query ran.
func (r *reader) queryCounts() map[string]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.counts)
}

// inTx runs fn in a read-only, repeatable-read transaction (one snapshot
// for every view), the whole bounded by r.timeout.
func (r *reader) inTx(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	tx, err := r.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return fmt.Errorf("begin status page read: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := r.q.StatusPageSetTimeout(ctx, tx, strconv.FormatInt(r.timeout.Milliseconds(), 10)); err != nil {
		return fmt.Errorf("set status page statement timeout: %w", err)
	}
	if err := fn(ctx, tx); err != nil {
		return err
	}
	return tx.Commit(context.WithoutCancel(ctx))
}

// overview reads every section of the page but the service's own state.
func (r *reader) overview(ctx context.Context) (*Overview, error) {
	o := &Overview{}
	sections := []func(context.Context, pgx.Tx, *Overview) error{
		r.inboxNow, r.outboxNow, r.throughput, r.deadByError, r.failuresByBuild,
		r.dead, r.heldBack, r.replays, r.conflicts, r.lockHolders,
	}
	err := r.inTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		for _, read := range sections {
			if err := read(ctx, tx, o); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return o, nil
}

// inboxNow reads inbox_overview.
func (r *reader) inboxNow(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_overview")
	in, err := r.q.StatusPageInboxOverview(ctx, tx)
	if err != nil {
		return fmt.Errorf("read inbox_overview: %w", err)
	}
	o.Inbox = &InboxNow{
		Pending: in.Pending, InProgress: in.InProgress, WaitingRetry: in.WaitingRetry,
		ReplaysWaiting: in.ReplaysWaiting, Dead: in.Dead, Processed: in.Processed,
		OldestPendingSeconds: in.OldestPendingSeconds, ProcessedLastMinute: in.ProcessedLastMinute,
		PerSecondLast5Minutes: in.PerSecondLast5Minutes, FailedAttemptsLast5Minutes: in.FailedAttemptsLast5Minutes,
		ConflictingIDs: in.ConflictingIds, LastProcessedAt: anyTime(in.LastProcessedAt),
	}
	return nil
}

// outboxNow reads outbox_backlog.
func (r *reader) outboxNow(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("outbox_backlog")
	ob, err := r.q.StatusPageOutboxBacklog(ctx, tx)
	if err != nil {
		return fmt.Errorf("read outbox_backlog: %w", err)
	}
	o.Outbox = &OutboxNow{Unpublished: ob.Unpublished, Failing: ob.Failing, OldestSeconds: ob.OldestSeconds, Dead: ob.Dead,
		RepliesUnpublished: ob.RepliesUnpublished, RepliesUndeliverable: ob.RepliesUndeliverable}
	return nil
}

// throughput reads the last 15 minutes.
func (r *reader) throughput(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_throughput")
	minutes, err := r.q.StatusPageThroughput(ctx, tx)
	if err != nil {
		return fmt.Errorf("read inbox_throughput: %w", err)
	}
	for _, m := range minutes {
		o.Throughput = append(o.Throughput, Minute(m))
	}
	return nil
}

// deadByError reads inbox_dead_by_error.
func (r *reader) deadByError(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_dead_by_error")
	byError, err := r.q.StatusPageDeadByError(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_dead_by_error: %w", err)
	}
	for _, e := range byError {
		o.DeadByError = append(o.DeadByError, DeadError{
			LastError: text(e.LastError), Messages: e.Messages, MessageTypes: e.MessageTypes,
			FirstDiedAt: anyTime(e.FirstDiedAt), LastDiedAt: anyTime(e.LastDiedAt),
			ReplaySQL: replayByErrorSQL(text(e.LastError)),
		})
	}
	return nil
}

// failuresByBuild reads inbox_failures_by_build.
func (r *reader) failuresByBuild(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_failures_by_build")
	byBuild, err := r.q.StatusPageFailuresByBuild(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_failures_by_build: %w", err)
	}
	for _, b := range byBuild {
		o.FailuresByBuild = append(o.FailuresByBuild, BuildFailure{
			Build: b.Build, Outcome: b.Outcome, Attempts: b.Attempts, Messages: b.Messages,
			FirstAt: b.FirstAt, LastAt: b.LastAt, ReplaySQL: replayByBuildSQL(b.Build),
		})
	}
	return nil
}

// dead reads inbox_dead.
func (r *reader) dead(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_dead")
	dead, err := r.q.StatusPageDead(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_dead: %w", err)
	}
	for _, d := range dead {
		o.Dead = append(o.Dead, DeadMessage{
			MessageID: d.MessageID, MessageType: d.MessageType, Attempts: d.Attempts,
			LastError: text(d.LastError), DiedAt: d.DiedAt, ReplayCount: d.ReplayCount, LastBuild: d.LastBuild,
		})
	}
	return nil
}

// heldBack reads inbox_held_back.
func (r *reader) heldBack(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_held_back")
	held, err := r.q.StatusPageHeldBack(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_held_back: %w", err)
	}
	for _, h := range held {
		o.HeldBack = append(o.HeldBack, HeldOrder{
			OrderKey: h.OrderKey.String, BlockingMessageID: h.BlockingMessageID,
			BlockingMessageType: h.BlockingMessageType, BlockingStatus: h.BlockingStatus,
			Attempts: h.Attempts, LastError: text(h.LastError), NextAttemptAt: h.NextAttemptAt,
			HeldMessages: h.HeldMessages, OldestHeldReceivedAt: h.OldestHeldReceivedAt,
		})
	}
	return nil
}

// replays reads the latest replays.
func (r *reader) replays(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_replays")
	replays, err := r.q.StatusPageReplays(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read replays: %w", err)
	}
	for _, p := range replays {
		o.Replays = append(o.Replays, Replay{
			MessageID: p.MessageID, ReplayCount: p.ReplayCount, ReplayedAt: p.ReplayedAt,
			ReplayedBy: text(p.ReplayedBy), ReplayReason: text(p.ReplayReason), Status: p.Status, Result: text(p.Result),
		})
	}
	return nil
}

// conflicts reads inbox_conflicts.
func (r *reader) conflicts(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_conflicts")
	conflicts, err := r.q.StatusPageConflicts(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_conflicts: %w", err)
	}
	for _, c := range conflicts {
		o.Conflicts = append(o.Conflicts, Conflict(c))
	}
	return nil
}

// lockHolders reads inbox_lock_holders.
func (r *reader) lockHolders(ctx context.Context, tx pgx.Tx, o *Overview) error {
	r.count("inbox_lock_holders")
	holders, err := r.q.StatusPageLockHolders(ctx, tx, r.maxRows)
	if err != nil {
		return fmt.Errorf("read inbox_lock_holders: %w", err)
	}
	for _, h := range holders {
		o.LockHolders = append(o.LockHolders, LockHolder{
			Pid: h.Pid, User: h.Usename, ApplicationName: h.ApplicationName, ClientAddr: h.ClientAddr, State: h.State,
			XactStart: h.XactStart, OpenSeconds: h.OpenSeconds, Tables: h.Tables, EndSQL: h.EndSql,
		})
	}
	return nil
}

// message reads one message's inbox row and its attempts; errNotFound when
// no row has the id.
func (r *reader) message(ctx context.Context, messageID string) (*Message, error) {
	m := &Message{}
	err := r.inTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		r.count("inbox")
		row, err := r.q.StatusPageMessage(ctx, tx, messageID)
		if errors.Is(err, pgx.ErrNoRows) {
			return errNotFound
		}
		if err != nil {
			return fmt.Errorf("read message: %w", err)
		}
		m.Found = true
		m.Inbox = &InboxRow{
			ID: row.ID, MessageID: row.MessageID, MessageType: row.MessageType, RoutingKey: row.RoutingKey,
			Status: row.Status, Attempts: row.Attempts, LastError: text(row.LastError), Result: text(row.Result),
			ReceivedAt: row.ReceivedAt, NextAttemptAt: row.NextAttemptAt, ClaimedAt: row.ClaimedAt,
			ClaimedBy: text(row.ClaimedBy), ClaimedBuild: text(row.ClaimedBuild), ProcessedAt: row.ProcessedAt,
			ReplayRequested: row.ReplayRequested, ReplayCount: row.ReplayCount, ReplayedAt: row.ReplayedAt,
			ReplayedBy: text(row.ReplayedBy), ReplayReason: text(row.ReplayReason), OrderKey: text(row.OrderKey),
			PayloadBytes: row.PayloadBytes,
		}
		r.count("inbox_attempts")
		attempts, err := r.q.StatusPageMessageAttempts(ctx, tx, row.ID)
		if err != nil {
			return fmt.Errorf("read inbox_attempts: %w", err)
		}
		for _, a := range attempts {
			m.Attempts = append(m.Attempts, Attempt{
				Run: a.Run, Attempt: a.Attempt, Outcome: a.Outcome, Error: text(a.Error), Result: text(a.Result),
				Process: a.Process, Build: a.Build, StartedAt: a.StartedAt, FinishedAt: a.FinishedAt,
			})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

// replayReasonPlaceholder is the replay_reason of the statements the page
// offers; the operator replaces it with why the replay is safe now.
const replayReasonPlaceholder = "<why it is safe now>"

// replayByErrorSQL is docs/operations.md's statement that replays every message
// that died of one error (exactly that error, as inbox_dead_by_error
// groups them).
func replayByErrorSQL(lastError *string) string {
	cond := "last_error IS NULL"
	if lastError != nil {
		cond = "last_error = " + quote(*lastError)
	}
	return "UPDATE inbox SET replay_requested = true, replay_reason = " + quote(replayReasonPlaceholder) + "\n" +
		"WHERE status = 'dead' AND " + cond + ";"
}

// replayByBuildSQL is docs/operations.md's statement that replays every dead
// message a build failed (or crashed on).
func replayByBuildSQL(build string) string {
	return "UPDATE inbox SET replay_requested = true, replay_reason = " + quote(replayReasonPlaceholder) + "\n" +
		"WHERE status = 'dead'\n" +
		"  AND id IN (SELECT inbox_id FROM inbox_attempts WHERE build = " + quote(build) + " AND outcome <> 'processed');"
}

// quote returns s as a PostgreSQL string literal, built as quote_literal
// builds one: quotes and backslashes doubled and, when s holds a backslash,
// the E prefix, so that the literal reads as s whatever the session's
// standard_conforming_strings.
func quote(s string) string {
	q := "'" + strings.ReplaceAll(strings.ReplaceAll(s, `\`, `\\`), "'", "''") + "'"
	if strings.Contains(s, `\`) {
		return "E" + q
	}
	return q
}

func text(t pgtype.Text) *string {
	if !t.Valid {
		return nil
	}
	return &t.String
}

// anyTime converts a timestamptz column sqlc could not type (an aggregate
// of a view) to a time, nil for NULL.
func anyTime(v any) *time.Time {
	if t, ok := v.(time.Time); ok {
		return &t
	}
	return nil
}
