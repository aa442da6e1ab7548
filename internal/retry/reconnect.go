package retry

import (
	"context"
	"log/slog"
	"time"
)

// ReconnectConfig says how Reconnect backs off between sessions.
type ReconnectConfig struct {
	// Policy bounds the backoff. Defaults to Session.
	Policy Policy
	// ResetAfter, when not 0, has a session that lasted longer count as a
	// fresh start: the next backoff is Base again.
	ResetAfter time.Duration
	// Logger logs Message at each session's end, with the error and the
	// delay before the next.
	Logger  *slog.Logger
	Message string
}

// Reconnect runs session until ctx ends: again each time it returns before
// that, after a backoff that grows with the sessions that ended in a row. A
// session uses one connection until it fails; it returns nil once ctx ends.
func Reconnect(ctx context.Context, cfg ReconnectConfig, session func(context.Context) error) {
	if cfg.Policy == (Policy{}) {
		cfg.Policy = Session
	}
	failures := Failures{Policy: cfg.Policy}
	for ctx.Err() == nil {
		started := time.Now()
		err := session(ctx)
		if ctx.Err() != nil {
			return
		}
		if cfg.ResetAfter > 0 && time.Since(started) > cfg.ResetAfter {
			failures.Reset()
		}
		delay := failures.Next()
		cfg.Logger.Warn(cfg.Message, slog.String("error", errString(err)), slog.Duration("retry_in", delay))
		if !Sleep(ctx, delay) {
			return
		}
	}
}

func errString(err error) string {
	if err == nil {
		return "none"
	}
	return err.Error()
}
