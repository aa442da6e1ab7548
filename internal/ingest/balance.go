package ingest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
)

// partition is one inbox queue, as one replica's ingest consumes it.
type partition struct {
	queue string
	// activeSince is when the current subscription received its first
	// delivery (Unix nanoseconds), 0 before. A single active consumer stays
	// active until it goes, so a subscription that received one delivery
	// is the queue's active consumer.
	activeSince atomic.Int64
	// yield, when signalled, makes the consumer store its batch, close its
	// channel and subscribe again after yieldPause: the broker then hands
	// the queue to the consumer that waited longest.
	yield chan struct{}
	// counted is whether the partition is counted in Ingest.consuming
	// (owned by the partition's consumer goroutine).
	counted bool
}

// errYielded ends a consumer that gave its queue up.
var errYielded = errors.New("partition given up to another replica")

// Balancing the partitions over the replicas: every replica consumes every
// inbox queue, so each queue always has a standby; whichever subscribed
// first is active. Every balanceEvery, a replica active on more than its
// share (the partitions over the replicas, rounded up) gives one up; a
// queue it became active on less than holdAtLeast ago is kept, so that a
// handover is never undone at once.
const (
	balanceEvery = 2 * time.Second
	holdAtLeast  = 5 * time.Second
)

// balance keeps this replica active on at most its share of parts, until
// ctx ends. The number of replicas is the consumer count of
// broker.QueueIngestReplicas, which every replica consumes; when that
// queue goes (it is transient: with its node, say), it is declared and
// consumed again.
func (i *Ingest) balance(ctx context.Context, conn *amqp.Connection, parts []*partition) error {
	var counted *replicaCount
	defer func() { counted.close() }()
	tick := time.NewTicker(balanceEvery)
	defer tick.Stop()
	for {
		if counted == nil || counted.lost() {
			counted.close()
			var err error
			if counted, err = countReplicas(conn, i.cfg.ConnectionName); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		q, err := counted.ch.QueueDeclarePassive(broker.QueueIngestReplicas, false, true, false, false, nil)
		if err != nil {
			i.logger.Warn("cannot count the replicas; consuming the queue that counts them again",
				slog.String("queue", broker.QueueIngestReplicas), slog.String("error", err.Error()))
			counted.close()
			counted = nil
			continue
		}
		if p := overShare(parts, q.Consumers, time.Now()); p != nil {
			i.logger.Info("active on more partitions than its share; giving one up",
				slog.String("queue", p.queue), slog.Int("replicas", q.Consumers))
			select {
			case p.yield <- struct{}{}:
			default:
			}
		}
	}
}

// replicaCount is this replica's consumer of broker.QueueIngestReplicas.
type replicaCount struct {
	ch        *amqp.Channel
	cancelled <-chan string
}

// countReplicas declares broker.QueueIngestReplicas and consumes it on a
// channel of its own. Nothing is published to the queue; whatever is goes
// unread.
func countReplicas(conn *amqp.Connection, tag string) (*replicaCount, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	c := &replicaCount{ch: ch, cancelled: ch.NotifyCancel(make(chan string, 1))}
	_, err = ch.QueueDeclare(broker.QueueIngestReplicas, false, true, false, false, amqp.Table{amqp.QueueTypeArg: broker.QueueTypeClassic})
	if err == nil {
		_, err = ch.Consume(broker.QueueIngestReplicas, tag, true, false, false, false, nil)
	}
	if err != nil {
		c.close()
		return nil, fmt.Errorf("consume %q: %w", broker.QueueIngestReplicas, err)
	}
	return c, nil
}

// lost reports whether the consumer is gone: its channel closed, or the
// broker cancelled it (the queue was deleted).
func (c *replicaCount) lost() bool {
	select {
	case <-c.cancelled:
		return true
	default:
		return c.ch.IsClosed()
	}
}

// close closes the channel; a nil count has none.
func (c *replicaCount) close() {
	if c != nil {
		_ = c.ch.Close()
	}
}

// overShare returns the partition to give up, when this replica is active
// on more than its share of parts among replicas: the one it became active
// on last, of those held holdAtLeast. It returns nil otherwise.
func overShare(parts []*partition, replicas int, now time.Time) *partition {
	share := (len(parts) + max(replicas, 1) - 1) / max(replicas, 1)
	var active []*partition
	for _, p := range parts {
		if p.activeSince.Load() != 0 {
			active = append(active, p)
		}
	}
	if len(active) <= share {
		return nil
	}
	slices.SortFunc(active, func(a, b *partition) int { return cmp.Compare(b.activeSince.Load(), a.activeSince.Load()) })
	for _, p := range active {
		if now.Sub(time.Unix(0, p.activeSince.Load())) >= holdAtLeast {
			return p
		}
	}
	return nil
}
