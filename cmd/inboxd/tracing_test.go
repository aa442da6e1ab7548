package main

import (
	"bytes"
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// otlpReceiver is an OTLP/HTTP trace endpoint that keeps every span it is
// sent, decoded from protobuf.
type otlpReceiver struct {
	url   string
	mu    sync.Mutex
	spans []*tracepb.Span
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	r := &otlpReceiver{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" {
			http.NotFound(w, req)
			return
		}
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = zr
		}
		b, err := io.ReadAll(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var export coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &export); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		for _, rs := range export.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				r.spans = append(r.spans, ss.Spans...)
			}
		}
		r.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	r.url = srv.URL
	return r
}

// find returns the spans named name for which match holds.
func (r *otlpReceiver) find(name string, match func(*tracepb.Span) bool) []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range r.spans {
		if s.Name == name && (match == nil || match(s)) {
			out = append(out, s)
		}
	}
	return out
}

// bySpanID returns the span with span id id (hex), or nil.
func (r *otlpReceiver) bySpanID(id string) *tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.spans {
		if hex.EncodeToString(s.SpanId) == id {
			return s
		}
	}
	return nil
}

func attr(s *tracepb.Span, key string) *commonpb.AnyValue {
	for _, kv := range s.Attributes {
		if kv.Key == key {
			return kv.Value
		}
	}
	return nil
}

func attrString(s *tracepb.Span, key string) string {
	if v := attr(s, key); v != nil {
		return v.GetStringValue()
	}
	return ""
}

func linksTo(s *tracepb.Span, traceID, spanID string) bool {
	for _, l := range s.Links {
		if hex.EncodeToString(l.TraceId) == traceID && hex.EncodeToString(l.SpanId) == spanID {
			return true
		}
	}
	return false
}

// producerContext is the W3C context a test producer sets on a message.
type producerContext struct{ traceID, spanID string }

func (p producerContext) traceparent() string { return "00-" + p.traceID + "-" + p.spanID + "-01" }

// publishWithHeaders publishes msgs to the orders exchange with their AMQP
// headers and waits for the broker's confirms.
func publishWithHeaders(t *testing.T, url string, msgs []loadgen.Message, headers []amqp.Table) {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	for i, m := range msgs {
		dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), broker.ExchangeOrders, m.RoutingKey, false, false, amqp.Publishing{
			Headers: headers[i], ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: m.MessageID, Body: m.Body,
		})
		require.NoError(t, err)
		ok, err := dc.WaitContext(t.Context())
		require.NoError(t, err)
		require.True(t, ok)
	}
}

var traceparentRE = regexp.MustCompile(`^00-([0-9a-f]{32})-([0-9a-f]{16})-0[0-3]$`)

