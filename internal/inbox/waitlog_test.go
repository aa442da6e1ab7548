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
	require.False(t, ok, "past the bound, a new reason waits for an old one to end")
	require.Empty(t, l.ended(now.Add(waitLogEvery)), "they ended, with nothing left unsaid")
	ok, _ = l.allow("one more", now.Add(waitLogEvery))
	require.True(t, ok)
	require.LessOrEqual(t, len(l.reasons), waitLogReasons)
}

func TestWaitLogSaysWhenAReasonEnded(t *testing.T) {
	t.Parallel()
	var l waitLog
	start := time.Unix(0, 0)
	for i := range 100 { // a stall of 4 s: one line, 99 waits not logged
		l.allow("stock row A locked", start.Add(time.Duration(i)*40*time.Millisecond))
	}
	require.Empty(t, l.ended(start.Add(5*time.Second)), "not yet: a wait came 1 s ago")
	require.Equal(t, []endedWait{{reason: "stock row A locked", notLogged: 99}}, l.ended(start.Add(14*time.Second)))
	require.Empty(t, l.reasons)
	ok, _ := l.allow("stock row A locked", start.Add(15*time.Second))
	require.True(t, ok, "a new stall for the reason is logged at once")
}
