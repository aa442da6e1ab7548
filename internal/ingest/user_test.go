package ingest_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A copy asking for a reply is stored as a request only under the AMQP
// user_id of its message's first delivery, when that carried one, whether
// the first delivery is stored already or earlier in the same batch;
// the statement returns the copies it did not keep.
func TestACopyInTheSameBatchIsAnsweredOnlyForTheFirstUser(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	q := dbsqlc.New()
	type delivery struct{ id, user, replyTo, correlation string }
	store := func(ds ...delivery) (inserted, otherUser []string) {
		var p dbsqlc.InboxInsertManyParams
		for _, d := range ds {
			p.MessageIds, p.MessageTypes, p.RoutingKeys = append(p.MessageIds, d.id), append(p.MessageTypes, "order.created"), append(p.RoutingKeys, "order.created")
			p.Payloads, p.OrderKeys = append(p.Payloads, []byte(`{}`)), append(p.OrderKeys, d.id)
			p.Traceparents, p.Tracestates = append(p.Traceparents, ""), append(p.Tracestates, "")
			p.ReplyTos, p.CorrelationIds = append(p.ReplyTos, d.replyTo), append(p.CorrelationIds, d.correlation)
			p.Redelivered, p.UserIds = append(p.Redelivered, false), append(p.UserIds, d.user)
		}
		out, err := q.InboxInsertMany(t.Context(), db.Pool, p)
		require.NoError(t, err)
		for _, o := range out {
			switch {
			case o.AnotherUser:
				otherUser = append(otherUser, o.MessageID)
			case o.RequestID == 0: // not a request stored
				inserted = append(inserted, o.MessageID)
			}
		}
		return inserted, otherUser
	}
	inserted, other := store(
		delivery{"m-1", "alice", "q", "c-alice"},
		delivery{"m-1", "bob", "q", "c-bob"},
		delivery{"m-1", "", "q", "c-none"},
		delivery{"m-2", "", "q", "c-2-none"}, // no user_id first: any copy is answered
		delivery{"m-2", "bob", "q", "c-2-bob"},
		delivery{"m-3", "carol", "", ""}, // the first asks nothing, and still sets the user
		delivery{"m-3", "bob", "q", "c-3-bob"},
	)
	require.ElementsMatch(t, []string{"m-1", "m-2", "m-3"}, inserted)
	require.ElementsMatch(t, []string{"m-1", "m-1", "m-3"}, other)

	inserted, other = store(
		delivery{"m-1", "alice", "q", "c-alice-again"},
		delivery{"m-1", "bob", "q", "c-bob-again"},
		delivery{"m-3", "carol", "q", "c-3-carol"},
	)
	require.Empty(t, inserted)
	require.Equal(t, []string{"m-1"}, other)
	require.Equal(t, []string{"c-2-bob", "c-2-none", "c-3-carol", "c-alice", "c-alice-again"},
		db.Strings(t, "SELECT correlation_id FROM inbox_reply_requests ORDER BY 1"))
	require.Equal(t, []string{"m-1 alice", "m-2 -", "m-3 carol"},
		db.Strings(t, "SELECT message_id || ' ' || coalesce(user_id, '-') FROM inbox ORDER BY 1"))
}
