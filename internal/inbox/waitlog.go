package inbox

import (
	"sync"
	"time"
)

// Bounds of waitLog.
const (
	// waitLogEvery is how often at most a wait for one reason is logged.
	waitLogEvery = 10 * time.Second
	// waitLogReasons is the most reasons waitLog remembers; past it, a new
	// reason is not logged until ended has forgotten one.
	waitLogReasons = 1024
)

// waitLog bounds the log lines of waiting messages. A held row makes every
// message that needs it wait, again and again, until the row is free: a
// line for each wait would flood the log (a frozen replica holding the
// stock rows every order needs wrote two thousand a second). So the first
// wait for a reason is logged at once, and later ones for the same reason
// at most once every waitLogEvery, with how many were not logged since;
// once no wait for the reason has come for waitLogEvery, ended says so,
// with the waits not logged since the last line.
// inboxd_inbox_handled_total{outcome="waiting"} counts every one.
type waitLog struct {
	mu      sync.Mutex
	reasons map[string]*waitLogReason
}

type waitLogReason struct {
	logged    time.Time // when a wait for the reason was last logged
	seen      time.Time // when the last wait for it came
	notLogged int       // waits for it since the last line, not logged
}

// endedWait is a reason no wait has come for in waitLogEvery, with the
// waits for it that were not logged.
type endedWait struct {
	reason    string
	notLogged int
}

// allow reports whether a wait for reason, at now, is logged, and how many
// waits for it were not logged since the last line.
func (l *waitLog) allow(reason string, now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r, ok := l.reasons[reason]; ok {
		r.seen = now
		if now.Sub(r.logged) < waitLogEvery {
			r.notLogged++
			return false, 0
		}
		n := r.notLogged
		r.logged, r.notLogged = now, 0
		return true, n
	}
	if l.reasons == nil {
		l.reasons = map[string]*waitLogReason{}
	}
	if len(l.reasons) >= waitLogReasons {
		return false, 0 // until ended makes room
	}
	l.reasons[reason] = &waitLogReason{logged: now, seen: now}
	return true, 0
}

// ended forgets the reasons no wait has come for in waitLogEvery, and
// returns those with waits that were not logged.
func (l *waitLog) ended(now time.Time) []endedWait {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []endedWait
	for reason, r := range l.reasons {
		if now.Sub(r.seen) < waitLogEvery {
			continue
		}
		if r.notLogged > 0 {
			out = append(out, endedWait{reason: reason, notLogged: r.notLogged})
		}
		delete(l.reasons, reason)
	}
	return out
}
