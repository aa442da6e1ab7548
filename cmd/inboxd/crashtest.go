//go:build crashtest

package main

import (
	"context"
	"os"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/startstop"
)

// The crashtest build of inboxd, used only by the tests, kills itself with
// SIGKILL whenever it handles a message of type "test.crash", as a handler
// that crashes the process (a segfault in a library, the OOM killer) would.

// With INBOXD_TEST_GOROUTINE_PANIC set, a goroutine of the service's
// panics as serve starts, with a value that quotes DATABASE_URL.
func init() {
	wrapHandler = func(h inbox.Handler) inbox.Handler {
		if os.Getenv("INBOXD_TEST_GOROUTINE_PANIC") != "" {
			startstop.Go(func() { panic("test panic while connected to " + os.Getenv("DATABASE_URL")) })
		}
		return crashingHandler{next: h}
	}
}

type crashingHandler struct{ next inbox.Handler }

func (c crashingHandler) HandleBatch(ctx context.Context, tx pgx.Tx, msgs []inbox.Message) ([]inbox.Outcome, error) {
	for _, m := range msgs {
		if m.Type == "test.crash" {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
	}
	return c.next.HandleBatch(ctx, tx, msgs)
}
