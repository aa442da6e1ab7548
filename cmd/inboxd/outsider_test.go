package main

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// leadsLog is what a process logs when it takes the lead.
const leadsLog = "this process leads"

// Acceptance: PostgreSQL's advisory locks are one namespace for every login
// of a database, and pg_locks, which every login reads, shows their keys. A
// login with no rights at all on the service's schema takes, exclusively and
// for good, every advisory lock it sees a session of the database hold or
// wait for, while orders arrive at a steady pace for 20 s and the leader of
// two replicas is killed with SIGKILL halfway. It cannot stall the service:
// every order is handled once, the claims of the killed replica are taken
// over, the other replica leads within 20 s, and the inbox's claim floor
// rises.
func TestALoginOutsideTheServiceCannotStallIt(t *testing.T) {
	t.Parallel()
	// A database of its own: the outsider takes every advisory lock it sees
	// in its database, and would stall the tests beside it in the shared one.
	b := setupIn(t, testenv.NewDBAlone(t))
	outsiderURL := outsiderLogin(t, b.db)
	outsider, err := pgx.Connect(t.Context(), outsiderURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = outsider.Close(context.WithoutCancel(t.Context())) })
	requirePermissionDenied(t, outsider, "SELECT count(*) FROM "+pgx.Identifier{b.db.Schema, "inbox"}.Sanitize())

	start := func(name string) *process {
		p, _ := startServing(t, b, "DATABASE_URL="+withApplicationName(t, b.db.URL, name),
			"INBOX_STOCK_FOLD_INTERVAL=1s", "INBOX_JANITOR_INTERVAL=1s")
		return p
	}
	a, c := start("a"), start("b")
	var lead, survivor *process
	require.Eventually(t, func() bool {
		switch inA, inB := a.logContains(leadsLog), c.logContains(leadsLog); {
		case inA && !inB:
			lead, survivor = a, c
		case inB && !inA:
			lead, survivor = c, a
		}
		return lead != nil
	}, 30*time.Second, 50*time.Millisecond, "one of the two replicas leads")

	sq := startSquatter(t, outsider, outsiderURL, b.db.Schema)

	w := loadgen.Generate(loadgen.Spec{Orders: 2000, DuplicateRate: 0.1, Seed: 31})
	const publishFor = 20 * time.Second
	published := make(chan error, 1)
	publishing := time.Now()
	go func() {
		published <- loadgen.PublishPaced(t.Context(), b.broker.URL, w.Messages, 10, int(float64(len(w.Messages))/publishFor.Seconds()))
	}()

	time.Sleep(time.Until(publishing.Add(publishFor / 2)))
	require.False(t, survivor.logContains(leadsLog), "the replica that survives has not led before the kill")
	lead.kill()
	killed := time.Now()
	floor := b.count(t, "SELECT inbox_claim_floor()")
	t.Logf("killed the leader %s into publishing; the inbox's claim floor is %d; the outsider %s",
		killed.Sub(publishing).Round(time.Millisecond), floor, sq.counts())

	assert.Eventually(t, func() bool { return survivor.logContains(leadsLog) },
		20*time.Second-time.Since(killed), 50*time.Millisecond, "the surviving replica leads within 20 s of the leader's kill")
	assert.Eventually(t, func() bool { return b.count(t, "SELECT inbox_claim_floor()") > floor },
		30*time.Second-time.Since(killed), 100*time.Millisecond, "the inbox's claim floor rises above %d within 30 s of the kill", floor)
	require.NoError(t, <-published)
	t.Logf("published %d messages; the outsider %s", len(w.Messages), sq.counts())
	// Drained: the claims the killed replica held were taken over too.
	b.waitDrained(t, w.UniqueMessageIDs, 2*time.Minute)
	b.requireExactlyOnce(t, w)
}

// outsiderLogin creates a login role for this test only, granted nothing
// (PUBLIC's CONNECT on the database aside), and returns a URL that connects
// to db as it. When the test ends its sessions are ended and it is dropped.
func outsiderLogin(t *testing.T, db *testenv.DB) string {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	login := "outsider_" + db.Schema
	_, err := db.Pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{login}.Sanitize()+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		// A session blocked in pg_advisory_lock stays until it is ended:
		// the server reads nothing from its client meanwhile.
		_, err := db.Pool.Exec(ctx, "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = $1", login)
		assert.NoError(t, err, "end the outsider's sessions")
		_, err = db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+pgx.Identifier{login}.Sanitize())
		assert.NoError(t, err, "drop the outsider's login")
	})
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.User(login)
	return u.String()
}

// advisoryKey is an advisory lock's key as pg_locks shows it: objsubid 1
// for pg_advisory_lock(bigint) (classid its high half, objid its low one),
// 2 for pg_advisory_lock(int4, int4).
type advisoryKey struct {
	classid, objid uint32
	objsubid       int16
}

