package broker

import (
	"cmp"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A peer that stops reading (as a broker does with a connection it blocks)
// fails the write that fills the socket once its timeout passes, instead of
// holding it until the peer reads again.
func TestAWriteToAPeerThatStopsReadingTimesOut(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c // never read
		}
	}()
	c, err := dialWithWriteTimeout(time.Second, 200*time.Millisecond)("tcp", l.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	defer func() { (<-accepted).Close() }()
	// As amqp091-go does once the connection is open: the handshake's
	// deadline is cleared.
	require.NoError(t, c.SetDeadline(time.Time{}))

	chunk := make([]byte, 1<<20)
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := c.Write(chunk); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		require.True(t, errors.Is(err, os.ErrDeadlineExceeded), "%v", err)
	case <-time.After(time.Minute):
		t.Fatal("the write is still waiting on a peer that does not read")
	}
}

func TestNodes(t *testing.T) {
	t.Parallel()
	for in, want := range map[string][]string{
		"amqp://u:p@a:5672/":                      {"amqp://u:p@a:5672/"},
		"amqp://u:p@a:5672/, amqps://u:p@b:5671/": {"amqp://u:p@a:5672/", "amqps://u:p@b:5671/"},
		"amqp://u:p,q@a/,amqp://u:p,q@b/":         {"amqp://u:p,q@a/", "amqp://u:p,q@b/"},
	} {
		require.Equal(t, want, Nodes(in), in)
	}
}

// Dial tries the nodes in turn: with the first one listed down, it
// connects to the next, and each call starts at another node.
func TestDialTriesEveryNode(t *testing.T) {
	t.Parallel()
	live := cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	down := "amqp://guest:guest@" + l.Addr().String() + "/"
	require.NoError(t, l.Close()) // nothing listens there now
	for range 3 {
		conn, err := Dial(down+","+live, "inboxd test", 0)
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	}
	_, err = Dial(down+","+down, "inboxd test", 0)
	require.ErrorContains(t, err, "tried 2 nodes")
	require.NotContains(t, err.Error(), "guest:guest", "no credentials in the error")
}
