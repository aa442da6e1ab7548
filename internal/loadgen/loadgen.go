// Package loadgen builds order workloads (with duplicates, re-sent ids and
// cancellations) and publishes them to the orders exchange with publisher
// confirms. Tests and the bench command share it.
package loadgen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// Message is one message to publish. An empty MessageID publishes the
// message without one.
type Message struct {
	MessageID  string
	RoutingKey string
	// Type is the AMQP type property; empty leaves it unset.
	Type string
	// OrderID, when set, is sent in the broker.HeaderOrderID header, which
	// partitioned ingest hashes on.
	OrderID string
	Body    []byte
}

// Spec describes a workload.
type Spec struct {
	// Orders is the number of distinct orders.
	Orders int
	// DuplicateRate is the fraction of messages published a second time
	// under the same message id.
	DuplicateRate float64
	// ResendRate is the fraction of orders whose order.created is sent again
	// under a new message id.
	ResendRate float64
	// CancelRate is the fraction of orders followed by an order.cancelled.
	CancelRate float64
	// Seed makes the workload reproducible.
	Seed uint64
	// Prefix starts every order and message id. Defaults to "o".
	Prefix string
	// SKUs is the number of distinct SKUs the orders draw their items from
	// (SKUName(0) … SKUName(SKUs-1)); each order has one to three items.
	// Zero means the three SKUs of OrderCreatedBody, the same for every
	// order.
	SKUs int
}

// Workload is a generated list of messages and what it should lead to.
type Workload struct {
	Messages []Message
	// UniqueMessageIDs is the number of distinct message ids.
	UniqueMessageIDs int
	// Cancelled lists the orders that get an order.cancelled.
	Cancelled map[string]bool
	// OrderIDs lists every order.
	OrderIDs []string
}

// Generate builds the workload of spec. A duplicate or re-sent message comes
// a little after its original, as redeliveries do; a cancellation comes after
// its order's order.created.
func Generate(spec Spec) *Workload {
	rng := rand.New(rand.NewPCG(spec.Seed, 0x1b0cd))
	prefix := spec.Prefix
	if prefix == "" {
		prefix = "o"
	}
	w := &Workload{Cancelled: map[string]bool{}}
	var extra []Message // duplicates, inserted later in the stream
	for i := range spec.Orders {
		orderID := fmt.Sprintf("%s-%06d", prefix, i)
		w.OrderIDs = append(w.OrderIDs, orderID)
		body := OrderCreatedBody(orderID, 1+rng.IntN(3))
		if spec.SKUs > 0 {
			body = orderBody(orderID, rng, spec.SKUs)
		}
		created := Message{
			MessageID:  fmt.Sprintf("%s-created", orderID),
			RoutingKey: orders.TypeOrderCreated,
			OrderID:    orderID,
			Body:       body,
		}
		w.Messages = append(w.Messages, created)
		w.UniqueMessageIDs++
		if rng.Float64() < spec.DuplicateRate {
			extra = append(extra, created)
		}
		if rng.Float64() < spec.ResendRate {
			resent := created
			resent.MessageID = fmt.Sprintf("%s-created-resent", orderID)
			w.Messages = append(w.Messages, resent)
			w.UniqueMessageIDs++
		}
		if rng.Float64() < spec.CancelRate {
			body, _ := json.Marshal(orders.OrderCancelled{OrderID: orderID, Reason: "customer request"})
			cancel := Message{MessageID: orderID + "-cancelled", RoutingKey: orders.TypeOrderCancelled, OrderID: orderID, Body: body}
			w.Messages = append(w.Messages, cancel)
			w.UniqueMessageIDs++
			w.Cancelled[orderID] = true
		}
		// Release duplicates a few messages later.
		for len(extra) > 0 && rng.IntN(3) == 0 {
			w.Messages = append(w.Messages, extra[0])
			extra = extra[1:]
		}
	}
	w.Messages = append(w.Messages, extra...)
	return w
}

// SKUName names the i-th SKU of a workload with Spec.SKUs set.
func SKUName(i int) string { return fmt.Sprintf("SKU-%05d", i) }

