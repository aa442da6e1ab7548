package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// exec runs sql as the schema's owner, as an operator or an earlier build
// would have written the rows.
func (b *bundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.WithoutCancel(t.Context()), sql, args...)
	require.NoError(t, err)
}

// insertOrderRows inserts n order.confirmed effects of order, keyed
// prefix-0, prefix-1, ..., in that order.
func (b *bundle) insertOrderRows(t *testing.T, order, prefix string, n int) {
	t.Helper()
	b.exec(t, `
		INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		SELECT $2 || '-' || i || ':order.confirmed', $2 || '-' || i, 'order.confirmed',
		       jsonb_build_object('orderId', $1::text), $1
		FROM generate_series(0, $3 - 1) AS i ORDER BY i`, order, prefix, n)
}

// However many rows an earlier row of their order holds back sit at the
// head of the outbox, a batch is filled with rows that can go: a fresh
// order behind 1,500 held-back rows is published in the first batch.
func TestHeldBackRowsNeverFillABatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The first row of o-stuck waits for a retry an hour away; its 1,500
	// later rows wait for it.
	b.insertOrderRows(t, "o-stuck", "stuck", 1)
	b.exec(t, `UPDATE outbox SET next_attempt_at = now() + interval '1 hour', last_error = 'waiting'`)
	b.insertOrderRows(t, "o-stuck", "held", 1500)
	b.insertOrderRows(t, "o-fresh", "fresh", 1)

	var clock testenv.Clock // the relay's
	r := b.startRelay(t, outbox.RelayConfig{BatchSize: 1000, PollInterval: time.Hour, Now: clock.Now})
	b.receive(t, map[string]bool{"fresh-0:order.confirmed": true})
	// The event reaches the queue before the relay records it published.
	require.Eventually(t, func() bool { return b.unpublished(t) == 1501 }, 10*time.Second, 10*time.Millisecond,
		"o-stuck's rows all wait, in order: only o-fresh's is published")
	require.Zero(t, b.db.Int(t, `SELECT count(*) FROM outbox WHERE order_key = 'o-stuck' AND attempts > 0`),
		"no held-back row was even claimed")

	// Once the relay's clock has passed the retry, the order goes out, in
	// order.
	clock.SetAhead(time.Hour + time.Minute)
	r.Notify()
	want := []string{"stuck-0:order.confirmed"}
	for i := range 1500 {
		want = append(want, fmt.Sprintf("held-%d:order.confirmed", i))
	}
	// A batch the broker did not confirm in time is published again
	// (at least once): a row seen already is a redelivery of it, and the
	// rows' first deliveries keep their order.
	seen := map[string]bool{"fresh-0:order.confirmed": true}
	for _, key := range want {
		for {
			var d amqp.Delivery
			select {
			case d = <-b.received:
			case <-time.After(30 * time.Second):
				t.Fatalf("%s not published once the retry was due", key)
			}
			if seen[d.MessageId] {
				continue
			}
			seen[d.MessageId] = true
			require.Equal(t, key, d.MessageId, "o-stuck's rows in the order they were written")
			break
		}
	}
}

// A row is never both dead and published, whoever writes it: the claim
// finds an order's earlier dead rows among its unpublished ones.
func TestNoRowIsDeadAndPublished(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t) // the schema alone: no broker
	db.Exec(t, `INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		VALUES ('m-1:order.confirmed', 'm-1', 'order.confirmed', '{}', 'o-1'),
		       ('m-2:order.confirmed', 'm-2', 'order.confirmed', '{}', 'o-2')`)
	for _, sql := range []string{
		"UPDATE outbox SET published_at = now(), dead_at = now() WHERE message_id = 'm-1'",
		"UPDATE outbox SET dead_at = now() WHERE message_id = 'm-2'",
		"UPDATE outbox SET published_at = now() WHERE message_id = 'm-2'",
	} {
		_, err := db.Pool.Exec(t.Context(), sql)
		if strings.Contains(sql, "published_at = now()") {
			require.ErrorContains(t, err, "outbox_dead_unpublished", sql)
		} else {
			require.NoError(t, err, sql)
		}
	}
}

