package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/migrate"
)

// repartition moves ingest to the layout of INBOX_PARTITIONS (docs/ordering.md,
// "Changing INBOX_PARTITIONS"), with every replica stopped: it declares the
// new layout and routes the orders exchange to it alone, then stores what
// waits in the other layouts' queues, each in its order, and deletes them.
// Every message of the old layouts is thus in the inbox before the replicas,
// started again on the new layout, store a newer message of its order.
func repartition(ctx context.Context, cfg *config, logger *slog.Logger, stdout io.Writer) error {
	if err := migrate.Check(ctx, cfg.dbConfig.ConnConfig); err != nil {
		return err
	}
	conn, err := broker.Dial(cfg.amqpURL, "inboxd repartition", 0)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if err := noConsumers(conn, cfg.partitions); err != nil {
		return err
	}
	others, err := broker.Reroute(conn, broker.Topology{QueueType: cfg.queueType, Partitions: cfg.partitions})
	if err != nil {
		return fmt.Errorf("route %s to the layout of %d partitions: %w", broker.ExchangeOrders, cfg.partitions, err)
	}
	fmt.Fprintf(stdout, "%s now routes to the layout of INBOX_PARTITIONS=%d\n", broker.ExchangeOrders, cfg.partitions)
	pool, err := newPool(ctx, cfg, "repartition", 2, false)
	if err != nil {
		return err
	}
	defer pool.Close()
	for _, n := range others {
		settings := ingestSettings(cfg, logger, "inboxd repartition")
		settings.Partitions = n // the layout drained, for its header rule
		ing, err := ingest.New(pool, settings)
		if err != nil {
			return err
		}
		queues, err := broker.LayoutQueues(conn, n)
		if err != nil {
			return err
		}
		names := make([]string, len(queues))
		for q := range queues {
			names[q] = queues[q].Name
		}
		// Only those left: a repartition cut short deleted some already.
		if err := ing.Drain(ctx, names); err != nil {
			return fmt.Errorf("store what waits in the layout of %d partitions: %w", n, err)
		}
		if err := broker.DeleteLayout(conn, n); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "stored what waited in the layout of INBOX_PARTITIONS=%d, and deleted it\n", n)
	}
	fmt.Fprintf(stdout, "start the replicas with INBOX_PARTITIONS=%d\n", cfg.partitions)
	return nil
}

// noConsumers refuses while a replica still consumes an inbox queue, of any
// layout: repartition runs with every replica stopped, or a replica could
// store a newer message of an order before repartition stores an older one
// (and one active on an old queue would hold its messages unacknowledged,
// out of Drain's reach).
func noConsumers(conn *amqp.Connection, partitions int) error {
	layouts, err := broker.OtherLayouts(conn, partitions)
	if err != nil {
		return err
	}
	for _, n := range append(layouts, partitions) {
		queues, err := broker.LayoutQueues(conn, n)
		if err != nil {
			return err
		}
		for _, q := range queues {
			if q.Consumers > 0 {
				return fmt.Errorf("queue %s has %d consumers: stop every replica before inboxd repartition (docs/ordering.md: \"Changing INBOX_PARTITIONS\")", q.Name, q.Consumers)
			}
		}
	}
	return nil
}
