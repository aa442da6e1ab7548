package broker

import (
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
