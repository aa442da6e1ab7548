package main

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/startstop"
	"github.com/orderconfirm/inboxd/internal/statuspage"
)

// pools are serve's PostgreSQL connection pools, one for each kind of work,
// so that none can starve another of connections: a flood of probes or
// status-page views never takes a connection from ingest or the workers,
// nor ingest from the workers.
type pools struct {
	// ingest stores the deliveries (ingestPoolSize).
	ingest *pgxpool.Pool
	// worker claims and handles the inbox (workerPoolSize).
	worker *pgxpool.Pool
	// relay publishes the outbox (relayPoolSize).
	relay *pgxpool.Pool
	// maintenance is the leader's: the janitor, the claim floors' keepers,
	// the stock fold and the key ledger's statistics
	// (maintenancePoolSize). A follower never connects it.
	maintenance *pgxpool.Pool
	// gauges reads the gauges /metrics exports from the database
	// (gaugesPoolSize): however many scrapes come, they never take a
	// connection the relay or the janitor needs.
	gauges *pgxpool.Pool
	// status serves the status page; nil when it is off.
	status *pgxpool.Pool
	// ready pings for /readyz (readyPoolSize).
	ready *pgxpool.Pool
}

// ingestPoolSize: ingest stores one batch at a time, and records the
// conflicts of a batch after it.
const ingestPoolSize = 2

// workerPoolSize is one connection for each batch in flight (INBOX_WORKERS,
// each in its own transaction), one for the takeover of unfinished
// messages and one for the answer of reply requests left unanswered,
// which run beside them.
func workerPoolSize(workers int) int { return workers + 2 }

// relayPoolSize: the relay holds one connection, for the transaction of the
// batch it is publishing; one is spare.
const relayPoolSize = 2

// maintenancePoolSize: one connection each for the janitor (one statement
// or one key-ledger step at a time), the two claim floors' keepers, the
// stock fold and the key ledger's statistics, which run side by side.
const maintenancePoolSize = 5

// gaugesPoolSize: the gauges are read once at a time, at most once a second
// (metrics.GaugeReadInterval), whatever the scrapes.
const gaugesPoolSize = 1

// readyPoolSize: /readyz pings once at a time at most (postgresCheck), the
// other probes wait for its answer.
const readyPoolSize = 1

// poolSizes is the number of connections of each of serve's pools, as in
// pools; 0 for a pool serve does not open.
type poolSizes struct{ ingest, worker, relay, maintenance, gauges, status, ready int }

// poolSizesFor returns the sizes of the pools serve opens for cfg.
func poolSizesFor(cfg *config) poolSizes {
	s := poolSizes{
		ingest:      ingestPoolSize,
		worker:      workerPoolSize(cfg.workers),
		relay:       relayPoolSize,
		maintenance: maintenancePoolSize,
		gauges:      gaugesPoolSize,
		ready:       readyPoolSize,
	}
	if cfg.statusPage {
		s.status = statuspage.PoolSizeDefault
	}
	return s
}

// openPools opens the pools of poolSizesFor(cfg). Opening connects to
// nothing yet: each pool connects when first used.
func openPools(ctx context.Context, cfg *config) (*pools, error) {
	sizes := poolSizesFor(cfg)
	ps := &pools{}
	for _, p := range []struct {
		pool *(*pgxpool.Pool)
		name string
		size int
	}{
		{&ps.ingest, "ingest", sizes.ingest},
		{&ps.worker, "worker", sizes.worker},
		{&ps.relay, "relay", sizes.relay},
		{&ps.maintenance, "maintenance", sizes.maintenance},
		{&ps.gauges, "gauges", sizes.gauges},
		{&ps.status, "status", sizes.status},
		{&ps.ready, "ready", sizes.ready},
	} {
		if p.size == 0 {
			continue
		}
		pool, err := newPool(ctx, cfg, p.name, p.size, !waitsOutside[p.name])
		if err != nil {
			ps.close()
			return nil, err
		}
		*p.pool = pool
	}
	return ps, nil
}

// waitsOutside names the pools whose transactions wait on something
// outside PostgreSQL: the relay's, open while the broker confirms its
// batch. Their sessions carry INBOX_IDLE_IN_TX_TIMEOUT. Every other pool's
// transactions wait on nothing outside PostgreSQL (the workers' lock,
// handle and record; the maintenance's steps, a key-ledger rotation's
// TRUNCATE among them, which every insert waits for), and their sessions
// carry INBOX_WORKER_IDLE_IN_TX_TIMEOUT: a replica frozen in the middle of
// one (a VM pause, SIGSTOP, a stuck node: its sockets stay open) holds the
// rows and locks it took for seconds, not for the minute the relay's
// confirms need. (Ingest runs single statements, in no transaction of its
// own.)
var waitsOutside = map[string]bool{"relay": true}

// plansEachCall names the pools that keep no plans: each statement is
// planned for its parameters and the tables as they are at each call. The
// maintenance's statements (a retention's delete, a fold's) run seconds
// or minutes apart, the status page's at a view, and some would read a
// grown table whole with a plan kept from when it was small: planning
// them costs next to nothing. The pools of the flow keep their plans (see
// pipeline.KeepPlans).
var plansEachCall = map[string]bool{"maintenance": true, "status": true}

// attach gives the pipeline's services their pools.
func (ps *pools) attach(pc *pipeline.Config) {
	pc.IngestPool = ps.ingest
	pc.WorkerPool = ps.worker
	pc.RelayPool = ps.relay
	pc.MaintenancePool = ps.maintenance
}

// measured returns the pools whose statistics the metrics export, by the
// name of their pool label.
func (ps *pools) measured() map[string]*pgxpool.Pool {
	return map[string]*pgxpool.Pool{"ingest": ps.ingest, "worker": ps.worker, "relay": ps.relay, "maintenance": ps.maintenance, "gauges": ps.gauges}
}

// close closes the pools that are open, the last opened first.
func (ps *pools) close() {
	for _, pool := range []*pgxpool.Pool{ps.ready, ps.status, ps.gauges, ps.maintenance, ps.relay, ps.worker, ps.ingest} {
		if pool != nil {
			closePool(pool)
		}
	}
}

// closePool closes pool, giving up after a second: a connection held by work
// that was left behind after the grace period (see startstop.AbandonAfter)
// never comes back, and pgxpool's Close waits for every one.
func closePool(pool *pgxpool.Pool) {
	closed := make(chan struct{})
	startstop.Go(func() {
		pool.Close()
		close(closed)
	})
	select {
	case <-closed:
	case <-time.After(time.Second):
	}
}
