// Package metrics exposes the service's Prometheus metrics: counters fed by
// ingest, the workers and the relay, the state of each connection pool, and
// gauges read from the database on every scrape by the one process that
// leads (internal/leader).
package metrics

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
)

// Metrics holds the service's collectors, registered on Registry.
type Metrics struct {
	// Registry is what /metrics serves.
	Registry *prometheus.Registry

	received     prometheus.Counter
	duplicates   prometheus.Counter
	conflicts    prometheus.Counter
	deadLettered prometheus.Counter
	batchSize    prometheus.Histogram
	outcomes     *prometheus.CounterVec
	replays      prometheus.Counter
	handler      prometheus.Histogram
	endToEnd     prometheus.Histogram
	published    prometheus.Counter
	janitor      *prometheus.CounterVec
	// repliesIgnored counts the requests for a reply not answered, by why.
	repliesIgnored *prometheus.CounterVec
}

// Options are the optional parts of the metrics.
type Options struct {
	// Pools are the connection pools whose pgxpool statistics are exported,
	// by the name in their pool label (e.g. ingest, worker, relay).
	Pools map[string]*pgxpool.Pool
	// Leader, when set, decides whether this process exports the gauges
	// read from the database: only while it leads (internal/leader). When
	// nil, it always does.
	Leader Leader
}

// Leader reports whether this process is the one that exports the gauges
// read from the database.
type Leader interface{ Held() bool }

