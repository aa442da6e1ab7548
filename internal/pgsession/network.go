package pgsession

import (
	"context"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Keepalive bounds how long a connection whose network has gone silent
// (packets lost, nothing refused: a partition, a peer's host gone) stays
// open at either end. TCP probes an idle connection after KeepaliveIdle,
// every KeepaliveInterval, and gives up after KeepaliveCount probes
// unanswered; UserTimeout gives up on data sent and not acknowledged for
// that long (where a probe is not sent, as data is in flight). Without
// them, a silent network goes unnoticed for the kernel's defaults: two
// hours idle, some fifteen minutes with data in flight.
const (
	KeepaliveIdle     = 5 * time.Second
	KeepaliveInterval = 2 * time.Second
	KeepaliveCount    = 3
	UserTimeout       = 10 * time.Second
)

// WatchNetwork sets up cc so that both ends of each of its connections
// notice a silent network within seconds: its TCP connections are dialled
// with the keepalive and user timeout above (the client's end), and the
// server is asked for the same on its end, through the session settings
// tcp_keepalives_idle, tcp_keepalives_interval, tcp_keepalives_count and
// tcp_user_timeout (set once the session is up, as the others are: see
// SetAfterConnect). A server that ends the session then drops its locks
// and its transaction at once. Connections over a Unix socket are
// dialled as before.
func WatchNetwork(cc *pgx.ConnConfig) {
	d := &net.Dialer{
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: KeepaliveIdle, Interval: KeepaliveInterval, Count: KeepaliveCount},
		Control: func(network, _ string, c syscall.RawConn) error {
			if !strings.HasPrefix(network, "tcp") {
				return nil
			}
			var err error
			if cerr := c.Control(func(fd uintptr) { err = setUserTimeout(fd, UserTimeout) }); cerr != nil {
				return cerr
			}
			return err
		},
	}
	cc.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		return d.DialContext(ctx, network, addr)
	}
	cc.RuntimeParams["tcp_keepalives_idle"] = strconv.Itoa(int(KeepaliveIdle.Seconds()))
	cc.RuntimeParams["tcp_keepalives_interval"] = strconv.Itoa(int(KeepaliveInterval.Seconds()))
	cc.RuntimeParams["tcp_keepalives_count"] = strconv.Itoa(KeepaliveCount)
	cc.RuntimeParams["tcp_user_timeout"] = strconv.FormatInt(UserTimeout.Milliseconds(), 10)
}
