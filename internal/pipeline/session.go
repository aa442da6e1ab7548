package pipeline

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ConfigureSession sets up a connection config for the sessions that run
// the pipeline's statements.
//
// Each statement is sent as an unnamed prepared statement (pgx's
// QueryExecModeCacheDescribe), so PostgreSQL plans it for its parameters
// and the tables as they are; the pools keep their plans for a while
// instead (see KeepPlans). The sessions change nothing of the planner's:
// the statements are written so that the planner reads by index where an
// index serves, with or without statistics, and the service gives the key
// ledger's hot parts statistics itself (inbox_keys_analyze_parts), since
// autovacuum leaves them alone. TestStatementsReadIndexesOnceTheTablesHaveGrown
// and TestAHeldSnapshotDoesNotGrowWhatAnOrderReads hold the plans to that
// on tables nobody vacuums or analyzes; BENCHMARKS.md ("The planner left
// alone") has the figures against the sessions that turned sequential and
// bitmap scans and JIT off.
//
// It pins durability: synchronous_commit is "on" in every session,
// whatever the server, the database or the role says (a session's own
// setting, which pgsession makes once the session is up, overrides ALTER
// ROLE and ALTER DATABASE). Ingest acks a delivery once its insert has
// committed; with synchronous_commit = off, a common tuning, that commit
// may not be on disk yet and a crash loses an acked message. A stronger
// value given in the connection string (remote_write, remote_apply: the
// commit waits for a standby) is kept.
func ConfigureSession(cc *pgx.ConnConfig) {
	cc.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	if !strongCommit[cc.RuntimeParams["synchronous_commit"]] {
		cc.RuntimeParams["synchronous_commit"] = "on"
	}
}

// ReplanEvery is how long a pool's connection keeps the plans of its
// statements (see KeepPlans).
const ReplanEvery = 10 * time.Second

// plansSince is the key, in a connection's pgconn.PgConn.CustomData, of
// the time its statements' plans were last dropped.
const plansSince = "inboxd.plans_since"

// KeepPlans sets up a pool whose connections ConfigureSession configured
// to prepare each statement once and keep its plan, and to drop every plan
// of a connection that is ReplanEvery old when the pool hands it out.
//
// Planning each statement anew at each call took about a quarter of
// PostgreSQL's CPU an order (pg_stat_statements, planning time: 13.5 s of
// the 51 s PostgreSQL spent on 60,000 orders at 1,000 a second): the
// claims and the batch statements read tables with many partial indexes
// and the key ledger's partitions, and cost 0.4-0.7 ms each to plan.
// Prepared, a statement is planned for its parameters five times, then,
// when no cheaper for them, once for any parameters, and that plan is
// kept; a change to a table's definition or its statistics replans it.
//
// Without statistics (a server that runs without autovacuum, or a table
// too young for it) nothing would replan it, and a plan kept from when the
// tables were small may read them whole once they have grown:
// TestStatementsReadIndexesOnceTheTablesHaveGrown saw a claim scan every
// processed message (8.8 million rows for 300 orders, a plan made while
// the inbox was empty), and in one run an anti-join read every attempt of
// inbox_attempts by index (302,165 entries). So a connection keeps its
// plans for ReplanEvery at most, then makes them again for the tables as
// they are: a few statements' planning every ten seconds.
func KeepPlans(pc *pgxpool.Config) { keepPlansFor(pc, ReplanEvery) }

// keepPlansFor is KeepPlans with the plans kept for d.
func keepPlansFor(pc *pgxpool.Config, d time.Duration) {
	pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	pc.PrepareConn = func(ctx context.Context, conn *pgx.Conn) (bool, error) {
		data := conn.PgConn().CustomData()
		since, ok := data[plansSince].(time.Time)
		if ok && time.Since(since) < d {
			return true, nil
		}
		if ok {
			if err := conn.DeallocateAll(ctx); err != nil {
				// The connection is broken, ctx ended, or something between
				// refuses DEALLOCATE ALL (a pooler that does not track
				// prepared statements). pgx has forgotten the statements
				// already, so the connection cannot be used: the pool
				// closes it and opens another, whose statements are new.
				return false, nil
			}
		}
		data[plansSince] = time.Now()
		return true, nil
	}
}

// strongCommit are the synchronous_commit values stronger than "on", kept
// when a connection string asks for them.
var strongCommit = map[string]bool{"remote_write": true, "remote_apply": true}

// CancelQueryOnContextEnd is a pgconn.Config.BuildContextWatcherHandler
// that answers a context ending inside a query by cancelling the query on
// the server, instead of closing the connection as pgx does by default: the
// transaction stays usable, so a batch whose handler ran out of time rolls
// back to its savepoint and goes on with its other messages. A query that
// ignores the cancel for 5 seconds closes the connection after all.
//
// It is for the pools, and not part of ConfigureSession: the sessions that
// wait idle (LISTEN, the advisory-lock sessions) are made from the same
// configured config, and an idle backend ignores a cancel, so they would
// notice their context only after the 5-second delay.
func CancelQueryOnContextEnd(conn *pgconn.PgConn) ctxwatch.Handler {
	return &pgconn.CancelRequestContextWatcherHandler{Conn: conn, DeadlineDelay: 5 * time.Second}
}
