//go:build crashtest

package main

import (
	"context"
	"os"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/inbox"
)

// The crashtest build of inboxd, used only by the tests, kills itself with
// SIGKILL whenever it handles a message of type "test.crash", as a handler
// that crashes the process (a segfault in a library, the OOM killer) would.

func init() {
	wrapHandler = func(h inbox.Handler) inbox.Handler { return crashingHandler{next: h} }
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
