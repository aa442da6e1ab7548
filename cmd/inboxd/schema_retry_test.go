package main

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A replica started while the database ends its sessions (a restart, a
// failover, an operator's pg_terminate_backend) migrates once they stop
// being ended, instead of exiting: for its first second every session of
// this one is terminated as soon as it shows.
func TestServeReadiesTheSchemaWhileTheDatabaseEndsItsSessions(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	app := fmt.Sprintf("inboxd-schema-retry-%d", time.Now().UnixNano())
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	env := map[string]string{"DATABASE_URL": u.String(), "AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/"}
	cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
	require.NoError(t, err)

	terminated := 0
	stop := time.Now().Add(time.Second)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for time.Now().Before(stop) {
			var n int
			_ = db.Pool.QueryRow(context.WithoutCancel(t.Context()), `
				SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name LIKE $1 AND pid <> pg_backend_pid()) AS t`, app+"%").Scan(&n)
			terminated += n
			time.Sleep(time.Millisecond)
		}
	}()
	require.NoError(t, readySchema(t.Context(), cfg, testenv.Logger(t)))
	<-done
	require.Positive(t, terminated, "sessions were ended while the schema was readied")
}
