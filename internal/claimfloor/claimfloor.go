// Package claimfloor keeps a claim floor: the id under which no row of a
// table can be claimed any more, where the claims of that table start their
// scans. Without it, a snapshot held open for minutes (an analytics query,
// pg_dump, a standby with hot_standby_feedback) leaves every claim wading
// through the index entries of every row ended since, which vacuum may not
// remove. migrations/00003_claim_floors.sql keeps the floors in PostgreSQL and has the
// argument for why raising one is safe; this package only calls it.
package claimfloor

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// IntervalDefault is how often a Keeper raises its floor. The floor trails
// the table by about two intervals, so a claim scans past at most that
// much of the table's ended rows.
const IntervalDefault = 250 * time.Millisecond

// Note is what a raise leaves for the next one: the last id the table had
// handed out, then the transactions inserting into it at that moment
// (their virtual transaction ids). The floor may rise past Last once all
// of those have ended; until then the raise gives the same note back.
type Note struct {
	Last      pgtype.Int8
	Inserters []string
}

// Raise raises a floor as far as note proves safe and returns the floor
// and the next note. A zero Note (NULLs) proves nothing: the first call
// only notes.
type Raise func(ctx context.Context, note Note) (floor int64, next Note, err error)

// AuditIntervalDefault is how often a Keeper audits its floor: often
// enough that a row left under the floor waits minutes, not hours.
const AuditIntervalDefault = 10 * time.Minute

// AuditBudget bounds an audit's scan (its statement_timeout). The scan
// reads the entries under the floor that vacuum has not removed: under a
// snapshot held open, those of every row ended since it began (ten
// minutes into a hold at 1,000 orders/s: 161,942 buffers and 28 s, which
// evicted the flow's pages from shared buffers). Otherwise it takes
// milliseconds. An audit out of budget gives up and runs again at the
// next interval.
const AuditBudget = time.Second

// Audit looks under a floor for a row still open, which no claim would
// find, lowers the floor to the oldest such row and returns its id, or 0
// when there is none. There should never be one; a dump restored with
// floors past its open rows, or a fault in the floors, leaves one.
type Audit func(ctx context.Context) (stranded int64, err error)

// Keeper raises one floor at every Interval until its context ends, and
// audits it at every AuditInterval, the first time at once. Any number of
// Keepers, in any number of processes, may raise and audit the same floor:
// each raise and each audit is safe on its own.
type Keeper struct {
	// Table names the floor's table in the logs.
	Table string
	// Raise is the statement that raises the floor.
	Raise Raise
	// Audit, when set, is the statement that audits the floor.
	Audit Audit
	// Interval defaults to IntervalDefault.
	Interval time.Duration
	// AuditInterval defaults to AuditIntervalDefault.
	AuditInterval time.Duration
	// Logger receives the failures, and each row an audit finds, as an
	// error.
	Logger *slog.Logger
}

