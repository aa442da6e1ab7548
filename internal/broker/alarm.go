package broker

import (
	"log/slog"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/startstop"
)

// Alarm follows whether the broker blocks a connection: RabbitMQ sends
// connection.blocked when a memory or disk alarm goes off and stops reading
// from every connection that publishes, then connection.unblocked when it
// clears. A blocked connection answers nothing, confirms and RPCs included,
// so whoever publishes on it waits for Changed instead of calling it. The
// zero Alarm is never active.
type Alarm struct {
	mu      sync.Mutex
	active  bool
	reason  string
	changed chan struct{}
}

// WatchAlarm follows conn's blocked state until conn closes, logging each
// change on logger with what names the connection.
func WatchAlarm(conn *amqp.Connection, logger *slog.Logger, what string) *Alarm {
	a := &Alarm{changed: make(chan struct{})}
	notes := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
	startstop.Go(func() {
		// amqp091-go sends each notification synchronously: drained at
		// once, or the connection would stall.
		for b := range notes {
			a.set(b.Active, b.Reason)
			if b.Active {
				logger.Warn("broker blocks the "+what+" connection (a memory or disk alarm)", slog.String("reason", b.Reason))
			} else {
				logger.Info("broker unblocked the " + what + " connection")
			}
		}
	})
	return a
}

func (a *Alarm) set(active bool, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.active, a.reason = active, reason
	close(a.changed)
	a.changed = make(chan struct{})
}

// Active reports whether the broker blocks the connection now, and why.
func (a *Alarm) Active() (bool, string) {
	if a == nil {
		return false, ""
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.active, a.reason
}

// Changed returns a channel closed at the next change of state.
func (a *Alarm) Changed() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.changed
}
