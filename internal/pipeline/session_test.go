package pipeline_test

import (
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/claimfloor"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The relay's claim, on a schema that nobody vacuums or analyzes, after
// 20,000 events have been published: on a session set up by
// ConfigureSession it reads the primary key from the claim floor, so that
// once the floor is raised past the published rows it reads a handful of
// pages instead of every one of them again. (A publish is a heap-only
// update, migration 00033: the primary key's entries of published rows
// stay live, and no scan from the table's start could skip them.)
func TestClaimsStayCheapWithoutVacuum(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO outbox (idempotency_key, routing_key, payload, message_id)
		SELECT 'k-' || g, 'order.confirmed', '{}', 'm-' || g FROM generate_series(1, 20000) AS g`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "UPDATE outbox SET published_at = now()")
	require.NoError(t, err)

	conn := db.SessionWith(t, pipeline.ConfigureSession)

	// The candidates of OutboxClaimBatch.
	const claim = `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
		SELECT id FROM outbox
		WHERE published_at IS NULL AND dead_at IS NULL
		  AND id >= outbox_claim_floor()
		  AND (claimed_at IS NULL OR claimed_at < now() - interval '30 seconds')
		  AND next_attempt_at <= now()
		ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED`
	buffers := func() int {
		var plan []struct {
			Plan struct {
				SharedHit  int `json:"Shared Hit Blocks"`
				SharedRead int `json:"Shared Read Blocks"`
			}
		}
		var raw []byte
		require.NoError(t, conn.QueryRow(ctx, claim, pgx.QueryExecModeSimpleProtocol).Scan(&raw))
		require.NoError(t, json.Unmarshal(raw, &plan))
		return plan[0].Plan.SharedHit + plan[0].Plan.SharedRead
	}
	first := buffers()
	// The relay's floor keeper: the first raise notes the last id and the
	// transactions inserting, the next raises the floor past what they
	// wrote that has ended.
	raise := claimfloor.Outbox(db.Pool)
	var note claimfloor.Note
	for range 2 {
		_, note, err = raise(ctx, note)
		require.NoError(t, err)
	}
	later := buffers()
	t.Logf("claim over 20,000 published rows: %d pages, then %d once the floor is raised", first, later)
	require.Less(t, later, 100, "the claims start at the floor, past the published rows")
}
