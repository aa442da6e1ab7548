package ingest

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/msgid"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// row is a delivery that can be stored.
type row struct {
	messageID, messageType, routingKey, orderKey string
	payload                                      []byte
	delivery                                     int // index in batch.deliveries
	// trace is the delivery's W3C trace context (zero when it had none, or
	// a malformed one).
	trace tracing.Text
	// replyTo and correlationID are the delivery's request for a reply
	// (empty replyTo: none); see replyRequest. userID is the delivery's
	// AMQP user_id (checked by the broker against its connection's user).
	replyTo, correlationID, userID string
	// replyNotAllowed is set when the delivery asked for a reply to an
	// address Config.ReplyPolicy does not allow: it is stored and handled,
	// and not answered.
	replyNotAllowed bool
	// redelivered is set when the request may have been stored already:
	// the broker redelivers the delivery, or a store whose outcome is
	// unknown is tried again.
	redelivered bool
}

// validate splits deliveries into the rows to store, in delivery order, and
// the deliveries that cannot be stored.
func (i *Ingest) validate(deliveries []amqp.Delivery) ([]row, []rejection) {
	rows := make([]row, 0, len(deliveries))
	var rejects []rejection
	for n, d := range deliveries {
		r, reason := i.classify(d)
		if reason != "" {
			rejects = append(rejects, rejection{delivery: d, reason: reason})
			continue
		}
		r.delivery = n
		rows = append(rows, r)
	}
	return rows, rejects
}

// classify turns a delivery into a row, or says why it cannot be stored.
func (i *Ingest) classify(d amqp.Delivery) (row, string) {
	if len(d.Body) > i.cfg.MaxMessageBytes {
		return row{}, fmt.Sprintf("message too large: %d bytes, the limit is %d", len(d.Body), i.cfg.MaxMessageBytes)
	}
	msgType := cmp.Or(d.Type, d.RoutingKey)
	if msgType == "" {
		return row{}, "no message type: neither a type property nor a routing key"
	}
	if msgid.Check(msgType) != nil {
		return row{}, "message type is not valid UTF-8 text or is too long"
	}
	id := d.MessageId
	if id == "" {
		if !i.cfg.DeriveMissingMessageID {
			return row{}, "missing message_id"
		}
		id = derivedMessageID(msgType, d.Body)
	}
	if msgid.Check(id) != nil {
		return row{}, "message_id is not valid UTF-8 text or is too long"
	}
	r := row{
		messageID:   id,
		messageType: msgType,
		routingKey:  strings.ToValidUTF8(strings.ReplaceAll(d.RoutingKey, "\x00", ""), "?"),
		payload:     d.Body,
		trace:       tracing.FromHeaders(d.Headers),
		redelivered: d.Redelivered,
	}
	r.replyTo, r.correlationID, r.replyNotAllowed = i.replyRequest(d, id)
	r.userID = strings.ToValidUTF8(strings.ReplaceAll(d.UserId, "\x00", ""), "?")
	if i.cfg.OrderingKey != nil {
		if key := i.cfg.OrderingKey(msgType, d.Body); msgid.Check(key) == nil {
			r.orderKey = key
		}
	}
	if i.cfg.Partitions > 1 {
		if reason := misrouted(d, r.orderKey, i.cfg.Partitions); reason != "" {
			return row{}, reason
		}
	}
	return r, ""
}

// misrouted says why a delivery of a partitioned inbox may sit in another
// queue than the other messages of its order: it has no
// broker.HeaderOrderID, or one that is not its order key (a body without a
// readable key is stored, and dies in the handler). Such a delivery is
// dead-lettered, never stored out of its order's sequence.
func misrouted(d amqp.Delivery, orderKey string, partitions int) string {
	header, ok := d.Headers[broker.HeaderOrderID].(string)
	switch {
	case !ok:
		return fmt.Sprintf("no %s header (a string, the order id): with %d inbox partitions the broker hashes it to keep an order's messages in one queue",
			broker.HeaderOrderID, partitions)
	case orderKey != "" && header != orderKey:
		return fmt.Sprintf("%s header %q is not the message's order id %q: with %d inbox partitions the message may sit in another queue than its order's",
			broker.HeaderOrderID, header, orderKey, partitions)
	}
	return ""
}

// replyRequest returns the delivery's reply_to and correlation_id when it
// asks for a reply that may be sent. PostgreSQL's text cannot hold one that
// is not valid UTF-8 or holds a NUL byte, and a reply to a changed address
// or id would reach nobody: such a request is logged and not kept. A reply
// to an address Config.ReplyPolicy does not allow is not kept either
// (notAllowed), and logged once for each address. Either way the message
// is stored and handled as usual.
func (i *Ingest) replyRequest(d amqp.Delivery, id string) (replyTo, correlationID string, notAllowed bool) {
	if d.ReplyTo == "" {
		return "", "", false
	}
	if msgid.Check(d.ReplyTo) != nil || (d.CorrelationId != "" && msgid.Check(d.CorrelationId) != nil) {
		i.logger.Warn("reply_to or correlation_id is not text PostgreSQL can store (invalid UTF-8, or a NUL byte): the message is stored, no reply will be sent",
			slog.String("message_id", id))
		return "", "", false
	}
	if !i.cfg.ReplyPolicy.Allows(d.ReplyTo) {
		if i.notAllowed.first(d.ReplyTo) {
			i.logger.Warn("reply_to is neither direct reply-to nor a queue INBOX_REPLY_QUEUE_PREFIXES allows: the message is stored and handled, no reply will be sent (logged once for each address; counted in inboxd_reply_requests_ignored_total)",
				slog.String("message_id", id), slog.String("reply_to", d.ReplyTo), slog.String("user_id", d.UserId))
		}
		return "", "", true
	}
	return d.ReplyTo, d.CorrelationId, false
}

// onceSet remembers up to onceSetMax strings, to log a condition once for
// each of them; past that, every string counts as seen.
type onceSet struct {
	mu   sync.Mutex
	seen map[string]struct{}
}

const onceSetMax = 1024

// first reports whether s is new to the set, and remembers it.
func (o *onceSet) first(s string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.seen[s]; ok || len(o.seen) >= onceSetMax {
		return false
	}
	if o.seen == nil {
		o.seen = map[string]struct{}{}
	}
	o.seen[s] = struct{}{}
	return true
}

// derivedMessageID is the id of a delivery without one, when
// Config.DeriveMissingMessageID asks for it: identical bodies of one type
// get the same id.
func derivedMessageID(msgType string, body []byte) string {
	sum := sha256.New()
	sum.Write([]byte(msgType))
	sum.Write([]byte{0})
	sum.Write(body)
	return "sha256:" + hex.EncodeToString(sum.Sum(nil))
}

// traces returns the trace contexts the rows carry, the origins of a batch's
// receive span.
func traces(rows []row) []tracing.Text {
	var origins []tracing.Text
	for _, r := range rows {
		if !r.trace.IsZero() {
			origins = append(origins, r.trace)
		}
	}
	return origins
}
