package testenv

import (
	"fmt"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// The ports handed to the servers tests start lie below the kernel's
// ephemeral range, where no outgoing connection of another test can take
// one before its server binds it; each is handed out once, and is free
// on every address.
func TestFreePortsLieBelowTheEphemeralRange(t *testing.T) {
	t.Parallel()
	seen := map[int]bool{}
	for range 200 {
		port := freePort(t)
		require.GreaterOrEqual(t, port, lowestPort)
		require.Less(t, port, ephemeralLow(), "a port of the ephemeral range")
		require.False(t, seen[port], "port %d handed out twice", port)
		seen[port] = true
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		require.NoError(t, err)
		require.NoError(t, l.Close())
	}
}
