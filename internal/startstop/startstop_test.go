package startstop_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/startstop"
)

func TestStopLetsWorkFinish(t *testing.T) {
	t.Parallel()
	var s startstop.Service
	finished := make(chan struct{})
	require.NoError(t, s.Start(t.Context(), func(fetchCtx, workCtx context.Context) {
		<-fetchCtx.Done()
		time.Sleep(50 * time.Millisecond) // work in flight
		require.NoError(t, workCtx.Err(), "work is not cancelled within the grace")
		close(finished)
	}))
	require.ErrorIs(t, s.Start(t.Context(), func(context.Context, context.Context) {}), startstop.ErrAlreadyStarted)
	s.Stop(t.Context())
	<-finished
}

func TestStopCancelsWorkWhenTheGraceEnds(t *testing.T) {
	t.Parallel()
	var s startstop.Service
	require.NoError(t, s.Start(t.Context(), func(_, workCtx context.Context) {
		<-workCtx.Done() // work that only ends when cancelled
	}))
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	s.Stop(ctx)
	var never startstop.Service
	never.Stop(t.Context())
}

func TestStopAbandonsARunThatIgnoresItsContexts(t *testing.T) {
	t.Parallel()
	var s startstop.Service
	release := make(chan struct{})
	defer close(release)
	require.NoError(t, s.Start(t.Context(), func(context.Context, context.Context) {
		<-release // a call that ignores every context
	}))
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	require.False(t, s.Stop(ctx), "Stop returns, reporting the run left behind")
}
