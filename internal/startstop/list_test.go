package startstop_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/startstop"
)

// recorder is a service that records its starts and stops in log.
type recorder struct {
	name    string
	log     *[]string
	failing bool
}

func (r recorder) Start(context.Context) error {
	if r.failing {
		return errors.New(r.name + " failed")
	}
	*r.log = append(*r.log, "start "+r.name)
	return nil
}

func (r recorder) Stop(context.Context) { *r.log = append(*r.log, "stop "+r.name) }

func TestStartAll(t *testing.T) {
	t.Parallel()

	t.Run("StopsInReverse", func(t *testing.T) {
		t.Parallel()
		var log []string
		services := []startstop.Startable{recorder{name: "a", log: &log}, recorder{name: "b", log: &log}}
		require.NoError(t, startstop.StartAll(t.Context(), services...))
		startstop.StopAll(t.Context(), services...)
		require.Equal(t, []string{"start a", "start b", "stop b", "stop a"}, log)
	})

	t.Run("RollsBackWhenOneFails", func(t *testing.T) {
		t.Parallel()
		var log []string
		err := startstop.StartAll(t.Context(),
			recorder{name: "a", log: &log}, recorder{name: "b", log: &log},
			recorder{name: "c", log: &log, failing: true}, recorder{name: "d", log: &log})
		require.EqualError(t, err, "c failed")
		require.Equal(t, []string{"start a", "start b", "stop b", "stop a"}, log, "what started is stopped, d never starts")
	})
}

func TestFunc(t *testing.T) {
	t.Parallel()
	ended := make(chan struct{})
	s := startstop.Func(func(ctx context.Context) {
		<-ctx.Done()
		close(ended)
	})
	require.NoError(t, s.Start(t.Context()))
	s.Stop(t.Context())
	<-ended
}
