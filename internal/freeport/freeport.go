// Package freeport hands out TCP ports for the servers tests and the
// bench start beside each other on one machine (RabbitMQ nodes,
// PostgreSQL servers, inboxd's HTTP listener).
//
// A port is taken below the kernel's ephemeral range. A port of that range
// that is free when asked (as bind to port 0 returns one) can be taken by
// an outgoing connection of anything running beside the caller in the
// seconds before its server binds it; a RabbitMQ node whose distribution
// port is taken dies while it boots without writing a line of log.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// Lowest is where Port starts looking: above the ports services are
// usually configured on, below the kernel's ephemeral range.
const Lowest = 15000

// given holds the ports handed out in this process, so that two callers
// running side by side never get the same one.
var given struct {
	sync.Mutex
	ports map[int]bool
}

// Port returns a TCP port between Lowest and the ephemeral range that is
// free on every address at the time of the call and that this process
// has not handed out before.
func Port() (int, error) {
	highest := EphemeralLow() - 1
	given.Lock()
	defer given.Unlock()
	if given.ports == nil {
		given.ports = map[int]bool{}
	}
	for range 1000 {
		port := Lowest + rand.IntN(highest-Lowest+1)
		if given.ports[port] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			continue
		}
		_ = l.Close()
		given.ports[port] = true
		return port, nil
	}
	return 0, fmt.Errorf("freeport: no free port between %d and %d", Lowest, highest)
}

// Addr returns 127.0.0.1 with a port from Port.
func Addr() (string, error) {
	port, err := Port()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("127.0.0.1:%d", port), nil
}

// EphemeralLow is the lowest port the kernel hands to outgoing
// connections (32768 where it cannot be read).
func EphemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if low, err := strconv.Atoi(f[0]); err == nil && low > Lowest+1000 {
				return low
			}
		}
	}
	return 32768
}