// squatter takes, as the outsider, each advisory lock key another session
// of the database holds or waits for, each on a connection of its own,
// exclusively, and holds it until the test ends.
type squatter struct {
	t      *testing.T
	config *pgx.ConnConfig
	// Key names, read through the outsider's session (hashtext needs no
	// rights), to say in the log which of the service's locks it holds.
	classNames map[uint32]string
	leaderKey  int64

	queued, got atomic.Int64
	wg          sync.WaitGroup
	mu          sync.Mutex
	conns       []*pgx.Conn
}

// startSquatter polls pg_locks every 20 ms through poll, a session of the
// outsider at outsiderURL, until the test ends.
func startSquatter(t *testing.T, poll *pgx.Conn, outsiderURL, schema string) *squatter {
	t.Helper()
	config, err := pgx.ParseConfig(outsiderURL)
	require.NoError(t, err)
	s := &squatter{t: t, config: config, classNames: map[uint32]string{}}
	var inserting, floor, ledger uint32
	require.NoError(t, poll.QueryRow(t.Context(), `
		SELECT hashtext('inboxd claim floor inserting')::oid, hashtext('inboxd claim floor')::oid,
		       hashtext('inboxd key ledger')::oid, hashtextextended('inboxd leader ' || $1, 0)`, schema).
		Scan(&inserting, &floor, &ledger, &s.leaderKey))
	s.classNames[inserting] = "a claim floor's inserting lock"
	s.classNames[floor] = "a claim floor's floor lock"
	s.classNames[ledger] = "the key ledger's remembering lock"

	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	s.wg.Go(func() { s.poll(ctx, poll) })
	t.Cleanup(func() {
		cancel()
		s.wg.Wait()
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, conn := range s.conns {
			closing, done := context.WithTimeout(context.Background(), 5*time.Second)
			_ = conn.Close(closing)
			done()
		}
		t.Logf("at the end, the outsider %s", s.counts())
	})
	return s
}

// counts says for how many keys the squatter queued and how many it got.
func (s *squatter) counts() string {
	return fmt.Sprintf("queued for %d advisory lock keys and got %d", s.queued.Load(), s.got.Load())
}

// name says which lock of the service a key is.
func (s *squatter) name(k advisoryKey) string {
	if k.objsubid == 1 {
		key := int64(uint64(k.classid)<<32 | uint64(k.objid))
		if key == s.leaderKey {
			return fmt.Sprintf("the leader's lock (%d)", key)
		}
		return fmt.Sprintf("bigint key %d (a process's liveness lock)", key)
	}
	if n, ok := s.classNames[k.classid]; ok {
		return fmt.Sprintf("%s (%d, %d)", n, int32(k.classid), int32(k.objid))
	}
	return fmt.Sprintf("key (%d, %d)", int32(k.classid), int32(k.objid))
}

func (s *squatter) poll(ctx context.Context, conn *pgx.Conn) {
	taken := map[advisoryKey]bool{}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		rows, err := conn.Query(ctx, `
			SELECT DISTINCT classid, objid, objsubid, mode FROM pg_locks
			WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND pid <> pg_backend_pid()`)
		var keys []advisoryKey
		if err == nil {
			keys, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (advisoryKey, error) {
				var k advisoryKey
				var mode string
				return k, row.Scan(&k.classid, &k.objid, &k.objsubid, &mode)
			})
		}
		if err != nil {
			if ctx.Err() == nil {
				s.t.Errorf("the outsider reads pg_locks: %v", err)
			}
			return
		}
		for _, k := range keys {
			if taken[k] || (k.objsubid != 1 && k.objsubid != 2) {
				continue
			}
			taken[k] = true
			s.queued.Add(1)
			s.wg.Go(func() { s.hold(ctx, k) })
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// hold takes k exclusively on a new session of the outsider, waiting for
// it as long as it takes, and keeps it until ctx ends.
func (s *squatter) hold(ctx context.Context, k advisoryKey) {
	conn, err := pgx.ConnectConfig(ctx, s.config.Copy())
	if err != nil {
		if ctx.Err() == nil {
			s.t.Errorf("the outsider connects: %v", err)
		}
		return
	}
	s.mu.Lock()
	s.conns = append(s.conns, conn)
	s.mu.Unlock()
	sql, args := "SELECT pg_advisory_lock($1::int4, $2::int4)", []any{int32(k.classid), int32(k.objid)}
	if k.objsubid == 1 {
		sql, args = "SELECT pg_advisory_lock($1::bigint)", []any{int64(uint64(k.classid)<<32 | uint64(k.objid))}
	}
	for ctx.Err() == nil {
		_, err := conn.Exec(ctx, sql, args...)
		if err == nil {
			s.got.Add(1)
			s.t.Logf("the outsider holds %s", s.name(k))
			return
		}
		if ctx.Err() != nil || conn.IsClosed() {
			return
		}
		// A deadlock with the service's session ends one of the two waits.
		s.t.Logf("the outsider's wait for %s ended (%v); waiting again", s.name(k), err)
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}
