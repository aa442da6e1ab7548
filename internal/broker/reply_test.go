package broker_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
)

func TestReplyPolicyAllows(t *testing.T) {
	t.Parallel()
	none := broker.ReplyPolicy{}
	require.True(t, none.Allows("amq.rabbitmq.reply-to.g1h2AA"), "direct reply-to, always")
	require.False(t, none.Allows("billing.commands"), "no queue by default")
	require.False(t, none.Allows("amq.gen-abc"))
	require.False(t, none.Allows("amq.rabbitmq.reply-to"), "the name a requester sets, which the broker rewrites")
	require.False(t, none.Allows("xamq.rabbitmq.reply-to.g1h2AA"))

	some := broker.ReplyPolicy{QueuePrefixes: []string{"checkout.replies.", "amq.gen-", ""}}
	require.True(t, some.Allows("checkout.replies.7"))
	require.True(t, some.Allows("amq.gen-abc"))
	require.False(t, some.Allows("checkout.commands"))
	require.False(t, some.Allows("billing.commands"), "an empty prefix allows nothing")
}
