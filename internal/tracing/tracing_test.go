package tracing

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

const (
	producerTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	producerTraceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
	producerSpanID      = "00f067aa0ba902b7"
)

func TestFromHeaders(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		headers amqp.Table
		want    Text
	}{
		"Valid":             {amqp.Table{"traceparent": producerTraceparent, "tracestate": "a=1,b=2"}, Text{producerTraceparent, "a=1,b=2"}},
		"Bytes":             {amqp.Table{"traceparent": []byte(producerTraceparent)}, Text{Traceparent: producerTraceparent}},
		"None":              {nil, Text{}},
		"Malformed":         {amqp.Table{"traceparent": "00-xyz-00f067aa0ba902b7-01", "tracestate": "a=1"}, Text{}},
		"ZeroTraceID":       {amqp.Table{"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}, Text{}},
		"NotText":           {amqp.Table{"traceparent": int32(7)}, Text{}},
		"MalformedState":    {amqp.Table{"traceparent": producerTraceparent, "tracestate": "not a list member"}, Text{Traceparent: producerTraceparent}},
		"UpperCaseRejected": {amqp.Table{"traceparent": strings.ToUpper(producerTraceparent)}, Text{}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := FromHeaders(tc.headers)
			require.Equal(t, tc.want, got)
			if !got.IsZero() {
				require.Equal(t, got, FromSpanContext(got.SpanContext()), "round trip")
				h := got.SetHeaders(nil)
				require.Equal(t, got, FromHeaders(h))
			}
		})
	}
}

func setupRecorder(t *testing.T) (*Tracer, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return New(tp), rec
}

func TestStartProcess(t *testing.T) {
	t.Parallel()
	t.Run("ChildOfTheProducer", func(t *testing.T) {
		t.Parallel()
		tr, rec := setupRecorder(t)
		_, span := tr.StartProcess(context.Background(), "q", Message{ID: "m-1", Type: "order.created", Attempt: 2, Origin: Text{Traceparent: producerTraceparent}})
		EndProcess(span, "processed", nil)
		s := rec.Ended()[0]
		require.Equal(t, trace.SpanKindConsumer, s.SpanKind())
		require.Equal(t, producerTraceID, s.SpanContext().TraceID().String())
		require.Equal(t, producerSpanID, s.Parent().SpanID().String())
		require.Contains(t, s.Attributes(), AttrOutcome.String("processed"))
		require.Contains(t, s.Attributes(), AttrAttempt.Int(2))
	})
	t.Run("ReplayIsALinkedRoot", func(t *testing.T) {
		t.Parallel()
		tr, rec := setupRecorder(t)
		_, span := tr.StartProcess(context.Background(), "q", Message{ID: "m-1", Replay: true, Origin: Text{Traceparent: producerTraceparent}})
		EndProcess(span, "processed", nil)
		s := rec.Ended()[0]
		require.False(t, s.Parent().IsValid())
		require.NotEqual(t, producerTraceID, s.SpanContext().TraceID().String())
		require.Len(t, s.Links(), 1)
		require.Equal(t, producerSpanID, s.Links()[0].SpanContext.SpanID().String())
	})
	t.Run("NoContextIsANewTrace", func(t *testing.T) {
		t.Parallel()
		tr, rec := setupRecorder(t)
		_, span := tr.StartProcess(context.Background(), "q", Message{ID: "m-1", Origin: Text{Traceparent: "garbage"}})
		EndProcess(span, "dead", inboxErr("bad"))
		s := rec.Ended()[0]
		require.False(t, s.Parent().IsValid())
		require.True(t, s.SpanContext().IsValid())
	})
}

type inboxErr string

func (e inboxErr) Error() string { return string(e) }

// Without an exporter, nothing is recorded, yet every span has valid ids
// in its parent's trace, so the context still flows to the events.
func TestPropagateOnly(t *testing.T) {
	t.Parallel()
	_, span := PropagateOnly().StartProcess(context.Background(), "q", Message{ID: "m-1", Origin: Text{Traceparent: producerTraceparent}})
	defer span.End()
	require.False(t, span.IsRecording())
	sc := span.SpanContext()
	require.True(t, sc.IsValid())
	require.Equal(t, producerTraceID, sc.TraceID().String())
	require.NotEqual(t, producerSpanID, sc.SpanID().String())
	require.False(t, sc.IsSampled(), "nothing recorded, so not sampled")
	require.Equal(t, producerTraceID, FromSpanContext(sc).SpanContext().TraceID().String())
}

func TestLogHandler(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	logger := slog.New(LogHandler(slog.NewJSONHandler(&buf, nil))).With(slog.String("component", "x"))
	ctx := Text{Traceparent: producerTraceparent}.Context(context.Background())
	logger.InfoContext(ctx, "about a message")
	logger.Info("about nothing")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Contains(t, lines[0], `"trace_id":"`+producerTraceID+`","span_id":"`+producerSpanID+`"`)
	require.NotContains(t, lines[1], "trace_id")
}
