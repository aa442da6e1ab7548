package testenv

import (
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/sandbox"
)

func TestMain(m *testing.M) { Main(m) }

// A test's database of its own is the one it connects to, even when the
// server's URL also names the shared database in its query (where pgx
// lets it win over the path), and it is gone once the test has ended.
func TestNewDBAloneIsInADatabaseOfItsOwn(t *testing.T) {
	t.Parallel()
	shared := getServers(t).databaseURL
	conn := connect(t, shared)
	sharedName := currentDatabase(t, conn)
	u, err := url.Parse(shared)
	require.NoError(t, err)
	q := u.Query()
	q.Set("dbname", sharedName)
	u.RawQuery = q.Encode()

	var names []string
	t.Run("alone", func(t *testing.T) {
		db := NewDBAlone(t)
		named, drop, err := sandbox.CreateDatabase(t.Context(), u.String(), uniqueName())
		require.NoError(t, err)
		t.Cleanup(drop)
		for _, dbURL := range []string{db.URL, named} {
			name := currentDatabase(t, connect(t, dbURL))
			require.NotEqual(t, sharedName, name, "%s connects to the shared database", dbURL)
			names = append(names, name)
		}
	})
	require.Len(t, names, 2)
	var left int
	require.NoError(t, conn.QueryRow(t.Context(), "SELECT count(*) FROM pg_database WHERE datname = ANY($1)", names).Scan(&left))
	require.Zero(t, left, "databases left behind of %v", names)
}

func connect(t *testing.T, dbURL string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(t.Context()) })
	return conn
}

func currentDatabase(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	var name string
	require.NoError(t, conn.QueryRow(t.Context(), "SELECT current_database()").Scan(&name))
	return name
}
