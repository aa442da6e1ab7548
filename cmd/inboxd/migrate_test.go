package main

import (
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/migrations"
)

// runInboxd runs inboxd command with env and returns its combined output
// and whether it exited 0.
func runInboxd(t *testing.T, command string, env ...string) (string, bool) {
	t.Helper()
	cmd := exec.Command(inboxdPath, command)
	cmd.Env = env
	out, err := combinedOutput(t, cmd)
	return string(out), err == nil
}

// slowLocks lets a migration wait for the long transactions of other tests
// in the database (CREATE INDEX CONCURRENTLY waits for each older one).
const slowLocks = "INBOX_MIGRATE_LOCK_TIMEOUT=5m"

// validIndexes counts the valid indexes of db's schema among names.
func validIndexes(t *testing.T, db *testenv.DB, names ...string) int {
	t.Helper()
	return db.Int(t, `SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND c.relname = ANY($1) AND i.indisvalid`, names)
}

// Acceptance: on an outbox of 2,000,000 rows, the migrations that build
// indexes concurrently (00010, 00011, 00024, 00028, 00030) complete although
// INBOX_STATEMENT_TIMEOUT is 1s: the migration session has no
// statement_timeout.
func TestConcurrentIndexesBuildOnALargeOutbox(t *testing.T) {
	if testing.Short() {
		t.Skip("2,000,000 rows: not under -short")
	}
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS)
	require.NoError(t, err)
	_, err = provider.DownTo(ctx, 9)
	require.NoError(t, err)

	started := time.Now()
	// In transactions of 100,000 rows: a concurrent index build waits for
	// every older transaction of the database, those of other tests too.
	for from := 1; from <= 2_000_000; from += 100_000 {
		_, err = db.Pool.Exec(ctx, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, published_at)
			SELECT 'k-' || g, 'order.confirmed', '{}', 'm-' || g, CASE WHEN g % 2 = 0 THEN now() END
			FROM generate_series($1::int, $1::int + 99999) g`, from)
		require.NoError(t, err)
	}
	_, err = db.Pool.Exec(ctx, "ANALYZE outbox")
	require.NoError(t, err)
	t.Logf("2,000,000 outbox rows inserted in %s", time.Since(started).Round(time.Millisecond))

	started = time.Now()
	out, ok := runInboxd(t, "migrate", "DATABASE_URL="+db.URL, "INBOX_STATEMENT_TIMEOUT=1s", slowLocks)
	require.True(t, ok, "migrate completes: %s", out)
	t.Logf("migrations 00010 to the last applied in %s", time.Since(started).Round(time.Millisecond))
	require.Equal(t, 5, validIndexes(t, db, "outbox_published_at_idx", "outbox_order_key_unpublished_idx",
		"outbox_dead_order_key_idx", "outbox_dead_at_idx", "outbox_open_idx"))
	require.Zero(t, validIndexes(t, db, "outbox_unpublished_idx"), "migration 00030 drops the index it replaces")
}

// Acceptance: an INVALID index (a concurrent build that failed) makes
// inboxd migrate, and serve's schema check, fail with one line naming it
// and the fix; after that fix, migrate builds what its migrations need.
func TestMigrateRefusesAnInvalidIndex(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	_, err := db.Pool.Exec(ctx, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id)
		VALUES ('k-1', 'order.confirmed', '{}', 'm-1'), ('k-2', 'order.confirmed', '{}', 'm-2')`)
	require.NoError(t, err)
	// Duplicates under a unique index: the build fails, the index stays.
	_, err = db.Pool.Exec(ctx, "CREATE UNIQUE INDEX CONCURRENTLY outbox_routing_key_uniq ON outbox (routing_key)")
	require.Error(t, err)
	// A migration's own index whose build failed (cancelled, say), which
	// IF NOT EXISTS would then skip.
	_, err = db.Pool.Exec(ctx, "DROP INDEX outbox_order_key_unpublished_idx")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "CREATE INDEX CONCURRENTLY outbox_order_key_unpublished_idx ON outbox ((1 / (id - id)))")
	require.Error(t, err)

	out, ok := runInboxd(t, "migrate", "DATABASE_URL="+db.URL, slowLocks)
	require.False(t, ok, "migrate fails: %s", out)
	line := strings.TrimRight(out, "\n")
	require.NotContains(t, line, "\n", "one line")
	require.Contains(t, line, "indexes outbox_order_key_unpublished_idx, outbox_routing_key_uniq of schema "+db.Schema+" are INVALID")
	require.Contains(t, line, `DROP INDEX CONCURRENTLY "`+db.Schema+`"."outbox_routing_key_uniq";`)

	out, ok = runInboxd(t, "serve", "DATABASE_URL="+db.URL, "AMQP_URL=amqp://guest:guest@127.0.0.1:1/", "INBOX_MIGRATE=false")
	require.False(t, ok)
	require.Contains(t, out, "outbox_routing_key_uniq")

	// The fix, as the line says it.
	fix := regexp.MustCompile(`run (DROP INDEX .*;) then run inboxd migrate again`).FindStringSubmatch(line)
	require.NotNil(t, fix, line)
	for stmt := range strings.SplitSeq(fix[1], ";") {
		if strings.TrimSpace(stmt) != "" {
			_, err := db.Pool.Exec(ctx, stmt)
			require.NoError(t, err, stmt)
		}
	}
	out, ok = runInboxd(t, "migrate", "DATABASE_URL="+db.URL, slowLocks)
	require.True(t, ok, out)
	require.Equal(t, 1, validIndexes(t, db, "outbox_order_key_unpublished_idx"), "the migration's index is built again")
	require.Equal(t, "CREATE INDEX outbox_order_key_unpublished_idx ON "+db.Schema+".outbox USING btree (order_key, id) WHERE ((published_at IS NULL) AND (order_key IS NOT NULL))",
		db.Strings(t, "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() AND indexname = 'outbox_order_key_unpublished_idx'")[0])
}
