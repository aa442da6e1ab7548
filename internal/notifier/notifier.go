// Package notifier serves the database wake-ups: one LISTEN connection for
// every topic, so the workers and the relay learn of new rows without
// polling for them.
package notifier

import (
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// Topic is a PostgreSQL channel on which a trigger announces new rows. The
// payload is the schema of the table.
type Topic string

// The topics the service listens on.
const (
	// TopicInbox is notified by the statement that stores messages
	// (InboxInsertMany).
	TopicInbox Topic = "inbox_pending"
	// TopicOutbox is notified by the statements that write outbox rows
	// (OutboxInsertMany, and the reply functions).
	TopicOutbox Topic = "outbox_pending"
)

// Notifier holds one connection that LISTENs on every topic subscribed to
// and calls the topic's functions for each notification about its own
// schema. It reconnects with backoff when the connection is lost; the
// workers' and relay's polling covers the gap.
type Notifier struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	subs       map[Topic][]func()
}

// New returns a Notifier that connects with connConfig.
func New(connConfig *pgx.ConnConfig, logger *slog.Logger) *Notifier {
	return &Notifier{
		connConfig: connConfig,
		logger:     logger.With(slog.String("component", "inbox.listener")),
		subs:       map[Topic][]func(){},
	}
}

// Subscribe has fn, which must not block, called for each wake-up on topic,
// and once after every (re)connection: rows may have arrived while nothing
// listened. Subscribe before Run.
func (l *Notifier) Subscribe(topic Topic, fn func()) {
	l.subs[topic] = append(l.subs[topic], fn)
}

func (l *Notifier) notify(topic Topic) {
	for _, fn := range l.subs[topic] {
		fn()
	}
}

// Run listens until ctx ends.
func (l *Notifier) Run(ctx context.Context) {
	retry.Reconnect(ctx, retry.ReconnectConfig{
		Policy: retry.Session,
		Logger: l.logger, Message: "listen connection lost",
	}, l.listen)
}

func (l *Notifier) listen(ctx context.Context) error {
	conn, err := pgsession.Connect(ctx, l.connConfig)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()

	queries := dbsqlc.New()
	schema, err := queries.SessionCurrentSchema(ctx, conn)
	if err != nil {
		return err
	}
	listen := map[Topic]func(context.Context, dbsqlc.DBTX) error{
		TopicInbox:  queries.SessionListenInboxPending,
		TopicOutbox: queries.SessionListenOutboxPending,
	}
	for _, topic := range []Topic{TopicInbox, TopicOutbox} {
		if len(l.subs[topic]) == 0 {
			continue
		}
		if err := listen[topic](ctx, conn); err != nil {
			return err
		}
	}
	// Rows may have arrived while we were not listening.
	l.notify(TopicInbox)
	l.notify(TopicOutbox)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload != schema {
			continue
		}
		l.notify(Topic(n.Channel))
	}
}