// Acceptance (issue 15): orders published with a known traceparent are
// followed through the service. Every event they cause carries a
// traceparent with the producer's trace id whose parent is a process span
// inboxd exported, itself the child of the producer's span; the receive,
// process and send spans reach an OTLP endpoint with the messaging
// attributes; a malformed traceparent is handled normally in a new trace
// and stored as NULL; a message's log lines carry its trace id; /metrics in
// OpenMetrics shows an exemplar on the end-to-end histogram; and a replay is
// a new trace linked to the original, whose events keep their ids.
func TestTraceFollowsAnOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	receiver := startOTLPReceiver(t)
	addr := testenv.FreeAddr(t)
	p := startProcess(t, serviceEnv(b.db, b.broker,
		"HTTP_ADDR="+addr,
		"OTEL_EXPORTER_OTLP_ENDPOINT="+receiver.url,
		"OTEL_BSP_SCHEDULE_DELAY=100",
		"OTEL_SERVICE_NAME=inboxd-test"))

	const orderCount = 4
	producers := map[string]producerContext{} // by message id
	var msgs []loadgen.Message
	var headers []amqp.Table
	for i := range orderCount {
		id := fmt.Sprintf("traced-%d", i)
		pc := producerContext{traceID: fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e47%02x", i), spanID: fmt.Sprintf("00f067aa0ba902%02x", i)}
		producers[id] = pc
		msgs = append(msgs, loadgen.Message{MessageID: id, RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-"+id, 1)})
		headers = append(headers, amqp.Table{"traceparent": pc.traceparent(), "tracestate": "vendor=v1"})
	}
	// A malformed traceparent, and a message that goes dead, in a trace of its own.
	msgs = append(msgs,
		loadgen.Message{MessageID: "malformed", RoutingKey: "order.created", Body: loadgen.OrderCreatedBody("o-malformed", 1)},
		loadgen.Message{MessageID: "dead-traced", RoutingKey: "order.created", Body: []byte(`{"orderId":`)})
	headers = append(headers, amqp.Table{"traceparent": "00-not-a-trace-context-01", "tracestate": "vendor=v1"})
	deadCtx := producerContext{traceID: "0af7651916cd43dd8448eb211c80319c", spanID: "b7ad6b7169203331"}
	headers = append(headers, amqp.Table{"traceparent": deadCtx.traceparent()})
	publishWithHeaders(t, b.broker.URL, msgs, headers)

	b.waitDrained(t, len(msgs), 30*time.Second)
	require.Equal(t, "processed", b.status(t, "malformed"), "a malformed traceparent is no error")
	require.Equal(t, "dead", b.status(t, "dead-traced"))
	for id, pc := range producers {
		require.Equal(t, pc.traceparent(), b.inboxText(t, "traceparent", id), "ingest stores the delivery's traceparent")
		require.Equal(t, "vendor=v1", b.inboxText(t, "tracestate", id))
	}
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM inbox WHERE message_id = 'malformed' AND traceparent IS NULL AND tracestate IS NULL"),
		"a malformed traceparent is stored as NULL, not as if valid")

	// Every event carries the trace context of the process span that
	// wrote it.
	wantEvents := b.count(t, "SELECT count(*) FROM outbox")
	require.Equal(t, 2*(orderCount+1), wantEvents)
	events := map[string]amqp.Delivery{}
	timeout := time.After(30 * time.Second)
	for len(events) < wantEvents {
		select {
		case d := <-b.events:
			require.NoError(t, d.Ack(false))
			events[d.MessageId] = d
		case <-timeout:
			t.Fatalf("%d of %d events arrived", len(events), wantEvents)
		}
	}
	processParent := map[string]string{} // event message id -> span id of its parent
	for key, d := range events {
		tp, _ := d.Headers["traceparent"].(string)
		m := traceparentRE.FindStringSubmatch(tp)
		require.NotNil(t, m, "event %s carries a valid traceparent, got %q", key, tp)
		messageID, _, _ := strings.Cut(key, ":")
		if pc, ok := producers[messageID]; ok {
			require.Equal(t, pc.traceID, m[1], "event %s continues its order's trace", key)
			require.Equal(t, "vendor=v1", d.Headers["tracestate"], "event %s keeps the tracestate", key)
		} else {
			require.Equal(t, "malformed", messageID)
			require.NotContains(t, tp, "not-a-trace", "a new trace, not the malformed one")
		}
		processParent[key] = m[2]
	}

	// The spans reach the OTLP endpoint: each event's parent, and the send
	// span of the relay's batch that published it. The relay publishes the
	// events in batches, each exported once its publish is confirmed: one
	// send span exported says nothing of the others.
	require.Eventually(t, func() bool {
		for _, spanID := range processParent {
			s := receiver.bySpanID(spanID)
			if s == nil {
				return false
			}
			traceID := hex.EncodeToString(s.TraceId)
			if len(receiver.find("send order-confirmation.events", func(s *tracepb.Span) bool { return linksTo(s, traceID, spanID) })) == 0 {
				return false
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond, "every event's parent span was exported, and a send span linked to each event")
	for key, spanID := range processParent {
		s := receiver.bySpanID(spanID)
		messageID, _, _ := strings.Cut(key, ":")
		require.Equal(t, "process order-confirmation.inbox", s.Name, "event %s's parent is a process span", key)
		require.Equal(t, tracepb.Span_SPAN_KIND_CONSUMER, s.Kind)
		require.Equal(t, "rabbitmq", attrString(s, "messaging.system"))
		require.Equal(t, "process", attrString(s, "messaging.operation.type"))
		require.Equal(t, broker.QueueInbox, attrString(s, "messaging.destination.name"))
		require.Equal(t, messageID, attrString(s, "messaging.message.id"))
		require.Equal(t, "order.created", attrString(s, "inboxd.message.type"))
		require.Equal(t, "processed", attrString(s, "inboxd.outcome"))
		require.EqualValues(t, 1, attr(s, "inboxd.attempt").GetIntValue())
		require.False(t, attr(s, "inboxd.replay").GetBoolValue())
		if pc, ok := producers[messageID]; ok {
			require.Equal(t, pc.spanID, hex.EncodeToString(s.ParentSpanId), "the process span is the child of the producer's span")
		} else {
			require.Empty(t, s.ParentSpanId, "without valid context, a new trace")
		}
	}
	// One receive span per ingest batch, linked to each message's context.
	for id, pc := range producers {
		receives := receiver.find("receive order-confirmation.inbox", func(s *tracepb.Span) bool { return linksTo(s, pc.traceID, pc.spanID) })
		require.NotEmpty(t, receives, "a receive span links to %s's context", id)
		s := receives[0]
		require.Equal(t, tracepb.Span_SPAN_KIND_CONSUMER, s.Kind)
		require.Equal(t, "rabbitmq", attrString(s, "messaging.system"))
		require.Equal(t, "receive", attrString(s, "messaging.operation.type"))
		require.Equal(t, broker.QueueInbox, attrString(s, "messaging.destination.name"))
		require.Positive(t, attr(s, "messaging.batch.message_count").GetIntValue())
	}
	// The send spans link to each event's context.
	for key, spanID := range processParent {
		traceID := hex.EncodeToString(receiver.bySpanID(spanID).TraceId)
		sends := receiver.find("send order-confirmation.events", func(s *tracepb.Span) bool { return linksTo(s, traceID, spanID) })
		require.NotEmpty(t, sends, "a send span links to event %s's context", key)
		s := sends[0]
		require.Equal(t, tracepb.Span_SPAN_KIND_PRODUCER, s.Kind)
		require.Equal(t, "send", attrString(s, "messaging.operation.type"))
		require.Equal(t, broker.ExchangeEvents, attrString(s, "messaging.destination.name"))
		require.Positive(t, attr(s, "messaging.batch.message_count").GetIntValue())
	}

	// The dead message's log line names its trace.
	require.Eventually(t, func() bool {
		return logLineHas(p, `"message_id":"dead-traced"`, `"trace_id":"`+deadCtx.traceID+`"`, `"span_id":"`)
	}, 10*time.Second, 50*time.Millisecond, "the log line about the dead message carries its trace_id and span_id")

	// /metrics in OpenMetrics shows an exemplar on the end-to-end latency.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+addr+"/metrics", nil)
	require.NoError(t, err)
	req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0; charset=utf-8")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	exemplar := regexp.MustCompile(`(?m)^inboxd_inbox_end_to_end_seconds_bucket\{.*\} \d+ # \{trace_id="([0-9a-f]{32})"\}`).FindSubmatch(body)
	require.NotNil(t, exemplar, "an exemplar on inboxd_inbox_end_to_end_seconds:\n%s", grepLines(body, "inboxd_inbox_end_to_end_seconds"))
	known := map[string]bool{}
	for _, spanID := range processParent {
		known[hex.EncodeToString(receiver.bySpanID(spanID).TraceId)] = true
	}
	require.True(t, known[string(exemplar[1])], "the exemplar names a trace of a processed message")

	// A replay is a new trace linked to the original; its events keep
	// their ids (the outbox rows are not written again).
	keysBefore := b.db.Strings(t, "SELECT idempotency_key || ' ' || traceparent FROM outbox WHERE message_id = 'traced-0' ORDER BY 1")
	_, err = b.db.Pool.Exec(t.Context(), "UPDATE inbox SET replay_requested = true, replay_reason = 'trace test' WHERE message_id = 'traced-0'")
	require.NoError(t, err)
	original := producers["traced-0"]
	var replay *tracepb.Span
	require.Eventually(t, func() bool {
		spans := receiver.find("process order-confirmation.inbox", func(s *tracepb.Span) bool {
			return attrString(s, "messaging.message.id") == "traced-0" && attr(s, "inboxd.replay").GetBoolValue()
		})
		if len(spans) == 0 {
			return false
		}
		replay = spans[0]
		return true
	}, 20*time.Second, 50*time.Millisecond, "the replay's process span was exported")
	require.Empty(t, replay.ParentSpanId, "a replay is the root of a new trace")
	require.NotEqual(t, original.traceID, hex.EncodeToString(replay.TraceId))
	require.True(t, linksTo(replay, original.traceID, original.spanID), "the replay links to the original context")
	require.Equal(t, "processed", attrString(replay, "inboxd.outcome"))
	require.Equal(t, keysBefore, b.db.Strings(t, "SELECT idempotency_key || ' ' || traceparent FROM outbox WHERE message_id = 'traced-0' ORDER BY 1"),
		"the replay's events keep their ids")
}

// logLineHas reports whether one line of p's log holds every one of parts.
func logLineHas(p *process, parts ...string) bool {
	b, _ := os.ReadFile(p.logs)
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		all := true
		for _, part := range parts {
			if !bytes.Contains(line, []byte(part)) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}

// grepLines returns the lines of b holding s.
func grepLines(b []byte, s string) string {
	var out []string
	for line := range strings.SplitSeq(string(b), "\n") {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}
