package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchWindow measures what the dedupe window costs (issue 23): the bytes
// an order takes while its rows are kept and the bytes its key takes in the
// ledger for the rest of the window, the WAL an order writes, and whether a
// full ledger slows the flow. One inboxd with the orders handler is fed at
// -window-rate for -window-duration on an empty ledger; then -window-keys
// keys (36-character UUIDs, as many producers use) are loaded into the
// ledger's eight slots with SQL, an eighth each, built apart, and the hot
// part writing is grown insert by insert to just under the size at which
// it is sealed (an eighth of its slot), so that the flow writes it at its
// largest; the slots are vacuumed and frozen as autovacuum would leave
// them, and the flow runs as long again. Each phase starts right after a
// checkpoint. Then the service stops and the hot part is sealed and merged
// into its slot, alone, right after a checkpoint: that is the rest of a
// key's WAL. Latencies and WAL come from inboxd's flow and the merge; the
// load is not measured. After each phase, once the flow has settled,
// ingest's look-up of the ledger is timed alone (probeLedger).
func benchWindow(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "window")
	if err != nil {
		return err
	}
	defer e.close()
	svc, _, err := e.serve(ctx, o)
	if err != nil {
		return err
	}
	defer svc.stop()
	perPhase := int(o.windowRate * o.windowDuration.Seconds())
	w := loadgen.Generate(loadgen.Spec{Orders: 2 * perPhase, Seed: 5, Prefix: e.name, SKUs: o.skus})

	phase := func(name string, msgs []loadgen.Message, processedBefore int) error {
		// Each phase starts right after a checkpoint, so that both write the
		// same share of full-page images.
		if _, err := e.pool.Exec(ctx, "CHECKPOINT"); err != nil {
			return err
		}
		walBefore, fpiBefore, err := walPosition(ctx, e)
		if err != nil {
			return err
		}
		cpuBefore, err := postgresCPU()
		if err != nil {
			return err
		}
		sent, err := publishPaced(ctx, e.amqpURL, msgs, o.windowRate)
		if err != nil {
			return err
		}
		if _, err := waitCount(ctx, e.pool, countProcessed, processedBefore+len(msgs), lastProcessed); err != nil {
			return err
		}
		// Each order publishes order.confirmed and email.requested.
		if _, err := waitCount(ctx, e.pool, countPublished, 2*(processedBefore+len(msgs)), lastPublished); err != nil {
			return err
		}
		cpuAfter, err := postgresCPU()
		if err != nil {
			return err
		}
		walAfter, fpiAfter, err := walPosition(ctx, e)
		if err != nil {
			return err
		}
		l, err := readLatencies(ctx, e.pool, sent)
		if err != nil {
			return err
		}
		var total []time.Duration
		for id := range sent {
			total = append(total, l.totalOf[id])
		}
		var keys int64
		if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM inbox_keys").Scan(&keys); err != nil {
			return err
		}
		r.add("window: "+name, "publish to processed p50 %s, p99 %s, max %s; %.0f bytes of WAL per order, its events published included, %.2f full-page images per order; PostgreSQL's CPU %.0f µs per order (%d orders at %.0f/s, %d keys in the ledger at the end)",
			quantile(total, 0.50), quantile(total, 0.99), quantile(total, 1), float64(walAfter-walBefore)/float64(len(msgs)),
			float64(fpiAfter-fpiBefore)/float64(len(msgs)), float64((cpuAfter-cpuBefore).Microseconds())/float64(len(msgs)),
			len(msgs), o.windowRate, keys)
		return probeLedger(ctx, e, r, name)
	}
	if err := phase("empty ledger", w.Messages[:perPhase], 0); err != nil {
		return err
	}
	kept, err := reportBytes(ctx, e, r, perPhase)
	if err != nil {
		return err
	}

	perSlot := o.windowKeys / 8
	loadStarted := time.Now()
	// Every slot holds a full generation's share: each is built apart,
	// indexed, and swapped in for its empty slot, which takes minutes where
	// inserts into indexes larger than memory take an hour. The current
	// slot (0) is as full as the others, as late in a generation, when its
	// keys have come in by merges from the hot parts.
	for slot := range 8 {
		for _, stmt := range []string{
			"CREATE TABLE inbox_keys_load (LIKE inbox_keys) WITH (autovacuum_freeze_min_age = 0)",
			fmt.Sprintf("INSERT INTO inbox_keys_load SELECT %d, gen_random_uuid()::text FROM generate_series(1, %d)", slot, perSlot),
			"CREATE INDEX ON inbox_keys_load USING hash (message_id)",
			fmt.Sprintf("ALTER TABLE inbox_keys_load ADD CONSTRAINT inbox_keys_load_slot CHECK (slot = %d)", slot),
			fmt.Sprintf("ALTER TABLE inbox_keys DETACH PARTITION inbox_keys_%d", slot),
			fmt.Sprintf("DROP TABLE inbox_keys_%d", slot),
			fmt.Sprintf("ALTER TABLE inbox_keys_load RENAME TO inbox_keys_%d", slot),
			fmt.Sprintf("ALTER TABLE inbox_keys ATTACH PARTITION inbox_keys_%d FOR VALUES IN (%d)", slot, slot),
			fmt.Sprintf("ALTER TABLE inbox_keys_%d DROP CONSTRAINT inbox_keys_load_slot", slot),
		} {
			if _, err := e.pool.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("load slot %d: %s: %w", slot, stmt, err)
			}
		}
	}
	built := time.Since(loadStarted)
	// The hot part writing grows insert after insert, as it does, to just
	// under the size at which it is sealed (an eighth of its slot), so that
	// the flow writes it at its largest.
	hotKeys := max(perSlot/8-2*perPhase, 0)
	for done := 0; done < hotKeys; done += 100_000 {
		if _, err := e.pool.Exec(ctx, `INSERT INTO inbox_keys (slot, message_id)
			SELECT (SELECT part FROM inbox_key_hot_parts WHERE state = 'writing'), gen_random_uuid()::text
			FROM generate_series(1, $1::int)`, min(100_000, hotKeys-done)); err != nil {
			return fmt.Errorf("load the hot part: %w", err)
		}
	}
	grown := time.Since(loadStarted) - built
	loaded := time.Since(loadStarted)
	for slot := range 8 {
		if _, err := e.pool.Exec(ctx, fmt.Sprintf("VACUUM (FREEZE, ANALYZE) inbox_keys_%d", slot)); err != nil {
			return err
		}
	}
	if _, err := e.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return err
	}
	if o.windowPrewarm {
		// As a server that has run a while with memory enough for them has
		// them: the probes then read no index page from the kernel.
		var pages int64
		if _, err := e.pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_prewarm"); err != nil {
			return fmt.Errorf("pg_prewarm: %w", err)
		}
		if err := e.pool.QueryRow(ctx, `SELECT coalesce(sum(pg_prewarm(i.indexrelid)), 0)::bigint FROM pg_index i
			JOIN pg_class c ON c.oid = i.indrelid
			WHERE c.relnamespace = current_schema()::regnamespace AND c.relname ~ '^inbox_keys_[0-9]$'`).Scan(&pages); err != nil {
			return fmt.Errorf("pg_prewarm: %w", err)
		}
		r.add("window: indexes prewarmed", "%d pages (%.1f GB) of the ledger's indexes read into shared buffers before the full phase", pages, float64(pages)*8192/1e9)
	}
	var ledgerBytes, slotBytes, slotKeys int64
	if err := e.pool.QueryRow(ctx, `SELECT sum(pg_total_relation_size(format('inbox_keys_%s', s)::regclass))::bigint
		FROM generate_series(0, 9) s`).Scan(&ledgerBytes); err != nil {
		return err
	}
	if err := e.pool.QueryRow(ctx, "SELECT pg_total_relation_size('inbox_keys_0'), count(*) FROM inbox_keys_0").Scan(&slotBytes, &slotKeys); err != nil {
		return err
	}
	perKey := float64(slotBytes) / float64(slotKeys)
	r.add("window: ledger loaded", "%d keys of 36 bytes in the slots, built apart (%s; %.1f bytes per key, heap and index), and %d in the hot part by inserts (%s); vacuumed, frozen and checkpointed in %s more; the ledger %.1f GB",
		8*perSlot, built.Round(time.Second), perKey, hotKeys, grown.Round(time.Second), (time.Since(loadStarted) - loaded).Round(time.Second), float64(ledgerBytes)/1e9)
	const day = 86_400_000 // orders a day at 1,000 a second
	r.add("window: at 1,000 orders/s", "rows kept for INBOX_RETENTION %.0f bytes an order, a key %.0f bytes: "+
		"the seed's day %.0f GB (rows and keys), a 7-day window of keys with a day of rows %.0f GB, order tables not counted",
		kept, perKey, (kept+perKey)*day/1e9, (kept*day+perKey*7*day)/1e9)
	if err := phase("full ledger", w.Messages[perPhase:], perPhase); err != nil {
		return err
	}
	// The hot part's keys then move into their slot: what that costs is
	// the rest of a key's WAL. The service is stopped first, so that its
	// janitor does not take the merge.
	svc.stop()
	if _, err := e.pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return err
	}
	walBefore, fpiBefore, err := walPosition(ctx, e)
	if err != nil {
		return err
	}
	started := time.Now()
	// Sealed whatever its size (a ratio at which any part outweighs its
	// slot), unless the janitor sealed it in the phase: then that part is
	// merged. A range of buckets at a time, as the janitor does (without
	// its pauses), until no part is left sealed.
	if _, err := janitor.SealKeys(ctx, e.pool, 1000000000, 0, janitor.KeysLockWaitDefault); err != nil {
		return fmt.Errorf("seal the hot part: %w", err)
	}
	var merged, ranges, longest int64
	for {
		rangeStarted := time.Now()
		n, merging, err := janitor.MergeKeys(ctx, e.pool, janitor.MergeBytesDefault)
		if err != nil {
			return fmt.Errorf("merge the hot part: %w", err)
		}
		if !merging {
			break
		}
		merged, ranges, longest = merged+n, ranges+1, max(longest, int64(time.Since(rangeStarted)))
	}
	took := time.Since(started)
	walAfter, fpiAfter, err := walPosition(ctx, e)
	if err != nil {
		return err
	}
	if merged == 0 {
		return fmt.Errorf("merge the hot part: nothing merged")
	}
	r.add("window: hot part merged", "%d keys into a slot of %d in %s (%d transactions, the longest %s), right after a checkpoint: %.0f bytes of WAL per key, %.3f full-page images per key",
		merged, slotKeys, took.Round(time.Millisecond), ranges, time.Duration(longest).Round(time.Millisecond),
		float64(walAfter-walBefore)/float64(merged), float64(fpiAfter-fpiBefore)/float64(merged))
	return nil
}

