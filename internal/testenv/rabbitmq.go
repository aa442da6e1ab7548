package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
	"github.com/orderconfirm/inboxd/internal/sandbox"
)

// Broker is a RabbitMQ virtual host of its own for one test.
type Broker struct {
	// Vhost is the virtual host's name.
	Vhost string
	// URL connects to the virtual host.
	URL string

	admin  *rabbitadmin.Client
	closed map[string]bool // connections CloseConnections closed already
}

// NewBroker creates a virtual host, grants the test user every permission on
// it, and deletes it (with its queues and exchanges) when the test ends.
func NewBroker(tb testing.TB) *Broker {
	tb.Helper()
	s := getServers(tb)
	ctx := context.WithoutCancel(tb.Context())
	vhost := uniqueName()

	vhostURL, drop, err := sandbox.CreateVhost(ctx, s.admin, s.amqpURL, vhost)
	require.NoError(tb, err)
	tb.Cleanup(drop)
	return &Broker{Vhost: vhost, URL: vhostURL, admin: s.admin, closed: map[string]bool{}}
}

// NewUser creates a broker user of the test's own, with every permission
// on its virtual host, deleted when the test ends, and returns a URL that
// connects to the virtual host as that user: a second producer, whose
// AMQP user_id the broker checks against its connection.
func (b *Broker) NewUser(tb testing.TB, name string) string {
	tb.Helper()
	ctx := context.WithoutCancel(tb.Context())
	user := b.Vhost + "_" + name
	require.NoError(tb, b.admin.CreateUser(ctx, b.Vhost, user, "pw"))
	tb.Cleanup(func() { _ = b.admin.DeleteUser(context.Background(), user) })
	u, err := url.Parse(b.URL)
	require.NoError(tb, err)
	u.User = url.UserPassword(user, "pw")
	return u.String()
}

// ReadyMessages returns the exact number of messages in a queue of the
// virtual host that are ready for delivery (not held unacknowledged by a
// consumer).
func (b *Broker) ReadyMessages(tb testing.TB, queue string) int {
	tb.Helper()
	return b.Queue(tb, queue).Messages
}

// Queue returns what the broker says of a queue of the virtual host: its
// ready messages and its consumers.
func (b *Broker) Queue(tb testing.TB, queue string) amqp.Queue {
	tb.Helper()
	conn, err := amqp.Dial(b.URL)
	require.NoError(tb, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(tb, err)
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(tb, err)
	return q
}

// Receive consumes n messages from a queue of the virtual host (acking
// them) and returns them, failing the test if a minute passes without one
// arriving. The minute is counted from the last message, not the first: a
// test's messages may take longer than that to read (sixteen bodies of
// 24 MiB took over a minute under the race detector beside the other
// packages' tests), but a stalled queue still fails within a minute.
func (b *Broker) Receive(tb testing.TB, queue string, n int) []amqp.Delivery {
	tb.Helper()
	conn, err := amqp.Dial(b.URL)
	require.NoError(tb, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(tb, err)
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	require.NoError(tb, err)
	var got []amqp.Delivery
	idle := time.NewTimer(time.Minute)
	defer idle.Stop()
	for len(got) < n {
		select {
		case d, ok := <-deliveries:
			if !ok {
				require.FailNowf(tb, "consumer closed", "the broker closed the consumer of %s after %d of %d messages", queue, len(got), n)
			}
			got = append(got, d)
			idle.Reset(time.Minute)
		case <-idle.C:
			require.FailNowf(tb, "messages missing", "only %d of %d messages arrived on %s, none in the last minute", len(got), n, queue)
		}
	}
	return got
}

// ActiveQueues returns, for each consumer tag, the queues of the virtual
// host it is the active consumer of, as the management API last learnt.
func (b *Broker) ActiveQueues(tb testing.TB) map[string][]string {
	tb.Helper()
	consumers, err := b.admin.Consumers(tb.Context(), b.Vhost)
	require.NoError(tb, err)
	active := map[string][]string{}
	for _, c := range consumers {
		if c.Active {
			active[c.Tag] = append(active[c.Tag], c.Queue.Name)
		}
	}
	return active
}

// CloseConnections closes, from the broker's side, every client connection
// to the virtual host whose connection_name contains nameContains, as an
// operator or a broker restart would. The management API learns of new
// connections, and forgets closed ones, only every few seconds, so it skips
// the connections it closed before and waits up to 30 seconds for at least
// one new one to show. It returns how many it closed.
func (b *Broker) CloseConnections(tb testing.TB, nameContains string) int {
	tb.Helper()
	var matching []rabbitadmin.Connection
	deadline := time.Now().Add(30 * time.Second)
	for len(matching) == 0 && time.Now().Before(deadline) {
		conns, err := b.admin.Connections(tb.Context(), b.Vhost)
		require.NoError(tb, err)
		for _, c := range conns {
			if strings.Contains(c.ClientProperties.ConnectionName, nameContains) && !b.closed[c.Name] {
				matching = append(matching, c)
			}
		}
		if len(matching) == 0 {
			time.Sleep(250 * time.Millisecond)
		}
	}
	for _, c := range matching {
		b.closed[c.Name] = true
		_ = b.admin.CloseConnection(tb.Context(), c.Name)
	}
	return len(matching)
}
