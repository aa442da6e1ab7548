package inbox

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// liveness tells other processes that this one is alive, through the
// database: while it runs, a session of its own holds a session key
// (pgsession.SessionKey) that its claims carry (inbox.claimed_session).
// When the process dies, PostgreSQL ends that session and the key is live
// no more: other workers take the claims over at once, instead of waiting
// for the claim lease, which only covers claims whose process's liveness
// is unknown. A process that is frozen rather than dead stops pinging the
// session, and PostgreSQL ends it after livenessIdleLimit.
type liveness struct {
	key *pgsession.SessionKey
	// first is closed once the key is held for the first time.
	first     chan struct{}
	firstOnce sync.Once
}

func newLiveness() *liveness {
	return &liveness{key: pgsession.NewSessionKey(), first: make(chan struct{})}
}

// waitFirst waits until the key has been held once, for at most limit, or
// until ctx ends. The worker claims only then: a claim taken before carries
// no key, so it is taken over once its lease ends, while the process still
// handles it (a slow batch, taken over, spent a second attempt), and only
// then if the process dies. Past limit (no session to be had) the claims
// go on, covered by the lease alone.
func (l *liveness) waitFirst(ctx context.Context, limit time.Duration) {
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case <-l.first:
	case <-t.C:
	case <-ctx.Done():
	}
}

// session returns the key claims should carry: 0, for none, while the lock
// is not held (before the first connection, or between two).
func (l *liveness) session() int64 { return l.key.Held() }

// livenessPing is how often the liveness session checks its connection,
// and how long a check may take. Between a check and the next, a connection
// the server ended (a terminated backend) goes unnoticed: claims taken
// meanwhile carry a key nobody holds, and are taken over at once, each
// costing an attempt.
const livenessPing = time.Second

// livenessIdleLimit is the liveness session's idle_session_timeout: a
// process that stops pinging (frozen by SIGSTOP, a VM pause, a stuck node,
// whose sockets stay open) loses the session, and its claims are taken
// over, this long after its last ping. A dead process loses it at once.
const livenessIdleLimit = 5 * time.Second

// hold takes the lock on a connection of its own, made from config (as
// "<application_name> liveness"), and keeps it until ctx ends, connecting
// again whenever the connection fails.
func (l *liveness) hold(ctx context.Context, config *pgx.ConnConfig, logger *slog.Logger) {
	config = config.Copy()
	config.RuntimeParams["application_name"] += " liveness"
	config.RuntimeParams["idle_session_timeout"] = strconv.FormatInt(livenessIdleLimit.Milliseconds(), 10)
	pgsession.CloseOnContextEnd(config)
	retry.Reconnect(ctx, retry.ReconnectConfig{
		ResetAfter: retry.SessionResetAfter,
		Logger:     logger, Message: "liveness session ended, reconnecting; until then, new claims wait for the lease, and those taken under the lost session are taken over by others",
	}, func(ctx context.Context) error {
		conn, err := pgsession.Connect(ctx, config)
		if err != nil {
			return err
		}
		defer pgsession.Close(ctx, conn)
		if err := l.key.Take(ctx, conn); err != nil {
			return err
		}
		defer l.key.Release()
		l.firstOnce.Do(func() { close(l.first) })
		tick := time.NewTicker(livenessPing)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
				pingCtx, cancel := context.WithTimeout(ctx, livenessPing)
				err := conn.Ping(pingCtx)
				cancel()
				if err != nil && ctx.Err() == nil {
					return err
				}
			}
		}
	})
}
