// Package pipeline builds the services of the inbox's flow in one process —
// the database wake-ups, the inbox worker, ingest, the outbox relay and the
// janitor — wired to each other, and starts and stops them as one. Building
// and starting are separate steps: New builds, Start starts.
//
// With a Leader, the maintenance (the janitor, the keepers of the inbox's
// and the outbox's claim floors, the key ledger's statistics, and the
// LeaderTasks) runs only while this
// process leads, in one process of the schema at a time.
package pipeline

import (
	"cmp"
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/leader"
	"github.com/orderconfirm/inboxd/internal/notifier"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// Config says which services a Pipeline has: each one whose config is
// nil is left out.
type Config struct {
	// Logger receives the notifier's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Listen is the connection config of the notifier, which wakes the
	// worker and the relay when rows arrive; nil leaves them to their
	// polling.
	Listen *pgx.ConnConfig
	// Worker, with WorkerPool, configures the inbox worker.
	Worker     *inbox.WorkerConfig
	WorkerPool *pgxpool.Pool
	// Ingest, with IngestPool, configures ingest. When the pipeline has a
	// worker and OnStored is nil, ingest wakes the worker.
	Ingest     *ingest.Config
	IngestPool *pgxpool.Pool
	// Relay, with RelayPool, configures the outbox relay.
	Relay     *outbox.RelayConfig
	RelayPool *pgxpool.Pool
	// Janitor configures the janitor, which runs on MaintenancePool.
	Janitor *janitor.Config
	// MaintenancePool is the maintenance's: the janitor's, and with a
	// Leader the claim floors' keepers' and the key ledger's statistics'
	// (which otherwise go through WorkerPool, RelayPool and IngestPool).
	// Its transactions wait on nothing outside PostgreSQL, and some hold
	// what every insert waits for (a rotation's TRUNCATE): serve gives its
	// sessions the workers' short idle_in_transaction_session_timeout, so
	// that a leader frozen in one holds the inserts up for seconds.
	MaintenancePool *pgxpool.Pool
	// Leader, when set, runs the maintenance while this process leads: the
	// janitor, the claim floors' keepers, the key ledger's statistics and
	// LeaderTasks. When nil, the janitor runs with the rest, and the
	// worker and the relay keep their floors themselves.
	Leader      *leader.Elector
	LeaderTasks []func(ctx context.Context)
}

// Pipeline is the built services. Those its Config left out are nil.
type Pipeline struct {
	Worker   *inbox.Worker
	Ingest   *ingest.Ingest
	Relay    *outbox.Relay
	Janitor  *janitor.Janitor
	Notifier *notifier.Notifier

	services []startstop.Startable
}

// New builds the services cfg names, without starting any.
func New(cfg *Config) (*Pipeline, error) {
	p := &Pipeline{}
	logger := cmp.Or(cfg.Logger, slog.Default())
	var err error
	var maintenance []func(context.Context)
	if cfg.Worker != nil {
		wc := *cfg.Worker
		if cfg.Leader != nil {
			wc.FloorKeptElsewhere = true
			maintenance = append(maintenance, claimfloor.InboxKeeper(cmp.Or(cfg.MaintenancePool, cfg.WorkerPool), logger.With(slog.String("component", "inbox.floor"))).Run)
		}
		if p.Worker, err = inbox.NewWorker(cfg.WorkerPool, &wc); err != nil {
			return nil, err
		}
	}
	if cfg.Ingest != nil {
		ic := *cfg.Ingest
		if ic.OnStored == nil && p.Worker != nil {
			ic.OnStored = p.Worker.Notify
		}
		if p.Ingest, err = ingest.New(cfg.IngestPool, &ic); err != nil {
			return nil, err
		}
		keyStats := func(pool *pgxpool.Pool) func(ctx context.Context) {
			return func(ctx context.Context) {
				janitor.KeepKeyStatistics(ctx, pool, logger.With(slog.String("component", "inbox.keys")))
			}
		}
		if cfg.Leader != nil {
			maintenance = append(maintenance, keyStats(cmp.Or(cfg.MaintenancePool, cfg.IngestPool)))
		} else {
			p.services = append(p.services, startstop.Func(keyStats(cfg.IngestPool)))
		}
	}
	if cfg.Relay != nil {
		rc := *cfg.Relay
		if cfg.Leader != nil {
			rc.FloorKeptElsewhere = true
			maintenance = append(maintenance, claimfloor.OutboxKeeper(cmp.Or(cfg.MaintenancePool, cfg.RelayPool), logger.With(slog.String("component", "outbox.floor"))).Run)
		}
		if p.Relay, err = outbox.NewRelay(cfg.RelayPool, &rc); err != nil {
			return nil, err
		}
	}
	if cfg.Janitor != nil {
		if p.Janitor, err = janitor.New(cfg.MaintenancePool, cfg.Janitor); err != nil {
			return nil, err
		}
	}
	if cfg.Listen != nil {
		p.Notifier = notifier.New(cfg.Listen, logger)
		if p.Worker != nil {
			p.Notifier.Subscribe(notifier.TopicInbox, p.Worker.Notify)
		}
		if p.Relay != nil {
			p.Notifier.Subscribe(notifier.TopicOutbox, p.Relay.Notify)
		}
		p.services = append(p.services, startstop.Func(p.Notifier.Run))
	}
	// The steps of the flow stop together: ingest stores and acks the batch
	// in hand while the worker finishes (or rolls back) its batches.
	var work []startstop.Startable
	if p.Worker != nil {
		work = append(work, p.Worker)
	}
	if p.Ingest != nil {
		work = append(work, p.Ingest)
	}
	if p.Relay != nil {
		work = append(work, p.Relay)
	}
	switch {
	case cfg.Leader == nil && p.Janitor != nil:
		work = append(work, p.Janitor)
	case p.Janitor != nil:
		maintenance = append(maintenance, p.Janitor.Run)
	}
	p.services = append(p.services, startstop.Parallel(work...))
	if cfg.Leader != nil {
		maintenance = append(maintenance, cfg.LeaderTasks...)
		p.services = append(p.services, startstop.Func(func(ctx context.Context) { cfg.Leader.Run(ctx, maintenance...) }))
	}
	return p, nil
}

// Start starts the services in order: the notifier, then the worker,
// ingest, the relay and the janitor, then the election (with a Leader). When one fails to start, those started
// are stopped again and the error returned.
func (p *Pipeline) Start(ctx context.Context) error {
	return startstop.StartAll(ctx, p.services...)
}

// Stop stops the election and the maintenance it runs (with a Leader),
// then the worker, ingest, the relay and the janitor at once, then the
// notifier. ctx is the grace period of the work in flight (see
// startstop.Service).
func (p *Pipeline) Stop(ctx context.Context) {
	startstop.StopAll(ctx, p.services...)
}
