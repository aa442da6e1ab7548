package freeport

import (
	"fmt"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// The ports handed out lie outside the kernel's ephemeral range, where no
// outgoing connection can take one before its server binds it; each is
// handed out once, and is free on every address.
func TestPortsLieOutsideTheEphemeralRange(t *testing.T) {
	low, high := EphemeralRange()
	seen := map[int]bool{}
	for range 200 {
		port, err := Port()
		require.NoError(t, err)
		require.GreaterOrEqual(t, port, Lowest)
		require.False(t, port >= low && port <= high, "port %d of the ephemeral range %d-%d", port, low, high)
		require.False(t, seen[port], "port %d handed out twice", port)
		seen[port] = true
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		require.NoError(t, err)
		require.NoError(t, l.Close())
	}
}