// New returns the metrics, with gauges that read the database through pool
// (each scrape bounded by timeout), Go's process and runtime collectors, and
// the build of inboxd.
func New(pool *pgxpool.Pool, logger *slog.Logger, timeout time.Duration, build string, opts Options) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		received: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_inbox_received_total", Help: "Deliveries stored as new inbox rows.",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_inbox_duplicates_total", Help: "Deliveries whose message id was already in the inbox.",
		}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_inbox_conflicting_duplicates_total",
			Help: "Duplicates whose payload differed from the stored one (recorded in inbox_conflicts; the stored payload is kept).",
		}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_inbox_dead_lettered_total", Help: "Deliveries sent to order-confirmation.dlx because they could not be stored.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "inboxd_inbox_ingest_batch_size", Help: "Deliveries per acknowledged ingest batch.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12),
		}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inboxd_inbox_handled_total", Help: "Handling attempts by outcome: processed, retried or dead; waiting counts the messages put back without an attempt counted (a row they need is held).",
		}, []string{"outcome"}),
		replays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_inbox_replays_total", Help: "Replayed messages handled.",
		}),
		handler: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "inboxd_inbox_handler_batch_seconds", Help: "Time the handler took per work batch.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		endToEnd: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "inboxd_inbox_end_to_end_seconds",
			Help:    "Time from a message's arrival in the inbox to its processed commit; exemplars name the trace_id of sampled messages (OpenMetrics).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}),
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "inboxd_outbox_published_total", Help: "Outbox rows published and confirmed by the broker.",
		}),
		janitor: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inboxd_janitor_deleted_total", Help: "Rows the janitor deleted past their retention, by what they were.",
		}, []string{"rows"}),
		repliesIgnored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inboxd_reply_requests_ignored_total",
			Help: "Requests for a reply stored with their message but never answered: reply_to (neither direct reply-to nor a queue INBOX_REPLY_QUEUE_PREFIXES allows) or user_id (a copy under another AMQP user_id than the message's first delivery).",
		}, []string{"reason"}),
	}
	m.repliesIgnored.WithLabelValues("reply_to")
	m.repliesIgnored.WithLabelValues("user_id")
	for _, s := range []string{"processed", "retried", "dead"} {
		m.outcomes.WithLabelValues(s)
	}
	// Every kind of row the janitor deletes is exported from the start, at
	// 0 until it deletes some: increase() sees the first deletions.
	for _, rows := range []string{janitor.RowsProcessed, janitor.RowsDead, janitor.RowsPublished, janitor.RowsConflicts,
		janitor.RowsUndeliverable, janitor.RowsReplyRequests} {
		m.janitor.WithLabelValues(rows)
	}
	buildInfo := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "inboxd_build_info", Help: "Always 1; the build label names the running build of inboxd.",
	}, []string{"build"})
	buildInfo.WithLabelValues(build).Set(1)
	m.Registry.MustRegister(m.received, m.duplicates, m.conflicts, m.deadLettered, m.batchSize, m.outcomes, m.replays,
		m.handler, m.endToEnd, m.published, m.janitor, m.repliesIgnored, buildInfo,
		&gauges{pool: pool, logger: logger, timeout: timeout, lock: opts.Leader},
		&poolStats{pools: opts.Pools},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// ObserveIngest records an acknowledged ingest batch.
func (m *Metrics) ObserveIngest(s ingest.Stats) {
	m.received.Add(float64(s.Inserted))
	m.duplicates.Add(float64(s.Duplicates))
	m.conflicts.Add(float64(s.Conflicts))
	m.deadLettered.Add(float64(s.DeadLettered))
	m.batchSize.Observe(float64(s.Deliveries))
	m.repliesIgnored.WithLabelValues("reply_to").Add(float64(s.RepliesNotAllowed))
	m.repliesIgnored.WithLabelValues("user_id").Add(float64(s.RepliesOfAnotherUser))
}

// ObserveBatch records a committed work batch.
func (m *Metrics) ObserveBatch(s inbox.BatchStats) {
	m.outcomes.WithLabelValues("processed").Add(float64(s.Processed))
	m.outcomes.WithLabelValues("retried").Add(float64(s.Retried))
	m.outcomes.WithLabelValues("dead").Add(float64(s.Dead))
	m.outcomes.WithLabelValues("waiting").Add(float64(s.Waiting))
	m.replays.Add(float64(s.Replays))
	m.handler.Observe(s.HandlerDuration.Seconds())
	exemplars := m.endToEnd.(prometheus.ExemplarObserver)
	for i, l := range s.Latencies {
		if i < len(s.TraceIDs) && s.TraceIDs[i] != "" {
			exemplars.ObserveWithExemplar(l.Seconds(), prometheus.Labels{"trace_id": s.TraceIDs[i]})
			continue
		}
		m.endToEnd.Observe(l.Seconds())
	}
}

// ObserveJanitor records a batch of rows the janitor deleted.
func (m *Metrics) ObserveJanitor(rows string, n int, _ time.Duration) {
	m.janitor.WithLabelValues(rows).Add(float64(n))
}

// ObservePublished records published outbox rows.
func (m *Metrics) ObservePublished(n int) { m.published.Add(float64(n)) }

// GaugeReadInterval is how often at most the gauges are read from the
// database: scrapes within it, concurrent ones included, share one read.
const GaugeReadInterval = time.Second

// gauges reads the database's state for the scrapes, when this process
// holds lock (or lock is nil): at most once a GaugeReadInterval, one read
// at a time, the scrapes meanwhile waiting for it and sharing its result.
type gauges struct {
	pool    *pgxpool.Pool
	logger  *slog.Logger
	timeout time.Duration
	lock    Leader

	mu sync.Mutex
	// last is the latest read, taken at readAt.
	last   []prometheus.Metric
	readAt time.Time
}

var (
	pendingDesc    = prometheus.NewDesc("inboxd_inbox_pending", "Messages waiting to be handled (including retries).", nil, nil)
	deadDesc       = prometheus.NewDesc("inboxd_inbox_dead", "Messages that will not be retried unless replayed.", nil, nil)
	oldestDesc     = prometheus.NewDesc("inboxd_inbox_oldest_pending_age_seconds", "Age of the oldest pending message.", nil, nil)
	backlogDesc    = prometheus.NewDesc("inboxd_outbox_backlog", "Events in the outbox not yet published.", nil, nil)
	outboxDeadDesc = prometheus.NewDesc("inboxd_outbox_dead", "Events refused for good: not published, holding back their order's later rows, until replayed.", nil, nil)
	outboxOldDesc  = prometheus.NewDesc("inboxd_outbox_oldest_unpublished_age_seconds", "Age of the oldest event not published, dead ones included (0 when none waits).", nil, nil)
	repliesDesc    = prometheus.NewDesc("inboxd_outbox_replies_unpublished", "Replies to requesters not yet published.", nil, nil)
	undeliverDesc  = prometheus.NewDesc("inboxd_outbox_replies_undeliverable", "Replies the broker returned after their attempts: their requester was gone.", nil, nil)
	keyGenDesc     = prometheus.NewDesc("inboxd_inbox_key_generation_age_seconds", "Age of the key ledger's current generation: a seventh of INBOX_DEDUPE_WINDOW at most while the janitors rotate it.", nil, nil)
	hotPartDesc    = prometheus.NewDesc("inboxd_inbox_key_hot_part_waiting_seconds", "How long a hot part of the key ledger has waited, sealed or merged, to be moved into its slot and emptied (0 when none waits): a minute or so at most while the janitors run.", nil, nil)
	unfoldedDesc   = prometheus.NewDesc("inboxd_stock_unfolded_age_seconds", "Age of the oldest stock move not folded into stock.available yet: up to about 30 s while the folds run (longer for a SKU whose row is held at each fold).", nil, nil)
	heldDesc       = prometheus.NewDesc("inboxd_inbox_held_back_orders", "Orders whose later messages wait behind their first open message, dead or failed and waiting for its retry (the orders inbox_held_back lists).", nil, nil)
	heldOldDesc    = prometheus.NewDesc("inboxd_inbox_held_back_oldest_age_seconds", "Age of the oldest message held back behind an earlier message of its order that is dead or waiting for its retry (0 when none is).", nil, nil)
	snapshotDesc   = prometheus.NewDesc("inboxd_database_oldest_snapshot_age_seconds",
		"Age of the oldest transaction of the database holding a snapshot (backend_xmin set in pg_stat_activity; 0 when none but the scrape's): vacuum removes no row version ended since it began. PostgreSQL shows the transaction start of other logins' sessions only to members of pg_read_all_stats: without that role, the service login's own sessions only. Replication slots are not counted.", nil, nil)
	upDesc     = prometheus.NewDesc("inboxd_inbox_database_up", "Whether the last scrape could read the database.", nil, nil)
	holderDesc = prometheus.NewDesc("inboxd_inbox_database_gauges_exporter",
		"1 in the one process that exports the gauges read from the database, the elected leader (inboxd_inbox_pending, inboxd_inbox_dead, inboxd_inbox_oldest_pending_age_seconds, inboxd_outbox_backlog, inboxd_outbox_dead, inboxd_outbox_oldest_unpublished_age_seconds, inboxd_outbox_replies_unpublished, inboxd_outbox_replies_undeliverable, inboxd_inbox_key_generation_age_seconds, inboxd_inbox_key_hot_part_waiting_seconds, inboxd_stock_unfolded_age_seconds, inboxd_inbox_held_back_orders, inboxd_inbox_held_back_oldest_age_seconds, inboxd_database_oldest_snapshot_age_seconds), 0 in the others.", nil, nil)
)

func (g *gauges) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{pendingDesc, deadDesc, oldestDesc, backlogDesc, outboxDeadDesc, outboxOldDesc, repliesDesc, undeliverDesc, keyGenDesc, hotPartDesc, unfoldedDesc, heldDesc, heldOldDesc, snapshotDesc, upDesc, holderDesc} {
		ch <- d
	}
}

