package main

import (
	"maps"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// TestEachPromiseTurnsOffInTheSchema holds -without to the schema as it
// is: each promise's statements apply to a migrated schema, and the writes
// the promise makes are there without them and gone with them. A renamed
// trigger or table fails here, not in a bench run.
func TestEachPromiseTurnsOffInTheSchema(t *testing.T) {
	t.Parallel()
	// writes makes the writes of each promise and returns what they
	// left: the history rows, the ledger's keys, the order keys stored.
	writes := func(t *testing.T, db *testenv.DB) map[string]int {
		db.Exec(t, `INSERT INTO inbox (message_id, message_type, payload, order_key) VALUES ('m-1', 'order.created', '{}', 'o-1')`)
		db.Exec(t, `INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, process, build)
			SELECT id, 0, 1, message_id, 'processed', 'p', 'b' FROM inbox`)
		db.Exec(t, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, order_key)
			VALUES ('m-1:order.confirmed', 'order.confirmed', '{}', 'm-1', 'o-1')`)
		return map[string]int{
			"history": db.Int(t, "SELECT count(*) FROM inbox_attempts"),
			"ledger":  db.Int(t, "SELECT count(*) FROM inbox_keys"),
			"ordering": db.Int(t, "SELECT count(*) FROM inbox WHERE order_key IS NOT NULL") +
				db.Int(t, "SELECT count(*) FROM outbox WHERE order_key IS NOT NULL"),
		}
	}
	kept := writes(t, testenv.NewDB(t))
	require.Equal(t, map[string]int{"history": 1, "ledger": 1, "ordering": 2}, kept, "each promise's writes, all promises kept")
	for _, name := range slices.Sorted(maps.Keys(promisesOff)) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testenv.NewDB(t)
			require.NoError(t, turnOff(t.Context(), db.Pool, []string{name}))
			if name == "ledger" {
				require.Zero(t, db.Int(t, "SELECT count(*) FROM pg_inherits WHERE inhparent = 'inbox_keys'::regclass"),
					"the ledger's slots, which ingest's look-up probes")
			}
			left := writes(t, db)
			for promise, n := range kept {
				if promise == name {
					require.Zero(t, left[promise], "%s turned off", promise)
				} else {
					require.Equal(t, n, left[promise], "%s kept", promise)
				}
			}
		})
	}
	_, err := parseWithout("history,nothing")
	require.ErrorContains(t, err, `"nothing" is none of history, ledger, ordering`)
}
