package dbsqlc

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PlanEachCall returns db with every statement run through it planned for
// its own parameters at each call (pgx's QueryExecModeCacheDescribe: the
// statement runs as the unnamed one), whatever plans db's connection keeps.
// It is for the few statements whose plan for any parameters, made while
// the tables were small and kept by a pool, would read a grown table whole:
// internal/pipeline's TestEveryStatementsKeptPlanReadsGrowingTablesByIndex
// names them, and fails when a call of one does not go through it.
func PlanEachCall(db DBTX) DBTX { return eachCall{db} }

type eachCall struct{ db DBTX }

func (e eachCall) Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	return e.db.Exec(ctx, sql, planned(args)...)
}

func (e eachCall) Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	return e.db.Query(ctx, sql, planned(args)...)
}

func (e eachCall) QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row {
	return e.db.QueryRow(ctx, sql, planned(args)...)
}

// planned puts the execution mode before args, where pgx reads it.
func planned(args []interface{}) []interface{} {
	return append([]interface{}{pgx.QueryExecModeCacheDescribe}, args...)
}
