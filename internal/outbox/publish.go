package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// recordTimeout bounds the release and the commit of a batch's outcome.
const recordTimeout = 10 * time.Second

// claimError is a claim of outbox rows, or the commit of their outcome, that
// failed: the database's trouble, not the channel's, so the session backs
// off and claims again.
type claimError struct{ err error }

func (e claimError) Error() string { return "claim outbox rows: " + e.err.Error() }
func (e claimError) Unwrap() error { return e.err }

// publishBatch claims rows, publishes them and records the outcome, in one
// transaction. It returns a claimError when the claim failed, and any other
// error only when the channel can no longer be used.
func (r *Relay) publishBatch(ctx, workCtx context.Context, ch *amqp.Channel, returns <-chan amqp.Return, alarm *broker.Alarm) (int, error) {
	tx, claimed, err := r.claim(ctx, workCtx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(workCtx)) }()
	if len(claimed) == 0 {
		return 0, nil
	}
	p := planBatch(claimed)
	ctx, span := r.cfg.Tracer.StartPublish(ctx, broker.ExchangeEvents, len(p.rows), p.traces())
	defer span.End()
	publishErr := r.publish(workCtx, ch, returns, p, alarm)
	return len(claimed), r.record(ctx, workCtx, tx, ch, span, p.rows, publishErr)
}

// claim begins the batch's transaction and claims its rows in it. The
// transaction stays open until the broker has confirmed the rows: the
// claim marks every row published, and the row locks it holds keep other
// relays off them. The caller rolls it back; claim does when it fails.
func (r *Relay) claim(ctx, workCtx context.Context) (pgx.Tx, []dbsqlc.OutboxClaimBatchRow, error) {
	// Begun on workCtx: a shutdown during the publish still records what
	// the broker confirmed, within the grace period.
	tx, err := r.pool.Begin(workCtx)
	if err != nil {
		return nil, nil, claimError{err}
	}
	// The lease's clock: nil, the database's.
	var now *time.Time
	if r.cfg.Now != nil {
		t := r.cfg.Now()
		now = &t
	}
	rows, err := r.queries.OutboxClaimBatch(ctx, tx, dbsqlc.OutboxClaimBatchParams{
		Now: now, LeaseMs: r.cfg.Lease.Milliseconds(), MaxRows: int32(r.cfg.BatchSize),
	})
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(workCtx))
		return nil, nil, claimError{err}
	}
	return tx, rows, nil
}

// publish publishes the rounds of p in turn, each once the one before is
// confirmed, until a publish fails; it returns that publish's error. The
// rows' outcomes are in their claimedRow. One ConfirmTimeout bounds the
// wait for the confirms of all the rounds, and the broker blocking the
// connection ends it at once: the rows not confirmed by then are given back
// and the transaction ends, rather than holding its rows and its snapshot
// through the alarm; they are published again, once, after it.
func (r *Relay) publish(workCtx context.Context, ch *amqp.Channel, returns <-chan amqp.Return, p plan, alarm *broker.Alarm) error {
	waitCtx, cancel := context.WithTimeout(workCtx, r.cfg.ConfirmTimeout)
	defer cancel()
	startstop.Go(func() {
		for {
			changed := alarm.Changed()
			if active, _ := alarm.Active(); active {
				cancel()
				return
			}
			select {
			case <-changed:
			case <-waitCtx.Done():
				return
			}
		}
	})
	for n := range p.rounds {
		if err := publishRound(workCtx, waitCtx, ch, returns, p.due(n), r.cfg.ReplyPolicy); err != nil {
			return err
		}
	}
	return nil
}

// publishRound publishes rows in order, waits for their confirms until
// waitCtx ends, and reads their returns, marking each row confirmed or
// returned. A publish that fails ends the round, leaving the rows after it
// unpublished, and its error is returned.
func publishRound(workCtx, waitCtx context.Context, ch *amqp.Channel, returns <-chan amqp.Return, rows []*claimedRow, replies broker.ReplyPolicy) error {
	pub := broker.Publisher{Ch: ch}
	var sent []*claimedRow
	var publishErr error
	for _, row := range rows {
		if row.reason = row.refusal(replies); row.reason != "" {
			row.refused = true
			continue
		}
		// Mandatory: an event that neither a binding nor the alternate
		// exchange's queue takes comes back, and its row stays unpublished;
		// so does a reply whose requester's queue is gone.
		exchange, key, mandatory := row.destination()
		if publishErr = pub.Publish(workCtx, exchange, key, mandatory, row.publishing()); publishErr != nil {
			break
		}
		sent = append(sent, row)
	}
	for k, ok := range pub.Confirmed(waitCtx) {
		sent[k].confirmed = ok
	}
	// The broker sends a return before the confirm of the same publish:
	// every return of this round is in the channel by now.
	returned := map[string]amqp.Return{}
	for _, ret := range broker.DrainReturns(returns) {
		returned[ret.MessageId] = ret
	}
	for _, row := range sent {
		ret, ok := returned[row.IdempotencyKey]
		switch {
		case !ok:
		case row.ReplyTo != "":
			// The requester is gone (its channel closed, its queue
			// deleted): retrying cures that only if it comes back, so the
			// reply ends undeliverable after its attempts.
			row.confirmed, row.refused = false, true
			row.reason = fmt.Sprintf("undeliverable: the broker returned the reply (%d %s): no queue %q, the requester is gone",
				ret.ReplyCode, ret.ReplyText, ret.RoutingKey)
		default:
			row.confirmed = false
			row.reason = fmt.Sprintf("unroutable: the broker returned it (%d %s): no queue is bound for routing key %q, and %s is missing",
				ret.ReplyCode, ret.ReplyText, ret.RoutingKey, broker.QueueUnroutable)
		}
	}
	return publishErr
}

