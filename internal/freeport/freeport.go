// Package freeport hands out TCP ports for the servers tests and the
// bench start beside each other on one machine (RabbitMQ nodes,
// PostgreSQL servers, inboxd's HTTP listener).
//
// A port is taken outside the kernel's ephemeral range. A port of that
// range that is free when asked (as bind to port 0 returns one) can be
// taken by an outgoing connection of anything running beside the caller
// in the seconds before its server binds it; a RabbitMQ node whose
// distribution port is taken dies while it boots without writing a line
// of log. Ports are handed out once per process; two processes may still
// pick the same one, at odds of about one in 17,000 a pair.
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
// usually configured on (PostgreSQL's 5432, RabbitMQ's 5672 and 15672).
const Lowest = 15000

// given holds the ports handed out in this process, so that two callers
// running side by side never get the same one.
var given struct {
	sync.Mutex
	ports map[int]bool
}

// Port returns a TCP port outside the kernel's ephemeral range (between
// Lowest and the range where there is room, else above it) that is free
// on every address at the time of the call and that this process has not
// handed out before. It fails when the ephemeral range leaves fewer than
// 1,000 ports above Lowest on either side of it.
func Port() (int, error) {
	low, high := EphemeralRange()
	first, last := Lowest, low-1 // below the ephemeral range where there is room
	if last-first < 1000 {
		first, last = max(high+1, Lowest), 65535
	}
	if last-first < 1000 {
		return 0, fmt.Errorf("freeport: the ephemeral range %d-%d leaves no room for test servers' ports above %d", low, high, Lowest)
	}
	given.Lock()
	defer given.Unlock()
	if given.ports == nil {
		given.ports = map[int]bool{}
	}
	for range 1000 {
		port := first + rand.IntN(last-first+1)
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
	return 0, fmt.Errorf("freeport: no free port found outside the ephemeral range %d-%d", low, high)
}

// Addr returns 127.0.0.1 with a port from Port.
func Addr() (string, error) {
	port, err := Port()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("127.0.0.1:%d", port), nil
}

// EphemeralRange is the range of ports the kernel hands to outgoing
// connections (Linux's default, 32768-60999, where it cannot be read).
func EphemeralRange() (low, high int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			l, errL := strconv.Atoi(f[0])
			h, errH := strconv.Atoi(f[1])
			if errL == nil && errH == nil && l <= h {
				return l, h
			}
		}
	}
	return 32768, 60999
}
