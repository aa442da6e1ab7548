// Package claimfloor keeps a claim floor: the id under which no row of a
// table can be claimed any more, where the claims of that table start their
// scans. Without it, a snapshot held open for minutes (an analytics query,
// pg_dump, a standby with hot_standby_feedback) leaves every claim wading
// through the index entries of every row ended since, which vacuum may not
// remove. migrations/00003_claim_floors.sql keeps the floors in sequences,
// with what must hold for every writer (the floor lock, and the replay
// triggers that lower a floor); this package raises and audits them, with
// the statements of queries/claimfloor.sql.
//
// A Keeper raises a floor only as far as this proves safe:
//
//   - Rows take their ids when inserted but commit in another order. Every
//     statement that writes a table takes its ROW EXCLUSIVE lock before it
//     runs, so before any of its rows takes an id, and holds it until its
//     transaction ends. A raise notes the last id handed out (the id
//     sequences hand them out one at a time), then the transactions holding
//     that lock in this database (the table's writers, from pg_locks). Once
//     none of those holds it any more, every row up to the noted id is
//     committed or gone, and the oldest one still open is the new floor;
//     until then the note is kept. So the floor trails by a round of the
//     keeper, and a transaction that writes the table and stays open holds
//     the floor until it ends.
//   - Only a snapshot taken after those transactions ended sees what they
//     committed. So a raise runs under READ COMMITTED (it begins its
//     transaction at that level, whatever the session's default), where
//     each statement takes a snapshot of its own, and scans for the oldest
//     open row in a statement after the one that found the writers gone.
//   - A replay makes an ended row claimable again. A trigger lowers the
//     floor to its row, holding the table's floor lock (its row of
//     claim_floor_locks) until its transaction ends; a raise moves the floor
//     only while holding the same lock, which it takes without waiting (a
//     raise that finds it held tries again at the next round), then reads
//     the floor again, and scans in a statement after that: a replay that
//     lowered the floor before has committed, and the scan sees its row
//     open, from the floor it set; a replay after waits for the raise to
//     commit and lowers the floor from where the raise left it.
//   - An audit finds any row left open under a floor and lowers the floor
//     to it (see Audit).
//
// Both locks are locks only the service's roles can take: a table's ROW
// EXCLUSIVE lock needs a right to write it, a row lock a right to update
// it. Advisory locks are one namespace for every login of the database,
// and pg_locks shows their keys to all: any login could have held one and
// stalled every insert, or every raise. Waiting for every writer, not only
// inserters, costs a floor a round at most: a writer that stays open (a
// relay waiting for confirms, an operator's open UPDATE) holds it back as
// an inserter that stays open does.
//
// The floor only ever makes a scan shorter: with no keeper running it
// stays where it is and the claims read from there. Each scan here reads
// the table's index of open rows (inbox_pending_idx, outbox_open_idx)
// within its bounds, with or without statistics
// (TestTheKeepersStatementsReadOnlyOpenRows).
package claimfloor

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// IntervalDefault is how often a Keeper raises its floor. The floor trails
// the table by about two intervals, so a claim scans past at most that
// much of the table's ended rows.
const IntervalDefault = 250 * time.Millisecond

// Note is what a raise leaves for the next one: the last id the table had
// handed out, then the transactions writing it at that moment (their
// virtual transaction ids). The floor may rise past that id once none of
// those writes the table any more; until then the raise gives the same
// note back.
type Note struct {
	taken   bool
	last    int64
	writers []string
}

// Raise raises a floor as far as note proves safe and returns the floor
// and the next note. A zero Note proves nothing: the first call only
// notes.
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
// when there is none. There should never be one (a replay lowers the floor
// itself); a dump restored with floors past rows it restores as open
// (pg_dump reads sequences outside its snapshot), or a fault in the
// floors, leaves one.
//
// Its scan reads the ended rows' entries under the floor that vacuum has
// not removed, which under a snapshot held open can take many seconds. So
// the scan takes no lock and the raises go on meanwhile (AuditBudget
// bounds it). A row found was open under the floor read before the scan's
// snapshot, and only a replay committed in between lowers the floor to it
// itself; so the row is checked again under the floor lock (which a replay
// holds until it commits), with a snapshot taken after it: still open, and
// still under the floor.
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

// Beginner begins transactions: a pool or a connection.
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// DB is what a Keeper raises and audits its floor through: a pool.
type DB interface {
	dbsqlc.DBTX
	Beginner
}

var q = dbsqlc.New()

// table is a table with a floor: its name, its floor's sequence, and its
// scans, which differ by what an open row is.
type table struct {
	name, seq string
	// raise sets the floor to the oldest open row from from to last, or
	// past last when there is none, and returns it.
	raise func(ctx context.Context, db dbsqlc.DBTX, from, last int64) (int64, error)
	// stranded returns the oldest open row under floor, or 0.
	stranded func(ctx context.Context, db dbsqlc.DBTX, floor int64) (int64, error)
	// still says whether row id is open and under the floor.
	still func(ctx context.Context, db dbsqlc.DBTX, id int64) (bool, error)
}

