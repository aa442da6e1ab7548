// Package testsignal lets a service tell a test that it did something, so
// that the test waits for that instead of polling the database against a
// clock. In production a Signal is never initialized and Signal costs a nil
// check.
package testsignal

import (
	"testing"
	"time"
)

// signalBuffer is how many signals a test can leave unread before the
// service's further ones are dropped (a service never blocks on a test).
const signalBuffer = 100

// WaitTimeout bounds Wait: long enough for a loaded shared machine, short
// enough that a test whose signal never comes fails with a clear message.
const WaitTimeout = 30 * time.Second

// Signal carries values of type T from a service to a test. The zero value
// is off: Signal does nothing until a test calls Init.
type Signal[T any] struct {
	ch chan T
}

// Init turns the signal on. Call it before the service starts.
func (s *Signal[T]) Init() { s.ch = make(chan T, signalBuffer) }

// Signal sends v to the test, when one called Init; it never blocks.
func (s *Signal[T]) Signal(v T) {
	if s.ch == nil {
		return
	}
	select {
	case s.ch <- v:
	default:
	}
}

// Wait returns the next value signalled, failing t when none comes within
// WaitTimeout.
func (s *Signal[T]) Wait(t testing.TB) T {
	t.Helper()
	if s.ch == nil {
		t.Fatal("testsignal: Wait on a signal that was not initialized")
	}
	select {
	case v := <-s.ch:
		return v
	case <-time.After(WaitTimeout):
		t.Fatalf("testsignal: no signal within %s", WaitTimeout)
		var zero T
		return zero
	}
}
