package inbox

import (
	"context"
	"fmt"
	"time"

	"github.com/orderconfirm/inboxd/internal/retry"
)

// answerLeftBatch is the most requests one answerLeft statement answers.
const answerLeftBatch = 1000

// answerLeft answers the reply requests that neither the handler's
// transaction nor ingest's statement answered: a copy stored while its
// message was being handled (after the batch locked it) is seen by
// neither. Every other request is answered where it is stored or where its
// message ends (see migration 00021); this is the rule's one gap, closed
// within a poll interval. It returns how many replies it queued.
func (w *Worker) answerLeft(ctx context.Context) (int, error) {
	total := 0
	for {
		n, err := w.queries.InboxReplyAnswerLeft(ctx, w.pool, answerLeftBatch)
		if err != nil {
			return total, fmt.Errorf("answer reply requests left unanswered: %w", err)
		}
		total += int(n)
		if n < answerLeftBatch {
			return total, nil
		}
	}
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
