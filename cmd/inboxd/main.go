// Command inboxd is the order-confirmation inbox service.
//
// Usage:
//
//	inboxd migrate   apply the embedded migrations and exit
//	inboxd serve     run ingest, workers and the HTTP endpoint until SIGINT/SIGTERM
//	inboxd redeliver-unroutable
//	                 move events no binding took back to order-confirmation.events
//	inboxd healthcheck
//	                 exit 0 only if /readyz on HTTP_ADDR answers 200
//	inboxd help      list the commands and every environment variable
//
// All configuration comes from the environment; see `inboxd help`.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/go-logr/stdr"
	"go.opentelemetry.io/otel"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

func main() {
	// What the libraries print through the standard logger (net/http's
	// recovered handler panics, OpenTelemetry's own messages, which quote
	// header values) and the panics of the services' goroutines go through
	// the redactor too.
	stderr := redactorFor(os.Getenv, broker.Nodes).writer(os.Stderr)
	log.SetOutput(stderr)
	otel.SetLogger(stdr.New(log.Default()))
	startstop.SetPanicHandler(func(v any, stack []byte) {
		slog.New(slog.NewJSONHandler(stderr, nil)).Error("panic: inboxd stops",
			slog.String("panic", fmt.Sprint(v)), slog.String("stack", string(stack)))
		os.Exit(2)
	})
	var err error
	startstop.Guard(func() { err = run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr) })()
	if err != nil {
		fmt.Fprintf(os.Stderr, "inboxd: %v\n", err)
		os.Exit(1)
	}
}

// errUsage is returned for a command line inboxd does not understand.
var errUsage = errors.New("usage: inboxd migrate|serve|redeliver-unroutable|repartition|healthcheck|help")

// run is inboxd without the process around it: tests call it directly.
// Neither its error nor its log holds a password of DATABASE_URL or
// AMQP_URL, whether they parse or not.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) (err error) {
	redactor := redactorFor(getenv, broker.Nodes)
	defer func() {
		if err != nil && !errors.Is(err, errUsage) {
			err = redactedError{err: err, r: redactor}
		}
	}()
	stderr = redactor.writer(stderr)
	if len(args) != 1 {
		return errUsage
	}
	switch args[0] {
	case "help", "-h", "--help":
		printHelp(stdout)
		return nil
	case "healthcheck":
		// Only HTTP_ADDR: the check needs no other setting.
		addr := strings.TrimSpace(getenv("HTTP_ADDR"))
		if addr == "" {
			addr = HTTPAddrDefault
		}
		return healthcheck(ctx, addr)
	case "migrate", "serve", "redeliver-unroutable", "repartition":
	default:
		return errUsage
	}

	cfg, err := loadConfig(getenv, args[0])
	if err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	logger := newLogger(cfg, stderr)

	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	startstop.Go(func() {
		// After the first signal, a second one kills the process at once.
		<-ctx.Done()
		stop()
	})

	switch args[0] {
	case "migrate":
		// goose's lock is a session-level advisory lock, and the
		// migration's timeouts are session settings.
		if err := requireSessionPooling(ctx, cfg); err != nil {
			return err
		}
		return migrateUp(ctx, cfg, logger)
	case "redeliver-unroutable":
		moved, left, err := broker.RedeliverUnroutable(ctx, cfg.amqpURL)
		if err != nil {
			return fmt.Errorf("redeliver unroutable events: %w", err)
		}
		fmt.Fprintf(stdout, "redelivered %d events from %s; %d wait there still (no binding takes them yet)\n", moved, broker.QueueUnroutable, left)
		return nil
	case "repartition":
		return repartition(ctx, cfg, logger, stdout)
	}
	tp, err := tracing.Setup(ctx, getenv, logger, buildName(), inbox.DefaultProcessName())
	if err != nil {
		return fmt.Errorf("configuration: %w", err)
	}
	return serve(ctx, cfg, logger, tp)
}

func newLogger(cfg *config, w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{
		Level: cfg.logLevel,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				a.Value = slog.StringValue(a.Value.Duration().String())
			}
			return a
		},
	}
	var h slog.Handler = slog.NewJSONHandler(w, opts)
	if cfg.logFormat == "text" {
		h = slog.NewTextHandler(w, opts)
	}
	// Records logged with a context holding a span carry its trace_id and
	// span_id.
	return slog.New(tracing.LogHandler(h)).With(slog.Int("pid", os.Getpid()))
}

func printHelp(w io.Writer) {
	fmt.Fprint(w, `inboxd: the order-confirmation inbox service.

Commands:
  migrate   apply the embedded database migrations and exit
  serve     run ingest, workers and the HTTP endpoint until SIGINT or SIGTERM
  redeliver-unroutable
            move the events waiting in order-confirmation.unroutable back to
            order-confirmation.events, under their message ids (after binding
            the queues that were missing)
  repartition
            with every replica stopped, route the orders exchange to the
            inbox queues of INBOX_PARTITIONS, store what waits in the queues
            of the former layout and delete them; then start the replicas
            with the new INBOX_PARTITIONS (docs/ordering.md: "Changing INBOX_PARTITIONS")
  healthcheck
            GET /readyz on HTTP_ADDR (0.0.0.0 is asked on 127.0.0.1) and exit
            0 only on 200: a container's healthcheck
  help      show this text

Ordering:
  The messages of one order are handled, and the events they cause
  published, in the order the broker delivered them from
  order-confirmation.inbox: for one producer channel, the order it published
  them in. This holds on any number of replicas and through crashes: the
  queue has a single active consumer (the other replicas stand by), and a
  message waits while an earlier one of its order is open. Messages of one
  order published at once by two producers race at the broker.

Environment:
`)
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	for _, s := range (&config{}).settings() {
		def := s.def
		if def == "" {
			def = "(required)"
			if s.optional {
				def = "(none)"
			}
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", s.name, def, s.doc)
	}
	_ = tw.Flush()
	fmt.Fprint(w, `
OpenTelemetry tracing (standard variables; the OpenTelemetry SDK reads them,
and the other OTEL_* variables it knows, see its documentation):
`)
	tw = tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	for _, s := range otelSettings() {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", s.name, s.def, s.doc)
	}
	_ = tw.Flush()
}
