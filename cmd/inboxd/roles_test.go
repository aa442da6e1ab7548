package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// loginAs creates a login role for this test only, member of group, and
// returns a database URL that connects as it.
func loginAs(t *testing.T, db *testenv.DB, group string) string {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	login := group + "_" + db.Schema
	_, err := db.Pool.Exec(ctx, "CREATE ROLE "+login+" LOGIN PASSWORD 'pw' IN ROLE "+group)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+login) })
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(login, "pw")
	return u.String()
}

func requirePermissionDenied(t *testing.T, conn *pgx.Conn, statements ...string) {
	t.Helper()
	for _, stmt := range statements {
		_, err := conn.Exec(t.Context(), stmt)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%s: %v", stmt, err)
		require.Equal(t, "42501", pgErr.Code, "%s is refused with permission denied (%s)", stmt, pgErr.Message)
	}
}

// Acceptance: after migrating as the owner, inboxd serves as a role without
// DDL rights: it ingests, handles, publishes and cleans up, and the role can
// create, alter, drop or truncate nothing.
func TestServeAsTheServiceRole(t *testing.T) {
	t.Parallel()
	b := setup(t) // migrated by the schema's owner
	serviceURL := loginAs(t, b.db, "inbox_service")

	// The janitor runs too, with a retention of two seconds, so the role's
	// deletes are exercised.
	runInProcess(t, serviceEnv(b.db, b.broker, "DATABASE_URL="+serviceURL, "INBOX_MIGRATE=false", ownReplyQueues,
		"INBOX_DEDUPE_WINDOW=1s", "INBOX_RETENTION=2s", "INBOX_DEAD_RETENTION=2s", "INBOX_JANITOR_INTERVAL=500ms"))
	w := loadgen.Generate(loadgen.Spec{Orders: 200, DuplicateRate: 0.2, Seed: 11})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 100))
	// Requests, a copy of one, and one whose requester is gone: the role
	// stores, answers, publishes, gives up on and deletes replies.
	req := newRequester(t, b.broker.URL, true)
	gone := newRequester(t, b.broker.URL, true)
	gone.request(t, "r-gone", "order.created", "c-gone", loadgen.OrderCreatedBody("o-r-gone", 1))
	require.NoError(t, gone.ch.Close())
	for i := range 5 {
		req.request(t, fmt.Sprintf("r-%d", i), "order.created", fmt.Sprintf("c-%d", i), loadgen.OrderCreatedBody(fmt.Sprintf("o-r-%d", i), 1))
	}
	first := req.receive(t, 5, 30*time.Second)
	req.request(t, "r-0", "order.created", "c-0-again", loadgen.OrderCreatedBody("o-r-0", 1))
	again := req.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, "c-0-again", again.correlationID)
	require.Equal(t, "confirmed", again.body["outcome"], again.raw)
	require.Len(t, first, 5)

	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'") == len(w.OrderIDs)+6
	}, 60*time.Second, 50*time.Millisecond, "every order confirmed")
	// Each confirmed order publishes order.confirmed and email.requested.
	timeout := time.After(60 * time.Second)
	for len(b.seen) < 2*len(w.OrderIDs) {
		select {
		case d := <-b.events:
			require.NoError(t, d.Ack(false))
			b.seen[d.MessageId]++
		case <-timeout:
			t.Fatalf("%d of %d events arrived", len(b.seen), 2*len(w.OrderIDs))
		}
	}
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox") == 0 &&
			b.count(t, "SELECT count(*) FROM inbox_attempts") == 0 &&
			b.count(t, "SELECT count(*) FROM outbox") == 0
	}, 30*time.Second, 100*time.Millisecond, "the janitor deleted what was past its retention")
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox_reply_requests") == 0
	}, 30*time.Second, 100*time.Millisecond, "reply requests leave with their messages")
	require.Equal(t, len(w.OrderIDs)+6, b.count(t, "SELECT count(*) FROM order_confirmations"), "the domain's rows stay")
	require.Positive(t, b.count(t, "SELECT inbox_claim_floor()"), "the service raised the inbox's claim floor")
	require.Positive(t, b.count(t, "SELECT outbox_claim_floor()"), "the service raised the outbox's claim floor")
	require.Greater(t, b.count(t, "SELECT max(generation) FROM inbox_key_generations"), 8, "the service's janitor rotated the key ledger round its slots")

	conn, err := pgx.Connect(t.Context(), serviceURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.WithoutCancel(t.Context())) }()
	folded, err := orders.FoldStock(t.Context(), conn)
	require.NoError(t, err)
	require.Positive(t, folded, "the service folds the stock moves its orders wrote")
	require.Zero(t, b.count(t, "SELECT count(*) FROM stock_moves"))
	requirePermissionDenied(t, conn,
		"CREATE TABLE sneaky (id int)",
		"DROP TABLE inbox",
		"TRUNCATE inbox",
		"ALTER TABLE inbox ADD COLUMN sneaky int",
		"CREATE INDEX sneaky_idx ON inbox (message_type)",
		"DROP VIEW inbox_overview",
		"ALTER TABLE inbox DISABLE TRIGGER inbox_replay_update",
		"DELETE FROM goose_db_version",
		"DELETE FROM inbox_keys",
		"TRUNCATE inbox_keys",
		"UPDATE inbox_keys SET message_id = 'sneaky'",
		// Rights inboxd does not use.
		"DELETE FROM order_confirmations",
		"DELETE FROM stock",
		"DELETE FROM stock_reservations",
		"INSERT INTO stock (sku, available) VALUES ('sneaky', 1)",
		"UPDATE inbox SET payload = '', message_id = 'x'",
		"UPDATE outbox SET payload = '{}', idempotency_key = 'x'",
		"UPDATE order_confirmations SET email = 'x', order_id = 'x'",
		"UPDATE inbox_attempts SET outcome = 'processed'",
		"UPDATE stock_reservations SET quantity = 0",
		"UPDATE stock_moves SET quantity = 0",
		"TRUNCATE stock_moves",
		"UPDATE inbox_reply_requests SET reply_to = 'x'",
	)
}