// Run raises the floor until ctx ends. A failed raise is logged and tried
// again with backoff, with the note it had.
func (k *Keeper) Run(ctx context.Context) {
	interval := k.Interval
	if interval <= 0 {
		interval = IntervalDefault
	}
	logger := k.Logger
	if logger == nil {
		logger = slog.Default()
	}
	auditInterval := k.AuditInterval
	if auditInterval <= 0 {
		auditInterval = AuditIntervalDefault
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	failures := retry.Failures{Policy: retry.Transient}
	var note Note
	var audited time.Time
	for ctx.Err() == nil {
		_, next, err := k.Raise(ctx, note)
		if err != nil {
			if !failures.Wait(ctx, logger, "raising the claim floor failed", err) {
				return
			}
			continue
		}
		failures.Reset()
		note = next
		if k.Audit != nil && time.Since(audited) >= auditInterval {
			audited = time.Now()
			k.audit(ctx, logger)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// audit runs one audit and logs what it found. A failed audit is logged
// and runs again at the next AuditInterval: it never holds the raises up.
func (k *Keeper) audit(ctx context.Context, logger *slog.Logger) {
	stranded, err := k.Audit(ctx)
	var pgErr *pgconn.PgError
	switch {
	case err != nil && ctx.Err() != nil: // the keeper stops
	case errors.As(err, &pgErr) && pgErr.Code == "57014": // query_canceled: the statement_timeout
		logger.Info("the claim floor's audit gave up at its budget (most likely a snapshot held open keeps the entries it reads); it runs again at the next interval",
			slog.String("table", k.Table))
	case err != nil:
		logger.Warn("auditing the claim floor failed", slog.String("table", k.Table), slog.String("error", err.Error()))
	case stranded > 0:
		logger.Error("a row was open under the claim floor, where no claim looks: the floor is lowered to it",
			slog.String("table", k.Table), slog.Int64("id", stranded))
	}
}

// InboxAudit returns the Audit of the inbox's floor, through db, within
// budget (AuditBudget in the service).
func InboxAudit(db Beginner, budget time.Duration) Audit {
	return audit(db, budget, dbsqlc.New().InboxClaimFloorAudit)
}

// OutboxAudit returns the Audit of the outbox's floor, through db, within
// budget.
func OutboxAudit(db Beginner, budget time.Duration) Audit {
	return audit(db, budget, dbsqlc.New().OutboxClaimFloorAudit)
}

// Beginner begins transactions: a pool or a connection.
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// audit runs query in a READ COMMITTED transaction of its own (the audit
// takes a snapshot for each of its statements), whose statements time out
// after budget: the server cancels the scan, and the connection stays
// sound.
func audit(db Beginner, budget time.Duration, query func(context.Context, dbsqlc.DBTX) (int64, error)) Audit {
	return func(ctx context.Context) (stranded int64, err error) {
		err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			ms := strconv.FormatInt(max(budget.Milliseconds(), 1), 10) // 0 would turn the timeout off
			if _, err := tx.Exec(ctx, "SELECT set_config('statement_timeout', $1, true)", ms); err != nil {
				return err
			}
			stranded, err = query(ctx, tx)
			return err
		})
		return stranded, err
	}
}

// Inbox returns the Raise of the inbox's floor, through db.
func Inbox(db dbsqlc.DBTX) Raise {
	q := dbsqlc.New()
	return func(ctx context.Context, note Note) (int64, Note, error) {
		r, err := q.InboxClaimFloorRaise(ctx, db, dbsqlc.InboxClaimFloorRaiseParams{NotedLast: note.Last, NotedInserters: note.Inserters})
		return r.Floor, noted(r.NextLast, r.NextInserters), err
	}
}

// Outbox returns the Raise of the outbox's floor, through db.
func Outbox(db dbsqlc.DBTX) Raise {
	q := dbsqlc.New()
	return func(ctx context.Context, note Note) (int64, Note, error) {
		r, err := q.OutboxClaimFloorRaise(ctx, db, dbsqlc.OutboxClaimFloorRaiseParams{NotedLast: note.Last, NotedInserters: note.Inserters})
		return r.Floor, noted(r.NextLast, r.NextInserters), err
	}
}

func noted(last int64, inserters []string) Note {
	if inserters == nil {
		inserters = []string{} // none: not NULL, which would mean no note
	}
	return Note{Last: pgtype.Int8{Int64: last, Valid: true}, Inserters: inserters}
}

// DB is what a Keeper raises and audits its floor through: a pool.
type DB interface {
	dbsqlc.DBTX
	Beginner
}

// InboxKeeper returns the Keeper of the inbox's floor, raising and
// auditing it through db.
func InboxKeeper(db DB, logger *slog.Logger) *Keeper {
	return &Keeper{Table: "inbox", Raise: Inbox(db), Audit: InboxAudit(db, AuditBudget), Logger: logger}
}

// OutboxKeeper returns the Keeper of the outbox's floor, raising and
// auditing it through db.
func OutboxKeeper(db DB, logger *slog.Logger) *Keeper {
	return &Keeper{Table: "outbox", Raise: Outbox(db), Audit: OutboxAudit(db, AuditBudget), Logger: logger}
}
