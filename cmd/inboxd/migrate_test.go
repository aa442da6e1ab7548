package main

import (
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
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

// Acceptance: an INVALID index (a concurrent build that failed) makes
// inboxd migrate, and serve's schema check, fail with one line naming it
// and the fix; after that fix, migrate succeeds.
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

	out, ok := runInboxd(t, "migrate", "DATABASE_URL="+db.URL, slowLocks)
	require.False(t, ok, "migrate fails: %s", out)
	line := strings.TrimRight(out, "\n")
	require.NotContains(t, line, "\n", "one line")
	require.Contains(t, line, "index outbox_routing_key_uniq of schema "+db.Schema+" is INVALID")
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
}
