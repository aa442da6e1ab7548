package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchReply measures request to reply: a real inboxd process, and a
// requester on direct reply-to publishing order.created at -steady-rate for
// -reply-duration, each with reply_to and its message id as correlation
// id, timing each reply's arrival from its request's publish.
func benchReply(ctx context.Context, o *options, r *report) error {
	e, err := newEnv(ctx, o, "reply")
	if err != nil {
		return err
	}
	defer e.close()
	svc, _, err := e.serve(ctx, o)
	if err != nil {
		return err
	}
	defer svc.stop()
	n := int(o.steadyRate * o.replyDuration.Seconds())
	w := loadgen.Generate(loadgen.Spec{Orders: n, Seed: 4, Prefix: e.name, SKUs: o.skus})

	req, err := newBenchRequester(e.amqpURL)
	if err != nil {
		return err
	}
	defer req.close()
	sent, err := req.publishPaced(ctx, w.Messages, o.steadyRate)
	if err != nil {
		return err
	}
	arrived, outcomes := req.wait(ctx, len(w.Messages), 60*time.Second)
	latency := map[string]time.Duration{}
	for id, at := range arrived {
		latency[id] = at.Sub(sent[id])
	}
	ds := sinceSent(sent, arrived)
	r.add(fmt.Sprintf("reply at %.0f requests/s for %s", o.steadyRate, o.replyDuration),
		"request to reply p50 %s, p99 %s, max %s (%d of %d replied; outcomes %v)",
		quantile(ds, 0.50), quantile(ds, 0.99), quantile(ds, 1), len(ds), len(w.Messages), outcomes)
	r.add("   p99 per window", "%s", perWindow(sent, latency, o.replyDuration))
	return nil
}

// benchRequester publishes requests and consumes their replies on one
// channel, as direct reply-to requires.
type benchRequester struct {
	conn *amqp.Connection
	ch   *amqp.Channel

	mu       sync.Mutex
	arrived  map[string]time.Time // correlation id → first reply's arrival
	outcomes map[string]int
	changed  chan struct{}
}

func newBenchRequester(amqpURL string) (*benchRequester, error) {
	conn, err := broker.Dial(amqpURL, "inboxbench requester", 0)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	replies, err := ch.Consume("amq.rabbitmq.reply-to", "", true, false, false, false, nil)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return nil, err
	}
	q := &benchRequester{conn: conn, ch: ch, arrived: map[string]time.Time{}, outcomes: map[string]int{}, changed: make(chan struct{}, 1)}
	go func() {
		for d := range replies {
			var body struct {
				Outcome string `json:"outcome"`
			}
			_ = json.Unmarshal(d.Body, &body)
			q.mu.Lock()
			if _, ok := q.arrived[d.CorrelationId]; !ok {
				q.arrived[d.CorrelationId] = time.Now()
				q.outcomes[body.Outcome]++
			}
			q.mu.Unlock()
			select {
			case q.changed <- struct{}{}:
			default:
			}
		}
	}()
	return q, nil
}

func (q *benchRequester) close() { _ = q.conn.Close() }

// publishPaced publishes msgs at rate per second as requests, and returns
// when each was sent.
func (q *benchRequester) publishPaced(ctx context.Context, msgs []loadgen.Message, rate float64) (map[string]time.Time, error) {
	return pace(ctx, q.ch, msgs, rate, func(m loadgen.Message) amqp.Publishing {
		return amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: m.MessageID, Body: m.Body,
			ReplyTo: "amq.rabbitmq.reply-to", CorrelationId: m.MessageID,
		}
	})
}

// wait waits until n replies have arrived, or timeout, and returns when
// each arrived, and the count of each outcome.
func (q *benchRequester) wait(ctx context.Context, n int, timeout time.Duration) (map[string]time.Time, map[string]int) {
	deadline := time.After(timeout)
	for {
		q.mu.Lock()
		done := len(q.arrived) >= n
		q.mu.Unlock()
		if done {
			break
		}
		select {
		case <-q.changed:
			continue
		case <-deadline:
		case <-ctx.Done():
		}
		break
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return maps.Clone(q.arrived), maps.Clone(q.outcomes)
}
