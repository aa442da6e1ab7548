package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/tracing"
)

// rejection is a delivery that cannot be stored, with the reason.
type rejection struct {
	delivery amqp.Delivery
	reason   string
}

// deadLetters publishes rejected deliveries on a channel in confirm mode, of
// the dead-letter connection.
type deadLetters struct {
	ch      *amqp.Channel
	returns <-chan amqp.Return
	logger  *slog.Logger
}

// openDeadLetters opens the dead-letter channel on pubConn; a batch holds
// at most batchSize dead letters.
func openDeadLetters(pubConn *amqp.Connection, batchSize int, logger *slog.Logger) (*deadLetters, error) {
	ch, err := pubConn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open dead-letter channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("enable publisher confirms: %w", err)
	}
	// A dead letter no queue takes comes back (mandatory); a batch has at
	// most BatchSize of them, drained after each.
	returns := ch.NotifyReturn(make(chan amqp.Return, batchSize))
	return &deadLetters{ch: ch, returns: returns, logger: logger}, nil
}

func (dl *deadLetters) close() { _ = dl.ch.Close() }

// publish publishes rejected deliveries to broker.ExchangeDeadLetter with the
// reason in a header, and waits for the broker to confirm every publish. A
// dead letter that no queue took is an error: the batch then stays
// unacknowledged, and the next session declares broker.QueueDead again.
func (dl *deadLetters) publish(ctx context.Context, rejects []rejection) error {
	pub := broker.Publisher{Ch: dl.ch}
	for _, r := range rejects {
		d := r.delivery
		if err := pub.Publish(ctx, broker.ExchangeDeadLetter, d.RoutingKey, true, deadLetter(r)); err != nil {
			return err
		}
		dl.logger.WarnContext(tracing.FromHeaders(d.Headers).Context(ctx), "delivery dead-lettered",
			slog.String("message_id", d.MessageId), slog.String("routing_key", d.RoutingKey),
			slog.Int("bytes", len(d.Body)), slog.String("reason", r.reason))
	}
	if err := pub.Wait(ctx); err != nil {
		if errors.Is(err, broker.ErrNacked) {
			return errors.New("broker refused a dead letter")
		}
		return err
	}
	// A return comes before the confirm of its publish.
	n := len(broker.DrainReturns(dl.returns))
	if n > 0 {
		return fmt.Errorf("%d dead letters returned unroutable: is %s missing?", n, broker.QueueDead)
	}
	return nil
}

// deadLetter is the message that carries a rejected delivery: its body and
// properties, its headers and the reason with where it came from.
func deadLetter(r rejection) amqp.Publishing {
	d := r.delivery
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers[broker.HeaderRejectReason] = r.reason
	headers[broker.HeaderOriginalExchange] = d.Exchange
	headers[broker.HeaderOriginalRoutingKey] = d.RoutingKey
	if d.Expiration != "" {
		headers[broker.HeaderOriginalExpiration] = d.Expiration
	}
	if d.UserId != "" {
		headers[broker.HeaderOriginalUserID] = d.UserId
	}
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}
