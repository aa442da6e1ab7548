package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// promisesOff are the promises -without can turn off in inboxd's schema,
// for the bench alone, to measure what each costs (README, "What each
// promise costs"): the statements that follow, run once inboxd has
// migrated its schema and is ready, before any traffic. Each removes the
// promise's writes, not every statement it adds to the flow, so a
// promise's price measured this way is a lower bound. inboxd is never run
// this way outside the bench: each leaves the promise broken.
var promisesOff = map[string]string{
	// The attempt history: no inbox_attempts row is stored (the outcome
	// statement still builds them).
	"history": `
		CREATE FUNCTION bench_skip_row() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';
		CREATE TRIGGER bench_no_history BEFORE INSERT ON inbox_attempts
		FOR EACH ROW EXECUTE FUNCTION bench_skip_row();`,
	// The key ledger: no id is remembered past the inbox row, and none is
	// checked against the ledger at insert. Its slots are detached from
	// inbox_keys, so ingest's look-up of each id probes no slot (it
	// probes every slot's index while they are attached, empty or not).
	"ledger": `
		DROP TRIGGER inbox_keys_known ON inbox;
		DROP TRIGGER inbox_keys_remember ON inbox;
		DO $$
		DECLARE part regclass;
		BEGIN
			FOR part IN SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'inbox_keys'::regclass LOOP
				EXECUTE format('ALTER TABLE inbox_keys DETACH PARTITION %s', part);
			END LOOP;
		END $$;`,
	// Per-order ordering: no message, and no event, is stored with its
	// order's key, so none waits for an earlier one of its order.
	"ordering": `
		CREATE FUNCTION bench_no_order_key() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN NEW.order_key := NULL; RETURN NEW; END';
		CREATE TRIGGER bench_no_order_key BEFORE INSERT ON inbox
		FOR EACH ROW EXECUTE FUNCTION bench_no_order_key();
		CREATE TRIGGER bench_no_order_key BEFORE INSERT ON outbox
		FOR EACH ROW EXECUTE FUNCTION bench_no_order_key();`,
}

// parseWithout checks -without's comma-separated names against
// promisesOff and returns them, each once.
func parseWithout(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var names []string
	for _, n := range strings.Split(s, ",") {
		if _, ok := promisesOff[n]; !ok {
			return nil, fmt.Errorf("-without: %q is none of %s", n, strings.Join(slices.Sorted(maps.Keys(promisesOff)), ", "))
		}
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	return names, nil
}

// turnOff turns off the promises names in the schema pool works in.
func turnOff(ctx context.Context, pool *pgxpool.Pool, names []string) error {
	for _, n := range names {
		if _, err := pool.Exec(ctx, promisesOff[n]); err != nil {
			return fmt.Errorf("-without %s: %w", n, err)
		}
	}
	return nil
}

// withoutOf labels inboxd's rows with the promises -without turned off.
func withoutOf(o *options) string {
	if len(o.without) == 0 {
		return ""
	}
	return " [without " + strings.Join(o.without, ", ") + "]"
}
