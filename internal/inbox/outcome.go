package inbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// claimed is one message of a work batch, from its lock to what is
// recorded of it. Its process span is the message's (see Message.Context).
type claimed struct {
	msg Message
	// givenUp is true for a message that has used up its attempts without
	// ever finishing one: it is recorded dead without running.
	givenUp bool
	// outcome is what the handler said, unless givenUp.
	outcome Outcome
	// replyRequests are the message's reply requests stored by the time
	// the batch locked it: the batch's transaction answers them once the
	// message ends.
	replyRequests []int64
	// decision is set once the batch's handling is over.
	decision decision
	// claimedAt is when the claim the batch locked the message under was
	// made: the attempt's start in its history row.
	claimedAt time.Time
}

// outcomeWaiting is the status InboxCompleteMany takes for a message that
// waits (see Wait): pending again, the attempt given back.
const outcomeWaiting = "waiting"

// decision is what becomes of a handled message: the status recorded
// (StatusProcessed, StatusDead, StatusPending for a retry, or
// outcomeWaiting), its result or error text, its reply (a JSON object, or
// empty), and the delay before a retry or after a wait.
type decision struct {
	status, result, lastError, reply string
	delay                            time.Duration
	// waitKind is, for a wait, what the worker's log counts it under: the
	// kind of thing it waits for (see WaitFor).
	waitKind string
}

// decide turns a claimed message's outcome into its decision under cfg's
// attempts and backoff. It is pure: the outcome statement stores the
// decision, and the stats, spans and logs read it.
func decide(cfg *WorkerConfig, c *claimed) decision {
	m, out := c.msg, c.outcome
	var wait *waitError
	var ra *retryAfterError
	switch {
	case c.givenUp:
		// Not handled at all: its earlier attempts never finished.
		return decision{status: StatusDead, lastError: fmt.Sprintf(
			"gave up after %d attempts: the last ones never finished (the process died, or lost its database connection, while handling the message)",
			m.Attempt-1)}
	case out.Err == nil:
		return decision{status: StatusProcessed, result: storable(out.Result), reply: replyObject(out.Reply)}
	case errors.As(out.Err, &wait):
		d := decision{status: outcomeWaiting, lastError: storable("waiting: " + out.Err.Error()), delay: wait.after}
		d.waitKind = d.lastError
		if wait.kind != "" {
			d.waitKind = "waiting: " + wait.kind
		}
		return d
	case IsLockNotAvailable(out.Err):
		return decision{status: outcomeWaiting, lastError: storable("waiting: a row it needs is locked by another session: " + out.Err.Error()), delay: WaitDefault,
			waitKind: "waiting: a row it needs is locked by another session (lock_timeout)"}
	case isDatabaseTrouble(out.Err):
		return decision{status: outcomeWaiting, lastError: storable("waiting: the database, not the message: " + out.Err.Error()), delay: WaitDefault,
			waitKind: "waiting: the database, not the message"}
	case errors.Is(out.Err, ErrPermanent), m.Attempt >= cfg.MaxAttempts:
		return decision{status: StatusDead, lastError: storable(out.Err.Error())}
	case errors.As(out.Err, &ra):
		return decision{status: StatusPending, lastError: storable(out.Err.Error()), delay: ra.after}
	default:
		return decision{status: StatusPending, lastError: storable(out.Err.Error()),
			delay: retry.Backoff(m.Attempt, cfg.RetryBase, cfg.RetryMax)}
	}
}

// IsLockNotAvailable reports whether err is PostgreSQL's lock_timeout (or a
// NOWAIT lock) giving up: SQLSTATE 55P03.
func IsLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// isDatabaseTrouble reports whether err is the database's trouble rather
// than the message's, so that it costs no attempt: a lost or refused
// connection (class 08), a server shutting down or starting (57P01-57P03),
// too many connections (53300), a serialization failure or deadlock (40001,
// 40P01), and a statement_timeout. A statement cancelled because the
// handler's own time ran out (57014 "due to user request") is the message's,
// and counts.
func isDatabaseTrouble(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "40001", "40P01", "53300", "57P01", "57P02", "57P03":
		return true
	case "57014":
		return strings.Contains(pgErr.Message, "statement timeout")
	}
	return strings.HasPrefix(pgErr.Code, "08")
}

// replyObject returns reply as text when it is a JSON object of at most
// 4 KiB, and "" otherwise. The object is decoded and encoded again, so that
// what PostgreSQL's jsonb refuses and json.Valid lets through (a lone
// surrogate, a number beyond float64) cannot fail the statement that
// records a whole batch: a lone surrogate becomes U+FFFD, an out-of-range
// number drops the reply, and so does a NUL, which jsonb refuses too.
func replyObject(reply []byte) string {
	var v map[string]any
	if len(reply) > 4096 || json.Unmarshal(reply, &v) != nil || v == nil {
		return ""
	}
	out, err := json.Marshal(v)
	if err != nil || bytes.Contains(out, []byte(`\u0000`)) {
		return ""
	}
	return string(out)
}

// storable makes a handler's result or error text safe for a text column
// (valid UTF-8, no NUL), so that no message text can fail the statement that
// records a whole batch, and bounds its length.
func storable(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "\uFFFD")
	if len(s) > 4096 {
		s = strings.ToValidUTF8(s[:4096], "") + "…"
	}
	return s
}

