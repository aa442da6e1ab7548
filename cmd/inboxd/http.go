package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"

	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// The HTTP server's timeouts, so that a client that opens connections and
// stalls (slow headers, a slow body, a response it does not read, an idle
// keep-alive) holds a connection for a bounded time.
const (
	// HTTPReadHeaderTimeout bounds reading a request's headers.
	HTTPReadHeaderTimeout = 5 * time.Second
	// HTTPReadTimeout bounds reading a whole request, body included.
	HTTPReadTimeout = 10 * time.Second
	// HTTPWriteTimeout bounds a request from the end of its headers to the
	// end of its response.
	HTTPWriteTimeout = 30 * time.Second
	// HTTPIdleTimeout bounds how long a keep-alive connection waits for its
	// next request.
	HTTPIdleTimeout = 60 * time.Second
	// PprofWriteTimeout is the write timeout of the profiler's server: a CPU
	// profile or trace runs for its seconds parameter (30 by default) first.
	PprofWriteTimeout = 5 * time.Minute
)

// The paths of the probes and the metrics on HTTP_ADDR.
const (
	// HealthzPath answers 200 while the process serves HTTP, whatever
	// PostgreSQL and RabbitMQ do: a liveness probe.
	HealthzPath = "/healthz"
	// ReadyzPath answers 200 only while PostgreSQL answers, ingest consumes
	// and the relay is connected, 503 otherwise: a readiness probe.
	ReadyzPath = "/readyz"
	// MetricsPath serves the Prometheus metrics.
	MetricsPath = "/metrics"
)

// ReadyPingInterval is how long /readyz reuses its last PostgreSQL ping:
// however many probes arrive, readiness pings at most once per interval,
// over a pool of its own.
const ReadyPingInterval = time.Second

// ReadyPingTimeout bounds one readiness ping: a readiness probe's timeout
// must be longer.
const ReadyPingTimeout = 2 * time.Second

// newHTTPServer returns a server for h with the timeouts above.
func newHTTPServer(h http.Handler, writeTimeout time.Duration) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: HTTPReadHeaderTimeout,
		ReadTimeout:       HTTPReadTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       HTTPIdleTimeout,
	}
}

// postgresCheck pings PostgreSQL for /readyz through a pool of its own (so
// that probes never take a connection from the service's work), once per
// ReadyPingInterval at most: concurrent probes share one ping and its
// result. The ping reads what an ack's commit waits for (see durability).
type postgresCheck struct {
	pool *pgxpool.Pool
	mu   sync.Mutex
	at   time.Time
	err  error
	d    durability
}

// durability is what a commit of the service's sessions waits for: the
// server's synchronous_standby_names (empty: the primary's own disk only,
// so a failover to a standby may lose acked messages) and the session's
// synchronous_commit.
type durability struct {
	standbyNames, synchronousCommit string
}

// waitsForStandby reports whether a commit waits for a standby too.
func (d durability) waitsForStandby() bool {
	return d.standbyNames != "" && d.synchronousCommit != "local" && d.synchronousCommit != "off"
}

// String says it for /readyz.
func (d durability) String() string {
	if d.waitsForStandby() {
		return fmt.Sprintf("commits wait for a standby (synchronous_standby_names = %q, synchronous_commit = %s)", d.standbyNames, d.synchronousCommit)
	}
	return "commits wait for the primary's disk only: a failover to an asynchronous standby may lose acked messages (synchronous_standby_names is empty)"
}

func (c *postgresCheck) check(ctx context.Context) (durability, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < ReadyPingInterval {
		return c.d, c.err
	}
	// The probe that pings may go away; the others wait for its answer.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReadyPingTimeout)
	defer cancel()
	c.err = c.pool.QueryRow(ctx, "SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit')").
		Scan(&c.d.standbyNames, &c.d.synchronousCommit)
	c.at = time.Now()
	return c.d, c.err
}

// newHTTPHandler serves /healthz (the process is alive), /readyz (it can
// reach PostgreSQL, as ready checks, is consuming from RabbitMQ and its
// relay is connected), /metrics (Prometheus) and the status page at / when
// statusPage is not nil.
func newHTTPHandler(ready *postgresCheck, ingest *ingest.Ingest, relay *outbox.Relay, registry *prometheus.Registry, statusPage http.Handler) http.Handler {
	return routes(probes(ready, ingest, relay, registry), statusPage, statusPagePace)
}

