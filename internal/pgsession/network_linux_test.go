package pgsession_test

import (
	"context"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A session made with WatchNetwork watches its network at both ends: the
// client's socket has TCP keepalive and TCP_USER_TIMEOUT set, and the
// server's session the same through its tcp_* settings.
func TestSessionsWatchTheirNetworkAtBothEnds(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	pgsession.WatchNetwork(cc)
	conn, err := pgsession.Connect(t.Context(), cc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(t.Context())) })

	tcp, ok := conn.PgConn().Conn().(*net.TCPConn)
	require.True(t, ok, "a TCP connection (TEST_DATABASE_URL names a host)")
	raw, err := tcp.SyscallConn()
	require.NoError(t, err)
	opts := map[string]int{}
	require.NoError(t, raw.Control(func(fd uintptr) {
		for name, opt := range map[string][2]int{
			"SO_KEEPALIVE":     {unix.SOL_SOCKET, unix.SO_KEEPALIVE},
			"TCP_KEEPIDLE":     {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
			"TCP_KEEPINTVL":    {unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
			"TCP_KEEPCNT":      {unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
			"TCP_USER_TIMEOUT": {unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT},
		} {
			v, err := unix.GetsockoptInt(int(fd), opt[0], opt[1])
			require.NoError(t, err, name)
			opts[name] = v
		}
	}))
	require.Equal(t, map[string]int{
		"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 10000,
	}, opts, "the client's socket")

	var idle, interval, count, userTimeout string
	require.NoError(t, conn.QueryRow(t.Context(),
		"SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')").
		Scan(&idle, &interval, &count, &userTimeout))
	require.Equal(t, []string{"5", "2", "3", "10000"}, []string{idle, interval, count, userTimeout}, "the server's end")
}
