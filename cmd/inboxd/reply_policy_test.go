package main

import (
	"bytes"
	"os"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// producer is a publisher of its own on the broker, in confirm mode.
type producer struct{ ch *amqp.Channel }

func newProducer(t *testing.T, url string) *producer {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	return &producer{ch: ch}
}

// publish publishes msg to the orders exchange and waits for its confirm.
func (p *producer) publish(t *testing.T, routingKey string, msg amqp.Publishing) {
	t.Helper()
	publishConfirmed(t, p.ch, routingKey, msg)
}

// publishConfirmed publishes msg, persistent JSON, to the orders exchange
// on ch, in confirm mode, and waits for the broker's confirm.
func publishConfirmed(t *testing.T, ch *amqp.Channel, routingKey string, msg amqp.Publishing) {
	t.Helper()
	msg.DeliveryMode, msg.ContentType = amqp.Persistent, "application/json"
	dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), broker.ExchangeOrders, routingKey, false, false, msg)
	require.NoError(t, err)
	ok, err := dc.WaitContext(t.Context())
	require.NoError(t, err)
	require.True(t, ok)
}

// declare declares plain queues, as another service's would be.
func (p *producer) declare(t *testing.T, queues ...string) {
	t.Helper()
	for _, q := range queues {
		_, err := p.ch.QueueDeclare(q, true, false, false, false, nil)
		require.NoError(t, err)
	}
}

// countLines counts the lines of the process's log that hold s.
func (p *process) countLines(s string) int {
	b, _ := os.ReadFile(p.logs)
	return bytes.Count(b, []byte(s))
}

// Acceptance: a reply goes only to direct reply-to or to a queue whose name
// INBOX_REPLY_QUEUE_PREFIXES allows. Orders asking for a reply to another
// service's command queue are stored and handled, and nothing reaches that
// queue; the address is logged once and each request counted.
func TestRepliesGoOnlyWhereTheyMay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, addr := startServing(t, b, "INBOX_REPLY_QUEUE_PREFIXES=checkout.replies.")
	prod := newProducer(t, b.broker.URL)
	prod.declare(t, "billing.commands", "checkout.replies.1")
	direct := newRequester(t, b.broker.URL, false)

	for _, id := range []string{"a-0", "a-1", "a-2"} {
		prod.publish(t, "order.created", amqp.Publishing{MessageId: id, ReplyTo: "billing.commands", CorrelationId: "c-" + id,
			Body: loadgen.OrderCreatedBody("o-"+id, 1)})
	}
	prod.publish(t, "order.created", amqp.Publishing{MessageId: "allowed", ReplyTo: "checkout.replies.1", CorrelationId: "c-allowed",
		Body: loadgen.OrderCreatedBody("o-allowed", 1)})
	direct.request(t, "direct", "order.created", "c-direct", loadgen.OrderCreatedBody("o-direct", 1))

	got := direct.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, "c-direct", got.correlationID)
	require.Equal(t, "confirmed", got.body["outcome"], got.raw)
	require.Eventually(t, func() bool { return b.broker.ReadyMessages(t, "checkout.replies.1") == 1 },
		30*time.Second, 50*time.Millisecond, "the allowed reply queue gets its reply")
	b.waitDrained(t, 5, 30*time.Second)
	for _, id := range []string{"a-0", "a-1", "a-2"} {
		require.Equal(t, "processed", b.status(t, id), "stored and handled")
	}
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0 },
		30*time.Second, 50*time.Millisecond, "the relay published everything")
	require.Zero(t, b.broker.ReadyMessages(t, "billing.commands"), "nothing reached the other service's queue")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox_reply_requests WHERE reply_to = 'billing.commands'"))
	require.Equal(t, 1, p.countLines(`"reply_to":"billing.commands"`), "logged once for the address")
	require.Equal(t, 3.0, scrape(t, addr)[`inboxd_reply_requests_ignored_total{reason="reply_to"}`])
}

