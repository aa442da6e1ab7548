package broker

import "strings"

// DirectReplyTo starts the reply_to of a requester on RabbitMQ's direct
// reply-to: the broker turns the "amq.rabbitmq.reply-to" a requester sets
// into this prefix and a name of its channel.
const DirectReplyTo = "amq.rabbitmq.reply-to."

// ReplyPolicy says which reply_to addresses the service answers. A reply is
// published under the service's own identity to the default exchange, which
// routes it to the queue its reply_to names: answered wherever it points, a
// producer could make the service publish into any queue of the virtual
// host (another service's command queue). So a reply goes only to RabbitMQ's
// direct reply-to, or to a queue whose name starts with one of
// QueuePrefixes.
type ReplyPolicy struct {
	// QueuePrefixes are the prefixes of the reply queues answered besides
	// direct reply-to. None by default: only direct reply-to is answered.
	QueuePrefixes []string
}

// Allows reports whether a reply may go to replyTo.
func (p ReplyPolicy) Allows(replyTo string) bool {
	if strings.HasPrefix(replyTo, DirectReplyTo) {
		return true
	}
	for _, prefix := range p.QueuePrefixes {
		if prefix != "" && strings.HasPrefix(replyTo, prefix) {
			return true
		}
	}
	return false
}
