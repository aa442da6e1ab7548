// Package leader elects, through PostgreSQL, the one process of a schema
// that runs the maintenance: the work every replica could do but one is
// enough for (the janitor, the claim floors' keepers, the stock fold) and
// the gauges read from the database, which would count each row once per
// replica if every replica exported them.
//
// The leader is the process whose session key (pgsession.SessionKey) the
// schema's inbox_leader row names. The key is live while the process's
// leader session holds it: when the leader dies, PostgreSQL ends its
// session at once; when it is frozen (a VM pause, SIGSTOP: its sockets
// stay open), the session stops pinging and PostgreSQL ends it after
// IdleLimit (idle_session_timeout). Another process takes the row over at
// its next try, every Interval. A process that loses its session stops its
// tasks before it tries again. Only the service's roles may write the
// row: no other login of the database can take the lead, or hold it.
//
// The tasks are each safe to run in two processes at once (each of their
// statements is), so a leader that wakes from a freeze to find its session
// gone does no harm in the moments before it stops them.
package leader

import (
	"context"
	"errors"
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
	key        *pgsession.SessionKey
	held       atomic.Bool
}

// New returns an Elector whose session is opened with connConfig (its
// application_name names it in pg_stat_activity).
func New(connConfig *pgx.ConnConfig, logger *slog.Logger) *Elector {
	cc := connConfig.Copy()
	cc.RuntimeParams["idle_session_timeout"] = strconv.FormatInt(IdleLimit.Milliseconds(), 10)
	pgsession.CloseOnContextEnd(cc)
	return &Elector{connConfig: cc, logger: logger.With(slog.String("component", "leader")), key: pgsession.NewSessionKey()}
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

// session opens the leader session, takes the session key and tries for
// the lead every Interval (the leader's try is its ping), until the session
// fails or ctx ends, running tasks while it leads.
func (e *Elector) session(ctx context.Context, tasks []func(context.Context)) error {
	conn, err := pgsession.Connect(ctx, e.connConfig)
	if err != nil {
		return err
	}
	defer pgsession.Close(ctx, conn)
	if err := e.key.Take(ctx, conn); err != nil {
		return err
	}
	defer e.key.Release()
	var wg sync.WaitGroup
	leadCtx, stop := context.WithCancel(ctx)
	defer func() {
		// Every task has returned before the session closes and the lead
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
		tryCtx, cancel := context.WithTimeout(ctx, Interval)
		leads, err := q.LeaderTake(tryCtx, conn, e.key.Key())
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			return err
		case leads && !e.held.Load():
			e.held.Store(true)
			e.logger.Info("this process leads: it runs the maintenance and exports the database gauges")
			for _, task := range tasks {
				wg.Go(startstop.Guard(func() { task(leadCtx) }))
			}
		case !leads && e.held.Load():
			// Only if the key stopped being live while the session held
			// it, which PostgreSQL does not do: stop, and start again.
			return errors.New("another process took the lead while this one held it")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
