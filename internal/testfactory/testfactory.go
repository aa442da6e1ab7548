// Package testfactory stores rows for tests directly, in any state, with
// defaults for every column a test does not care about.
package testfactory

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// InboxRowOpts are the columns of an inbox row. An empty string stores the
// column's default (message_type "order.created", payload "{}", status
// "pending") or NULL; a nil time stores now() (received_at,
// next_attempt_at) or NULL.
type InboxRowOpts struct {
	MessageID     string
	MessageType   string
	Payload       string
	Status        string
	Attempts      int
	LastError     string
	OrderKey      string
	ReceivedAt    *time.Time
	ProcessedAt   *time.Time
	NextAttemptAt *time.Time
	ClaimedAt     *time.Time
	ClaimedBy     string
	ClaimedBuild  string
}

// InboxRow stores one inbox row as opts describe it, as it is: no handler
// runs and no history is written. It returns the row's id and fails the
// test if the row cannot be stored.
func InboxRow(ctx context.Context, tb testing.TB, db dbsqlc.DBTX, opts *InboxRowOpts) int64 {
	tb.Helper()
	var id int64
	err := db.QueryRow(ctx, `
		INSERT INTO inbox (message_id, message_type, payload, status, attempts, last_error, order_key,
		                   received_at, processed_at, next_attempt_at, claimed_at, claimed_by, claimed_build)
		VALUES ($1, coalesce(nullif($2, ''), 'order.created'), convert_to(coalesce(nullif($3, ''), '{}'), 'UTF8'),
		        coalesce(nullif($4, ''), 'pending'), $5, nullif($6, ''), nullif($7, ''),
		        coalesce($8::timestamptz, now()), $9::timestamptz, coalesce($10::timestamptz, now()),
		        $11::timestamptz, nullif($12, ''), nullif($13, ''))
		RETURNING id`,
		opts.MessageID, opts.MessageType, opts.Payload, opts.Status, opts.Attempts, opts.LastError, opts.OrderKey,
		opts.ReceivedAt, opts.ProcessedAt, opts.NextAttemptAt, opts.ClaimedAt, opts.ClaimedBy, opts.ClaimedBuild,
	).Scan(&id)
	require.NoError(tb, err)
	return id
}
