// Package tracing carries W3C trace context through the service and records
// its spans with OpenTelemetry.
//
// Propagation is always on: ingest reads a delivery's traceparent and
// tracestate headers (FromHeaders) and stores them as text with its inbox row
// (Text); the worker handles the message in a process span that is a child of
// that context; the handler stores the context of the process span with each
// outbox row; the relay puts it in the published event's headers
// (Text.SetHeaders), so a downstream consumer continues the same trace.
// Parsing and formatting use OpenTelemetry's propagation.TraceContext, so a
// malformed header reads as no context at all.
//
// Spans follow OpenTelemetry's messaging semantic conventions for RabbitMQ
// (Tracer). Whether they are exported is decided by Setup, from the standard
// OTEL_* environment variables; without an exporter, spans are not recorded
// but still get valid ids, so the context keeps flowing.
package tracing

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The W3C Trace Context header names, as AMQP header keys.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

var propagator = propagation.TraceContext{}

// Text is W3C trace context in its header form, as the inbox and outbox
// store it. The zero Text is no context.
type Text struct {
	Traceparent string
	Tracestate  string
}

// IsZero reports whether t holds no context.
func (t Text) IsZero() bool { return t.Traceparent == "" }

// SpanContext parses t. A malformed or empty traceparent gives the zero
// (invalid) SpanContext; a malformed tracestate is dropped, as the W3C
// specification asks. The span context is marked remote.
func (t Text) SpanContext() trace.SpanContext {
	if t.Traceparent == "" {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(propagator.Extract(context.Background(), &textCarrier{t: t}))
}

// SetHeaders adds t to h as the traceparent and tracestate headers, and
// returns h (a new table when h is nil and t is not zero). A zero t leaves
// h as it is.
func (t Text) SetHeaders(h amqp.Table) amqp.Table {
	if t.IsZero() {
		return h
	}
	if h == nil {
		h = amqp.Table{}
	}
	h[HeaderTraceparent] = t.Traceparent
	if t.Tracestate != "" {
		h[HeaderTracestate] = t.Tracestate
	}
	return h
}

// FromSpanContext formats sc; an invalid sc gives the zero Text.
func FromSpanContext(sc trace.SpanContext) Text {
	if !sc.IsValid() {
		return Text{}
	}
	var c textCarrier
	propagator.Inject(trace.ContextWithSpanContext(context.Background(), sc), &c)
	return c.t
}

// FromContext formats the span context of ctx's span.
func FromContext(ctx context.Context) Text {
	return FromSpanContext(trace.SpanContextFromContext(ctx))
}

// FromHeaders reads the trace context of AMQP headers h. A missing or
// malformed traceparent gives the zero Text, never an error; what it
// returns is the context re-formatted, so only well-formed text is stored.
func FromHeaders(h amqp.Table) Text {
	if h == nil {
		return Text{}
	}
	c := headerCarrier(h)
	if c.Get(HeaderTraceparent) == "" {
		return Text{}
	}
	return FromSpanContext(trace.SpanContextFromContext(propagator.Extract(context.Background(), c)))
}

// headerCarrier reads AMQP headers as a propagation.TextMapCarrier. Header
// values that are not text read as missing.
type headerCarrier amqp.Table

func (h headerCarrier) Get(key string) string {
	switch v := h[key].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

func (h headerCarrier) Set(key, value string) { h[key] = value }

func (h headerCarrier) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

// textCarrier holds the two W3C headers without allocating a map.
type textCarrier struct{ t Text }

func (c *textCarrier) Get(key string) string {
	switch key {
	case HeaderTraceparent:
		return c.t.Traceparent
	case HeaderTracestate:
		return c.t.Tracestate
	}
	return ""
}

func (c *textCarrier) Set(key, value string) {
	switch key {
	case HeaderTraceparent:
		c.t.Traceparent = value
	case HeaderTracestate:
		c.t.Tracestate = value
	}
}

func (c *textCarrier) Keys() []string { return []string{HeaderTraceparent, HeaderTracestate} }

// Context returns ctx carrying t as its remote span context, so that logs
// written with it name t's trace; when t holds no valid context, ctx as it
// is.
func (t Text) Context(ctx context.Context) context.Context {
	if sc := t.SpanContext(); sc.IsValid() {
		return trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	return ctx
}
