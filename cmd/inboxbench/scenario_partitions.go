package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// partitionRuns are the layouts and replica counts the partitions scenario
// measures: partitions × replicas.
var partitionRuns = [][2]int{{1, 1}, {6, 1}, {1, 2}, {6, 2}}

// benchPartitions measures ingest and the whole path (the order handler
// included) against INBOX_PARTITIONS and the number of inboxd replicas: a
// preloaded backlog of orders (each with its x-order-id header) drained by
// R inboxd processes on N partitions, timed to the last message stored and
// to the last processed.
func benchPartitions(ctx context.Context, o *options, r *report) error {
	for _, run := range partitionRuns {
		partitions, replicas := run[0], run[1]
		stored, processed, n, err := partitionRun(ctx, o, partitions, replicas)
		if err != nil {
			return err
		}
		r.add(fmt.Sprintf("partitions: %d × %d replicas", partitions, replicas),
			"ingest %.0f msg/s, publish-free core path %.0f msg/s (a preloaded backlog of %d orders, order handler)",
			float64(n)/stored.Seconds(), float64(n)/processed.Seconds(), n)
	}
	return nil
}

// partitionRun drains one backlog with replicas inboxd processes on
// partitions inbox queues, and returns the time to the last message stored
// and to the last processed, from the first message stored. The replicas
// start together; the first to subscribe is active on every partition
// until the balancing hands some over (at most one every 2 s, each kept 5 s).
func partitionRun(ctx context.Context, o *options, partitions, replicas int) (stored, processed time.Duration, n int, err error) {
	e, err := newEnv(ctx, o, fmt.Sprintf("partitions%dx%d", partitions, replicas))
	if err != nil {
		return 0, 0, 0, err
	}
	defer e.close()
	if err := broker.Declare(e.amqpURL, broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: partitions}); err != nil {
		return 0, 0, 0, err
	}
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
		return 0, 0, 0, err
	}
	for range replicas {
		svc, httpAddr, err := e.startInboxd(o, "INBOX_PARTITIONS="+strconv.Itoa(partitions))
		if err != nil {
			return 0, 0, 0, err
		}
		defer svc.stop()
		if err := waitReady(ctx, httpAddr); err != nil {
			return 0, 0, 0, err
		}
	}
	storedAt, err := waitCount(ctx, e.pool, "SELECT count(*) FROM inbox", w.UniqueMessageIDs, "SELECT max(received_at) FROM inbox")
	if err != nil {
		return 0, 0, 0, err
	}
	// From the first message stored: the processes' start (migrations,
	// connections) is not ingest's.
	var start time.Time
	if err := e.pool.QueryRow(ctx, "SELECT min(received_at) FROM inbox").Scan(&start); err != nil {
		return 0, 0, 0, err
	}
	processedAt, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
	if err != nil {
		return 0, 0, 0, err
	}
	return storedAt.Sub(start), processedAt.Sub(start), w.UniqueMessageIDs, nil
}