func (g *gauges) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.last == nil || time.Since(g.readAt) >= GaugeReadInterval {
		g.last, g.readAt = g.read(), time.Now()
	}
	for _, m := range g.last {
		ch <- m
	}
}

// read reads the gauges from the database, or, when another process
// exports them, only whether the database answers.
func (g *gauges) read() []prometheus.Metric {
	ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	gauge := func(d *prometheus.Desc, v float64) prometheus.Metric {
		return prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	if g.lock != nil && !g.lock.Held() {
		up := 1.0
		if err := g.pool.Ping(ctx); err != nil {
			up = 0
		}
		return []prometheus.Metric{gauge(holderDesc, 0), gauge(upDesc, up)}
	}
	row, err := dbsqlc.New().MetricsGauges(ctx, g.pool)
	if err != nil {
		g.logger.Warn("read metrics gauges", slog.String("error", err.Error()))
		return []prometheus.Metric{gauge(holderDesc, 1), gauge(upDesc, 0)}
	}
	return []prometheus.Metric{
		gauge(holderDesc, 1), gauge(upDesc, 1),
		gauge(pendingDesc, float64(row.Pending)),
		gauge(deadDesc, float64(row.Dead)),
		gauge(oldestDesc, row.OldestPendingSeconds),
		gauge(backlogDesc, float64(row.OutboxBacklog)),
		gauge(outboxDeadDesc, float64(row.OutboxDead)),
		gauge(outboxOldDesc, row.OutboxOldestSeconds),
		gauge(repliesDesc, float64(row.RepliesUnpublished)),
		gauge(undeliverDesc, float64(row.RepliesUndeliverable)),
		gauge(keyGenDesc, row.KeyGenerationSeconds),
		gauge(hotPartDesc, row.KeyHotPartWaitingSeconds),
		gauge(unfoldedDesc, row.StockUnfoldedSeconds),
		gauge(heldDesc, float64(row.HeldBackOrders)),
		gauge(heldOldDesc, row.HeldBackOldestSeconds),
		gauge(snapshotDesc, row.OldestSnapshotSeconds),
	}
}

// poolStats exports pgxpool's statistics of each pool, labelled by pool.
type poolStats struct {
	pools map[string]*pgxpool.Pool
}

var (
	poolAcquiredDesc = prometheus.NewDesc("inboxd_pool_acquired_connections", "Connections of the pool in use.", []string{"pool"}, nil)
	poolIdleDesc     = prometheus.NewDesc("inboxd_pool_idle_connections", "Idle connections of the pool.", []string{"pool"}, nil)
	poolTotalDesc    = prometheus.NewDesc("inboxd_pool_total_connections", "Open connections of the pool (in use, idle or being opened).", []string{"pool"}, nil)
	poolMaxDesc      = prometheus.NewDesc("inboxd_pool_max_connections", "Most connections the pool opens.", []string{"pool"}, nil)
	poolAcquiresDesc = prometheus.NewDesc("inboxd_pool_acquires_total", "Connections acquired from the pool.", []string{"pool"}, nil)
	poolEmptyDesc    = prometheus.NewDesc("inboxd_pool_empty_acquires_total", "Acquires that had to wait for a connection (none was idle).", []string{"pool"}, nil)
	poolCanceledDesc = prometheus.NewDesc("inboxd_pool_canceled_acquires_total", "Acquires given up because their context ended.", []string{"pool"}, nil)
	poolWaitDesc     = prometheus.NewDesc("inboxd_pool_acquire_wait_seconds_total", "Total time spent acquiring connections from the pool.", []string{"pool"}, nil)
)

func (p *poolStats) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{poolAcquiredDesc, poolIdleDesc, poolTotalDesc, poolMaxDesc, poolAcquiresDesc, poolEmptyDesc, poolCanceledDesc, poolWaitDesc} {
		ch <- d
	}
}

