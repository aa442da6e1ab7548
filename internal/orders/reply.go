package orders

import (
	"encoding/json"
	"strings"
)

// Outcomes a reply names (see Reply).
const (
	OutcomeConfirmed       = "confirmed"
	OutcomeRejected        = "rejected"
	OutcomeAlreadyRecorded = "already_recorded"
	OutcomeCancelled       = "cancelled"
	OutcomeNotCancelled    = "not_cancelled"
)

// Reply is what an order message's handling tells a requester that asked
// for it (AMQP reply_to): the outcome, and its reason when the order was
// rejected or not cancelled. The inbox adds the message id, order id,
// status and run; a message that ends dead replies {"outcome": "dead"} with
// its error instead.
type Reply struct {
	Outcome string `json:"outcome"`
	Reason  string `json:"reason,omitempty"`
}

// replyOf returns the reply of a message whose result is result;
// rejectReason is the reason an order.created message's order was
// rejected, "" for any other.
func replyOf(result, rejectReason string) []byte {
	var r Reply
	switch {
	case result == ResultConfirmed:
		r = Reply{Outcome: OutcomeConfirmed}
	case result == ResultRejected:
		r = Reply{Outcome: OutcomeRejected, Reason: rejectReason}
	case result == ResultAlreadyRecorded:
		r = Reply{Outcome: OutcomeAlreadyRecorded, Reason: "the order was recorded by an earlier message, under another message id"}
	case result == ResultCancelled, result == ResultCancelledUnseen:
		r = Reply{Outcome: OutcomeCancelled}
	case strings.HasPrefix(result, ResultNotCancelledPrefix):
		r = Reply{Outcome: OutcomeNotCancelled, Reason: strings.TrimPrefix(result, "not cancelled: ")}
	default:
		return nil
	}
	body, _ := json.Marshal(r) // two strings: it cannot fail
	return body
}
