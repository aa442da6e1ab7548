// Package leader elects, through PostgreSQL, the one process of a schema
// that runs the maintenance: the work every replica could do but one is
// enough for (the janitor, the claim floors' keepers, the stock fold) and
// the gauges read from the database, which would count each row once per
// replica if every replica exported them.
//
// The leader is the process whose session holds an advisory lock, one per
// schema. The lock goes with the session: when the leader dies, PostgreSQL
// ends its session at once; when it is frozen (a VM pause, SIGSTOP: its
// sockets stay open), the session stops pinging and PostgreSQL ends it
// after IdleLimit (idle_session_timeout). Another process takes the lock
// at its next try, every Interval. A process that loses its session stops
// its tasks before it tries again.
//
// The tasks are each safe to run in two processes at once (each of their
// statements is), so a leader that wakes from a freeze to find its session
// gone does no harm in the moments before it stops them.
package leader

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/retry"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// Interval is how often a process that does not lead tries to take the
// lead, and how often the leader pings its session.
const Interval = time.Second

// IdleLimit is the lock session's idle_session_timeout: a leader that stops
// pinging loses the lead this long after its last ping.
const IdleLimit = 5 * time.Second

// Elector takes the lead when it can and runs the tasks while it leads.
// The zero value is not usable: see New.
type Elector struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	held       atomic.Bool
}

// New returns an Elector whose session is opened with connConfig (its
// application_name names it in pg_stat_activity).
func New(connConfig *pgx.ConnConfig, logger *slog.Logger) *Elector {
	cc := connConfig.Copy()
	cc.RuntimeParams["idle_session_timeout"] = strconv.FormatInt(IdleLimit.Milliseconds(), 10)
	pgsession.CloseOnContextEnd(cc)
	return &Elector{connConfig: cc, logger: logger.With(slog.String("component", "leader"))}
}

// Held reports whether this process leads. It is safe on a nil Elector,
// which never leads.
func (e *Elector) Held() bool { return e != nil && e.held.Load() }

// Run tries to take the lead, and runs tasks while it leads, each until
// the lead is lost or ctx ends, until ctx ends. A task should return soon
// after its context ends: the lead is given up (or tried for again) only
// once every task has returned.
func (e *Elector) Run(ctx context.Context, tasks ...func(ctx context.Context)) {
	retry.Reconnect(ctx, retry.ReconnectConfig{
		Policy: retry.Policy{Base: retry.Session.Base, Max: Interval}, ResetAfter: retry.SessionResetAfter,
		Logger: e.logger, Message: "leader session ended; trying again",
	}, func(ctx context.Context) error {
		return e.session(ctx, tasks)
	})
}

// session opens the lock session and holds it until it fails or ctx ends,
// running tasks while it holds the lock.
func (e *Elector) session(ctx context.Context, tasks []func(context.Context)) error {
	conn, err := pgsession.Connect(ctx, e.connConfig)
	if err != nil {
		return err
	}
	defer pgsession.Close(ctx, conn)
	var wg sync.WaitGroup
	leadCtx, stop := context.WithCancel(ctx)
	defer func() {
		// Every task has returned before the session closes and the lock
		// goes to another process.
		stop()
		wg.Wait()
		if e.held.Swap(false) {
			e.logger.Info("this process no longer leads")
		}
	}()
	q := dbsqlc.New()
	tick := time.NewTicker(Interval)
	defer tick.Stop()
	for {
		if e.held.Load() {
			pingCtx, cancel := context.WithTimeout(ctx, Interval)
			err := conn.Ping(pingCtx)
			cancel()
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
		} else {
			held, err := q.LeaderTryLock(ctx, conn)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			if held {
				e.held.Store(true)
				e.logger.Info("this process leads: it runs the maintenance and exports the database gauges")
				for _, task := range tasks {
					wg.Go(startstop.Guard(func() { task(leadCtx) }))
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
