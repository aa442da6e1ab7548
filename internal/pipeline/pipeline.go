// Package pipeline builds the services of the inbox's flow in one process —
// the database wake-ups, the inbox worker, ingest, the outbox relay and the
// janitor — wired to each other, and starts and stops them as one. Building
// and starting are separate steps: New builds, Start starts.
package pipeline

import (
	"cmp"
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
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
	// Janitor, with JanitorPool, configures the janitor.
	Janitor     *janitor.Config
	JanitorPool *pgxpool.Pool
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
	var err error
	if cfg.Worker != nil {
		if p.Worker, err = inbox.NewWorker(cfg.WorkerPool, cfg.Worker); err != nil {
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
	}
	if cfg.Relay != nil {
		if p.Relay, err = outbox.NewRelay(cfg.RelayPool, cfg.Relay); err != nil {
			return nil, err
		}
	}
	if cfg.Janitor != nil {
		if p.Janitor, err = janitor.New(cfg.JanitorPool, cfg.Janitor); err != nil {
			return nil, err
		}
	}
	if cfg.Listen != nil {
		p.Notifier = notifier.New(cfg.Listen, cmp.Or(cfg.Logger, slog.Default()))
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
	if p.Janitor != nil {
		work = append(work, p.Janitor)
	}
	p.services = append(p.services, startstop.Parallel(work...))
	return p, nil
}

// Start starts the services in order: the notifier, then the worker,
// ingest, the relay and the janitor. When one fails to start, those started
// are stopped again and the error returned.
func (p *Pipeline) Start(ctx context.Context) error {
	return startstop.StartAll(ctx, p.services...)
}

// Stop stops the worker, ingest, the relay and the janitor at once, then
// the notifier. ctx is the grace period of the work in flight (see
// startstop.Service).
func (p *Pipeline) Stop(ctx context.Context) {
	startstop.StopAll(ctx, p.services...)
}