// complete records every message's decision in one statement and queues
// the replies of the messages that ended.
func (w *Worker) complete(ctx context.Context, tx pgx.Tx, batch []claimed) error {
	p := dbsqlc.InboxCompleteManyParams{
		Process:       w.cfg.Process,
		Build:         w.cfg.Build,
		Ids:           make([]int64, len(batch)),
		Statuses:      make([]string, len(batch)),
		Results:       make([]string, len(batch)),
		LastErrors:    make([]string, len(batch)),
		RetryDelaysMs: make([]int64, len(batch)),
		Replies:       make([]string, len(batch)),
		StartedAts:    make([]time.Time, len(batch)),
	}
	var requests []int64
	for i, c := range batch {
		d := c.decision
		p.Ids[i], p.Statuses[i], p.Results[i], p.LastErrors[i] = c.msg.ID, d.status, d.result, d.lastError
		p.RetryDelaysMs[i], p.Replies[i] = d.delay.Milliseconds(), d.reply
		p.StartedAts[i] = c.claimedAt
		if d.status == StatusProcessed || d.status == StatusDead {
			requests = append(requests, c.replyRequests...)
		}
	}
	if err := w.queries.InboxCompleteMany(ctx, dbsqlc.PlanEachCall(tx), p); err != nil {
		return fmt.Errorf("record outcomes: %w", err)
	}
	// The requesters of the messages that ended are answered in the same
	// transaction: the reply commits with the result it carries.
	if len(requests) > 0 {
		if _, err := w.queries.InboxReplyAnswer(ctx, dbsqlc.PlanEachCall(tx), requests); err != nil {
			return fmt.Errorf("queue replies: %w", err)
		}
	}
	return nil
}

// logDecisions logs the messages of a committed batch that did not end
// processed. It runs after the commit: a log that blocks (a stalled log
// driver's pipe) never keeps a work transaction open, where the workers'
// short idle limit would end it.
func (w *Worker) logDecisions(ctx context.Context, batch []claimed) {
	for _, c := range batch {
		w.logDecision(ctx, c)
	}
}

func (w *Worker) logDecision(ctx context.Context, c claimed) {
	m, d := c.msg, c.decision
	mctx := m.Context(ctx)
	switch d.status {
	case StatusDead:
		w.logger.WarnContext(mctx, "message dead", slog.String("message_id", m.MessageID),
			slog.String("message_type", m.Type), slog.Int("attempt", m.Attempt), slog.String("error", d.lastError))
	case StatusPending:
		w.logger.InfoContext(mctx, "message will be retried", slog.String("message_id", m.MessageID),
			slog.Int("attempt", m.Attempt), slog.Duration("retry_in", d.delay), slog.String("error", d.lastError))
	case outcomeWaiting:
		if ok, notLogged := w.waits.allow(d.waitKind, time.Now()); ok {
			w.logger.InfoContext(mctx, "message waits, its attempt not counted (logged once every 10s for each reason)",
				slog.String("message_id", m.MessageID), slog.Duration("retry_in", d.delay), slog.String("reason", d.waitKind),
				slog.String("error", d.lastError), slog.Int("waits_not_logged", notLogged))
		}
	}
}

// endProcessSpans ends the process span of every claimed message: with its
// recorded decision when the batch committed (workErr is nil), else as
// abandoned with workErr.
func endProcessSpans(batch []claimed, workErr error) {
	for _, c := range batch {
		if workErr != nil {
			tracing.EndProcess(c.msg.span, "abandoned", workErr)
			continue
		}
		var err error
		if c.decision.lastError != "" {
			err = errors.New(c.decision.lastError)
		}
		tracing.EndProcess(c.msg.span, spanOutcome(c.decision.status), err)
	}
}

// spanOutcome names a decision's status in the process span.
func spanOutcome(status string) string {
	switch status {
	case StatusPending:
		return "retried"
	case outcomeWaiting:
		return "waiting"
	}
	return status
}

// BatchStats describes one committed work batch.
type BatchStats struct {
	// Processed, Retried and Dead count the messages by outcome, Waiting
	// those that wait without an attempt counted (see Wait); Replays counts
	// the replayed messages among them.
	Processed, Retried, Dead, Waiting, Replays int
	// HandlerDuration is how long the handler took for the batch.
	HandlerDuration time.Duration
	// Latencies holds, for each processed message, the time from its
	// arrival in the inbox to the commit.
	Latencies []time.Duration
	// TraceIDs holds, for each of Latencies, the trace id of the message's
	// process span when that trace is sampled (exported), else "".
	TraceIDs []string
}

func batchStats(batch []claimed, handlerDuration time.Duration) BatchStats {
	st := BatchStats{HandlerDuration: handlerDuration}
	now := time.Now()
	for _, c := range batch {
		m := c.msg
		switch c.decision.status {
		case StatusProcessed:
			st.Processed++
			st.Latencies = append(st.Latencies, now.Sub(m.ReceivedAt))
			st.TraceIDs = append(st.TraceIDs, tracing.SampledTraceID(m.Context(context.Background())))
		case StatusDead:
			st.Dead++
		case outcomeWaiting:
			st.Waiting++
		default:
			st.Retried++
		}
		if m.Replay {
			st.Replays++
		}
	}
	return st
}