func (p *poolStats) Collect(ch chan<- prometheus.Metric) {
	for name, pool := range p.pools {
		s := pool.Stat()
		ch <- prometheus.MustNewConstMetric(poolAcquiredDesc, prometheus.GaugeValue, float64(s.AcquiredConns()), name)
		ch <- prometheus.MustNewConstMetric(poolIdleDesc, prometheus.GaugeValue, float64(s.IdleConns()), name)
		ch <- prometheus.MustNewConstMetric(poolTotalDesc, prometheus.GaugeValue, float64(s.TotalConns()), name)
		ch <- prometheus.MustNewConstMetric(poolMaxDesc, prometheus.GaugeValue, float64(s.MaxConns()), name)
		ch <- prometheus.MustNewConstMetric(poolAcquiresDesc, prometheus.CounterValue, float64(s.AcquireCount()), name)
		ch <- prometheus.MustNewConstMetric(poolEmptyDesc, prometheus.CounterValue, float64(s.EmptyAcquireCount()), name)
		ch <- prometheus.MustNewConstMetric(poolCanceledDesc, prometheus.CounterValue, float64(s.CanceledAcquireCount()), name)
		ch <- prometheus.MustNewConstMetric(poolWaitDesc, prometheus.CounterValue, s.AcquireDuration().Seconds(), name)
	}
}
