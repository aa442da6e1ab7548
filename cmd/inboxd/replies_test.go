package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// requester publishes order messages that ask for a reply, from the
// channel that consumes the replies, as a checkout waiting for its answer
// would: on RabbitMQ's direct reply-to, or on a reply queue of its own that
// the broker deletes when the requester's channel closes.
type requester struct {
	ch      *amqp.Channel
	replyTo string
	replies <-chan amqp.Delivery
}

func newRequester(t *testing.T, url string, ownQueue bool) *requester {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	r := &requester{ch: ch, replyTo: "amq.rabbitmq.reply-to"}
	if ownQueue {
		q, err := ch.QueueDeclare("", false, true, false, false, nil) // auto-delete
		require.NoError(t, err)
		r.replyTo = q.Name
	}
	r.replies, err = ch.Consume(r.replyTo, "", true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	return r
}

// ownReplyQueues lets replies go to the server-named queues
// (amq.gen-…) a requester with a queue of its own declares.
const ownReplyQueues = "INBOX_REPLY_QUEUE_PREFIXES=amq.gen-"

// request publishes one message asking for a reply under correlationID,
// and waits for the broker's confirm.
func (r *requester) request(t *testing.T, messageID, routingKey, correlationID string, body []byte) {
	t.Helper()
	publishConfirmed(t, r.ch, routingKey, amqp.Publishing{MessageId: messageID, CorrelationId: correlationID, ReplyTo: r.replyTo, Body: body})
}

// reply is a received reply, its body decoded.
type reply struct {
	id, correlationID string
	body              map[string]any
	raw               string
}

// receive returns the next n replies, failing after timeout.
func (r *requester) receive(t *testing.T, n int, timeout time.Duration) []reply {
	t.Helper()
	var out []reply
	deadline := time.After(timeout)
	for len(out) < n {
		select {
		case d := <-r.replies:
			var body map[string]any
			require.NoError(t, json.Unmarshal(d.Body, &body), "reply %q", d.Body)
			out = append(out, reply{id: d.MessageId, correlationID: d.CorrelationId, body: body, raw: string(d.Body)})
		case <-deadline:
			t.Fatalf("%d of %d replies arrived", len(out), n)
		}
	}
	return out
}

// requireNoMoreReplies checks that no reply arrives within settle.
func (r *requester) requireNoMoreReplies(t *testing.T, settle time.Duration) {
	t.Helper()
	select {
	case d := <-r.replies:
		t.Fatalf("an extra reply: %s %s %s", d.MessageId, d.CorrelationId, d.Body)
	case <-time.After(settle):
	}
}

// Acceptance: a requester on direct reply-to publishes 500 orders and
// waits: each gets one reply with its outcome and correlation id. Copies of
// 100 of them under the same id, 50 sent right behind their first copy
// (while it is still pending) and 50 once it was handled, each get the
// same reply as the first, and cause no second effect.
func TestRepliesReachTheirRequesters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	req := newRequester(t, b.broker.URL, false)

	const orders, rejected = 500, 10
	body := func(i int) []byte {
		if i < rejected { // no stock of this SKU: rejected with the reason
			return []byte(fmt.Sprintf(`{"orderId":"o-%d","userId":"u-1","email":"a@example.com","items":[{"sku":"NO-SUCH-SKU","quantity":1}]}`, i))
		}
		return loadgen.OrderCreatedBody(fmt.Sprintf("o-%d", i), 1)
	}
	// Published before inboxd starts: the first 50 copies sit right
	// behind their originals, pending with them.
	for i := range orders {
		req.request(t, fmt.Sprintf("m-%d", i), "order.created", fmt.Sprintf("c-%d", i), body(i))
		if i < 50 {
			req.request(t, fmt.Sprintf("m-%d", i), "order.created", fmt.Sprintf("c-%d-again", i), body(i))
		}
	}
	runInProcess(t, serviceEnv(b.db, b.broker))

	first := map[string]reply{}
	for _, r := range req.receive(t, orders+50, 60*time.Second) {
		_, twice := first[r.correlationID]
		require.False(t, twice, "one reply per request: %s came twice (%s, %s)", r.correlationID, first[r.correlationID].id, r.id)
		first[r.correlationID] = r
	}
	b.waitDrained(t, orders, 30*time.Second)
	// The other 50 copies come once their message was handled.
	for i := 50; i < 100; i++ {
		req.request(t, fmt.Sprintf("m-%d", i), "order.created", fmt.Sprintf("c-%d-again", i), body(i))
	}
	for _, r := range req.receive(t, 50, 30*time.Second) {
		_, twice := first[r.correlationID]
		require.False(t, twice, "one reply per request: %s came twice (%s, %s)", r.correlationID, first[r.correlationID].id, r.id)
		first[r.correlationID] = r
	}
	req.requireNoMoreReplies(t, time.Second)

	ids := map[string]bool{}
	for i := range orders {
		r := first[fmt.Sprintf("c-%d", i)]
		require.NotEmpty(t, r.id, "order %d got no reply", i)
		require.False(t, ids[r.id], "reply ids are unique")
		ids[r.id] = true
		require.Equal(t, fmt.Sprintf("m-%d", i), r.body["messageId"])
		require.Equal(t, fmt.Sprintf("o-%d", i), r.body["orderId"])
		require.Equal(t, "processed", r.body["status"])
		if i < rejected {
			require.Equal(t, "rejected", r.body["outcome"], r.raw)
			require.Contains(t, r.body["reason"], "NO-SUCH-SKU", r.raw)
		} else {
			require.Equal(t, "confirmed", r.body["outcome"], r.raw)
		}
		if i < 100 {
			again := first[fmt.Sprintf("c-%d-again", i)]
			require.Equal(t, r.raw, again.raw, "a copy gets the same reply as the first")
			require.NotEqual(t, r.id, again.id, "each request its own reply id")
		}
	}
	require.Equal(t, orders, b.count(t, "SELECT count(*) FROM inbox"), "one inbox row per message id")
	require.Equal(t, orders, b.count(t, "SELECT count(*) FROM order_confirmations"))
	require.Equal(t, 2*(orders-rejected)+rejected, b.count(t, "SELECT count(*) FROM outbox WHERE reply_to IS NULL"),
		"no second effect")
	require.Equal(t, orders+100, b.count(t, "SELECT count(*) FROM inbox_replies WHERE state = 'sent'"))
}

