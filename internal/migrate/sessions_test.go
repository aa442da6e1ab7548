package migrate_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A session key is live while a session of the pid and the login that
// registered it holds its lock: a session of another login given the same
// pid (pids are reused, and pg_locks shows them to every login) keeps
// nothing alive.
func TestASessionKeyIsLiveOnlyForTheLoginThatRegisteredIt(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	const key = 4_000_000_000_321
	holder := db.Session(t)
	registered, err := dbsqlc.New().InboxHoldLiveness(t.Context(), holder, key)
	require.NoError(t, err)
	require.True(t, registered)
	live := "SELECT count(*) FROM inbox_live_sessions() k WHERE k = $1"
	require.Equal(t, 1, db.Int(t, live, int64(key)), "live while its session holds it")

	// The same pid, as another login would have it.
	db.Exec(t, "UPDATE inbox_sessions SET login = 'pg_monitor'::regrole WHERE session = $1", int64(key))
	require.Zero(t, db.Int(t, live, int64(key)), "not live under another login")
}
