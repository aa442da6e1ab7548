package ingest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestOverShare(t *testing.T) {
	t.Parallel()
	now := time.Now()
	parts := func(activeFor ...time.Duration) []*partition {
		ps := make([]*partition, len(activeFor))
		for n, d := range activeFor {
			ps[n] = &partition{queue: string(rune('a' + n))}
			if d > 0 {
				ps[n].activeSince.Store(now.Add(-d).UnixNano())
			}
		}
		return ps
	}
	const long = time.Minute
	// Alone: every partition is its share.
	require.Nil(t, overShare(parts(long, long, long, long, long, long), 1, now))
	// Two replicas, six partitions: three each; the one it became active
	// on last goes first.
	ps := parts(long+2*time.Second, long+time.Second, long+3*time.Second, 2*long, long+4*time.Second, long)
	require.Equal(t, ps[5], overShare(ps, 2, now))
	require.Nil(t, overShare(parts(long, long, long, 0, 0, 0), 2, now))
	// Rounded up: four partitions over three replicas is two each.
	require.Nil(t, overShare(parts(long, long, 0, 0), 3, now))
	require.NotNil(t, overShare(parts(long, long, long, 0), 3, now))
	// A partition taken over a moment ago is kept, so a handover is not
	// undone at once.
	require.Nil(t, overShare(parts(time.Second, time.Second, time.Second, time.Second), 2, now))
	ps = parts(time.Second, long, time.Second, time.Second)
	require.Equal(t, ps[1], overShare(ps, 2, now))
	// No count (the queue was just declared): taken as one replica.
	require.Nil(t, overShare(parts(long, long), 0, now))
}