// probeBatch is how many new ids ingest's look-up of the ledger is timed
// with: about the batches of ingest at 1,000 orders a second.
const probeBatch = 20

// probeLedger times ingest's look-up of the ledger alone, once the flow has
// settled: statements asking for probeBatch new ids (36-character UUIDs,
// none in the ledger, so each is looked for in every slot and hot part),
// one after another on one connection, 2 s to warm it, then 15 s timed. It
// tells the ledger's own cost apart from the rest of the flow's, which
// shares the machine's two cores with the broker and the load.
func probeLedger(ctx context.Context, e *benchEnv, r *report, name string) error {
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	const lookup = `SELECT count(*) FROM unnest($1::text[]) m(message_id)
		WHERE NOT EXISTS (SELECT 1 FROM inbox_keys k WHERE k.message_id = m.message_id)`
	var took []time.Duration
	var sum time.Duration
	warm := time.Now().Add(2 * time.Second)
	end := warm.Add(15 * time.Second)
	ids := make([]string, probeBatch)
	for now := time.Now(); now.Before(end); now = time.Now() {
		for i := range ids {
			ids[i] = uuid.NewString()
		}
		started := time.Now()
		var missing int
		if err := conn.QueryRow(ctx, lookup, ids).Scan(&missing); err != nil {
			return fmt.Errorf("probe the ledger: %w", err)
		}
		if missing != probeBatch {
			return fmt.Errorf("probe the ledger: %d of %d new ids found in it", probeBatch-missing, probeBatch)
		}
		if started.After(warm) {
			d := time.Since(started)
			took, sum = append(took, d), sum+d
		}
	}
	r.add("window: "+name+", look-up", "%d new ids a statement, in every slot and hot part: p50 %s, p99 %s, mean %s (%d statements on one connection, after 2s to warm it)",
		probeBatch, quantileTo(took, 0.50, time.Microsecond), quantileTo(took, 0.99, time.Microsecond),
		(sum / time.Duration(len(took))).Round(time.Microsecond), len(took))
	return nil
}

