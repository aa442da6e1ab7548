package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// lowestPort is where freePort starts looking: above the ports services
// are usually configured on, below the kernel's ephemeral range.
const lowestPort = 15000

// givenPorts holds the ports freePort has handed out in this process, so
// that two tests running side by side never get the same one.
var givenPorts struct {
	sync.Mutex
	given map[int]bool
}

// freePort returns a TCP port free on every address at the time of the
// call, for a server a test starts (a RabbitMQ node, a PostgreSQL
// server). It is taken below the kernel's ephemeral range: a port of that
// range, free when asked, can be taken by an outgoing connection of a
// test running beside this one in the seconds before the server binds
// it, and a RabbitMQ node whose distribution port is taken dies while it
// boots without writing a line of log.
func freePort(t *testing.T) int {
	t.Helper()
	highest := ephemeralLow() - 1
	givenPorts.Lock()
	defer givenPorts.Unlock()
	if givenPorts.given == nil {
		givenPorts.given = map[int]bool{}
	}
	for range 1000 {
		port := lowestPort + rand.IntN(highest-lowestPort+1)
		if givenPorts.given[port] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			continue
		}
		_ = l.Close()
		givenPorts.given[port] = true
		return port
	}
	t.Fatalf("no free port between %d and %d", lowestPort, highest)
	return 0
}

// ephemeralLow is the lowest port the kernel hands to outgoing
// connections (32768 where it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if low, err := strconv.Atoi(f[0]); err == nil && low > lowestPort+1000 {
				return low
			}
		}
	}
	return 32768
}
