package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// answerLeftScan is the most unanswered reply requests one answerLeft pass
// looks at, so that a pass costs the same however many requests wait for
// their message.
const answerLeftScan = 10_000

// answerLeft answers the reply requests that neither the handler's
// transaction nor ingest's answered: a copy stored while its message was
// being handled (after the batch locked it) is seen by neither, and one
// another session held when its message ended was skipped. Every other
// request is answered where it is stored or where its message ends; these
// gaps close within a few poll intervals. Each pass looks at up to
// answerLeftScan unanswered requests, going on from where the last pass
// stopped, and answers those due with the statement every other answer
// uses (InboxReplyAnswer). It returns how many replies it queued.
func (w *Worker) answerLeft(ctx context.Context) (int, error) {
	left, err := w.queries.InboxReplyLeft(ctx, w.pool, dbsqlc.InboxReplyLeftParams{
		AfterID: w.answerCursor.Load(), MaxScan: answerLeftScan,
	})
	if err != nil {
		return 0, fmt.Errorf("find reply requests left unanswered: %w", err)
	}
	var queued int32
	if len(left.DueIds) > 0 {
		if queued, err = w.queries.InboxReplyAnswer(ctx, dbsqlc.PlanEachCall(w.pool), left.DueIds); err != nil {
			return 0, fmt.Errorf("answer reply requests left unanswered: %w", err)
		}
	}
	next := left.LastID
	if left.Scanned < answerLeftScan {
		next = 0 // the end: the next pass starts again
	}
	w.answerCursor.Store(next)
	return int(queued), nil
}

// answerLoop runs answerLeft every interval until ctx ends.
func (w *Worker) answerLoop(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	failures := retry.Failures{Policy: retry.Transient}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if _, err := w.answerLeft(ctx); err != nil {
			failures.Wait(ctx, w.logger, "answer reply requests", err)
			continue
		}
		failures.Reset()
	}
}
