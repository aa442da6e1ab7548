package migrate_test

import (
	"context"
	"errors"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// operatorLogin creates a login in inbox_operator, for this test only,
// and returns its name and a connection of it to db, both ended with the
// test.
func operatorLogin(t *testing.T, db *testenv.DB) (string, *pgx.Conn) {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	login := "op_" + db.Schema
	db.Exec(t, "CREATE ROLE "+login+" LOGIN PASSWORD 'operator' IN ROLE inbox_operator")
	t.Cleanup(func() { _, _ = db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+login) })
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(login, "operator")
	op, err := pgx.Connect(ctx, u.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = op.Close(ctx) })
	return login, op
}

// The operator role reads everything and can replay, and can change
// nothing else.
func TestOperatorRole(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	_, err := dbsqlc.New().InboxInsertMany(ctx, db.Pool, dbsqlc.InboxInsertManyParams{
		MessageIds: []string{"m-1"}, MessageTypes: []string{"order.created"}, RoutingKeys: []string{"order.created"},
		Payloads: [][]byte{[]byte(`{}`)}, OrderKeys: []string{"o-1"},
	})
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "UPDATE inbox SET status = 'processed', processed_at = now() WHERE message_id = 'm-1'")
	require.NoError(t, err)

	login, op := operatorLogin(t, db)

	for _, view := range []string{"inbox", "inbox_overview", "inbox_dead", "inbox_held_back", "order_confirmations",
		"stock", "stock_reservations", "stock_overview", "stock_levels", "stock_moves", "outbox", "outbox_backlog",
		"inbox_attempts", "inbox_conflicts", "inbox_dead_by_error", "inbox_failures_by_build", "inbox_throughput"} {
		_, err := op.Exec(ctx, "SELECT * FROM "+view+" LIMIT 1")
		require.NoError(t, err, "the operator reads %s", view)
	}

	tag, err := op.Exec(ctx, "UPDATE inbox SET replay_requested = true, replay_reason = 'check' WHERE message_id = 'm-1'")
	require.NoError(t, err, "the operator replays")
	require.EqualValues(t, 1, tag.RowsAffected())
	var status, by string
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT status, replayed_by FROM inbox WHERE message_id = 'm-1'").Scan(&status, &by))
	require.Equal(t, "pending", status, "the trigger did the rest")
	require.Equal(t, login, by)

	for _, stmt := range []string{
		"UPDATE inbox SET status = 'dead'",
		"UPDATE inbox SET replay_count = 0",
		"DELETE FROM inbox",
		"INSERT INTO inbox (message_id, message_type, payload) VALUES ('x', 'y', '')",
		"UPDATE stock SET available = 0",
		"INSERT INTO stock_moves (sku, quantity) VALUES ('x', 1)",
		// What a fold does.
		"UPDATE stock SET folded_through = folded_through",
		"DELETE FROM stock_moves",
		"DELETE FROM outbox",
		"UPDATE order_confirmations SET status = 'cancelled'",
		"TRUNCATE inbox",
		"DELETE FROM inbox_attempts",
		"UPDATE inbox_attempts SET outcome = 'processed'",
		"DELETE FROM inbox_conflicts",
		"UPDATE inbox SET claimed_by = 'me'",
		"CREATE TABLE sneaky (id int)",
	} {
		_, err := op.Exec(ctx, stmt)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%s: %v", stmt, err)
		require.Equal(t, "42501", pgErr.Code, "%s is refused with permission denied", stmt)
	}
}

// A database administrator who creates the roles after migrating grants
// them their rights with one call, as often as needed.
func TestGrantRolesAgain(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	for range 2 {
		require.Equal(t, []string{"granted to inbox_operator, inbox_service"}, db.Strings(t, "SELECT inbox_grant_roles()"))
	}
	require.Equal(t, 1, db.Int(t, `
		SELECT count(*) FROM information_schema.column_privileges
		WHERE grantee = 'inbox_operator' AND table_schema = current_schema() AND table_name = 'inbox'
		  AND column_name = 'replay_requested' AND privilege_type = 'UPDATE'`))
}

// After a restore that carried the claim floors past rows it restored as
// open, an operator lowers each floor to its table's oldest open row with
// the statements docs/failure-handling.md gives; a floor already under
// that row stays where it is.
func TestAnOperatorLowersTheFloorsAfterARestore(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	db.Exec(t, `INSERT INTO inbox (message_id, message_type, payload, status, processed_at)
		SELECT 'ended-' || g, 'order.created', '{}', 'processed', now() FROM generate_series(1, 10) g`)
	db.Exec(t, `INSERT INTO inbox (message_id, message_type, payload) VALUES ('open-1', 'order.created', '{}'), ('open-2', 'order.created', '{}')`)
	db.Exec(t, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, published_at)
		SELECT 'ended-' || g, 'order.confirmed', '{}', 'ended-' || g, now() FROM generate_series(1, 10) g`)
	db.Exec(t, `INSERT INTO outbox (idempotency_key, routing_key, payload, message_id) VALUES ('open-1', 'order.confirmed', '{}', 'open-1')`)
	inboxOpen := db.Int(t, "SELECT min(id) FROM inbox WHERE status = 'pending'")
	outboxOpen := db.Int(t, "SELECT min(id) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL")
	// The restore: both floors past their open rows.
	db.Exec(t, "SELECT setval('inbox_claim_floor_seq', 100), setval('outbox_claim_floor_seq', 100)")

	_, op := operatorLogin(t, db)

	repair := func() {
		t.Helper()
		for _, stmt := range []string{
			"SELECT claim_floor_lower('inbox', min(id)) FROM inbox WHERE status = 'pending'",
			"SELECT claim_floor_lower('outbox', min(id)) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL",
		} {
			_, err := op.Exec(ctx, stmt)
			require.NoError(t, err, "the operator runs %s", stmt)
		}
	}
	repair()
	require.Equal(t, inboxOpen, db.Int(t, "SELECT inbox_claim_floor()"), "the inbox's floor is lowered to its oldest pending message")
	require.Equal(t, outboxOpen, db.Int(t, "SELECT outbox_claim_floor()"), "the outbox's floor is lowered to its oldest open row")

	db.Exec(t, "SELECT setval('inbox_claim_floor_seq', 1), setval('outbox_claim_floor_seq', 1)")
	repair()
	require.Equal(t, 1, db.Int(t, "SELECT inbox_claim_floor()"), "a floor under the oldest open row stays")
	require.Equal(t, 1, db.Int(t, "SELECT outbox_claim_floor()"))
}
