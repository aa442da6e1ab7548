package broker_test

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
)

func TestDrainReturns(t *testing.T) {
	t.Parallel()
	returns := make(chan amqp.Return, 3)
	require.Empty(t, broker.DrainReturns(returns), "nothing waiting")
	returns <- amqp.Return{MessageId: "a"}
	returns <- amqp.Return{MessageId: "b"}
	require.Len(t, broker.DrainReturns(returns), 2)
	// amqp091 closes the channel when the AMQP channel closes: a closed
	// channel has nothing more (reading it forever would spin).
	returns <- amqp.Return{MessageId: "c"}
	close(returns)
	require.Len(t, broker.DrainReturns(returns), 1)
}
