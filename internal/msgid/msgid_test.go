package msgid_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/msgid"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	for id, want := range map[string]error{
		"order-1":                nil,
		strings.Repeat("x", 255): nil,
		strings.Repeat("é", 127): nil, // 254 bytes
		"":                       msgid.ErrEmpty,
		strings.Repeat("x", 256): msgid.ErrTooLong,
		"a\xffb":                 msgid.ErrUTF8,
		"a\x00b":                 msgid.ErrNUL,
		strings.Repeat("é", 128): msgid.ErrTooLong, // 256 bytes
		strings.Repeat("€", 85):  nil,              // 255 bytes
	} {
		require.Equal(t, want, msgid.Check(id), "%q", id)
	}
}

// Every legal id gives event ids that fit an AMQP short string, are valid
// UTF-8, differ between ids and between routing keys, and are the same on
// every call.
func TestEventIDFits(t *testing.T) {
	t.Parallel()
	keys := []string{"order.confirmed", "order.rejected", "order.cancelled", "email.requested"}
	var ids []string
	for n := 200; n <= 255; n++ {
		ids = append(ids, strings.Repeat("a", n), strings.Repeat("a", n-1)+"b")
	}
	for n := 67; n <= 85; n++ { // 3-byte characters, 201 to 255 bytes
		ids = append(ids, strings.Repeat("€", n), "x"+strings.Repeat("€", n-1))
	}
	for n := 50; n <= 63; n++ { // 4-byte characters, 200 to 255 bytes
		ids = append(ids, strings.Repeat("🙂", n), "x"+strings.Repeat("🙂", n), "xyz"+strings.Repeat("🙂", n))
	}
	seen := map[string]string{}
	for _, id := range ids {
		require.NoError(t, msgid.Check(id), "%q", id)
		for _, key := range keys {
			e := msgid.EventID(id, key)
			require.LessOrEqual(t, len(e), msgid.MaxBytes, "%q %s", id, key)
			require.True(t, utf8.ValidString(e), "%q %s", id, key)
			require.True(t, strings.HasSuffix(e, ":"+key))
			require.Equal(t, e, msgid.EventID(id, key), "stable")
			prev, dup := seen[e]
			require.False(t, dup, "%q and %q give the same event id %q", prev, id, e)
			seen[e] = id
		}
	}
}

// An id that fits with its routing key is kept as it is, so that a short
// id's events keep the ids they always had.
func TestEventIDOfAShortID(t *testing.T) {
	t.Parallel()
	require.Equal(t, "order-1:order.confirmed", msgid.EventID("order-1", "order.confirmed"))
	id := strings.Repeat("a", 255-len(":order.confirmed"))
	require.Equal(t, id+":order.confirmed", msgid.EventID(id, "order.confirmed"))
	long := id + "a"
	e := msgid.EventID(long, "order.confirmed")
	require.Len(t, e, msgid.MaxBytes)
	require.True(t, strings.HasPrefix(e, strings.Repeat("a", 100)), "the id's beginning stays readable: %s", e)
}