// orderBody returns an order of one to three distinct SKUs drawn from the
// first skus.
func orderBody(orderID string, rng *rand.Rand, skus int) []byte {
	m := orders.OrderCreated{OrderID: orderID, UserID: "user-" + orderID, Email: orderID + "@example.com"}
	picked := map[int]bool{}
	for range 1 + rng.IntN(min(3, skus)) {
		i := rng.IntN(skus)
		if !picked[i] {
			picked[i] = true
			m.Items = append(m.Items, orders.Item{SKU: SKUName(i), Quantity: 1 + rng.IntN(3)})
		}
	}
	b, _ := json.Marshal(m)
	return b
}

// OrderCreatedBody returns a valid order.created body with n items: SKU-1
// (quantity 1) up to SKU-n (quantity n).
func OrderCreatedBody(orderID string, n int) []byte {
	m := orders.OrderCreated{OrderID: orderID, UserID: "user-" + orderID, Email: orderID + "@example.com"}
	for i := range n {
		m.Items = append(m.Items, orders.Item{SKU: fmt.Sprintf("SKU-%d", i+1), Quantity: 1 + i})
	}
	b, _ := json.Marshal(m)
	return b
}

// Publish publishes msgs to the orders exchange in order, on one channel, as
// persistent messages, and returns once the broker has confirmed every one.
// It keeps up to window publishes unconfirmed at a time.
func Publish(ctx context.Context, amqpURL string, msgs []Message, window int) error {
	return PublishPaced(ctx, amqpURL, msgs, window, 0)
}

// PublishPaced is Publish at about perSecond messages a second (as fast as
// the broker confirms when perSecond is 0), all on one channel, so that the
// broker's order is msgs' order.
func PublishPaced(ctx context.Context, amqpURL string, msgs []Message, window, perSecond int) error {
	conn, ch, err := dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := ch.ExchangeDeclare(broker.ExchangeOrders, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	// A sliding window: once window publishes are unconfirmed, wait for
	// the oldest before the next.
	pub := broker.Publisher{Ch: ch, Window: max(window, 1)}
	started := time.Now()
	for i, m := range msgs {
		if perSecond > 0 {
			if ahead := time.Until(started.Add(time.Duration(i) * time.Second / time.Duration(perSecond))); ahead > 0 {
				select {
				case <-time.After(ahead):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		var headers amqp.Table
		if m.OrderID != "" {
			headers = amqp.Table{broker.HeaderOrderID: m.OrderID}
		}
		err := pub.Publish(ctx, broker.ExchangeOrders, m.RoutingKey, false, amqp.Publishing{
			Headers:      headers,
			ContentType:  "application/json",
			DeliveryMode: amqp.Persistent,
			MessageId:    m.MessageID,
			Type:         m.Type,
			Body:         m.Body,
		})
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
	}
	return pub.Wait(ctx)
}

// PublishParallel splits msgs into n contiguous parts and publishes each on
// its own connection at once.
func PublishParallel(ctx context.Context, amqpURL string, msgs []Message, n, window int) error {
	n = max(1, min(n, len(msgs)))
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		part := msgs[i*len(msgs)/n : (i+1)*len(msgs)/n]
		wg.Go(func() { errs[i] = Publish(ctx, amqpURL, part, window) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// DeclareTopology declares the service's exchanges and queues, so that
// messages published before the service first connects are not unroutable.
func DeclareTopology(amqpURL, queueType string) error {
	return broker.Declare(amqpURL, broker.Topology{QueueType: queueType, Partitions: 1})
}

// dial opens a connection and a channel on it; closing the connection
// closes both. The connection's name leaves out "inboxd": tests close the
// service's connections by that name, and the publisher's must stay.
func dial(amqpURL string) (*amqp.Connection, *amqp.Channel, error) {
	conn, err := broker.Dial(amqpURL, "loadgen", broker.HeartbeatDefault)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, nil, fmt.Errorf("open channel: %w", err)
	}
	return conn, ch, nil
}
