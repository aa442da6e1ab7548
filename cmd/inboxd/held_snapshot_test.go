package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// An old snapshot (an analytics query, pg_dump, a standby with
// hot_standby_feedback, a replication slot) keeps every row version that
// ends after it, and the index entries that point to them: vacuum may
// remove none, and a scan may not even mark them dead. What an order reads
// must not grow with them. A real inboxd handles orders on a clean server;
// then, with a snapshot held, 3,000 orders leave their ended rows behind,
// and the next orders must read about what the same number read before
// the snapshot, table by table, counted by PostgreSQL (entries returned
// by index scans, rows by sequential scans), not timed.
//
// This is the flow's side of what the claim floors promise the claims
// (TestAClaimUnderAnOldSnapshotSkipsTheEndedRows): every statement an
// order runs, the keepers' and the relay's included. With the floors left
// where they start (the keepers never raising them), the inbox's index
// entries read for 300 orders went from 4,382 to 128,452; with them, from
// 3,713 to 6,457 (the outbox's from 3,343 to 6,043), whatever the number
// of orders ended under the snapshot.
func TestAHeldSnapshotDoesNotGrowWhatAnOrderReads(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := serviceEnv(b.db, b.broker)

	const orders = 300
	seed := 0
	publish := func(n int) {
		seed++
		w := loadgen.Generate(loadgen.Spec{Orders: n, CancelRate: 0.1, DuplicateRate: 0.1, Seed: uint64(seed), Prefix: fmt.Sprintf("round%d", seed)})
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 20))
		// Each order sends order.confirmed and email.requested, and each
		// cancellation order.cancelled.
		b.awaitEvents(t, 2*n+len(w.Cancelled), 2*time.Minute)
	}
	// measure counts what inboxd p reads while it handles the next orders,
	// then stops it: a backend reports what it read at the end of a
	// transaction at most once a second, and all of it when it ends.
	measure := func(p *process) map[string]tableReads {
		// What the rounds before read is reported by now: a backend idle
		// for 10 seconds reports all it has.
		time.Sleep(11 * time.Second)
		before := b.readsByTable(t)
		publish(orders)
		p.terminate(30 * time.Second)
		after := b.settledReads(t)
		out := map[string]tableReads{}
		for table, a := range after {
			out[table] = tableReads{seq: a.seq - before[table].seq, idx: a.idx - before[table].idx}
		}
		return out
	}

	p := startProcess(t, env)
	publish(orders) // plans made, floors raised
	clean := measure(p)

	b.db.HoldSnapshot(t)
	p = startProcess(t, env)
	const ended = 3000
	publish(ended)
	held := measure(p)

	for table, c := range clean {
		h := held[table]
		t.Logf("%s: index entries %d clean, %d with %d orders ended under a held snapshot; sequential rows %d, %d",
			table, c.idx, h.idx, ended, c.seq, h.seq)
		// Twice what the clean round read, and some slack for the
		// keepers' rounds, which read what ended since the last one.
		require.LessOrEqual(t, h.idx, 2*c.idx+10*orders, "%s: index entries read for %d orders with %d ended under a held snapshot, against %d before it", table, orders, ended, c.idx)
		require.LessOrEqual(t, h.seq, 2*c.seq+10*orders, "%s: rows read by sequential scans for %d orders with %d ended under a held snapshot, against %d before it", table, orders, ended, c.seq)
	}
}
