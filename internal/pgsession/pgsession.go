// Package pgsession connects the service's sessions so that they work
// through a connection pooler: the session settings inboxd chooses (its
// timeouts, synchronous_commit, the search_path of DATABASE_URL, …) are set
// by a statement once the session is up, not sent in the startup message,
// where PgBouncer refuses every parameter it does not track.
package pgsession

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
)

// startupParams are the settings a connection pooler such as PgBouncer
// accepts in the startup message (it tracks them for each client and sets
// them on the server connection it lends): they stay there. PgBouncer
// refuses any other with "unsupported startup parameter" (08P01).
var startupParams = map[string]bool{
	"application_name":            true,
	"client_encoding":             true,
	"datestyle":                   true,
	"timezone":                    true,
	"standard_conforming_strings": true,
}

// SetAfterConnect moves the session settings of cc.RuntimeParams (the
// timeouts, synchronous_commit, search_path, …) but those a pooler tracks
// (startupParams) out of the startup message and into one statement run as
// soon as the session is up, before cc's own AfterConnect: each is set with
// set_config(name, value, false), which takes a value as the startup
// message does, so every session has the same settings either way, and
// they override the role's and the database's defaults the same way. This
// is what lets inboxd connect through PgBouncer (session pooling).
//
// Call it on the config of each connection just before connecting (a
// pool's BeforeConnect, or before pgx.ConnectConfig): settings added to
// cc.RuntimeParams afterwards are sent at startup again. Calling it again
// moves those too.
func SetAfterConnect(cc *pgx.ConnConfig) {
	var names []string
	for name := range cc.RuntimeParams {
		if !startupParams[strings.ToLower(name)] {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return
	}
	slices.Sort(names)
	var sql strings.Builder
	args := make([][]byte, 0, 2*len(names))
	sql.WriteString("SELECT ")
	for i, name := range names {
		if i > 0 {
			sql.WriteString(", ")
		}
		fmt.Fprintf(&sql, "set_config($%d, $%d, false)", 2*i+1, 2*i+2)
		args = append(args, []byte(name), []byte(cc.RuntimeParams[name]))
		delete(cc.RuntimeParams, name)
	}
	query := sql.String()
	then := cc.AfterConnect
	cc.AfterConnect = func(ctx context.Context, conn *pgconn.PgConn) error {
		if _, err := conn.ExecParams(ctx, query, args, nil, nil, nil).Close(); err != nil {
			return fmt.Errorf("set the session's settings (%s): %w", strings.Join(names, ", "), err)
		}
		if then != nil {
			return then(ctx, conn)
		}
		return nil
	}
}

// Connect connects with a copy of cc whose session settings are set after
// connecting (SetAfterConnect).
func Connect(ctx context.Context, cc *pgx.ConnConfig) (*pgx.Conn, error) {
	cc = cc.Copy()
	SetAfterConnect(cc)
	return pgx.ConnectConfig(ctx, cc)
}

// SetAfterConnectInPool makes every connection of a pool made with pc set
// its session settings after connecting (SetAfterConnect), whatever its
// RuntimeParams hold when it connects.
func SetAfterConnectInPool(pc *pgxpool.Config) {
	before := pc.BeforeConnect
	pc.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		if before != nil {
			if err := before(ctx, cc); err != nil {
				return err
			}
		}
		SetAfterConnect(cc)
		return nil
	}
}

// CloseOnContextEnd makes a context that ends during a query close cc's
// connection (pgx's deadline handler) instead of sending the server a
// cancel request: for a session that waits idle, as a lock holder does,
// which a cancel would not reach. Closing it ends the session, and with it
// the locks it holds, at once.
func CloseOnContextEnd(cc *pgx.ConnConfig) {
	cc.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
}

// Close closes conn, waiting at most a second for the server to hear of
// it, even when ctx has ended: for a deferred close.
func Close(ctx context.Context, conn *pgx.Conn) {
	closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = conn.Close(closeCtx)
}
