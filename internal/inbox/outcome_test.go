package inbox

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// decide is pure: each outcome, at each attempt, comes to one status. Only
// the message's own failures spend attempts; the database's trouble (a lock,
// a statement timeout, a lost connection, a serialization failure) waits
// and gives its attempt back.
func TestDecide(t *testing.T) {
	t.Parallel()
	cfg := &WorkerConfig{MaxAttempts: 3, RetryBase: time.Second, RetryMax: time.Minute}
	pg := func(code, msg string) error {
		return fmt.Errorf("stock: %w", &pgconn.PgError{Code: code, Message: msg})
	}
	for name, tc := range map[string]struct {
		attempt int
		err     error
		givenUp bool
		want    string
	}{
		"Success":                     {1, nil, false, StatusProcessed},
		"Failure":                     {1, errors.New("downstream down"), false, StatusPending},
		"FailureAtTheLastAttempt":     {3, errors.New("downstream down"), false, StatusDead},
		"Permanent":                   {1, Permanentf("bad body"), false, StatusDead},
		"RetryAfter":                  {1, RetryAfter(time.Hour, errors.New("rate limited")), false, StatusPending},
		"Wait":                        {3, Wait(time.Second, errors.New("held back")), false, outcomeWaiting},
		"LockTimeout":                 {3, pg("55P03", "canceling statement due to lock timeout"), false, outcomeWaiting},
		"StatementTimeout":            {3, pg("57014", "canceling statement due to statement timeout"), false, outcomeWaiting},
		"HandlerTimeoutCounts":        {3, pg("57014", "canceling statement due to user request"), false, StatusDead},
		"SerializationFailure":        {3, pg("40001", "could not serialize access"), false, outcomeWaiting},
		"Deadlock":                    {3, pg("40P01", "deadlock detected"), false, outcomeWaiting},
		"ConnectionLost":              {3, pg("08006", "connection failure"), false, outcomeWaiting},
		"ServerShuttingDown":          {3, pg("57P01", "terminating connection due to administrator command"), false, outcomeWaiting},
		"ConstraintViolationCounts":   {3, pg("23505", "duplicate key"), false, StatusDead},
		"GivenUpAfterUnfinishedTries": {4, nil, true, StatusDead},
	} {
		c := &claimed{msg: Message{Attempt: tc.attempt}, outcome: Outcome{Err: tc.err}, givenUp: tc.givenUp}
		require.Equal(t, tc.want, decide(cfg, c).status, name)
	}
}

// A reply the handler gives is kept only as a JSON object that jsonb takes,
// so that no reply can fail the statement that records a whole batch.
func TestReplyObject(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"outcome":"confirmed"}`, `{"outcome":"confirmed"}`},
		{` {"b":1, "a":"x"} `, `{"a":"x","b":1}`},
		{`{"s":"\ud800"}`, "{\"s\":\"\ufffd\"}"}, // a lone surrogate: jsonb refuses it
		{`{"n":1e1001}`, ``},                     // beyond float64: dropped
		{`{"s":"a\u0000b"}`, ``},                 // jsonb refuses NUL
		{`["not", "an", "object"]`, ``},
		{`null`, ``},
		{`{"broken":`, ``},
		{``, ``},
	} {
		require.Equal(t, tc.want, replyObject([]byte(tc.in)), tc.in)
	}
	require.Empty(t, replyObject([]byte(`{"s":"`+strings.Repeat("x", 5000)+`"}`)), "over 4 KiB")
}
