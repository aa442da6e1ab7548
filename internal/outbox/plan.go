package outbox

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/msgid"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// claimedRow is one row of a claimed batch: the row as claimed, its place in
// the batch's plan, and what became of its publish.
type claimedRow struct {
	dbsqlc.OutboxClaimBatchRow
	round int
	// prev is the row of the same order in the round before, nil for the
	// first row of an order and for a row of no order.
	prev *claimedRow

	// confirmed is set once the broker has confirmed the publish and not
	// returned it.
	confirmed bool
	// reason says why the row was not published, when the broker said so (a
	// return) or the relay refused to send it; empty otherwise.
	reason string
	// refused is set when the row was not sent because it cannot be: a
	// reason that retrying does not change (see refusal).
	refused bool
}

// refusal says why the row cannot be published as it is, whatever the
// broker's state: an id or routing key that does not fit an AMQP short
// string, which the client would refuse after closing the connection, or a
// reply to an address replies may not go to. Rows the handler writes
// always fit (msgid.EventID), and ingest stores no request replies may not
// answer; rows written by an earlier build or by hand may not. It returns
// "" for a row that can be sent.
func (c *claimedRow) refusal(replies broker.ReplyPolicy) string {
	if c.ReplyTo != "" && !replies.Allows(c.ReplyTo) {
		return "refused: reply_to is neither direct reply-to nor a queue INBOX_REPLY_QUEUE_PREFIXES allows"
	}
	if err := msgid.Check(c.IdempotencyKey); err != nil {
		return fmt.Sprintf("refused: the event id cannot be sent as an AMQP message_id: %v", err)
	}
	if len(c.RoutingKey) > msgid.MaxBytes || len(c.ReplyTo) > msgid.MaxBytes {
		return fmt.Sprintf("refused: the routing key is longer than %d bytes", msgid.MaxBytes)
	}
	if len(c.CorrelationID) > msgid.MaxBytes {
		return fmt.Sprintf("refused: the correlation id is longer than %d bytes", msgid.MaxBytes)
	}
	return ""
}

// heldBack reports whether the row must not be published in this batch: an
// earlier row of its order was not published (not confirmed, returned, or
// held back itself), so publishing this one would overtake it.
func (c *claimedRow) heldBack() bool { return c.prev != nil && !c.prev.confirmed }

func (c *claimedRow) trace() tracing.Text {
	return tracing.Text{Traceparent: c.Traceparent, Tracestate: c.Tracestate}
}

// plan says in which round each row of a claimed batch is published, and,
// as the rounds are confirmed, which rows are held back.
//
// The rows are published in id order: the claim returns its rows in no set
// order, and an order's events must leave in the order they were written.
// An order's rows go out one round at a time: its first row in the first
// round, with the first rows of the other orders, its second in the next,
// once the first is confirmed. Rows of no order all go out in the first
// round. A row that was not confirmed (or came back) holds back the later
// rows of its order, so no event of an order reaches the exchange ahead of
// an earlier one.
type plan struct {
	// rows is every claimed row, in id order.
	rows []*claimedRow
	// rounds holds the rows of each round, in id order.
	rounds [][]*claimedRow
}

// planBatch plans the publish of rows. It neither keeps nor changes rows.
func planBatch(rows []dbsqlc.OutboxClaimBatchRow) plan {
	var p plan
	for _, row := range rows {
		p.rows = append(p.rows, &claimedRow{OutboxClaimBatchRow: row})
	}
	slices.SortFunc(p.rows, func(a, b *claimedRow) int { return cmp.Compare(a.ID, b.ID) })
	last := map[string]*claimedRow{} // the latest row of each order so far
	for _, row := range p.rows {
		if row.OrderKey != "" {
			row.prev = last[row.OrderKey]
			if row.prev != nil {
				row.round = row.prev.round + 1
			}
			last[row.OrderKey] = row
		}
		if row.round == len(p.rounds) {
			p.rounds = append(p.rounds, nil)
		}
		p.rounds[row.round] = append(p.rounds[row.round], row)
	}
	return p
}

// due returns the rows of round n to publish: those not held back. It reads
// the outcome of the rounds before n, so it is asked once they are done.
func (p plan) due(n int) []*claimedRow {
	var out []*claimedRow
	for _, row := range p.rounds[n] {
		if !row.heldBack() {
			out = append(out, row)
		}
	}
	return out
}

func (p plan) traces() []tracing.Text {
	out := make([]tracing.Text, len(p.rows))
	for i, row := range p.rows {
		out[i] = row.trace()
	}
	return out
}
