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

// lostClaims are claims whose messages a batch did not handle for reasons
// outside them: the database lost the batch's transaction (see
// lostToTheDatabase), or another session held the row when the batch
// locked its rows. The attempt each claim counted is given back (giveBack)
// before the Worker claims anything else. Without it, such a message would
// wait for the takeover, which counts the lost attempt as abandoned: a few
// minutes of database trouble would spend an attempt of every message in
// flight.
type lostClaims struct {
	mu     sync.Mutex
	claims []lostClaim
}

// lostClaim is a batch's claims to give back, and why.
type lostClaim struct {
	claims
	reason string
}

// add keeps c to be given back, for reason.
func (l *lostClaims) add(c claims, reason string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claims = append(l.claims, lostClaim{c, reason})
}

// take returns every claim kept, and forgets them.
func (l *lostClaims) take() []lostClaim {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.claims
	l.claims = nil
	return c
}

// Reasons recorded as last_error of a message whose claim was given back.
const (
	reasonLostTransaction = "waiting: the database lost the transaction that was handling it (a lost connection, a server shutting down); its attempt was given back"
	reasonRowHeld         = "waiting: its inbox row was locked by another session when its batch began (see inbox_lock_holders); its attempt was given back"
)

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

// giveBack gives back the attempts of the claims kept in w.lost, if any.
// Those whose rows another session still holds are kept for the next call;
// so are all of them when the database cannot be reached, and it returns
// the error.
func (w *Worker) giveBack(ctx context.Context) error {
	lost := w.lost.take()
	if len(lost) == 0 {
		return nil
	}
	var all dbsqlc.InboxGiveBackParams
	for _, c := range lost {
		all.Ids = append(all.Ids, c.Ids...)
		all.ClaimedAts = append(all.ClaimedAts, c.ClaimedAts...)
		for range c.Ids {
			all.Reasons = append(all.Reasons, c.reason)
		}
	}
	held, err := w.queries.InboxGiveBack(ctx, w.pool, all)
	if err != nil {
		for _, c := range lost {
			w.lost.add(c.claims, c.reason)
		}
		return fmt.Errorf("give back claims: %w", err)
	}
	stillHeld := make(map[int64]bool, len(held))
	for _, id := range held {
		stillHeld[id] = true
	}
	perReason := map[string]int{}
	for _, c := range lost {
		keep := c.only(func(id int64) bool { return stillHeld[id] })
		if len(keep.Ids) > 0 {
			w.lost.add(keep, c.reason)
		}
		if given := len(c.Ids) - len(keep.Ids); given > 0 {
			perReason[c.reason] += given
		}
	}
	for reason, claims := range perReason {
		w.logger.Info("claims not handled given back, their attempts not counted",
			slog.Int("claims", claims), slog.String("reason", reason))
	}
	return nil
}

// keepIfLost keeps c to be given back when its work transaction tx (nil
// if none was begun) failed with err for the database's reasons.
func (w *Worker) keepIfLost(ctx context.Context, tx pgx.Tx, c claims, err error) {
	if lostToTheDatabase(ctx, tx, err) {
		w.lost.add(c, reasonLostTransaction)
	}
}

// keepUnlocked keeps, to be given back, the claims of c that InboxLockClaimed
// did not return in rows: those whose row another session held (the others,
// no longer pending or no longer this claim's, are left alone by
// InboxGiveBack).
func (w *Worker) keepUnlocked(c claims, rows []dbsqlc.InboxLockClaimedRow) {
	if len(rows) == len(c.Ids) {
		return
	}
	locked := make(map[int64]bool, len(rows))
	for _, r := range rows {
		locked[r.ID] = true
	}
	w.lost.add(c.only(func(id int64) bool { return !locked[id] }), reasonRowHeld)
}
