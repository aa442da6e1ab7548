package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/outbox"
)

// newHTTPHandler serves /healthz (the process is alive), /readyz (it can
// reach PostgreSQL, is consuming from RabbitMQ and its relay is connected),
// /metrics (Prometheus), the status page at / when statusPage is not nil,
// and, when withPprof, Go's profiler under /debug/pprof/.
func newHTTPHandler(pool *pgxpool.Pool, consumer *inbox.Consumer, relay *outbox.Relay, registry *prometheus.Registry, statusPage http.Handler, withPprof bool) http.Handler {
	mux := http.NewServeMux()
	if statusPage != nil {
		// Any method: "GET /" would conflict with the profiler's patterns.
		// The page answers only GET (and HEAD) itself.
		mux.Handle("/", statusPage)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{
		// OpenMetrics, when the scraper asks for it, carries the exemplars
		// (trace ids) of inbox_end_to_end_seconds.
		EnableOpenMetrics: true,
	}))
	if withPprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		checks := map[string]string{"postgres": "ok", "rabbitmq": "ok", "relay": "ok"}
		status := http.StatusOK
		if err := pool.Ping(ctx); err != nil {
			checks["postgres"] = "unreachable"
			status = http.StatusServiceUnavailable
		}
		if !consumer.Consuming() {
			checks["rabbitmq"] = "not consuming"
			status = http.StatusServiceUnavailable
		}
		if !relay.Connected() {
			checks["relay"] = "not connected"
			status = http.StatusServiceUnavailable
		}
		writeJSON(w, status, checks)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
