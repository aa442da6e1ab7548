package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// store writes rows to the inbox table and records the duplicates whose
// payload differs from the stored one.
type store struct {
	pool    *pgxpool.Pool
	queries *dbsqlc.Queries
	logger  *slog.Logger
	timeout time.Duration // of one insert, with its conflict recording
}

// stored is what storing a batch of rows came to.
type stored struct {
	// inserted counts the new inbox rows; conflicts the duplicates whose
	// payload differs from the stored one.
	inserted, conflicts int
	// rejects are the indexes of rows the database refused as data (never
	// retried; they are dead-lettered).
	rejects []int
	// repliesOfAnotherUser counts the copies whose request for a reply was
	// not kept: their user_id is not the one of the message's first
	// delivery.
	repliesOfAnotherUser int
}

// untilDone stores rows, retrying with backoff while the database is
// unreachable: the deliveries stay unacknowledged and no more are taken from
// their channel meanwhile, so ingest pauses instead of failing them. It gives
// up when ctx ends or abandoned reports true (the session stops or the
// channel closed; the broker then redelivers).
func (s *store) untilDone(ctx context.Context, rows []row, abandoned func() bool) (stored, error) {
	failures := retry.Failures{Policy: retry.Transient}
	for {
		res, err := s.save(ctx, rows)
		if err == nil {
			return res, nil
		}
		if abandoned() || !failures.Wait(ctx, s.logger, "store batch failed, holding deliveries and retrying", err,
			slog.Int("rows", len(rows))) {
			return stored{}, fmt.Errorf("store batch: %w", err)
		}
		// The failed store may have committed (its outcome is unknown):
		// its reply requests are not stored twice.
		for n := range rows {
			rows[n].redelivered = true
		}
	}
}

// save inserts rows in one statement. If the database refuses the batch's
// data, it inserts the rows one by one to find the ones at fault.
//
// A failure whose outcome is unknown (the connection dropped around the
// commit) is safe to retry: rows that did commit come back as duplicates.
func (s *store) save(ctx context.Context, rows []row) (stored, error) {
	if len(rows) == 0 {
		return stored{}, nil
	}
	res, err := s.insert(ctx, rows)
	if err == nil {
		return res, nil
	}
	if !isDataError(err) {
		return stored{}, err
	}
	s.logger.WarnContext(ctx, "database refused a batch, storing its rows one by one", slog.String("error", err.Error()))
	res = stored{}
	for n := range rows {
		one, err := s.insert(ctx, rows[n:n+1])
		switch {
		case isDataError(err):
			s.logger.WarnContext(rows[n].trace.Context(ctx), "database refused a message", slog.String("message_id", rows[n].messageID), slog.String("error", err.Error()))
			res.rejects = append(res.rejects, n)
		case err != nil:
			return stored{}, err
		default:
			res.inserted += one.inserted
			res.conflicts += one.conflicts
			res.repliesOfAnotherUser += one.repliesOfAnotherUser
		}
	}
	return res, nil
}

// insert stores rows with one INSERT ... ON CONFLICT DO NOTHING, then looks
// at the duplicates, if any, for conflicting payloads.
func (s *store) insert(ctx context.Context, rows []row) (stored, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	out, err := s.insertAndAnswer(ctx, rows)
	if err != nil {
		return stored{}, err
	}
	ids := make([]string, 0, len(out))
	res := stored{}
	for _, o := range out {
		switch {
		case o.AnotherUser:
			res.repliesOfAnotherUser++
		case o.RequestID != 0: // a request stored, answered already if it could be
		default:
			ids = append(ids, o.MessageID)
		}
	}
	res.inserted = len(ids)
	if len(ids) == len(rows) {
		return res, nil
	}
	res.conflicts, err = s.recordConflicts(ctx, duplicates(rows, ids))
	if err != nil {
		return stored{}, err
	}
	return res, nil
}