// routes serves the probes as they are and the status page, when not nil,
// at / within pace: however many requests the page gets, a probe or a
// scrape is never made to wait for them.
func routes(probes *http.ServeMux, statusPage http.Handler, p pace) http.Handler {
	if statusPage != nil {
		// Any method, so that the page answers 405 itself to other methods
		// than GET and HEAD.
		probes.Handle("/", p.limit(statusPage))
	}
	return probes
}

// metricsMaxInFlight bounds the scrapes of /metrics served at once.
const metricsMaxInFlight = 4

// probes serves /healthz, /readyz and /metrics.
func probes(pg *postgresCheck, ingest *ingest.Ingest, relay *outbox.Relay, registry *prometheus.Registry) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET "+MetricsPath, promhttp.HandlerFor(registry, promhttp.HandlerOpts{
		// OpenMetrics, when the scraper asks for it, carries the exemplars
		// (trace ids) of inboxd_inbox_end_to_end_seconds.
		EnableOpenMetrics: true,
		// Scrapes beyond it get 503 at once rather than pile up; the
		// database gauges are read once a second whatever their number.
		MaxRequestsInFlight: metricsMaxInFlight,
	}))
	mux.HandleFunc("GET "+HealthzPath, func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "inboxd_inbox_commit_waits_for_standby",
		Help: "1 when the service's commits (and so its acks) wait for a synchronous standby, 0 when for the primary's disk only; read by /readyz's ping.",
	}, func() float64 {
		if d, err := pg.check(context.Background()); err == nil && d.waitsForStandby() {
			return 1
		}
		return 0
	}))
	mux.HandleFunc("GET "+ReadyzPath, func(w http.ResponseWriter, r *http.Request) {
		checks := map[string]string{"postgres": "ok", "rabbitmq": "ok", "relay": "ok"}
		status := http.StatusOK
		if d, err := pg.check(r.Context()); err != nil {
			checks["postgres"] = "unreachable"
			status = http.StatusServiceUnavailable
		} else {
			checks["durability"] = d.String()
		}
		if !ingest.Consuming() {
			checks["rabbitmq"] = "not consuming"
			status = http.StatusServiceUnavailable
		}
		if !relay.Connected() {
			checks["relay"] = "not connected"
			status = http.StatusServiceUnavailable
		}
		// Reported, not failed: the alarm is the broker's state, and this
		// replica would do no better than another; ingest stores on.
		if blocked, reason := relay.Blocked(); blocked {
			checks["broker_alarm"] = "the broker blocks publishing (memory or disk alarm): " + reason
		}
		writeJSON(w, status, checks)
	})
	return mux
}

// HTTPRequestRate is how many requests a second the status page and its
// API answer, all clients together, beyond a burst of httpRequestBurst: far
// more than the screens of a team ask for. A flood waits its turn instead of
// taking the workers' CPU. The probes and /metrics are never paced.
const HTTPRequestRate = 200

// HTTPClientRate is how many requests a second one client (one remote
// address) gets from the status page and its API, beyond a burst of
// httpClientBurst, so that a single client cannot spend the page's whole
// rate. One over it is answered 429 after HTTPClientTarpit: a flood's
// connections each send one request a second instead of as many as the
// server can refuse, and refusing them no longer takes the CPU the probes
// and the workers need.
const HTTPClientRate = 20

// HTTPClientTarpit is how long a request over its client's rate is held
// before its 429, for up to httpTarpitHeld such requests at once (past
// that, the 429 is at once).
const HTTPClientTarpit = time.Second

const (
	httpRequestBurst = 50
	httpClientBurst  = 40
	// httpPaceWait bounds how long a request waits for its turn before it
	// is answered 503.
	httpPaceWait = 5 * time.Second
	// httpClientsTracked bounds the clients whose rate is kept; past it the
	// record starts over.
	httpClientsTracked = 10_000
	// httpTarpitHeld bounds the requests held by HTTPClientTarpit at once.
	httpTarpitHeld = 2_000
)

// pace is how the status page is limited: all clients together (rate,
// burst, and how long a request waits for its turn), and each client (rate,
// burst, and how long a request over them is held before its 429).
type pace struct {
	rate         float64
	burst        int
	wait         time.Duration
	clientRate   float64
	clientBurst  int
	clientTarpit time.Duration
}

