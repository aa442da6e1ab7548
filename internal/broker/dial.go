package broker

import (
	"net"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// WriteTimeout bounds every write to the broker's socket. A broker that
// blocks a connection (a memory or disk alarm) stops reading from it, and
// a write begun just before the connection.blocked notice arrives, or
// without one, would wait on the full socket until the alarm clears,
// holding whatever its caller holds meanwhile (the relay: its claiming
// transaction, with its row locks and its snapshot). Past WriteTimeout the
// write fails, the connection is closed and its session ends, and the
// caller connects again. A broker that reads keeps no write waiting
// anywhere near as long.
const WriteTimeout = 10 * time.Second

// dialWithWriteTimeout is amqp.DefaultDial(connectTimeout) whose
// connections give every write writeTimeout to complete.
func dialWithWriteTimeout(connectTimeout, writeTimeout time.Duration) func(network, addr string) (net.Conn, error) {
	dial := amqp.DefaultDial(connectTimeout)
	return func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		return &writeTimeoutConn{Conn: c, timeout: writeTimeout}, nil
	}
}

// writeTimeoutConn is a net.Conn whose every Write has a deadline of its
// own. amqp091-go writes one frame at a time under its own lock, so the
// deadline is never shared by two writes.
type writeTimeoutConn struct {
	net.Conn
	timeout time.Duration
}

func (c *writeTimeoutConn) Write(b []byte) (int, error) {
	if err := c.Conn.SetWriteDeadline(time.Now().Add(c.timeout)); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}
