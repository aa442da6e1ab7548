package ingest

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// rejection is a delivery that cannot be stored, with the reason.
type rejection struct {
	delivery amqp.Delivery
	reason   string
}

// deadLetters publishes rejected deliveries on a channel in confirm mode, of
// the dead-letter connection.
//
// While the broker blocks that connection (a memory or disk alarm), or when
// a publish is not confirmed within the wait a batch allows, the rejected
// deliveries are held, unacknowledged and in order, and ingest goes on
// storing: nothing waits on the blocked connection. They are published, and
// then acknowledged each on its own, once the connection is unblocked.
type deadLetters struct {
	ch      *amqp.Channel
	returns <-chan amqp.Return
	logger  *slog.Logger
	// alarm says whether the broker blocks the connection.
	alarm *broker.Alarm
	// replies says which requesters of a dead-lettered delivery are told
	// it was refused.
	replies broker.ReplyPolicy
	// held are the rejected deliveries waiting to be dead-lettered, oldest
	// first; each one keeps its place in the channel's unacknowledged
	// deliveries, so a batch is acknowledged delivery by delivery meanwhile.
	held []rejection
}

// openDeadLetters opens the dead-letter channel on pubConn; a batch holds
// at most batchSize dead letters.
func openDeadLetters(pubConn *amqp.Connection, batchSize int, logger *slog.Logger, replies broker.ReplyPolicy) (*deadLetters, error) {
	ch, err := pubConn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open dead-letter channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("enable publisher confirms: %w", err)
	}
	// A dead letter no queue takes comes back (mandatory); a batch has at
	// most BatchSize of them, drained after each.
	returns := ch.NotifyReturn(make(chan amqp.Return, batchSize))
	return &deadLetters{ch: ch, returns: returns, logger: logger, alarm: broker.WatchAlarm(pubConn, logger, "dead-letter"), replies: replies}, nil
}

// deadLetterWait bounds the wait for the confirms of a batch's dead letters:
// past it they are held (see deadLetters), and storing goes on.
const deadLetterWait = 5 * time.Second

// handle dead-letters rejects after the ones held before, or holds them all
// when the connection is blocked or the broker does not confirm within
// deadLetterWait. It returns whether any are held (the batch must then be
// acknowledged delivery by delivery), and an error only when a dead letter
// came back or was refused, or ctx ended.
func (dl *deadLetters) handle(ctx context.Context, rejects []rejection) (held bool, err error) {
	dl.held = append(dl.held, rejects...)
	if blocked, _ := dl.alarm.Active(); len(dl.held) == 0 || blocked {
		return len(dl.held) > 0, nil
	}
	waitCtx, cancel := context.WithTimeout(ctx, deadLetterWait)
	defer cancel()
	switch err := dl.publish(waitCtx, dl.held); {
	case err == nil:
	case ctx.Err() == nil && waitCtx.Err() != nil:
		dl.logger.Warn("dead letters not confirmed in time; held, unacknowledged, and sent again later",
			slog.Int("held", len(dl.held)), slog.Duration("waited", deadLetterWait))
		return true, nil
	default:
		return true, err
	}
	// Confirmed: each held delivery is acknowledged on its own, as later
	// ones may have been acknowledged already.
	for _, r := range dl.held[:len(dl.held)-len(rejects)] {
		if err := r.delivery.Ack(false); err != nil {
			return true, fmt.Errorf("ack dead-lettered delivery: %w", err)
		}
	}
	dl.held = dl.held[:0]
	return false, nil
}

func (dl *deadLetters) close() { _ = dl.ch.Close() }

