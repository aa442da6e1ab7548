package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/tracing"
)

// batch accumulates deliveries of one channel until they are flushed.
type batch struct {
	ch *amqp.Channel
	// queue is the inbox queue the channel consumes.
	queue      string
	deliveries []amqp.Delivery
	bytes      int // of the deliveries' bodies
	// stopping is closed when the session ends: a failing store is then not
	// retried, and its deliveries go back to the queue.
	stopping <-chan struct{}
}

func (b *batch) add(d amqp.Delivery) {
	b.deliveries = append(b.deliveries, d)
	b.bytes += len(d.Body)
}

// reset empties the batch, letting go of its bodies.
func (b *batch) reset() {
	clear(b.deliveries)
	b.deliveries, b.bytes = b.deliveries[:0], 0
}

// abandoned reports whether the batch can no longer be acknowledged, or
// should not be held any longer: its session is stopping or its channel
// closed.
func (b *batch) abandoned() bool {
	select {
	case <-b.stopping:
		return true
	default:
	}
	return b.ch.IsClosed()
}

// collect gathers the deliveries of in into b and flushes it when it is due,
// until the channel fails or sessCtx ends. Batches are stored one after the
// other, each after the one before it has committed, so that the inbox's ids
// follow the order in which the broker delivered the messages.
func (i *Ingest) collect(sessCtx, workCtx context.Context, in inbound, b *batch, dl *deadLetters, p *partition) error {
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	// Held dead letters are tried again each second, new deliveries or not.
	retryHeld := time.NewTicker(time.Second)
	defer retryHeld.Stop()
	for {
		select {
		case <-retryHeld.C:
			if len(dl.held) > 0 && len(b.deliveries) == 0 {
				if _, err := dl.handle(workCtx, nil); err != nil {
					return err
				}
			}
		case d, ok := <-in.deliveries:
			if !ok {
				return channelError(in.closed, "delivery channel closed")
			}
			p.activeSince.CompareAndSwap(0, time.Now().UnixNano())
			b.add(d)
			if len(b.deliveries) == 1 {
				linger.Reset(i.cfg.Linger)
			}
			if i.due(b, d) {
				linger.Stop()
				if err := i.flush(workCtx, b, dl); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := i.flush(workCtx, b, dl); err != nil {
				return err
			}
		case amqpErr := <-in.closed:
			return closedError("channel", amqpErr)
		case <-in.cancelled:
			return errors.New("consumer cancelled by the broker (queue deleted?)")
		case <-sessCtx.Done():
			// Store the batch in hand, then close the channel without
			// cancelling first: the broker requeues what it sent ahead and
			// gives it, before anything newer, to the next consumer. After a
			// cancel it would pick the next consumer at once, which could
			// store newer messages of an order before these.
			return i.flush(workCtx, b, dl)
		case <-p.yield:
			// The same, handing the queue to a standby replica.
			if err := i.flush(workCtx, b, dl); err != nil {
				return err
			}
			return errYielded
		}
	}
}

// due reports whether b, last added, is to be stored at once without
// lingering: when full, when it holds half of what the broker may send
// ahead (the other half keeps coming while it is stored), when its bodies
// reach half its partition's share of the budget, or when it holds a body over the limit
// (dead-lettered, and so released, at once).
func (i *Ingest) due(b *batch, last amqp.Delivery) bool {
	return len(b.deliveries) >= min(i.cfg.BatchSize, max(i.prefetch()/2, 1)) ||
		b.bytes >= i.cfg.MaxInflightBytes/i.cfg.Partitions/2 || len(last.Body) > i.cfg.MaxMessageBytes
}

// prefetch is each inbox queue's share of Config.Prefetch: however many
// partitions one replica is active on, the bodies it holds stay within
// Config.MaxInflightBytes.
func (i *Ingest) prefetch() int {
	return max(i.cfg.Prefetch/i.cfg.Partitions, 1)
}

// flush stores the batch, dead-letters what cannot be stored, and then
// acknowledges every delivery of the batch with one multiple ack. It returns
// an error, leaving the batch unacknowledged, only when the channel or the
// stop deadline ended the attempt.
func (i *Ingest) flush(ctx context.Context, b *batch, dl *deadLetters) error {
	if len(b.deliveries) == 0 {
		return nil
	}
	rows, rejects := i.validate(b.deliveries)
	ctx, span := i.cfg.Tracer.StartReceive(ctx, b.queue, len(b.deliveries), traces(rows))
	defer span.End()

	res, err := i.store.untilDone(ctx, rows, b.abandoned)
	if err != nil {
		tracing.Fail(span, err)
		return err
	}
	for _, n := range res.rejects {
		rejects = append(rejects, rejection{delivery: b.deliveries[rows[n].delivery], reason: "refused by the database"})
	}
	held, err := dl.handle(ctx, rejects)
	if err != nil {
		return fmt.Errorf("dead-letter %d deliveries: %w", len(rejects), err)
	}
	if err := ack(b, held, rejects); err != nil {
		return err
	}
	i.report(ctx, Stats{
		Deliveries:   len(b.deliveries),
		Inserted:     res.inserted,
		Duplicates:   len(rows) - len(res.rejects) - res.inserted,
		DeadLettered: len(rejects),
		Conflicts:    res.conflicts,

		RepliesNotAllowed:    repliesNotAllowed(rows),
		RepliesOfAnotherUser: res.repliesOfAnotherUser,
	})
	b.reset()
	if res.inserted > 0 && i.cfg.OnStored != nil {
		i.cfg.OnStored()
	}
	return nil
}

// repliesNotAllowed counts the rows whose request for a reply was not kept.
func repliesNotAllowed(rows []row) int {
	n := 0
	for _, r := range rows {
		if r.replyNotAllowed {
			n++
		}
	}
	return n
}

// ack acknowledges the deliveries of b: all with one multiple ack, or, while
// dead letters are held (each must stay unacknowledged until it is
// published), each stored one on its own.
func ack(b *batch, held bool, rejects []rejection) error {
	if !held {
		if err := b.deliveries[len(b.deliveries)-1].Ack(true); err != nil {
			return fmt.Errorf("ack batch: %w", err)
		}
		return nil
	}
	rejected := map[uint64]bool{}
	for _, r := range rejects {
		rejected[r.delivery.DeliveryTag] = true
	}
	for _, d := range b.deliveries {
		if rejected[d.DeliveryTag] {
			continue
		}
		if err := d.Ack(false); err != nil {
			return fmt.Errorf("ack delivery: %w", err)
		}
	}
	return nil
}

// report logs an acknowledged batch and tells Config.Observe about it.
func (i *Ingest) report(ctx context.Context, s Stats) {
	i.logger.DebugContext(ctx, "batch stored",
		slog.Int("deliveries", s.Deliveries),
		slog.Int("inserted", s.Inserted),
		slog.Int("duplicates", s.Duplicates),
		slog.Int("dead_lettered", s.DeadLettered))
	if i.cfg.Observe != nil {
		i.cfg.Observe(s)
	}
}
