package pipeline

import (
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
// and the tables as they are; the pools of the flow keep their plans
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

// KeepPlans sets up a pool whose connections ConfigureSession configured
// to prepare each statement once and keep its plan for the connection's
// life.
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
// too young for it) nothing replans it, so a plan kept from when the
// tables were small must still read them by index once they have grown:
// every statement's plan for any parameters, made on empty tables, does
// (TestEveryStatementsKeptPlanReadsGrowingTablesByIndex), but for a few
// that run through dbsqlc.PlanEachCall, planned at each call, and those
// of the pools that keep no plans (the maintenance's and the status
// page's, see serve's pools).
func KeepPlans(pc *pgxpool.Config) {
	pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
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
