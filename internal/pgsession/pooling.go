package pgsession

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/startstop"
)

// Pooling is how the server sessions behind a client connection are lent
// to it.
type Pooling int

const (
	// PooledPerSession: the client connection keeps one server session for
	// as long as it lives (a direct connection, or a pooler's session
	// pooling). What a session holds (LISTEN, session-level advisory locks,
	// settings, prepared statements) stays with the client that made it.
	PooledPerSession Pooling = iota
	// PooledPerTransaction: the client connection may be given another
	// server session at any transaction or statement (PgBouncer's
	// pool_mode=transaction or statement), and the one it leaves goes to
	// other clients with what it holds.
	PooledPerTransaction
)

// String returns "session" or "transaction".
func (p Pooling) String() string {
	if p == PooledPerTransaction {
		return "transaction"
	}
	return "session"
}

// Limits of DetectPooling.
const (
	// PoolingProbeRounds is how many rounds DetectPooling runs before it
	// answers PooledPerSession.
	PoolingProbeRounds = 4
	// PoolingProbeTimeout bounds one attempt of DetectPooling: its two
	// connections and its rounds. An attempt that overruns it is tried
	// again with new connections, PoolingProbeAttempts times in all.
	PoolingProbeTimeout = 5 * time.Second
	// PoolingProbeAttempts is how many attempts DetectPooling makes before
	// it gives up on a probe that keeps overrunning PoolingProbeTimeout.
	PoolingProbeAttempts = 3
)

// probeSetting is the custom setting that carries a probe's token.
const probeSetting = "inboxd.pooling_probe"

// DetectPooling tells how the server sessions behind connections made with
// cc are lent: PooledPerSession for a direct connection or session pooling,
// PooledPerTransaction for PgBouncer's transaction or statement pooling (or
// any pooler that may give a client another server session between its
// statements). It looks at what the connections do, not at names.
//
// It opens two connections of cc, A and B (pgx.Conn, with the session
// settings set after connecting, as SetAfterConnect does), each statement
// in the simple protocol, one implicit transaction, as a pooler in
// statement mode allows. Then, each round:
//
//  1. A sets a new random token in a custom setting, for the session:
//     set_config('inboxd.pooling_probe', token, false);
//  2. B reads that setting;
//  3. A reads it, twice.
//
// A session-level setting is visible to the session that set it, and to no
// other. With a server session of its own, A reads its token each time and
// B never sees it, whatever else runs on the server: no round can answer
// PooledPerTransaction on a direct connection or in session pooling, and
// none that sees B read A's token, or A miss its own, can answer anything
// else. Each statement is a transaction of its own, after which a pooler
// per transaction takes the server session back:
//
//   - one that hands out its idle server sessions last in, first out
//     (PgBouncer's default, server_round_robin=0) gives B the server
//     session A just left, and B reads A's token;
//   - one that hands them out in turn (server_round_robin=1) gives B the
//     only idle one, A's, or, with two idle or more, gives A's two reads
//     in a row two different sessions, and one of them lacks A's token
//     (with two idle and one read, B and A would take turns on the same
//     two sessions, each on its own, round after round);
//   - one that resets the session it takes back (server_reset_query_always)
//     leaves no token for A to read.
//
// Other clients of the pooler may take a server session between two steps
// and hide the change for a round; the rounds are repeated
// (PoolingProbeRounds) to give them less chance. Tokens, not backend pids,
// tell the server sessions apart: a pooler in front of several servers may
// show two sessions with one pid, never two with one random token. A
// setting changed in a SELECT, not by SET, is one a pooler that replays
// its clients' SET commands on each server session it lends does not
// replay. In transaction pooling, the tokens stay on the server sessions
// A used, as a custom setting that nothing reads.
//
// B reads in no transaction of its own: statement pooling refuses a
// transaction of two statements. A statement that waits for a server
// session (a pool whose every session is busy) makes the attempt overrun
// PoolingProbeTimeout; a wait is no proof of pooling, so the attempt is
// made again with new connections, PoolingProbeAttempts times in all,
// after which DetectPooling returns the last attempt's error. Any other
// error (a connection refused, a statement's) it returns at once, wrapped
// (a *pgconn.PgError stays reachable with errors.As).
//
// On a direct connection it costs two connections and four statements a
// round; the rounds end at the first sign of pooling per transaction.
func DetectPooling(ctx context.Context, cc *pgx.ConnConfig) (Pooling, error) {
	var err error
	for range PoolingProbeAttempts {
		attemptCtx, cancel := context.WithTimeout(ctx, PoolingProbeTimeout)
		var p Pooling
		p, err = probePooling(attemptCtx, cc)
		overran := errors.Is(attemptCtx.Err(), context.DeadlineExceeded)
		cancel()
		if err == nil || !overran || ctx.Err() != nil {
			return p, err
		}
	}
	return PooledPerSession, fmt.Errorf("the probe overran %s %d times: %w", PoolingProbeTimeout, PoolingProbeAttempts, err)
}

// probePooling is one attempt of DetectPooling.
func probePooling(ctx context.Context, cc *pgx.ConnConfig) (Pooling, error) {
	cc = cc.Copy()
	cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	// pgx runs the simple protocol only in UTF8, which a database of
	// another encoding (SQL_ASCII, the default of a cluster made with the
	// C locale) does not report unless asked; a pooler passes it on.
	cc.RuntimeParams["client_encoding"] = "UTF8"
	// The two connect at once: a connection costs more than every
	// statement of the probe.
	var a, b *pgx.Conn
	var errA, errB error
	var wg sync.WaitGroup
	wg.Go(startstop.Guard(func() { a, errA = Connect(ctx, cc) }))
	b, errB = Connect(ctx, cc)
	wg.Wait()
	for _, conn := range []*pgx.Conn{a, b} {
		if conn != nil {
			defer Close(ctx, conn)
		}
	}
	if err := cmp.Or(errA, errB); err != nil {
		return PooledPerSession, fmt.Errorf("connect: %w", err)
	}

	read := func(conn *pgx.Conn) (string, error) {
		var v string
		err := conn.QueryRow(ctx, "SELECT coalesce(current_setting($1, true), '')", probeSetting).Scan(&v)
		return v, err
	}
	for range PoolingProbeRounds {
		token := rand.Text()
		if _, err := a.Exec(ctx, "SELECT set_config($1, $2, false)", probeSetting, token); err != nil {
			return PooledPerSession, fmt.Errorf("set the probe's setting: %w", err)
		}
		seen, err := read(b)
		if err != nil {
			return PooledPerSession, fmt.Errorf("read the probe's setting in the second session: %w", err)
		}
		if seen == token {
			return PooledPerTransaction, nil
		}
		for range 2 {
			seen, err := read(a)
			if err != nil {
				return PooledPerSession, fmt.Errorf("read the probe's setting back: %w", err)
			}
			if seen != token {
				return PooledPerTransaction, nil
			}
		}
	}
	return PooledPerSession, nil
}
