package pgsession_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A direct connection keeps its server session: DetectPooling answers
// session pooling, every time, at its first attempt (it runs at each
// start; it costs about two connections). Through PgBouncer, the cmd/inboxd tests see it answer each pool
// mode (TestDetectPoolingThroughPgBouncer).
func TestDetectPoolingOfADirectConnection(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	for range 5 {
		started := time.Now()
		pooling, err := pgsession.DetectPooling(t.Context(), cc)
		took := time.Since(started)
		require.NoError(t, err)
		require.Equal(t, pgsession.PooledPerSession, pooling)
		require.Equal(t, "session", pooling.String())
		t.Logf("DetectPooling took %s", took)
		require.Less(t, took, pgsession.PoolingProbeTimeout, "no attempt overran")
	}
}
