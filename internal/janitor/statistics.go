package janitor

import (
	"context"
	"log/slog"
	"time"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// StatisticsEvery is how often KeepStatistics looks for a table that needs
// statistics.
const StatisticsEvery = 2 * time.Second

// KeepStatistics analyzes the tables that need statistics
// (inbox_keep_statistics) every StatisticsEvery until ctx ends; the leader
// runs it, whatever INBOX_JANITOR_INTERVAL says.
//
// A hot part of the key ledger is analyzed once it holds keys, if it has no
// statistics: autovacuum leaves the hot parts alone, and without statistics
// the planner takes 1 in 200 of a part's keys to match each id the ingest
// statement probes (it read the whole part by a sequential scan for each
// batch). A part's statistics say that its ids are distinct (n_distinct
// -1); they stay through its TRUNCATEs and scale with its size, so each
// part is analyzed once in the schema's life.
//
// Any other table is analyzed once it holds 1,000 rows, if it never was,
// and at each tenfold growth since: where autovacuum does not run, that is
// what makes the sessions plan again the statements they keep plans for
// (pipeline.KeepPlans), so that a plan made while a table was small is made
// again for it as it is. Where autovacuum runs, it analyzes sooner, and a
// look finds nothing to do, in a few catalog reads.
func KeepStatistics(ctx context.Context, db dbsqlc.DBTX, logger *slog.Logger) {
	q := dbsqlc.New()
	for {
		switch analyzed, err := q.JanitorKeepStatistics(ctx, db); {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			logger.Warn("statistics: analyzing the tables failed, trying again", slog.String("error", err.Error()))
		case analyzed > 0:
			logger.Info("statistics: tables analyzed", slog.Int("tables", int(analyzed)))
		}
		if !retry.Sleep(ctx, StatisticsEvery) {
			return
		}
	}
}