var statusPagePace = pace{
	rate: HTTPRequestRate, burst: httpRequestBurst, wait: httpPaceWait,
	clientRate: HTTPClientRate, clientBurst: httpClientBurst, clientTarpit: HTTPClientTarpit,
}

// limit serves h within p: each client first, then all together.
func (p pace) limit(h http.Handler) http.Handler {
	return perClient(paced(h, p.rate, p.burst, p.wait), p.clientRate, p.clientBurst, p.clientTarpit)
}

// perClient serves each client (by remote address, without its port) at
// most perSecond requests a second after a burst, answering 429 with
// Retry-After beyond that, after holding the request for tarpit (at once
// when httpTarpitHeld requests are held already).
func perClient(h http.Handler, perSecond float64, burst int, tarpit time.Duration) http.Handler {
	held := make(chan struct{}, httpTarpitHeld)
	var mu sync.Mutex
	clients := map[string]*rate.Limiter{}
	allow := func(client string) bool {
		mu.Lock()
		defer mu.Unlock()
		l, ok := clients[client]
		if !ok {
			if len(clients) >= httpClientsTracked {
				clear(clients)
			}
			l = rate.NewLimiter(rate.Limit(perSecond), burst)
			clients[client] = l
		}
		return l.Allow()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		client, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			client = r.RemoteAddr
		}
		if !allow(client) {
			select {
			case held <- struct{}{}:
				hold(r.Context(), tarpit)
				<-held
			default:
			}
			w.Header().Set("Retry-After", "1")
			http.Error(w, "too many requests from this client", http.StatusTooManyRequests)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// hold waits for d, or until ctx ends.
func hold(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// paced serves h at most perSecond requests a second (after a burst):
// a request over the rate waits for its turn, up to maxWait, and is then
// answered 503 with Retry-After.
func paced(h http.Handler, perSecond float64, burst int, maxWait time.Duration) http.Handler {
	limiter := rate.NewLimiter(rate.Limit(perSecond), burst)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), maxWait)
		defer cancel()
		if err := limiter.Wait(ctx); err != nil {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "busy: too many requests", http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// newPprofHandler serves Go's profiler under /debug/pprof/.
func newPprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// httpServices returns the HTTP endpoint, serving h on HTTP_ADDR, and the
// services to start with it: the endpoint itself and, only when
// INBOX_PPROF_ADDR is set, the profiler, on a listener of its own.
func httpServices(cfg *config, logger *slog.Logger, h http.Handler) (*httpService, []startstop.Startable) {
	endpoint := &httpService{
		setting: "HTTP_ADDR", addr: cfg.httpAddr, graceful: true, logger: logger, failed: "HTTP server failed",
		server: newHTTPServer(h, HTTPWriteTimeout),
	}
	services := []startstop.Startable{endpoint}
	if cfg.pprofAddr != "" {
		services = append(services, &httpService{
			setting: "INBOX_PPROF_ADDR", addr: cfg.pprofAddr, logger: logger, failed: "profiler's HTTP server failed",
			server: newHTTPServer(newPprofHandler(), PprofWriteTimeout),
		})
	}
	return endpoint, services
}

// httpService runs server as a service: Start listens on addr and serves in
// the background; Stop shuts the server down, gracefully (waiting for the
// requests in flight until ctx ends) or, when graceful is false, at once.
type httpService struct {
	// setting names addr in the error of a failed listen.
	setting  string
	addr     string
	server   *http.Server
	graceful bool
	logger   *slog.Logger
	// failed is logged when the server fails while serving.
	failed string

	ln   net.Listener
	done chan struct{}
}

func (s *httpService) Start(context.Context) error {
	ln, err := net.Listen("tcp", s.addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", s.setting, err)
	}
	s.ln, s.done = ln, make(chan struct{})
	startstop.Go(func() {
		defer close(s.done)
		if err := s.server.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.logger.Error(s.failed, slog.String("error", err.Error()))
		}
	})
	return nil
}

// Addr returns the address the server listens on, once started.
func (s *httpService) Addr() string { return s.ln.Addr().String() }

func (s *httpService) Stop(ctx context.Context) {
	if s.done == nil {
		return
	}
	if s.graceful {
		_ = s.server.Shutdown(ctx)
	} else {
		_ = s.server.Close()
	}
	<-s.done
}
