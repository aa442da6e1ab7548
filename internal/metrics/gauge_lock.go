package metrics

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// GaugeLock elects the one process that exports the gauges read from the
// database (inbox_pending, inbox_dead, inbox_oldest_pending_age_seconds,
// outbox_backlog). Those are the same whichever replica reads them, so if
// every replica exported them, sum() across replicas would count each
// message once per replica. The process whose session holds a PostgreSQL
// advisory lock (one per schema) exports them; the others export none of
// those series. When the holder dies or loses its connection, PostgreSQL
// releases the lock and another process takes it within CheckInterval.
type GaugeLock struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	interval   time.Duration
	held       atomic.Bool
}

// NewGaugeLock returns a GaugeLock that holds its own connection, opened
// with connConfig, and checks it every interval (5 seconds when 0).
func NewGaugeLock(connConfig *pgx.ConnConfig, logger *slog.Logger, interval time.Duration) *GaugeLock {
	if interval <= 0 {
		interval = 5 * time.Second
	}
	return &GaugeLock{connConfig: connConfig, logger: logger.With(slog.String("component", "metrics.gauge_lock")), interval: interval}
}

// Held reports whether this process holds the lock, and so exports the
// database gauges.
func (g *GaugeLock) Held() bool { return g != nil && g.held.Load() }

// Run tries to take the lock, and keeps it, until ctx ends.
func (g *GaugeLock) Run(ctx context.Context) {
	retry.Reconnect(ctx, retry.ReconnectConfig{
		Policy: retry.Policy{Base: retry.Session.Base, Max: g.interval},
		Logger: g.logger, Message: "gauge lock session ended",
	}, func(ctx context.Context) error {
		defer g.held.Store(false)
		return g.session(ctx)
	})
}

func (g *GaugeLock) session(ctx context.Context) error {
	conn, err := pgsession.Connect(ctx, g.connConfig)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	q := dbsqlc.New()
	tick := time.NewTicker(g.interval)
	defer tick.Stop()
	for {
		if g.held.Load() {
			if err := conn.Ping(ctx); err != nil {
				return err
			}
		} else {
			held, err := q.MetricsTryGaugeLock(ctx, conn)
			if err != nil {
				return err
			}
			if held {
				g.logger.Info("this process exports the database gauges")
				g.held.Store(true)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
