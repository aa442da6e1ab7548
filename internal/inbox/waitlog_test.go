package inbox

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestWaitLogBoundsTheLinesOfOneReason(t *testing.T) {
	t.Parallel()
	var l waitLog
	start := time.Unix(0, 0)
	logged, last := 0, 0
	for i := range 10_000 { // a wait every 6 ms for a minute
		now := start.Add(time.Duration(i) * 6 * time.Millisecond)
		if ok, _ := l.allow("stock row A locked", now); ok {
			logged, last = logged+1, i
		}
	}
	require.Equal(t, 6, logged, "once at the start, then once every 10 s")
	ok, notLogged := l.allow("stock row A locked", start.Add(2*time.Minute))
	require.True(t, ok)
	require.Equal(t, 10_000-1-last, notLogged, "the line says how many were not logged since the last")

	ok, _ = l.allow("stock row B locked", start.Add(2*time.Minute))
	require.True(t, ok, "another reason is logged at once")
}

func TestWaitLogRemembersABoundedNumberOfReasons(t *testing.T) {
	t.Parallel()
	var l waitLog
	now := time.Unix(0, 0)
	for i := range waitLogReasons {
		ok, _ := l.allow(fmt.Sprint(i), now)
		require.True(t, ok)
	}
	ok, _ := l.allow("one more", now)
	require.False(t, ok, "past the bound, a new reason waits for an old one to go quiet")
	ok, _ = l.allow("one more", now.Add(waitLogEvery))
	require.True(t, ok)
	require.LessOrEqual(t, len(l.reasons), waitLogReasons)
}
