//go:build !linux

package pgsession

import "time"

// setUserTimeout does nothing where TCP_USER_TIMEOUT is Linux's own: the
// keepalive and the server's settings still apply.
func setUserTimeout(uintptr, time.Duration) error { return nil }