// Acceptance: a requester that closes its channel before its reply, its
// reply queue going with it: the reply ends undeliverable with its reason,
// after its attempts, and the order's events are published as usual. A
// requester gone from direct reply-to: the broker drops the reply (RabbitMQ
// 3.x returns every mandatory publish there, so the relay cannot tell), and
// nothing retries either.
func TestAReplyToAGoneRequesterEndsUndeliverable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	gone := newRequester(t, b.broker.URL, true)
	gone.request(t, "m-gone", "order.created", "c-gone", loadgen.OrderCreatedBody("o-gone", 1))
	require.NoError(t, gone.ch.Close())
	goneDirect := newRequester(t, b.broker.URL, false)
	goneDirect.request(t, "m-gone-direct", "order.created", "c-gone-direct", loadgen.OrderCreatedBody("o-gone-direct", 1))
	require.NoError(t, goneDirect.ch.Close())
	runInProcess(t, serviceEnv(b.db, b.broker, ownReplyQueues, "INBOX_RELAY_MAX_ATTEMPTS=3", "INBOX_RETRY_BASE=50ms", "INBOX_RETRY_MAX=100ms"))

	b.waitDrained(t, 2, 30*time.Second)
	b.requireEventsOnce(t)
	require.Len(t, b.seen, 4, "both orders' two events went out")
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM inbox_replies WHERE state = 'undeliverable'") == 1
	}, 30*time.Second, 20*time.Millisecond)
	var attempts int
	var lastError string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(),
		"SELECT attempts, last_error FROM outbox WHERE reply_to IS NOT NULL AND message_id = 'm-gone'").Scan(&attempts, &lastError))
	require.Equal(t, 3, attempts, "it ends after its attempts")
	require.Contains(t, lastError, "undeliverable: the broker returned the reply (312 NO_ROUTE)")
	require.Equal(t, []string{"sent"}, b.db.Strings(t, "SELECT state FROM inbox_replies WHERE message_id = 'm-gone-direct'"))
	require.Equal(t, 1, b.count(t, "SELECT replies_undeliverable FROM outbox_backlog"))
	require.Zero(t, b.count(t, "SELECT replies_unpublished FROM outbox_backlog"), "nothing retries")
	require.Zero(t, b.count(t, "SELECT dead FROM outbox_backlog"), "no event is dead")
	require.Zero(t, b.count(t, "SELECT count(*) FROM outbox_dead"))
}

