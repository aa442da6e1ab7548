package tracing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// Protocols of OTEL_EXPORTER_OTLP_PROTOCOL that Setup supports.
const (
	ProtocolGRPC         = "grpc"
	ProtocolHTTPProtobuf = "http/protobuf"
)

// Provider is the outcome of Setup: the Tracer the service uses and, when
// spans are exported, the SDK's provider to shut down.
type Provider struct {
	// Tracer starts the service's spans.
	Tracer *Tracer
	// Exporting reports whether spans are exported; when false, Tracer is
	// PropagateOnly().
	Exporting bool
	// Protocol is the OTLP protocol spans are exported with ("" when not
	// exporting).
	Protocol string

	sdk *sdktrace.TracerProvider
}

// Shutdown exports the spans still buffered and stops the exporter, within
// ctx. It does nothing when nothing is exported.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p.sdk == nil {
		return nil
	}
	return p.sdk.Shutdown(ctx)
}

// Setup builds the tracer provider the standard OpenTelemetry environment
// variables ask for, read through getenv:
//
//   - OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none, or neither
//     OTEL_EXPORTER_OTLP_ENDPOINT nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set
//     (and OTEL_TRACES_EXPORTER not set to otlp): nothing is exported, and
//     the Tracer is PropagateOnly().
//   - Otherwise spans are exported over OTLP with a batching span processor:
//     grpc or http/protobuf (the default) by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
//     else OTEL_EXPORTER_OTLP_PROTOCOL. The SDK itself reads the rest:
//     endpoints, headers, timeouts, compression and certificates
//     (OTEL_EXPORTER_OTLP_*), the sampler (OTEL_TRACES_SAMPLER, default
//     parentbased_always_on), the batch processor (OTEL_BSP_*), span limits
//     (OTEL_SPAN_*), and the resource (OTEL_SERVICE_NAME,
//     OTEL_RESOURCE_ATTRIBUTES); the service name defaults to "inboxd".
//
// The SDK reads those from the process environment, whatever getenv says.
// Errors of the exporter are logged to logger. Setup's own errors name the
// variable at fault.
func Setup(ctx context.Context, getenv func(string) string, logger *slog.Logger, version, instance string) (*Provider, error) {
	off := &Provider{Tracer: PropagateOnly()}
	if v := strings.TrimSpace(getenv("OTEL_SDK_DISABLED")); v != "" {
		disabled, err := strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("OTEL_SDK_DISABLED is invalid: %q: not true or false", v)
		}
		if disabled {
			return off, nil
		}
	}
	switch v := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); v {
	case "none":
		return off, nil
	case "otlp":
	case "":
		if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
			return off, nil
		}
	default:
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER is invalid: %q: must be otlp or none", v)
	}

	name := "OTEL_EXPORTER_OTLP_PROTOCOL"
	protocol := strings.TrimSpace(getenv(name))
	if v := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")); v != "" {
		name, protocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v
	}
	protocol = cmp.Or(protocol, ProtocolHTTPProtobuf)
	var exporter sdktrace.SpanExporter
	var err error
	switch protocol {
	case ProtocolHTTPProtobuf:
		exporter, err = otlptracehttp.New(ctx)
	case ProtocolGRPC:
		exporter, err = otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("%s is invalid: %q: must be %s or %s", name, protocol, ProtocolGRPC, ProtocolHTTPProtobuf)
	}
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}

	// Later detectors win: the environment overrides the defaults.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("inboxd"), semconv.ServiceVersion(version), semconv.ServiceInstanceID(instance)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		_ = exporter.Shutdown(ctx)
		return nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES is invalid: %w", err)
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("OpenTelemetry", slog.String("error", err.Error()))
	}))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return &Provider{Tracer: New(tp), Exporting: true, Protocol: protocol, sdk: tp}, nil
}
