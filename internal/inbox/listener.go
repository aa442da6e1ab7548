package inbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// NotifyChannel is the PostgreSQL channel on which the inbox_notify trigger
// announces new rows. The payload is the schema of the inbox table.
const NotifyChannel = "inbox_pending"

// Listener holds a connection that LISTENs on NotifyChannel and calls a
// function for each notification about its own schema. It reconnects with
// backoff when the connection is lost; the workers' polling covers the gap.
type Listener struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	onNotify   func()
}

// NewListener returns a Listener that connects with connConfig and calls
// onNotify, which must not block, for each wake-up.
func NewListener(connConfig *pgx.ConnConfig, logger *slog.Logger, onNotify func()) *Listener {
	return &Listener{
		connConfig: connConfig,
		logger:     logger.With(slog.String("component", "inbox.listener")),
		onNotify:   onNotify,
	}
}

// Run listens until ctx ends.
func (l *Listener) Run(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		err := l.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		failures++
		delay := backoff(failures, 100*time.Millisecond, 10*time.Second)
		l.logger.Warn("listen connection lost", slog.String("error", err.Error()), slog.Duration("retry_in", delay))
		if !sleep(ctx, delay) {
			return
		}
	}
}

func (l *Listener) listen(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, l.connConfig)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()

	queries := dbsqlc.New()
	schema, err := queries.SessionCurrentSchema(ctx, conn)
	if err != nil {
		return err
	}
	if err := queries.SessionListenInboxPending(ctx, conn); err != nil {
		return err
	}
	// Rows may have arrived while we were not listening.
	l.onNotify()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == schema {
			l.onNotify()
		}
	}
}