// A dead row holds back its order's later rows before the batch is
// filled, as a row waiting for a retry does: a fresh order behind 1,500
// rows held back by a dead one is published in the first batch.
func TestRowsHeldBackByADeadRowNeverFillABatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.insertOrderRows(t, "o-dead", "dead", 1)
	b.exec(t, `UPDATE outbox SET dead_at = now(), attempts = 5, last_error = 'refused'`)
	b.insertOrderRows(t, "o-dead", "held", 1500)
	b.insertOrderRows(t, "o-fresh", "fresh", 1)

	b.startRelay(t, outbox.RelayConfig{BatchSize: 1000, PollInterval: time.Hour})
	b.receive(t, map[string]bool{"fresh-0:order.confirmed": true})
	require.Eventually(t, func() bool { return b.unpublished(t) == 1501 }, 10*time.Second, 10*time.Millisecond,
		"o-dead's rows all wait: only o-fresh's is published")
	require.Zero(t, b.db.Int(t, `SELECT count(*) FROM outbox WHERE idempotency_key LIKE 'held-%' AND attempts > 0`),
		"no held-back row was even claimed")
}

// A row the client cannot send ends dead after MaxAttempts, with its
// reason, and holds back its order's later rows, visibly; every other
// order's events go out, on the same connection. Once an operator fixes the
// row, the replay flag publishes it, and its order goes on, in order.
func TestARefusedRowEndsDeadAndHoldsBackOnlyItsOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tooLong := strings.Repeat("x", 300) + ":order.confirmed"
	b.exec(t, `INSERT INTO outbox (idempotency_key, message_id, routing_key, payload, order_key)
		VALUES ($1, 'long', 'order.confirmed', '{"orderId":"o-bad"}', 'o-bad')`, tooLong)
	b.insertOrderRows(t, "o-bad", "after", 2)
	b.insertOrderRows(t, "o-good", "good", 3)

	r := b.startRelay(t, outbox.RelayConfig{MaxAttempts: 3, RetryBase: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond})
	b.receive(t, map[string]bool{"good-0:order.confirmed": true, "good-1:order.confirmed": true, "good-2:order.confirmed": true})
	require.Eventually(t, func() bool {
		return b.db.Int(t, "SELECT count(*) FROM outbox_dead") == 1
	}, 30*time.Second, 20*time.Millisecond)
	require.True(t, r.Connected(), "the refusal never reached the connection")

	var attempts, holdsBack, dead int
	var lastError string
	require.NoError(t, b.db.Pool.QueryRow(t.Context(),
		`SELECT attempts, last_error, holds_back, (SELECT dead FROM outbox_backlog) FROM outbox_dead`).Scan(&attempts, &lastError, &holdsBack, &dead))
	require.Equal(t, 3, attempts)
	require.Contains(t, lastError, "refused: the event id cannot be sent")
	require.Equal(t, 2, holdsBack)
	require.Equal(t, 1, dead)
	require.Eventually(t, func() bool { return b.unpublished(t) == 3 }, 10*time.Second, 10*time.Millisecond,
		"the dead row and the two it holds back")
	require.Equal(t, 3, b.db.Int(t, "SELECT attempts FROM outbox WHERE message_id = 'long'"), "a dead row is not claimed again")

	// The fix, then the replay: the trigger resets the row and records it.
	b.exec(t, `UPDATE outbox SET idempotency_key = 'long:order.confirmed' WHERE message_id = 'long'`)
	b.exec(t, `UPDATE outbox SET replay_requested = true, replay_reason = 'key fixed' WHERE message_id = 'long'`)
	require.Equal(t, []string{"1 key fixed false"}, b.db.Strings(t,
		`SELECT replay_count || ' ' || replay_reason || ' ' || replay_requested FROM outbox WHERE message_id = 'long'`))
	got := b.receiveInOrder(t, 3)
	require.Equal(t, []string{"long:order.confirmed", "after-0:order.confirmed", "after-1:order.confirmed"}, got)
	require.Zero(t, b.db.Int(t, "SELECT count(*) FROM outbox_dead"))

	// Only a replay changes the audit columns.
	b.exec(t, `UPDATE outbox SET replay_reason = 'rewritten', replay_count = 0 WHERE message_id = 'long'`)
	require.Equal(t, []string{"1 key fixed"}, b.db.Strings(t,
		`SELECT replay_count || ' ' || replay_reason FROM outbox WHERE message_id = 'long'`))
}

// receiveInOrder returns the ids of the next n events, in arrival order.
func (b *bundle) receiveInOrder(t *testing.T, n int) []string {
	t.Helper()
	var ids []string
	timeout := time.After(60 * time.Second)
	for len(ids) < n {
		select {
		case d := <-b.received:
			ids = append(ids, d.MessageId)
		case <-timeout:
			t.Fatalf("%d of %d events arrived: %v", len(ids), n, ids)
		}
	}
	return ids
}
