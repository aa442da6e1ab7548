package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/orderconfirm/inboxd/internal/tracing"
)

// Message is one claimed inbox row, handed to a Handler.
type Message struct {
	// ID is the inbox row's primary key.
	ID int64
	// MessageID is the AMQP message_id: the message's idempotency key.
	MessageID string
	// Type is the AMQP type property, else the routing key.
	Type string
	// Payload is the body exactly as received.
	Payload []byte
	// Attempt counts the times the message was claimed for handling, this
	// one included: 1 the first time.
	Attempt int
	// ReceivedAt is when ingest stored the message.
	ReceivedAt time.Time
	// Replay is true when an operator asked for the message to be handled again.
	Replay bool

	// span is the process span of this handling attempt; nil in a Message
	// not made by a Worker.
	span trace.Span
}

// Context returns ctx carrying the message's process span: logs written
// with it carry the message's trace_id and span_id. A Message not made by a
// Worker has no span: ctx is returned as it is.
func (m Message) Context(ctx context.Context) context.Context {
	if m.span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, m.span)
}

// TraceContext returns the W3C trace context of the message's process span.
// A handler stores it with the effects it writes (outbox rows), so the
// events they cause continue the message's trace, under a span the service
// exported. It is zero for a Message not made by a Worker.
func (m Message) TraceContext() tracing.Text {
	if m.span == nil {
		return tracing.Text{}
	}
	return tracing.FromSpanContext(m.span.SpanContext())
}

// Outcome is what handling one message came to.
type Outcome struct {
	// Result is a short description of what the handler did, stored in
	// inbox.result when the message is processed (e.g. "confirmed").
	Result string
	// Err, when not nil, means the message failed: it is retried after a
	// backoff delay (or the delay RetryAfter gives), or marked dead at once
	// when errors.Is(Err, ErrPermanent), or when it has used up its attempts.
	// A failed message must have left no database effects in the transaction.
	Err error
	// Reply, when set on a processed message, is a JSON object: what a
	// requester that asked for the message's result (AMQP reply_to) is
	// told, e.g. {"outcome":"confirmed"}. The inbox adds messageId,
	// orderId, status and run to it. A message that is not processed, or
	// whose Reply is not a JSON object, replies with its status and result
	// (or error) alone.
	Reply []byte
}

// Handler handles claimed messages inside the worker's transaction, so that
// its database effects commit together with the messages' processed mark, or
// not at all.
type Handler interface {
	// HandleBatch handles msgs, in order, in tx and returns one Outcome per
	// message. It must not call anything outside the database: effects that
	// leave the service go through the outbox. tx is the worker's: the
	// handler may run statements and savepoints (Begin) in it, but not end
	// it (its Commit and Rollback return an error).
	//
	// Returning an error means the batch as a whole failed (typically a
	// database error that aborted tx). The worker then rolls back everything
	// the call did and hands each message to HandleBatch alone, under a
	// savepoint of its own, so one bad message cannot fail the others.
	HandleBatch(ctx context.Context, tx pgx.Tx, msgs []Message) ([]Outcome, error)
}

// ErrPermanent marks an error that retrying cannot fix, such as a payload that
// is not valid JSON. A message failing with it is marked dead at once.
var ErrPermanent = errors.New("permanent failure")

// Permanent wraps err so that errors.Is(err, ErrPermanent) reports true.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string        { return e.err.Error() }
func (e *permanentError) Unwrap() error        { return e.err }
func (e *permanentError) Is(target error) bool { return target == ErrPermanent }

// Permanentf is Permanent(fmt.Errorf(format, args...)).
func Permanentf(format string, args ...any) error {
	return Permanent(fmt.Errorf(format, args...))
}

// RetryAfter wraps err to ask for the next attempt after d rather than after
// the worker's backoff delay. The attempt still counts towards the maximum.
func RetryAfter(d time.Duration, err error) error {
	return &retryAfterError{after: d, err: err}
}

type retryAfterError struct {
	after time.Duration
	err   error
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// WaitDefault is how long a message waits, when its handler says Wait
// without a delay of its own, before it is tried again.
const WaitDefault = time.Second

// Wait wraps err to say that the message could not be handled now for a
// reason outside it, such as a row it needs being locked by another
// session: it is tried again after d (WaitDefault when d is 0) and the
// attempt does not count towards the maximum, nor enter the attempt
// history. Its reason stays in inbox.last_error while it waits. A lock wait
// that runs into lock_timeout (SQLSTATE 55P03) is treated the same way.
func Wait(d time.Duration, err error) error {
	return &waitError{after: cmp.Or(d, WaitDefault), err: err}
}

// WaitFor is Wait with the kind of thing the message waits for, without
// the particulars err names (e.g. "a stock row it needs is locked by
// another session", where err names the SKUs). The worker logs the waits
// of each kind once every 10 s, so that a stall of many orders, each
// waiting for rows of its own, makes a few lines, not one per order.
// With Wait, the kind is err's text.
func WaitFor(d time.Duration, kind string, err error) error {
	return &waitError{after: cmp.Or(d, WaitDefault), kind: kind, err: err}
}

type waitError struct {
	after time.Duration
	kind  string
	err   error
}

func (e *waitError) Error() string { return e.err.Error() }
func (e *waitError) Unwrap() error { return e.err }