// Acceptance: when a message's first delivery carried an AMQP user_id (which
// the broker checks against the connection's user), a copy asking for a
// reply is answered only under the same user_id: another producer who
// learns the message id cannot read the stored result, with its own user_id
// or with none. The first producer's own copy is answered.
func TestACopyIsAnsweredOnlyForItsFirstUser(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, addr := startServing(t, b)
	owner := newRequester(t, b.broker.URL, false)
	otherURL := b.broker.NewUser(t, "other")
	other := newRequester(t, otherURL, false)
	ownerUser := strings.SplitN(strings.TrimPrefix(b.broker.URL, "amqp://"), ":", 2)[0]
	otherUser := strings.SplitN(strings.TrimPrefix(otherURL, "amqp://"), ":", 2)[0]

	owner.requestAs(t, ownerUser, "m-1", "c-first", loadgen.OrderCreatedBody("o-1", 1))
	first := owner.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, "confirmed", first.body["outcome"], first.raw)

	other.requestAs(t, otherUser, "m-1", "c-other", loadgen.OrderCreatedBody("o-1", 1))
	other.requestAs(t, "", "m-1", "c-other-anonymous", loadgen.OrderCreatedBody("o-1", 1))
	// In one batch with the first copy, too: a copy behind it.
	owner.requestAs(t, ownerUser, "m-2", "c-second", loadgen.OrderCreatedBody("o-2", 1))
	other.requestAs(t, otherUser, "m-2", "c-second-other", loadgen.OrderCreatedBody("o-2", 1))
	owner.requestAs(t, ownerUser, "m-1", "c-again", loadgen.OrderCreatedBody("o-1", 1))

	var got []string
	for _, r := range owner.receive(t, 2, 30*time.Second) {
		got = append(got, r.correlationID)
	}
	require.ElementsMatch(t, []string{"c-second", "c-again"}, got)
	require.Eventually(t, func() bool { return b.count(t, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0 },
		30*time.Second, 50*time.Millisecond)
	other.requireNoMoreReplies(t, time.Second)
	require.Equal(t, 3.0, scrape(t, addr)[`inboxd_reply_requests_ignored_total{reason="user_id"}`], "the other user's three copies are counted")
	require.Equal(t, []string{ownerUser}, b.db.Strings(t, "SELECT user_id FROM inbox WHERE message_id = 'm-1'"))
}

// Acceptance: a request ingest cannot store, and so dead-letters, gets a
// reply saying it was refused and why, with its correlation id: its
// requester never waits for an answer that cannot come. The dead letters
// are in order-confirmation.dead as before.
func TestARefusedRequestIsAnswered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	startProcess(t, serviceEnv(b.db, b.broker, "INBOX_MAX_MESSAGE_BYTES=65536"))
	req := newRequester(t, b.broker.URL, false)

	req.request(t, "too-large", "order.created", "c-large", make([]byte, 2<<20))
	req.request(t, "", "order.created", "c-no-id", loadgen.OrderCreatedBody("o-no-id", 1))
	req.request(t, "fine", "order.created", "c-fine", loadgen.OrderCreatedBody("o-fine", 1))

	byCorrelation := map[string]reply{}
	for _, r := range req.receive(t, 3, 30*time.Second) {
		byCorrelation[r.correlationID] = r
	}
	large := byCorrelation["c-large"]
	require.Equal(t, "refused", large.body["outcome"], large.raw)
	require.Equal(t, "refused", large.body["status"], large.raw)
	require.Equal(t, "too-large", large.body["messageId"], large.raw)
	require.Contains(t, large.body["reason"], "message too large: 2097152 bytes, the limit is 65536", large.raw)
	require.True(t, strings.HasPrefix(large.id, "refused:"), large.id)
	noID := byCorrelation["c-no-id"]
	require.Equal(t, "refused", noID.body["outcome"], noID.raw)
	require.Equal(t, "missing message_id", noID.body["reason"], noID.raw)
	require.Equal(t, "confirmed", byCorrelation["c-fine"].body["outcome"])

	reasons := map[string]string{}
	for _, d := range b.broker.Receive(t, broker.QueueDead, 2) {
		reasons[d.CorrelationId], _ = d.Headers[broker.HeaderRejectReason].(string)
	}
	require.Contains(t, reasons["c-large"], "message too large")
	require.Equal(t, "missing message_id", reasons["c-no-id"])
}

// Acceptance: a reply row the policy does not allow (stored by an earlier
// build, or by hand) is refused by the relay, never sent, and ends
// undeliverable with the reason after its attempts.
func TestTheRelaySendsNoReplyThePolicyRefuses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	prod := newProducer(t, b.broker.URL)
	prod.declare(t, "billing.commands")
	b.db.Exec(t, `INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, reply_to, correlation_id)
		VALUES ('reply:old:0', 'old', 'reply', '{"outcome":"confirmed"}', 'billing.commands', 'c-old')`)
	startProcess(t, serviceEnv(b.db, b.broker, "INBOX_RELAY_MAX_ATTEMPTS=2", "INBOX_RETRY_BASE=50ms", "INBOX_RETRY_MAX=100ms"))
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM outbox WHERE idempotency_key = 'reply:old:0' AND dead_at IS NOT NULL") == 1
	}, 30*time.Second, 50*time.Millisecond, "the reply ends undeliverable")
	require.Contains(t, b.db.Strings(t, "SELECT last_error FROM outbox WHERE idempotency_key = 'reply:old:0'")[0],
		"refused: reply_to is neither direct reply-to nor a queue INBOX_REPLY_QUEUE_PREFIXES allows")
	require.Zero(t, b.broker.ReadyMessages(t, "billing.commands"), "nothing reached the other service's queue")
}