var inbox = table{
	name: "inbox", seq: "inbox_claim_floor_seq",
	raise: func(ctx context.Context, db dbsqlc.DBTX, from, last int64) (int64, error) {
		return q.InboxClaimFloorRaise(ctx, db, dbsqlc.InboxClaimFloorRaiseParams{FromID: from, NotedLast: last})
	},
	stranded: q.InboxClaimFloorStranded,
	still:    q.InboxClaimFloorStillStranded,
}

var outbox = table{
	name: "outbox", seq: "outbox_claim_floor_seq",
	raise: func(ctx context.Context, db dbsqlc.DBTX, from, last int64) (int64, error) {
		return q.OutboxClaimFloorRaise(ctx, db, dbsqlc.OutboxClaimFloorRaiseParams{FromID: from, NotedLast: last})
	},
	stranded: q.OutboxClaimFloorStranded,
	still:    q.OutboxClaimFloorStillStranded,
}

// Inbox returns the Raise of the inbox's floor, through db: every pending
// message has an id at least the floor.
func Inbox(db DB) Raise { return inbox.raiser(db) }

// Outbox returns the Raise of the outbox's floor, through db: every row
// neither published nor dead has an id at least the floor.
func Outbox(db DB) Raise { return outbox.raiser(db) }

// raiser returns the Raise of t's floor (see the package's comment for why
// each step is there).
func (t table) raiser(db DB) Raise {
	return func(ctx context.Context, note Note) (int64, Note, error) {
		now, err := q.ClaimFloorState(ctx, db, dbsqlc.ClaimFloorStateParams{Seq: t.seq, Tbl: t.name})
		if err != nil {
			return 0, note, err
		}
		if note.last > now.LastID {
			note = Note{} // taken on another server, before a failover
		}
		floor := now.Floor
		if note.taken {
			kept := false
			err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
				taken, err := q.ClaimFloorTake(ctx, tx, dbsqlc.ClaimFloorTakeParams{Tbl: t.name, NotedWriters: note.writers})
				if err != nil || !taken {
					kept = true
					return err
				}
				// Read under the lock: a replay that lowered the floor has committed.
				under, err := q.ClaimFloorState(ctx, tx, dbsqlc.ClaimFloorStateParams{Seq: t.seq, Tbl: t.name})
				if err != nil {
					return err
				}
				floor = under.Floor
				if note.last < floor {
					return nil // raised past the note already
				}
				// A new statement, so a new snapshot: it sees every row up to
				// note.last committed or gone, and every replay's row open.
				floor, err = t.raise(ctx, tx, floor, note.last)
				return err
			})
			if err != nil {
				return 0, note, err
			}
			if kept {
				return floor, note, nil
			}
		}
		// The last id handed out (read above), then the transactions writing
		// now: each took the table's lock before its rows took their ids.
		writers, err := q.ClaimFloorWriters(ctx, db, t.name)
		if err != nil {
			return 0, note, err
		}
		if writers == nil {
			writers = []string{}
		}
		return floor, Note{taken: true, last: now.LastID, writers: writers}, nil
	}
}

// InboxAudit returns the Audit of the inbox's floor, through db, within
// budget (AuditBudget in the service).
func InboxAudit(db Beginner, budget time.Duration) Audit { return inbox.auditor(db, budget) }

// OutboxAudit returns the Audit of the outbox's floor, through db, within
// budget.
func OutboxAudit(db Beginner, budget time.Duration) Audit { return outbox.auditor(db, budget) }

// auditor returns the Audit of t's floor. It runs in a READ COMMITTED
// transaction of its own (each of its statements takes a snapshot of its
// own), whose statements time out after budget: the server cancels the
// scan, and the connection stays sound.
func (t table) auditor(db Beginner, budget time.Duration) Audit {
	return func(ctx context.Context) (stranded int64, err error) {
		err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			ms := strconv.FormatInt(max(budget.Milliseconds(), 1), 10) // 0 would turn the timeout off
			if _, err := tx.Exec(ctx, "SELECT set_config('statement_timeout', $1, true)", ms); err != nil {
				return err
			}
			now, err := q.ClaimFloorState(ctx, tx, dbsqlc.ClaimFloorStateParams{Seq: t.seq, Tbl: t.name})
			if err != nil {
				return err
			}
			// A new statement, so a snapshot taken after the floor was read.
			found, err := t.stranded(ctx, tx, now.Floor)
			if err != nil || found == 0 {
				return err
			}
			if err := q.ClaimFloorLockWait(ctx, tx, t.name); err != nil {
				return err
			}
			// A snapshot taken under the lock: a replay of the row has
			// committed, and lowered the floor to it.
			still, err := t.still(ctx, tx, found)
			if err != nil || !still {
				return err
			}
			if err := q.ClaimFloorLower(ctx, tx, dbsqlc.ClaimFloorLowerParams{Tbl: t.name, ID: found}); err != nil {
				return err
			}
			stranded = found
			return nil
		})
		return stranded, err
	}
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
