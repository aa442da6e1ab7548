package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// lostClaims are the claims of batches whose work transaction the database
// lost (see lostToTheDatabase): their messages were not handled, and the
// attempt each claim counted is given back (giveBack) before the Worker
// claims anything else. Without it, such a message would wait for the
// takeover, which counts the lost attempt as abandoned: a few minutes of
// database trouble would spend an attempt of every message in flight.
type lostClaims struct {
	mu     sync.Mutex
	claims []claims
}

// add keeps c to be given back.
func (l *lostClaims) add(c claims) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claims = append(l.claims, c)
}

// take returns every claim kept, and forgets them.
func (l *lostClaims) take() []claims {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.claims
	l.claims = nil
	return c
}

// giveBackReason is the last_error of a message whose claim was given back.
const giveBackReason = "waiting: the database lost the transaction that was handling it (a lost connection, a server shutting down); its attempt was given back"

// lostToTheDatabase reports whether a work transaction failed with err for
// the database's reasons rather than its messages': a connection that
// could not be made or that failed under it (tx is nil when none was
// begun), or one of the errors isDatabaseTrouble names. A batch cut short
// because ctx ended (a stop past its grace period) is not: its claims are
// taken over once the process is gone.
func lostToTheDatabase(ctx context.Context, tx pgx.Tx, err error) bool {
	if err == nil || ctx.Err() != nil {
		return false
	}
	if isDatabaseTrouble(err) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return false // the server answered: the batch's own failure
	}
	return tx == nil || tx.Conn().IsClosed()
}

// giveBack gives back the attempts of the claims lost to the database, if
// any. The claims it could not give back (the database is still away) are
// kept for the next call, and it returns the error.
func (w *Worker) giveBack(ctx context.Context) error {
	lost := w.lost.take()
	if len(lost) == 0 {
		return nil
	}
	var all dbsqlc.InboxGiveBackParams
	for _, c := range lost {
		all.Ids = append(all.Ids, c.Ids...)
		all.ClaimedAts = append(all.ClaimedAts, c.ClaimedAts...)
	}
	all.Reason = giveBackReason
	n, err := w.queries.InboxGiveBack(ctx, w.pool, all)
	if err != nil {
		for _, c := range lost {
			w.lost.add(c)
		}
		return fmt.Errorf("give back claims lost to the database: %w", err)
	}
	w.logger.Info("claims lost to the database given back, their attempts not counted",
		slog.Int("claims", len(all.Ids)), slog.Int64("given_back", n),
		slog.Int("already_ended", len(all.Ids)-int(n)))
	return nil
}

// keepIfLost keeps c to be given back when its work transaction tx (nil
// if none was begun) failed with err for the database's reasons.
func (w *Worker) keepIfLost(ctx context.Context, tx pgx.Tx, c claims, err error) {
	if lostToTheDatabase(ctx, tx, err) {
		w.lost.add(c)
	}
}
