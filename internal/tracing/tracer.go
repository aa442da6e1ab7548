package tracing

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the service's spans.
const ScopeName = "github.com/orderconfirm/inboxd"

// Attributes of the service's own, outside the semantic conventions.
const (
	// AttrMessageType is the message's type (AMQP type, else routing key).
	AttrMessageType = attribute.Key("inboxd.message.type")
	// AttrAttempt is the handling attempt, 1 the first time.
	AttrAttempt = attribute.Key("inboxd.attempt")
	// AttrOutcome is what an attempt came to: processed, retried or dead.
	AttrOutcome = attribute.Key("inboxd.outcome")
	// AttrReplay is true on the process span of a replayed message.
	AttrReplay = attribute.Key("inboxd.replay")
	// AttrLinkReason says why a span links to a context: "message" for the
	// messages a batch span covers, "replay" for the original trace of a
	// replayed message.
	AttrLinkReason = attribute.Key("inboxd.link.reason")
)

// Tracer starts the service's spans. It is safe for concurrent use.
type Tracer struct {
	tracer trace.Tracer
}

// New returns a Tracer whose spans come from tp.
func New(tp trace.TracerProvider) *Tracer {
	return &Tracer{tracer: tp.Tracer(ScopeName)}
}

// propagateOnly records nothing and samples nothing, but gives every span
// valid, fresh ids: a child keeps its parent's trace id, a root gets a new
// one. It costs an id and a small allocation per span.
var propagateOnly = New(sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample())))

// PropagateOnly returns the Tracer used when no exporter is configured (and
// by components given none): its spans are never recorded, but their ids
// are valid, so trace context still flows to the events.
func PropagateOnly() *Tracer { return propagateOnly }

// Message describes one inbox message for its process span.
type Message struct {
	// ID is the message's AMQP message_id.
	ID string
	// Type is its type (AMQP type, else routing key).
	Type string
	// Attempt counts the handling attempts, this one included.
	Attempt int
	// Replay is true when an operator asked for it to be handled again.
	Replay bool
	// Origin is the context the message arrived with (zero for none).
	Origin Text
}

// StartReceive starts the span of one ingest batch read from queue and
// stored: kind consumer, operation receive, with a link to the context of
// each delivery that carried one. The span is the root of a trace of its
// own: a batch belongs to many traces.
func (t *Tracer) StartReceive(ctx context.Context, queue string, deliveries int, origins []Text) (context.Context, trace.Span) {
	ctx, span := t.tracer.Start(ctx, "receive "+queue, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithNewRoot())
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingSystemRabbitMQ,
			semconv.MessagingOperationTypeReceive,
			semconv.MessagingOperationName("receive"),
			semconv.MessagingDestinationName(queue),
			semconv.MessagingBatchMessageCount(deliveries),
		)
		addLinks(span, origins, "message")
	}
	return ctx, span
}

// StartProcess starts the span of one handling attempt of m, read from
// queue: kind consumer, operation process. It is a child of the context the
// message arrived with; a replay is instead the root of a new trace, linked
// to that context; a message without (valid) context starts a new trace.
// End it with EndProcess.
func (t *Tracer) StartProcess(ctx context.Context, queue string, m Message) (context.Context, trace.Span) {
	origin := m.Origin.SpanContext()
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	switch {
	case m.Replay:
		opts = append(opts, trace.WithNewRoot())
		if origin.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{
				SpanContext: origin,
				Attributes:  []attribute.KeyValue{AttrLinkReason.String("replay")},
			}))
		}
	case origin.IsValid():
		ctx = trace.ContextWithRemoteSpanContext(ctx, origin)
	default:
		opts = append(opts, trace.WithNewRoot())
	}
	ctx, span := t.tracer.Start(ctx, "process "+queue, opts...)
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingSystemRabbitMQ,
			semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"),
			semconv.MessagingDestinationName(queue),
			semconv.MessagingMessageID(m.ID),
			AttrMessageType.String(m.Type),
			AttrAttempt.Int(m.Attempt),
			AttrReplay.Bool(m.Replay),
		)
	}
	return ctx, span
}

// EndProcess records the outcome of a process span (processed, retried or
// dead, with the error of a failed attempt) and ends it.
func EndProcess(span trace.Span, outcome string, err error) {
	if span.IsRecording() {
		span.SetAttributes(AttrOutcome.String(outcome))
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
			if outcome == "dead" {
				span.RecordError(err)
			}
		}
	}
	span.End()
}

// StartPublish starts the span of one batch of events sent to exchange:
// kind producer, operation send, linked to the context each event carries.
func (t *Tracer) StartPublish(ctx context.Context, exchange string, events int, origins []Text) (context.Context, trace.Span) {
	ctx, span := t.tracer.Start(ctx, "send "+exchange, trace.WithSpanKind(trace.SpanKindProducer), trace.WithNewRoot())
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingSystemRabbitMQ,
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(exchange),
			semconv.MessagingBatchMessageCount(events),
		)
		addLinks(span, origins, "message")
	}
	return ctx, span
}

// Fail marks span failed with err, if it is recording.
func Fail(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.SetStatus(codes.Error, err.Error())
	}
}

func addLinks(span trace.Span, origins []Text, reason string) {
	for _, o := range origins {
		if sc := o.SpanContext(); sc.IsValid() {
			span.AddLink(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{AttrLinkReason.String(reason)}})
		}
	}
}

// SampledTraceID returns the trace id of ctx's span when that span is
// sampled (its trace is exported), else "". Metrics use it for exemplars,
// which should lead to a trace that exists.
func SampledTraceID(ctx context.Context) string {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsSampled() {
		return ""
	}
	return sc.TraceID().String()
}