// serve without migrating refuses a schema that is behind this build, and
// says what to do.
func TestServeWithoutMigratingChecksTheSchema(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	_, err := db.Pool.Exec(t.Context(), "CREATE SCHEMA "+db.Schema+"_empty")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.WithoutCancel(t.Context()), "DROP SCHEMA "+db.Schema+"_empty CASCADE")
	})
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("search_path", db.Schema+"_empty")
	u.RawQuery = q.Encode()

	cmd := exec.Command(inboxdPath, "serve")
	cmd.Env = []string{"DATABASE_URL=" + u.String(), "AMQP_URL=amqp://guest:guest@127.0.0.1:1/", "INBOX_MIGRATE=false"}
	out, err := combinedOutput(t, cmd)
	require.Error(t, err)
	require.Contains(t, string(out), "the schema is not migrated: run inboxd migrate")

	_, err = db.Pool.Exec(t.Context(), "UPDATE goose_db_version SET is_applied = false WHERE version_id = (SELECT max(version_id) FROM goose_db_version)")
	require.NoError(t, err)
	cmd = exec.Command(inboxdPath, "serve")
	cmd.Env = []string{"DATABASE_URL=" + db.URL, "AMQP_URL=amqp://guest:guest@127.0.0.1:1/", "INBOX_MIGRATE=false"}
	out, err = combinedOutput(t, cmd)
	require.Error(t, err)
	require.Regexp(t, `the schema is at migration \d+, this build needs \d+: run inboxd migrate`, string(out))
}