// Acceptance: a message that ends dead replies with its error; once an
// operator has fixed the cause and replayed it with SQL, a second reply
// carries the new result.
func TestADeadMessageRepliesAndItsReplayRepliesAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// What the operator will fix: the order cannot be recorded.
	_, err := b.db.Pool.Exec(t.Context(),
		`ALTER TABLE order_confirmations ADD CONSTRAINT broken CHECK (order_id <> 'o-broken')`)
	require.NoError(t, err)
	req := newRequester(t, b.broker.URL, true)
	runInProcess(t, serviceEnv(b.db, b.broker, ownReplyQueues, "INBOX_MAX_ATTEMPTS=1"))
	req.request(t, "m-broken", "order.created", "c-1", loadgen.OrderCreatedBody("o-broken", 1))

	dead := req.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, "c-1", dead.correlationID)
	require.Equal(t, "dead", dead.body["outcome"], dead.raw)
	require.Equal(t, "dead", dead.body["status"], dead.raw)
	require.Contains(t, dead.body["error"], "broken", dead.raw)
	require.EqualValues(t, 0, dead.body["run"])

	_, err = b.db.Pool.Exec(t.Context(), `ALTER TABLE order_confirmations DROP CONSTRAINT broken`)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(t.Context(),
		`UPDATE inbox SET replay_requested = true, replay_reason = 'dropped the broken check' WHERE message_id = 'm-broken'`)
	require.NoError(t, err)

	again := req.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, "c-1", again.correlationID, "the same request, answered again")
	require.NotEqual(t, dead.id, again.id)
	require.Equal(t, "confirmed", again.body["outcome"], again.raw)
	require.Equal(t, "processed", again.body["status"], again.raw)
	require.EqualValues(t, 1, again.body["run"])
	req.requireNoMoreReplies(t, time.Second)
}

// Every request is answered, through SIGKILLs landing while requests,
// handling and replies are in flight: each request gets its reply under
// one id (a copy after a crash carries the same id and body), a copy of a
// message gets the same body as its first, and no request is stored twice.
func TestEveryRequestIsAnsweredAcrossSIGKILL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	req := newRequester(t, b.broker.URL, true)
	env := serviceEnv(b.db, b.broker, ownReplyQueues, "INBOX_WORKER_BATCH_SIZE=20", "INBOX_INGEST_BATCH_SIZE=50",
		"INBOX_RELAY_BATCH_SIZE=50", "INBOX_RELAY_LEASE=1s", "INBOX_CLAIM_LEASE=500ms")

	const orders = 600
	type request struct{ messageID, correlationID string }
	var requests []request
	for i := range orders {
		requests = append(requests, request{fmt.Sprintf("m-%d", i), fmt.Sprintf("c-%d", i)})
		if i >= 40 && i%4 == 0 { // a quarter sent again, some time later, under the same id
			requests = append(requests, request{fmt.Sprintf("m-%d", i-40), fmt.Sprintf("c-%d-again", i-40)})
		}
	}
	published := make(chan struct{})
	go func() {
		defer close(published)
		for n, r := range requests {
			var i int
			_, _ = fmt.Sscanf(r.messageID, "m-%d", &i)
			req.request(t, r.messageID, "order.created", r.correlationID, loadgen.OrderCreatedBody(fmt.Sprintf("o-%d", i), 1))
			if n%50 == 49 {
				time.Sleep(30 * time.Millisecond)
			}
		}
	}()

	replies := map[string][]reply{}
	collect := func(d time.Duration) {
		for deadline := time.After(d); ; {
			select {
			case d := <-req.replies:
				var body map[string]any
				require.NoError(t, json.Unmarshal(d.Body, &body))
				replies[d.CorrelationId] = append(replies[d.CorrelationId], reply{id: d.MessageId, correlationID: d.CorrelationId, body: body, raw: string(d.Body)})
			case <-deadline:
				return
			}
		}
	}
	for kill := range 3 {
		p := startProcess(t, env)
		before := b.count(t, "SELECT count(*) FROM outbox WHERE reply_to IS NOT NULL")
		require.Eventually(t, func() bool {
			return b.count(t, "SELECT count(*) FROM outbox WHERE reply_to IS NOT NULL") > before
		}, 30*time.Second, 5*time.Millisecond, "kill %d: replies are being queued", kill)
		collect(time.Duration(50+kill*70) * time.Millisecond)
		p.kill()
	}
	<-published
	startProcess(t, env)
	b.waitDrained(t, orders, 60*time.Second)
	for deadline := time.Now().Add(60 * time.Second); len(replies) < len(requests) && time.Now().Before(deadline); {
		collect(100 * time.Millisecond)
	}
	collect(time.Second) // copies sent again after a crash
	require.Equal(t, len(requests), len(replies), "every request got a reply")

	require.Equal(t, len(requests), b.count(t, "SELECT count(*) FROM inbox_reply_requests"), "no request stored twice")
	ids := map[string]string{}
	for corr, rs := range replies {
		for _, r := range rs {
			require.Equal(t, rs[0].id, r.id, "%s: every copy of a reply has its id", corr)
			require.Equal(t, rs[0].raw, r.raw, "%s: and its body", corr)
			require.Equal(t, "confirmed", r.body["outcome"], r.raw)
		}
		require.NotContains(t, ids, rs[0].id, "a reply id answers one request")
		ids[rs[0].id] = corr
	}
	for _, r := range requests {
		require.Equal(t, r.messageID, replies[r.correlationID][0].body["messageId"])
	}
	require.Equal(t, orders, b.count(t, "SELECT count(*) FROM order_confirmations"))
	require.Equal(t, 2*orders, b.count(t, "SELECT count(*) FROM outbox WHERE reply_to IS NULL"), "no second effect")
}

