package janitor

import (
	"context"
	"log/slog"
	"time"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// KeyStatisticsEvery is how often KeepKeyStatistics looks for a hot part of
// the key ledger without statistics.
const KeyStatisticsEvery = 2 * time.Second

// KeepKeyStatistics gives each hot part of the key ledger statistics once it
// holds keys, if it has none (inbox_keys_analyze_parts), every
// KeyStatisticsEvery until ctx ends; the leader runs it, whatever
// INBOX_JANITOR_INTERVAL says.
//
// Autovacuum leaves the hot parts alone, and without statistics the
// planner takes 1 in 200 of a part's keys to match each id the ingest
// statement probes: it read the whole part by a sequential scan for each
// batch. A part's statistics say that its ids are distinct (n_distinct -1);
// they stay through its TRUNCATEs and scale with its size, so each part is
// analyzed once in the schema's life, in its first seconds of traffic. A
// look finds nothing to do in a few catalog reads.
func KeepKeyStatistics(ctx context.Context, db dbsqlc.DBTX, logger *slog.Logger) {
	q := dbsqlc.New()
	for {
		switch analyzed, err := q.JanitorAnalyzeKeys(ctx, db); {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			logger.Warn("key ledger: analyzing the hot parts failed, trying again", slog.String("error", err.Error()))
		case analyzed > 0:
			logger.Info("key ledger: hot parts analyzed", slog.Int("parts", int(analyzed)))
		}
		if !retry.Sleep(ctx, KeyStatisticsEvery) {
			return
		}
	}
}
