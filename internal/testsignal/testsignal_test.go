package testsignal_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testsignal"
)

func TestSignal(t *testing.T) {
	t.Parallel()
	var off testsignal.Signal[int]
	off.Signal(1) // a signal nobody initialized neither blocks nor panics

	var s testsignal.Signal[int]
	s.Init()
	s.Signal(1)
	s.Signal(2)
	require.Equal(t, 1, s.Wait(t))
	require.Equal(t, 2, s.Wait(t))
}