// walPosition is the server's WAL insert position, in bytes, and the
// full-page images it has written (pg_stat_wal).
func walPosition(ctx context.Context, e *benchEnv) (at, fpi int64, err error) {
	err = e.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint, wal_fpi
		FROM pg_stat_wal`).Scan(&at, &fpi)
	return at, fpi, err
}

// reportBytes adds the bytes per order of each table (heap, indexes and
// TOAST) once orders have been processed and their events published, and
// returns the bytes per order of the rows kept for INBOX_RETENTION.
func reportBytes(ctx context.Context, e *benchEnv, r *report, orders int) (float64, error) {
	rows, err := e.pool.Query(ctx, `
		SELECT CASE WHEN c.relname LIKE 'inbox_keys_%' THEN 'inbox_keys' ELSE c.relname END AS tbl,
		       sum(pg_total_relation_size(c.oid))::bigint
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = current_schema() AND c.relkind = 'r'
		  AND (c.relname IN ('inbox', 'inbox_attempts', 'inbox_reply_requests', 'inbox_conflicts', 'outbox',
		                     'order_confirmations', 'stock_reservations')
		       OR c.relname LIKE 'inbox\_keys\_%')
		GROUP BY 1 ORDER BY 2 DESC`)
	if err != nil {
		return 0, err
	}
	sizes := map[string]int64{}
	var parts []string
	for rows.Next() {
		var name string
		var size int64
		if err := rows.Scan(&name, &size); err != nil {
			return 0, err
		}
		sizes[name] = size
		parts = append(parts, fmt.Sprintf("%s %.0f", name, float64(size)/float64(orders)))
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	r.add("window: bytes per order", "%s (%d orders processed, events published)", strings.Join(parts, ", "), orders)
	kept := sizes["inbox"] + sizes["inbox_attempts"] + sizes["inbox_reply_requests"] + sizes["inbox_conflicts"] + sizes["outbox"]
	return float64(kept) / float64(orders), nil
}
