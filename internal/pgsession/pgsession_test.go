package pgsession_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A session made with SetAfterConnect has every setting of RuntimeParams,
// values a startup message would take as they are (a search_path of two
// schemas, one quoted), set before the config's own AfterConnect runs, and
// its startup message carries only what a pooler tracks.
func TestSessionsHaveTheirSettingsWithoutSendingThemAtStartup(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	cc.RuntimeParams["application_name"] = "pgsession test"
	cc.RuntimeParams["statement_timeout"] = "1234"
	cc.RuntimeParams["lock_timeout"] = "5s"
	cc.RuntimeParams["search_path"] = `"` + db.Schema + `", pg_catalog`
	var sawTimeout string
	cc.AfterConnect = func(ctx context.Context, conn *pgconn.PgConn) error {
		rows, err := conn.Exec(ctx, "SHOW statement_timeout").ReadAll()
		if err == nil {
			sawTimeout = string(rows[0].Rows[0][0])
		}
		return err
	}

	conn, err := pgsession.Connect(t.Context(), cc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(t.Context())) })
	require.Equal(t, "1234ms", sawTimeout, "set before the config's own AfterConnect")

	var timeout, lock, schema, name string
	require.NoError(t, conn.QueryRow(t.Context(),
		"SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), current_schema(), current_setting('application_name')").
		Scan(&timeout, &lock, &schema, &name))
	require.Equal(t, []string{"1234ms", "5s", db.Schema, "pgsession test"}, []string{timeout, lock, schema, name})
	_, err = conn.Exec(t.Context(), "SELECT 1 FROM inbox LIMIT 0")
	require.NoError(t, err, "the schema's tables are found")

	// Connect copies: the caller's config still sends everything.
	require.Equal(t, "1234", cc.RuntimeParams["statement_timeout"])
	moved := cc.Copy()
	pgsession.SetAfterConnect(moved)
	require.Equal(t, map[string]string{"application_name": "pgsession test"}, moved.RuntimeParams)
}