// destination returns the exchange and routing key the row is published
// with, and whether mandatory: an event's routing key on
// broker.ExchangeEvents, or a reply's reply_to on the default exchange (a
// queue's name, or RabbitMQ's direct reply-to).
//
// A reply to direct reply-to is not mandatory: RabbitMQ 3.x returns every
// mandatory publish to it, delivered or not (seen on 3.10), so a return
// says nothing there, and acting on it would send the reply again. A reply
// to a requester gone from direct reply-to is dropped by the broker; one to
// a queue that is gone comes back, and ends undeliverable.
func (c *claimedRow) destination() (exchange, key string, mandatory bool) {
	if c.ReplyTo != "" {
		return "", c.ReplyTo, !strings.HasPrefix(c.ReplyTo, broker.DirectReplyTo)
	}
	return broker.ExchangeEvents, c.RoutingKey, true
}

func (c *claimedRow) publishing() amqp.Publishing {
	return amqp.Publishing{
		Headers:       c.trace().SetHeaders(nil),
		ContentType:   "application/json",
		DeliveryMode:  amqp.Persistent,
		MessageId:     c.IdempotencyKey,
		CorrelationId: c.CorrelationID,
		Type:          c.RoutingKey,
		Timestamp:     c.CreatedAt,
		AppId:         "inboxd",
		Body:          []byte(c.Payload),
	}
}

// outcome is what a published batch leaves to record.
type outcome struct {
	published, failed []int64
	// refused are the rows not sent because they cannot be, each with its
	// reason: given back apart, to end dead after MaxAttempts.
	refused []*claimedRow
	// attempts is the most attempts of a failed row: the failed rows are
	// given back with the retry delay of that many.
	attempts int
	// reason is the last error of the failed rows: the failed publish's, a
	// return's, or the missing confirm.
	reason string
}

// outcomeOf reads the outcome of rows, published in a round that publishErr
// (nil if none) ended. A held-back row has no reason of its own: it takes
// the batch's.
func outcomeOf(rows []*claimedRow, publishErr error) outcome {
	o := outcome{attempts: 1, reason: "broker did not confirm the publish"}
	if publishErr != nil {
		o.reason = publishErr.Error()
	}
	for _, row := range rows {
		if row.confirmed {
			o.published = append(o.published, row.ID)
			continue
		}
		if row.refused {
			o.refused = append(o.refused, row)
			continue
		}
		o.failed = append(o.failed, row.ID)
		o.attempts = max(o.attempts, int(row.Attempts))
		if row.reason != "" {
			o.reason = row.reason
		}
	}
	return o
}

// record gives back the rows of the batch that were not published, commits,
// and reports the outcome. It returns a claimError when the commit failed,
// and an error of the publish when the channel can no longer be used.
func (r *Relay) record(ctx, workCtx context.Context, tx pgx.Tx, ch *amqp.Channel, span trace.Span, rows []*claimedRow, publishErr error) error {
	o := outcomeOf(rows, publishErr)
	if err := r.commit(workCtx, tx, o); err != nil {
		// The rollback undoes the attempts and retry delays too: the
		// session backs off, as after a failed claim, before the batch is
		// published again.
		return claimError{fmt.Errorf("record the batch's outcome (its %d rows will be published again, under the same ids): %w", len(rows), err)}
	}
	if len(o.published) > 0 && r.cfg.OnPublished != nil {
		r.cfg.OnPublished(len(o.published))
	}
	if len(o.failed) > 0 {
		r.logger.WarnContext(ctx, "outbox rows not published", slog.Int("rows", len(o.failed)), slog.String("error", o.reason))
		tracing.Fail(span, errors.New(o.reason))
		if publishErr != nil || ch.IsClosed() {
			return fmt.Errorf("publish: %s", o.reason)
		}
	}
	return nil
}

// commit records o in tx, even while stopping: the broker has the messages.
// The claim marked every row published; the rows that were not are given
// back before the commit. Should the commit fail, every row of the batch is
// published again, under the same ids.
func (r *Relay) commit(workCtx context.Context, tx pgx.Tx, o outcome) error {
	ctx, cancel := context.WithTimeout(workCtx, recordTimeout)
	defer cancel()
	backoff := retry.Policy{Base: r.cfg.RetryBase, Max: r.cfg.RetryMax}
	if len(o.failed) > 0 {
		err := r.queries.OutboxRelease(ctx, dbsqlc.PlanEachCall(tx), dbsqlc.OutboxReleaseParams{
			Ids: o.failed, LastError: o.reason, RetryDelayMs: backoff.Delay(o.attempts).Milliseconds(),
		})
		if err != nil {
			return err
		}
	}
	for _, row := range o.refused {
		err := r.queries.OutboxRelease(ctx, dbsqlc.PlanEachCall(tx), dbsqlc.OutboxReleaseParams{
			Ids: []int64{row.ID}, LastError: row.reason, RetryDelayMs: backoff.Delay(int(row.Attempts)).Milliseconds(),
			Refused: true, MaxAttempts: int32(r.cfg.MaxAttempts),
		})
		if err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}
