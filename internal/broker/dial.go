package broker

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// HeartbeatDefault is the AMQP heartbeat interval of ingest's and the
// relay's connections.
const HeartbeatDefault = 10 * time.Second

// Dial opens a connection to the broker at url, named name in the broker's
// tools, with heartbeat (0 takes the broker's suggestion) detecting half-open
// links, a 10-second bound on connecting, and WriteTimeout on every write.
// url may list the nodes of a cluster (see Nodes): each call tries them in
// turn, from the one after where the previous call in this process
// started, so that a connection lost with its node is made again on
// another, and the process's connections spread over the nodes.
func Dial(url, name string, heartbeat time.Duration) (*amqp.Connection, error) {
	nodes := Nodes(url)
	first := int(dials.Add(1) % uint64(len(nodes)))
	var errs []error
	for n := range nodes {
		node := nodes[(first+n)%len(nodes)]
		conn, err := amqp.DialConfig(node, amqp.Config{
			Heartbeat:  heartbeat,
			Locale:     "en_US",
			Dial:       dialWithWriteTimeout(10*time.Second, WriteTimeout),
			Properties: amqp.Table{"connection_name": name},
		})
		if err == nil {
			return conn, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", nodeAddress(node), err))
	}
	if len(errs) == 1 {
		return nil, fmt.Errorf("connect to broker: %w", errors.Unwrap(errs[0]))
	}
	return nil, fmt.Errorf("connect to broker, tried %d nodes: %w", len(nodes), errors.Join(errs...))
}

// dials counts the process's Dial calls: each starts at the next node.
var dials atomic.Uint64

// Nodes splits an AMQP_URL into the URLs of the nodes it lists: one URL,
// or several separated by commas, each beginning amqp:// or amqps:// (a
// comma not followed by a scheme belongs to the URL before it, as one in a
// password may).
func Nodes(url string) []string {
	var nodes []string
	for _, part := range strings.Split(url, ",") {
		trimmed := strings.TrimSpace(part)
		isNode := strings.HasPrefix(trimmed, "amqp://") || strings.HasPrefix(trimmed, "amqps://")
		if len(nodes) == 0 || isNode {
			nodes = append(nodes, trimmed)
			continue
		}
		nodes[len(nodes)-1] += "," + part
	}
	return nodes
}

// nodeAddress is a node URL's host and port, for errors: never its
// credentials.
func nodeAddress(node string) string {
	u, err := amqp.ParseURI(node)
	if err != nil {
		return "a node whose URL does not parse"
	}
	return net.JoinHostPort(u.Host, strconv.Itoa(u.Port))
}

// CloseHard closes conns within half a second, whether the broker answers
// or not: a connection it blocks (memory or disk alarm) never answers a
// graceful close. Services call it once their grace period is over.
func CloseHard(conns ...*amqp.Connection) {
	deadline := time.Now().Add(500 * time.Millisecond)
	for _, c := range conns {
		_ = c.CloseDeadline(deadline)
	}
}

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