// publish publishes rejected deliveries to broker.ExchangeDeadLetter with the
// reason in a header, and waits for the broker to confirm every publish. A
// dead letter that no queue took is an error: the batch then stays
// unacknowledged, and the next session declares broker.QueueDead again.
//
// Once the dead letters are confirmed, each rejected delivery that asked
// for a reply, to an address the policy allows, gets one saying it was
// refused and why (see tellRequesters).
func (dl *deadLetters) publish(ctx context.Context, rejects []rejection) error {
	pub := broker.Publisher{Ch: dl.ch}
	for _, r := range rejects {
		d := r.delivery
		if err := pub.Publish(ctx, broker.ExchangeDeadLetter, d.RoutingKey, true, deadLetter(r)); err != nil {
			return err
		}
		dl.logger.WarnContext(tracing.FromHeaders(d.Headers).Context(ctx), "delivery dead-lettered",
			slog.String("message_id", d.MessageId), slog.String("routing_key", d.RoutingKey),
			slog.Int("bytes", len(d.Body)), slog.String("reason", r.reason))
	}
	if err := pub.Wait(ctx); err != nil {
		if errors.Is(err, broker.ErrNacked) {
			return errors.New("broker refused a dead letter")
		}
		return err
	}
	// A return comes before the confirm of its publish.
	n := len(broker.DrainReturns(dl.returns))
	if n > 0 {
		return fmt.Errorf("%d dead letters returned unroutable: is %s missing?", n, broker.QueueDead)
	}
	dl.tellRequesters(ctx, rejects)
	return nil
}

// tellRequesters sends the refusal of each rejected delivery whose
// requester may be answered, and waits for their confirms. A refusal is
// not mandatory and holds nothing back: one the broker refuses (a full
// reply queue that rejects publishes) or does not confirm in time is
// logged, and the dead letters, confirmed already, are acknowledged all the
// same; a redelivery of the request would be refused again, under the same
// message id.
func (dl *deadLetters) tellRequesters(ctx context.Context, rejects []rejection) {
	pub := broker.Publisher{Ch: dl.ch}
	told := 0
	for _, r := range rejects {
		if d := r.delivery; d.ReplyTo != "" && dl.replies.Allows(d.ReplyTo) {
			if err := pub.Publish(ctx, "", d.ReplyTo, false, refusal(r)); err != nil {
				dl.logger.Warn("refusal not sent to its requester", slog.String("message_id", d.MessageId), slog.String("error", err.Error()))
				return
			}
			told++
		}
	}
	if told == 0 {
		return
	}
	if err := pub.Wait(ctx); err != nil {
		dl.logger.Warn("refusals not confirmed by the broker", slog.Int("refusals", told), slog.String("error", err.Error()))
	}
}

// deadLetter is the message that carries a rejected delivery: its body and
// properties, its headers and the reason with where it came from.
func deadLetter(r rejection) amqp.Publishing {
	d := r.delivery
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers[broker.HeaderRejectReason] = r.reason
	headers[broker.HeaderOriginalExchange] = d.Exchange
	headers[broker.HeaderOriginalRoutingKey] = d.RoutingKey
	if d.Expiration != "" {
		headers[broker.HeaderOriginalExpiration] = d.Expiration
	}
	if d.UserId != "" {
		headers[broker.HeaderOriginalUserID] = d.UserId
	}
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// Refusal is the body of the reply a requester gets when its request could
// not be stored and was dead-lettered: status and outcome "refused", and the
// reason, as in the dead letter's header.
type Refusal struct {
	MessageID string `json:"messageId,omitempty"`
	Status    string `json:"status"`
	Outcome   string `json:"outcome"`
	Reason    string `json:"reason"`
}

// refusal is the reply to a rejected delivery's requester: correlation_id
// copied (its message_id when it had none), type "reply", and a message_id
// derived from the delivery, so that a redelivery's refusal has the same id
// and a requester can drop the copy.
func refusal(r rejection) amqp.Publishing {
	d := r.delivery
	body, _ := json.Marshal(Refusal{MessageID: d.MessageId, Status: "refused", Outcome: "refused", Reason: r.reason}) // strings only: it cannot fail
	id := sha256.New()
	for _, part := range []string{d.MessageId, d.ReplyTo, d.CorrelationId, r.reason} {
		id.Write([]byte(part))
		id.Write([]byte{0})
	}
	id.Write(d.Body)
	return amqp.Publishing{
		Headers:       tracing.FromHeaders(d.Headers).SetHeaders(nil),
		ContentType:   "application/json",
		DeliveryMode:  amqp.Persistent,
		CorrelationId: cmp.Or(d.CorrelationId, d.MessageId),
		MessageId:     "refused:" + hex.EncodeToString(id.Sum(nil)),
		Type:          "reply",
		Body:          body,
	}
}