// insertAndAnswer runs the insert and, when it stored reply requests,
// answers them in the same transaction (InboxReplyAnswer): a request whose
// message has ended already, or has left and is remembered, has its reply
// queued by the commit that stores it, before its delivery is acked. A
// batch that asks for no reply is one statement, with no transaction
// around it.
func (s *store) insertAndAnswer(ctx context.Context, rows []row) ([]dbsqlc.InboxInsertManyRow, error) {
	p := insertParams(rows)
	if !slices.ContainsFunc(rows, func(r row) bool { return r.replyTo != "" }) {
		return s.queries.InboxInsertMany(ctx, s.pool, p)
	}
	var out []dbsqlc.InboxInsertManyRow
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var err error
		if out, err = s.queries.InboxInsertMany(ctx, tx, p); err != nil {
			return err
		}
		var requests []int64
		for _, o := range out {
			if o.RequestID != 0 {
				requests = append(requests, o.RequestID)
			}
		}
		if len(requests) == 0 {
			return nil
		}
		if _, err := s.queries.InboxReplyAnswer(ctx, dbsqlc.PlanEachCall(tx), requests); err != nil {
			return fmt.Errorf("answer reply requests: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func insertParams(rows []row) dbsqlc.InboxInsertManyParams {
	p := dbsqlc.InboxInsertManyParams{
		MessageIds:     make([]string, len(rows)),
		MessageTypes:   make([]string, len(rows)),
		RoutingKeys:    make([]string, len(rows)),
		Payloads:       make([][]byte, len(rows)),
		OrderKeys:      make([]string, len(rows)),
		Traceparents:   make([]string, len(rows)),
		Tracestates:    make([]string, len(rows)),
		ReplyTos:       make([]string, len(rows)),
		CorrelationIds: make([]string, len(rows)),
		Redelivered:    make([]bool, len(rows)),
		UserIds:        make([]string, len(rows)),
	}
	for n, r := range rows {
		p.MessageIds[n], p.MessageTypes[n], p.RoutingKeys[n], p.Payloads[n] = r.messageID, r.messageType, r.routingKey, r.payload
		p.OrderKeys[n] = r.orderKey
		p.Traceparents[n], p.Tracestates[n] = r.trace.Traceparent, r.trace.Tracestate
		p.ReplyTos[n], p.CorrelationIds[n], p.Redelivered[n] = r.replyTo, r.correlationID, r.redelivered
		p.UserIds[n] = r.userID
	}
	return p
}

// duplicates returns the rows the insert did not store, given the ids it
// did. The first row with each inserted id is the one stored; every other
// row is a duplicate, of a message stored earlier or in this batch.
func duplicates(rows []row, ids []string) dbsqlc.InboxRecordConflictsParams {
	fresh := make(map[string]bool, len(ids))
	for _, id := range ids {
		fresh[id] = true
	}
	var dups dbsqlc.InboxRecordConflictsParams
	for _, r := range rows {
		if fresh[r.messageID] {
			delete(fresh, r.messageID)
			continue
		}
		dups.MessageIds = append(dups.MessageIds, r.messageID)
		dups.MessageTypes = append(dups.MessageTypes, r.messageType)
		dups.Payloads = append(dups.Payloads, r.payload)
	}
	return dups
}

// recordConflicts records the duplicates whose payload differs from the
// stored one in inbox_conflicts, and returns how many deliveries those are.
func (s *store) recordConflicts(ctx context.Context, dups dbsqlc.InboxRecordConflictsParams) (int, error) {
	// The insert has committed: retry only this statement while the store
	// timeout allows, so that a failure here does not send the whole batch
	// round again (its new rows would then count as duplicates).
	failures := retry.Failures{Policy: retry.Statement}
	var conflicts []dbsqlc.InboxRecordConflictsRow
	for {
		var err error
		conflicts, err = s.queries.InboxRecordConflicts(ctx, s.pool, dups)
		if err == nil {
			break
		}
		if isDataError(err) || !retry.Sleep(ctx, failures.Next()) {
			return 0, fmt.Errorf("record conflicting duplicates: %w", err)
		}
	}
	n := 0
	for _, cf := range conflicts {
		n += int(cf.Deliveries)
		s.logger.WarnContext(ctx, "message id arrived again with a different payload: the stored payload is kept, the delivery recorded in inbox_conflicts",
			slog.String("message_id", cf.MessageID),
			slog.String("stored_sha256", cf.StoredSha256),
			slog.String("conflicting_sha256", cf.ConflictingSha256),
			slog.Int("deliveries", int(cf.Deliveries)))
	}
	return n, nil
}

// isDataError reports whether err is PostgreSQL refusing the data itself
// (SQLSTATE classes 22 and 23), which no retry can fix.
func isDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")
}
