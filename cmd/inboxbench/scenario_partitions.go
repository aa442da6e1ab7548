package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchPartitions measures ingest and the whole path (the order handler
// included) against INBOX_PARTITIONS and the number of inboxd replicas: a
// preloaded backlog of orders (each with its x-order-id header) drained by
// R inboxd processes on N partitions, timed to the last message stored and
// to the last processed.
func benchPartitions(ctx context.Context, o *options, r *report) error {
	for _, run := range strings.Split(o.partitionRuns, ",") {
		var partitions, replicas int
		if _, err := fmt.Sscanf(run, "%dx%d", &partitions, &replicas); err != nil {
			return fmt.Errorf("-partition-runs: %q is not PARTITIONSxREPLICAS", run)
		}
		res, err := partitionRun(ctx, o, partitions, replicas)
		if err != nil {
			return err
		}
		n := float64(res.orders)
		cpuPerOrder := res.pgCPU.Seconds() / n
		r.add(fmt.Sprintf("partitions: %d × %d replicas", partitions, replicas),
			"ingest %.0f msg/s, publish-free core path %.0f msg/s (a preloaded backlog of %d orders, order handler); "+
				"PostgreSQL per order: %.0f µs of CPU (all its processes), %.0f bytes of WAL, events published included; "+
				"one primary would cap near %.0f orders/s per core at that cost",
			n/res.stored.Seconds(), n/res.processed.Seconds(), res.orders,
			cpuPerOrder*1e6, float64(res.wal)/n, 1/cpuPerOrder)
	}
	return nil
}

// partitionResult is what one run of the partitions scenario measured.
type partitionResult struct {
	// stored and processed are the times from the first message stored to
	// the last stored and to the last processed.
	stored, processed time.Duration
	orders            int
	// pgCPU and wal are PostgreSQL's CPU time (every postgres process of
	// this machine) and WAL written while the backlog was stored,
	// processed and its events published.
	pgCPU time.Duration
	wal   int64
}

// postgresCPU sums the CPU time (user and system) of every process of this
// machine named postgres, as /proc tells it. Processes that exit in between
// two readings take theirs with them, so read both while the service runs.
func postgresCPU() (time.Duration, error) { return processCPU("postgres") }

// pidCPU is the CPU time (user and system) the process pid has spent; 0
// for pid 0.
func pidCPU(pid int) (time.Duration, error) {
	if pid == 0 {
		return 0, nil
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	_, ticks, ok := statCommandAndTicks(stat)
	if !ok {
		return 0, fmt.Errorf("/proc/%d/stat: no CPU times in %q", pid, stat)
	}
	return time.Duration(ticks) * 10 * time.Millisecond, nil // USER_HZ is 100 on Linux
}

// statCommandAndTicks returns the command of a /proc/<pid>/stat and its
// user and system CPU ticks.
func statCommandAndTicks(stat []byte) (string, int64, bool) {
	// pid (comm) state ppid ...: comm may hold spaces; fields 14 and 15
	// (utime, stime) count after its closing parenthesis.
	open, closing := strings.IndexByte(string(stat), '('), strings.LastIndexByte(string(stat), ')')
	if open < 0 || closing < open {
		return "", 0, false
	}
	fields := strings.Fields(string(stat[closing+1:]))
	if len(fields) < 13 {
		return "", 0, false
	}
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	return string(stat[open+1 : closing]), utime + stime, true
}

// processCPU sums the CPU time (user and system) of every process of this
// machine whose command is name, as postgresCPU does.
func processCPU(name string) (time.Duration, error) {
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var ticks int64
	for _, d := range dirs {
		if _, err := strconv.Atoi(d.Name()); err != nil {
			continue
		}
		stat, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		if comm, t, ok := statCommandAndTicks(stat); ok && comm == name {
			ticks += t
		}
	}
	// USER_HZ is 100 on Linux.
	return time.Duration(ticks) * 10 * time.Millisecond, nil
}

// postgresCost is what PostgreSQL has spent so far: the CPU time of its
// processes (postgresCPU) and its WAL insert position, in bytes.
type postgresCost struct {
	cpu time.Duration
	wal int64
}

// readPostgresCost reads both.
func readPostgresCost(ctx context.Context, e *benchEnv) (postgresCost, error) {
	var c postgresCost
	var err error
	if c.cpu, err = postgresCPU(); err != nil {
		return c, err
	}
	err = e.pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint").Scan(&c.wal)
	return c, err
}

// partitionRun drains one backlog with replicas inboxd processes on
// partitions inbox queues, and returns the time to the last message stored
// and to the last processed, from the first message stored. The replicas
// start together; the first to subscribe is active on every partition
// until the balancing hands some over (at most one every 2 s, each kept 5 s).
func partitionRun(ctx context.Context, o *options, partitions, replicas int) (res partitionResult, err error) {
	e, err := newEnv(ctx, o, fmt.Sprintf("partitions%dx%d", partitions, replicas))
	if err != nil {
		return res, err
	}
	defer e.close()
	if err := broker.Declare(e.amqpURL, broker.Topology{QueueType: broker.QueueTypeQuorum, Partitions: partitions}); err != nil {
		return res, err
	}
	w := loadgen.Generate(loadgen.Spec{Orders: o.messages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
		return res, err
	}
	before, err := readPostgresCost(ctx, e)
	if err != nil {
		return res, err
	}
	for range replicas {
		svc, _, err := e.serve(ctx, o, "INBOX_PARTITIONS="+strconv.Itoa(partitions))
		if err != nil {
			return res, err
		}
		defer svc.stop()
	}
	storedAt, err := waitCount(ctx, e.pool, "SELECT count(*) FROM inbox", w.UniqueMessageIDs, "SELECT max(received_at) FROM inbox")
	if err != nil {
		return res, err
	}
	// From the first message stored: the processes' start (migrations,
	// connections) is not ingest's.
	var start time.Time
	if err := e.pool.QueryRow(ctx, "SELECT min(received_at) FROM inbox").Scan(&start); err != nil {
		return res, err
	}
	processedAt, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
	if err != nil {
		return res, err
	}
	var events int
	if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&events); err != nil {
		return res, err
	}
	if _, err := waitCount(ctx, e.pool, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL", events, "SELECT max(published_at) FROM outbox"); err != nil {
		return res, err
	}
	after, err := readPostgresCost(ctx, e)
	if err != nil {
		return res, err
	}
	return partitionResult{
		stored: storedAt.Sub(start), processed: processedAt.Sub(start), orders: w.UniqueMessageIDs,
		pgCPU: after.cpu - before.cpu, wal: after.wal - before.wal,
	}, nil
}
