package testenv

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/freeport"
)

// freePort returns a TCP port for a server a test starts (a RabbitMQ
// node, a PostgreSQL server), from freeport.Port: free on every address,
// outside the kernel's ephemeral range, handed out once.
func freePort(t *testing.T) int {
	t.Helper()
	port, err := freeport.Port()
	require.NoError(t, err)
	return port
}

// FreeAddr returns an address of 127.0.0.1 for a server a test starts
// (inboxd's HTTP_ADDR), from freeport.Addr.
func FreeAddr(t *testing.T) string {
	t.Helper()
	addr, err := freeport.Addr()
	require.NoError(t, err)
	return addr
}
