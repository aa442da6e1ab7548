package broker

import (
	"context"
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrNacked is the error Publisher.Wait returns when the broker refused a
// publish.
var ErrNacked = errors.New("broker nacked a publish")

// Publisher publishes on a channel in confirm mode and waits for the
// broker's confirms, in the order of the publishes. The zero Window keeps
// every publish unconfirmed until Wait or Confirmed; a Window above 0 has
// Publish wait for the oldest confirm first once Window are outstanding.
type Publisher struct {
	Ch      *amqp.Channel
	Window  int
	pending []*amqp.DeferredConfirmation
}

// Publish publishes msg to exchange with key, mandatory or not. It returns
// the channel's error as it is, or Wait's error for the oldest confirm.
func (p *Publisher) Publish(ctx context.Context, exchange, key string, mandatory bool, msg amqp.Publishing) error {
	if p.Window > 0 && len(p.pending) >= p.Window {
		if err := p.waitOldest(ctx); err != nil {
			return err
		}
	}
	dc, err := p.Ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, mandatory, false, msg)
	if err != nil {
		return err
	}
	p.pending = append(p.pending, dc)
	return nil
}

// Wait waits for the confirm of every outstanding publish, oldest first,
// and returns at the first that fails: ctx's error, the channel's, or
// ErrNacked.
func (p *Publisher) Wait(ctx context.Context) error {
	for len(p.pending) > 0 {
		if err := p.waitOldest(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (p *Publisher) waitOldest(ctx context.Context) error {
	dc := p.pending[0]
	p.pending = p.pending[1:]
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	if !ok {
		return ErrNacked
	}
	return nil
}

// Confirmed waits until ctx ends for the confirm of every outstanding
// publish and reports, in the order of the publishes, whether the broker
// confirmed each; a confirm already in counts even once ctx has ended.
func (p *Publisher) Confirmed(ctx context.Context) []bool {
	out := make([]bool, len(p.pending))
	for i, dc := range p.pending {
		out[i] = confirmedBy(ctx, dc)
	}
	p.pending = nil
	return out
}

func confirmedBy(ctx context.Context, dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return dc.Acked()
	default:
	}
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		select {
		case <-dc.Done():
			return dc.Acked()
		default:
			return false
		}
	}
	return ok
}