// The edges of what the contract takes: a message id, a reply queue name
// and a correlation id of 255 bytes each get their reply; a reply_to that
// PostgreSQL's text cannot hold (a NUL byte) is logged, and its message is
// stored and handled as usual, without a reply.
func TestRepliesAtTheEdges(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The reply queue's name is 255 q's.
	p := startProcess(t, serviceEnv(b.db, b.broker, "INBOX_REPLY_QUEUE_PREFIXES=q"))

	conn, err := amqp.Dial(b.broker.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	queue := strings.Repeat("q", 255)
	_, err = ch.QueueDeclare(queue, false, true, false, false, nil)
	require.NoError(t, err)
	replies, err := ch.Consume(queue, "", true, false, false, false, nil)
	require.NoError(t, err)
	req := &requester{ch: ch, replyTo: queue, replies: replies}
	require.NoError(t, ch.Confirm(false))

	longID, longCorrelation := strings.Repeat("m", 255), strings.Repeat("c", 255)
	req.request(t, longID, "order.created", longCorrelation, loadgen.OrderCreatedBody("o-long", 1))
	r := req.receive(t, 1, 30*time.Second)[0]
	require.Equal(t, longCorrelation, r.correlationID)
	require.Equal(t, longID, r.body["messageId"])
	require.Equal(t, "confirmed", r.body["outcome"], r.raw)

	req.replyTo = "bad\x00queue"
	req.request(t, "m-bad-reply-to", "order.created", "c-bad", loadgen.OrderCreatedBody("o-bad-reply-to", 1))
	b.waitDrained(t, 2, 30*time.Second)
	require.Equal(t, "processed", b.status(t, "m-bad-reply-to"), "the message is handled as usual")
	require.Zero(t, b.count(t, "SELECT count(*) FROM inbox_reply_requests WHERE message_id = 'm-bad-reply-to'"))
	require.Eventually(t, func() bool { return p.logContains("reply_to or correlation_id is not text PostgreSQL can store") },
		10*time.Second, 50*time.Millisecond, "the refused request is logged")
	req.requireNoMoreReplies(t, 500*time.Millisecond)
}

// requestAs is request with the AMQP user_id set (none when userID is
// empty); the broker refuses a user_id that is not the connection's user.
func (r *requester) requestAs(t *testing.T, userID, messageID, correlationID string, body []byte) {
	t.Helper()
	publishConfirmed(t, r.ch, "order.created", amqp.Publishing{
		MessageId: messageID, CorrelationId: correlationID, ReplyTo: r.replyTo, UserId: userID, Body: body,
	})
}