// Acceptance: inbox_grant_roles() gives each operator login the operators'
// session defaults and keeps a login's own; an operator session left idle
// in a transaction that holds inbox rows FOR UPDATE is ended by its
// timeout, and the workers then handle those rows.
func TestOperatorSessionIdleInATransactionIsEnded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.WithoutCancel(t.Context())
	operatorURL := loginAs(t, b.db, "inbox_operator")
	login := "inbox_operator_" + b.db.Schema
	settings := func() []string {
		return b.db.Strings(t, "SELECT unnest(setconfig) FROM pg_db_role_setting WHERE setrole = $1::regrole AND setdatabase = 0 ORDER BY 1", login)
	}
	require.Equal(t, []string{"granted to inbox_operator, inbox_service"}, b.db.Strings(t, "SELECT inbox_grant_roles()"))
	require.Equal(t, []string{"idle_in_transaction_session_timeout=60s", "lock_timeout=5s", "statement_timeout=30s"}, settings(),
		"the operators' defaults, on the login")
	// A login's own setting stays when the roles are granted again.
	_, err := b.db.Pool.Exec(ctx, "ALTER ROLE "+login+" SET idle_in_transaction_session_timeout = '1s'")
	require.NoError(t, err)
	b.db.Strings(t, "SELECT inbox_grant_roles()")
	require.Equal(t, []string{"idle_in_transaction_session_timeout=1s", "lock_timeout=5s", "statement_timeout=30s"}, settings())

	// Orders in the inbox, locked by an operator's forgotten transaction.
	w := loadgen.Generate(loadgen.Spec{Orders: 20, Seed: 23})
	var p dbsqlc.InboxInsertManyParams
	for _, m := range w.Messages {
		order := orders.OrderingKey(m.RoutingKey, m.Body)
		p.MessageIds, p.MessageTypes, p.RoutingKeys = append(p.MessageIds, m.MessageID), append(p.MessageTypes, m.RoutingKey), append(p.RoutingKeys, m.RoutingKey)
		p.Payloads, p.OrderKeys = append(p.Payloads, m.Body), append(p.OrderKeys, order)
		p.Traceparents, p.Tracestates = append(p.Traceparents, ""), append(p.Tracestates, "")
	}
	_, err = dbsqlc.New().InboxInsertMany(ctx, b.db.Pool, p)
	require.NoError(t, err)
	op, err := pgx.Connect(ctx, operatorURL)
	require.NoError(t, err)
	defer func() { _ = op.Close(ctx) }()
	tx, err := op.Begin(ctx)
	require.NoError(t, err)
	locked := 0
	require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM (SELECT id FROM inbox FOR UPDATE) l").Scan(&locked))
	require.Equal(t, len(w.Messages), locked)

	runInProcess(t, serviceEnv(b.db, b.broker))
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM order_confirmations WHERE status = 'confirmed'") == len(w.OrderIDs)
	}, 30*time.Second, 50*time.Millisecond, "the workers handle the rows once the operator's session is ended")
	_, err = tx.Exec(ctx, "SELECT 1")
	require.Error(t, err, "the idle transaction was ended")
}

// asyncServiceLogin makes a login in inbox_service whose role sets
// synchronous_commit = off (a common tuning), and returns its URL.
func asyncServiceLogin(t *testing.T, db *testenv.DB) string {
	t.Helper()
	serviceURL := loginAs(t, db, "inbox_service")
	u, err := url.Parse(serviceURL)
	require.NoError(t, err)
	_, err = db.Pool.Exec(t.Context(), "ALTER ROLE "+u.User.Username()+" SET synchronous_commit = off")
	require.NoError(t, err)
	return serviceURL
}

// Acceptance: with synchronous_commit = off on the service's login (a common
// tuning), the sessions serve opens still commit synchronously: an ack never
// runs ahead of a durable commit.
func TestServiceSessionsCommitSynchronouslyWhateverTheRoleSays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	serviceURL := asyncServiceLogin(t, b.db)

	plain, err := pgx.Connect(t.Context(), serviceURL)
	require.NoError(t, err)
	defer plain.Close(context.WithoutCancel(t.Context()))
	var setting string
	require.NoError(t, plain.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&setting))
	require.Equal(t, "off", setting, "the role's setting applies to a plain session")

	env := map[string]string{}
	for _, kv := range serviceEnv(b.db, b.broker, "DATABASE_URL="+serviceURL) {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
	require.NoError(t, err)
	conn, err := pgx.ConnectConfig(t.Context(), cfg.dbConfig.ConnConfig.Copy())
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(t.Context()))
	require.NoError(t, conn.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&setting))
	require.Equal(t, "on", setting, "serve's sessions pin it")
}
