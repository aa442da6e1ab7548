package main

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/api/schemas"
	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// Acceptance: what a running inboxd publishes keeps the contract of
// api/schemas. Requests that come to every outcome but forgotten (which
// needs a row past its retention), and to every event; each event, reply
// and dead letter is looked up in the AsyncAPI document by where it came
// from (exchange, routing key, type), and its body, headers and AMQP
// properties validated against that message's schemas.
func TestWhatInboxdPublishesKeepsTheContract(t *testing.T) {
	t.Parallel()
	contract, err := schemas.Load()
	require.NoError(t, err)
	b := setup(t)
	own := newRequester(t, b.broker.URL, true)
	direct := newRequester(t, b.broker.URL, false)
	startProcess(t, serviceEnv(b.db, b.broker, ownReplyQueues, "INBOX_MAX_MESSAGE_BYTES=65536"))

	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	send := func(r *requester, messageID, key, correlationID string, body []byte) {
		publishConfirmed(t, r.ch, key, amqp.Publishing{
			MessageId: messageID, CorrelationId: correlationID, ReplyTo: r.replyTo, Body: body,
			Headers: amqp.Table{"traceparent": traceparent, "tracestate": "vendor=1"},
		})
	}
	// One channel, so that each order's messages come in this order.
	send(own, "m-confirmed", "order.created", "c-confirmed", loadgen.OrderCreatedBody("o-1", 2))
	send(own, "m-again", "order.created", "c-again", loadgen.OrderCreatedBody("o-1", 1))
	send(own, "m-cancel", "order.cancelled", "c-cancel", []byte(`{"orderId":"o-1","reason":"changed\tmind"}`))
	send(own, "m-rejected", "order.created", "c-rejected",
		[]byte(`{"orderId":"o-2","userId":"u-2","email":"b@example.com","items":[{"sku":"NO-SUCH-SKU","quantity":1}]}`))
	send(own, "m-not-cancelled", "order.cancelled", "", []byte(`{"orderId":"o-2"}`))
	send(own, "m-early", "order.cancelled", "c-early", []byte(`{"orderId":"o-3"}`))
	send(own, "m-dead", "order.created", "c-dead", []byte(`{"orderId":"o-4"}`))
	send(own, "m-not-json", "order.created", "c-not-json", []byte(`not json`))
	send(own, "m-too-large", "order.created", "c-too-large", make([]byte, 70000))
	send(own, "", "order.created", "c-no-id", loadgen.OrderCreatedBody("o-5", 1))
	publishConfirmed(t, direct.ch, "order.created", amqp.Publishing{MessageId: "m-direct", ReplyTo: direct.replyTo,
		Body: loadgen.OrderCreatedBody("o-6", 3)})

	outcomes := map[string]int{}
	validateReplies := func(r *requester, n int) {
		t.Helper()
		for _, d := range receiveDeliveries(t, r.replies, n) {
			m, err := contract.MessageOn("", "", d.Type)
			require.NoError(t, err, "reply %s", d.MessageId)
			require.NoError(t, m.Validate(d), "reply %s: %s", d.MessageId, d.Body)
			var body struct{ Outcome string }
			require.NoError(t, json.Unmarshal(d.Body, &body))
			outcomes[body.Outcome]++
		}
	}
	validateReplies(own, 10)
	validateReplies(direct, 1)

	// An operator skips the dead message; a copy asking for a reply gets
	// the skipped result.
	_, err = b.db.Pool.Exec(t.Context(),
		`UPDATE inbox SET status = 'processed', result = 'skipped by operator', processed_at = now() WHERE message_id = 'm-dead' AND status = 'dead'`)
	require.NoError(t, err)
	send(own, "m-dead", "order.created", "c-dead-copy", []byte(`{"orderId":"o-4"}`))
	validateReplies(own, 1)
	require.Equal(t, map[string]int{"confirmed": 2, "already_recorded": 1, "cancelled": 2, "rejected": 1, "not_cancelled": 1,
		"dead": 2, "refused": 2, "processed": 1}, outcomes, "every outcome but forgotten")

	events := map[string]int{}
	for _, d := range receiveDeliveries(t, b.events, 7) {
		m, err := contract.MessageOn(d.Exchange, d.RoutingKey, d.Type)
		require.NoError(t, err, "event %s", d.MessageId)
		require.NoError(t, m.Validate(d), "event %s: %s", d.MessageId, d.Body)
		events[d.RoutingKey]++
	}
	require.Equal(t, map[string]int{"order.confirmed": 2, "email.requested": 2, "order.rejected": 1, "order.cancelled": 2}, events)

	for _, d := range b.broker.Receive(t, broker.QueueDead, 2) {
		m, err := contract.MessageOn(d.Exchange, "", "")
		require.NoError(t, err, "dead letter %s", d.MessageId)
		require.NoError(t, m.Validate(d), "dead letter %s", d.MessageId)
	}
}

// receiveDeliveries returns the next n deliveries of c, failing after a
// minute.
func receiveDeliveries(t *testing.T, c <-chan amqp.Delivery, n int) []amqp.Delivery {
	t.Helper()
	var got []amqp.Delivery
	deadline := time.After(time.Minute)
	for len(got) < n {
		select {
		case d := <-c:
			got = append(got, d)
		case <-deadline:
			require.FailNow(t, fmt.Sprintf("%d of %d deliveries arrived", len(got), n))
		}
	}
	return got
}
