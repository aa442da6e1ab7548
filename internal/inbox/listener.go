package inbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// PostgreSQL channels on which triggers announce new rows. The payload is
// the schema of the table.
const (
	// NotifyChannel is notified by the inbox_notify trigger.
	NotifyChannel = "inbox_pending"
	// OutboxNotifyChannel is notified by the outbox_notify trigger.
	OutboxNotifyChannel = "outbox_pending"
)

// Listener holds a connection that LISTENs on NotifyChannel and
// OutboxNotifyChannel and calls a function for each notification about its
// own schema. It reconnects with backoff when the connection is lost; the
// workers' and relay's polling covers the gap.
type Listener struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	onInbox    func()
	onOutbox   func()
}

// NewListener returns a Listener that connects with connConfig and calls
// onInbox or onOutbox, which must not block, for each wake-up. Either may be
// nil.
func NewListener(connConfig *pgx.ConnConfig, logger *slog.Logger, onInbox, onOutbox func()) *Listener {
	nop := func() {}
	if onInbox == nil {
		onInbox = nop
	}
	if onOutbox == nil {
		onOutbox = nop
	}
	return &Listener{
		connConfig: connConfig,
		logger:     logger.With(slog.String("component", "inbox.listener")),
		onInbox:    onInbox,
		onOutbox:   onOutbox,
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
		delay := retry.Backoff(failures, 100*time.Millisecond, 10*time.Second)
		l.logger.Warn("listen connection lost", slog.String("error", err.Error()), slog.Duration("retry_in", delay))
		if !retry.Sleep(ctx, delay) {
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
	if err := queries.SessionListenOutboxPending(ctx, conn); err != nil {
		return err
	}
	// Rows may have arrived while we were not listening.
	l.onInbox()
	l.onOutbox()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload != schema {
			continue
		}
		switch n.Channel {
		case NotifyChannel:
			l.onInbox()
		case OutboxNotifyChannel:
			l.onOutbox()
		}
	}
}
