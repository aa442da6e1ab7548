// Package testenv gives tests real PostgreSQL and RabbitMQ servers, isolated
// per test: each test gets a schema of its own (migrated), in a database of
// its own when it holds a snapshot or row locks open for seconds
// (NewDBAlone), and a RabbitMQ virtual host of its own, all removed when
// the test ends.
//
// The servers come from TEST_DATABASE_URL and TEST_AMQP_URL (CI and this
// repository's .ci/run set them). When those are unset, the servers are
// started once per test binary with testcontainers-go; when no Docker engine
// answers either, the local defaults (PostgreSQL on 127.0.0.1:5432 as user
// postgres, RabbitMQ on 127.0.0.1:5672 as guest) are used.
// The RabbitMQ management API, used to create virtual hosts, is found at
// TEST_AMQP_ADMIN_URL, else on port 15672 of the AMQP host with the AMQP
// URL's credentials.
package testenv

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
	"github.com/orderconfirm/inboxd/internal/sandbox"
)

// namePrefix starts the name of every schema, database and virtual host
// made here; the
// creation time follows, so that leftovers of killed runs can be recognised
// and removed.
const namePrefix = "t_"

// The servers used when neither the environment nor Docker provides them.
const (
	localDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	localAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
)

// staleAfter is the age after which a leftover schema, database or virtual
// host is removed by the next run.
const staleAfter = 30 * time.Minute

var (
	servers     *serverSet
	serversErr  error
	serversOnce sync.Once
)

type serverSet struct {
	databaseURL string
	amqpURL     string
	adminURL    string
	admin       *rabbitadmin.Client
	stop        func()
}

func getServers(tb testing.TB) *serverSet {
	tb.Helper()
	serversOnce.Do(func() {
		servers, serversErr = startServers(context.Background())
		if serversErr == nil {
			sweepStale(servers)
		}
	})
	require.NoError(tb, serversErr, "start test servers")
	return servers
}

func startServers(ctx context.Context) (*serverSet, error) {
	s := &serverSet{
		databaseURL: os.Getenv("TEST_DATABASE_URL"),
		amqpURL:     os.Getenv("TEST_AMQP_URL"),
		adminURL:    os.Getenv("TEST_AMQP_ADMIN_URL"),
		stop:        func() {},
	}
	var stops []func()
	if (s.databaseURL == "" || s.amqpURL == "") && !dockerAvailable(ctx) {
		// No Docker engine: use the services of a machine that runs them
		// locally with their default settings, as this repository's CI does.
		s.databaseURL = cmp.Or(s.databaseURL, localDatabaseURL)
		s.amqpURL = cmp.Or(s.amqpURL, localAMQPURL)
		for _, addr := range []string{"127.0.0.1:5432", "127.0.0.1:5672"} {
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err != nil {
				return nil, fmt.Errorf("TEST_DATABASE_URL or TEST_AMQP_URL is unset, no Docker engine answers, and nothing listens on %s: "+
					"start PostgreSQL and RabbitMQ (or Docker), or set TEST_DATABASE_URL and TEST_AMQP_URL", addr)
			}
			_ = conn.Close()
		}
	}
	if s.databaseURL == "" {
		dbURL, stop, err := startPostgresContainer(ctx)
		if err != nil {
			return nil, err
		}
		s.databaseURL = dbURL
		stops = append(stops, stop)
	}
	if s.amqpURL == "" {
		amqpURL, adminURL, stop, err := startRabbitMQContainer(ctx)
		if err != nil {
			return nil, err
		}
		s.amqpURL, s.adminURL = amqpURL, adminURL
		stops = append(stops, stop)
	}
	if s.adminURL == "" {
		u, err := url.Parse(s.amqpURL)
		if err != nil {
			return nil, fmt.Errorf("parse TEST_AMQP_URL: %w", err)
		}
		admin := &url.URL{Scheme: "http", User: u.User, Host: u.Hostname() + ":15672"}
		s.adminURL = admin.String()
	}
	admin, err := rabbitadmin.New(s.adminURL)
	if err != nil {
		return nil, err
	}
	s.admin = admin
	s.stop = func() {
		admin.Close()
		for _, stop := range stops {
			stop()
		}
	}
	return s, nil
}

// Main runs a package's tests, then Stop, and exits: a TestMain that needs
// nothing else is `func TestMain(m *testing.M) { testenv.Main(m) }`.
func Main(m *testing.M) {
	code := m.Run()
	Stop()
	os.Exit(code)
}

// MainNoLeaks is Main that, when every test passed, also fails the run on a
// goroutine the tests leaked.
func MainNoLeaks(m *testing.M) {
	code := m.Run()
	Stop()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck")); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Stop terminates the containers this package started, if any. TestMain
// functions call it after m.Run; Ryuk removes them anyway if the process
// dies first.
func Stop() {
	if servers != nil {
		servers.stop()
	}
}

// uniqueName returns namePrefix + creation time + random suffix.
func uniqueName() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s%d_%s", namePrefix, time.Now().Unix(), hex.EncodeToString(b[:]))
}

// isStale reports whether name was made by uniqueName more than staleAfter ago.
func isStale(name string) bool {
	rest, ok := strings.CutPrefix(name, namePrefix)
	if !ok {
		return false
	}
	ts, _, ok := strings.Cut(rest, "_")
	if !ok {
		return false
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	return err == nil && time.Since(time.Unix(sec, 0)) > staleAfter
}

// DB is a migrated schema of its own for one test.
type DB struct {
	// Schema is the schema's name.
	Schema string
	// URL connects to the schema (it sets search_path).
	URL string
	// Pool is a pool on URL, closed when the test ends.
	Pool *pgxpool.Pool
	// alone is set when the schema is in a database of its own.
	alone bool
}

// NewDB creates a schema, applies the migrations to it and drops it when
// the test ends.
func NewDB(tb testing.TB) *DB {
	tb.Helper()
	return newDB(tb, getServers(tb).databaseURL)
}

// NewDBAlone is NewDB in a database of its own, created for the test and
// dropped when it ends. A snapshot held open, or a transaction that holds
// row locks (its transaction id), keeps back the cleanup of every table in
// its database, whatever the schema (PostgreSQL 14 and later; before, of
// every database): in the shared database, the index entries of every
// row that other tests end would stay meanwhile, and their scans would
// read them. The tests that hold either for seconds (HoldSnapshot, a lock
// left open) run here, so that they neither slow the others nor are
// slowed by the others' holds. Dropping a database takes a checkpoint.
func NewDBAlone(tb testing.TB) *DB {
	tb.Helper()
	s := getServers(tb)
	dbURL, drop, err := sandbox.CreateDatabase(context.WithoutCancel(tb.Context()), s.databaseURL, uniqueName())
	require.NoError(tb, err)
	tb.Cleanup(drop)
	db := newDB(tb, dbURL)
	db.alone = true
	return db
}

// NewEmptyDB is NewDB without the migrations: an empty schema, for a test
// that creates tables of its own there (the benchmark's simplest inbox).
func NewEmptyDB(tb testing.TB) *DB {
	tb.Helper()
	return newEmptyDB(tb, getServers(tb).databaseURL)
}

// newDB creates a schema in the database at databaseURL and applies the
// migrations to it.
func newDB(tb testing.TB, databaseURL string) *DB {
	tb.Helper()
	db := newEmptyDB(tb, databaseURL)
	// Other tests' long transactions in the database hold up a concurrent
	// index build (it waits for every older transaction).
	db.MigrateUp(tb)
	return db
}

// newEmptyDB creates a schema in the database at databaseURL, dropped when
// the test ends.
func newEmptyDB(tb testing.TB, databaseURL string) *DB {
	tb.Helper()
	ctx := context.WithoutCancel(tb.Context())
	schema := uniqueName()

	dbURL, drop, err := sandbox.CreateSchema(ctx, databaseURL, schema)
	require.NoError(tb, err)
	tb.Cleanup(drop)

	pool, err := pgxpool.New(ctx, dbURL)
	require.NoError(tb, err)
	tb.Cleanup(pool.Close)
	return &DB{Schema: schema, URL: dbURL, Pool: pool}
}

// MigrateUp applies the migrations not applied yet, as inboxd migrate
// does.
func (db *DB) MigrateUp(tb testing.TB) {
	tb.Helper()
	connConfig, err := pgx.ParseConfig(db.URL)
	require.NoError(tb, err)
	_, err = migrate.UpWithOptions(context.WithoutCancel(tb.Context()), connConfig, discardLogger(), migrate.Options{LockTimeout: 5 * time.Minute})
	require.NoError(tb, err)
}

// Strings runs query and returns its rows' single text column.
func (db *DB) Strings(tb testing.TB, query string, args ...any) []string {
	tb.Helper()
	rows, err := db.Pool.Query(context.WithoutCancel(tb.Context()), query, args...)
	require.NoError(tb, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(tb, err)
	return out
}

// Session opens a connection of its own to the schema, as another process
// would hold one; closing it ends the session, as that process's death
// would. It is closed at the end of the test if it is still open.
func (db *DB) Session(tb testing.TB) *pgx.Conn {
	tb.Helper()
	return db.SessionWith(tb, nil)
}

// SessionWith is Session with the connection's config passed through
// configure first (pipeline.ConfigureSession: a session as the service
// opens it).
func (db *DB) SessionWith(tb testing.TB, configure func(*pgx.ConnConfig)) *pgx.Conn {
	tb.Helper()
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(tb, err)
	if configure != nil {
		configure(cc)
	}
	conn, err := pgx.ConnectConfig(context.WithoutCancel(tb.Context()), cc)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// Exec runs sql and fails the test on an error.
func (db *DB) Exec(tb testing.TB, sql string, args ...any) {
	tb.Helper()
	_, err := db.Pool.Exec(context.WithoutCancel(tb.Context()), sql, args...)
	require.NoError(tb, err)
}

// HoldSnapshot opens a REPEATABLE READ transaction on a session of its own
// and takes its snapshot, held until the test ends: as an analytics query,
// pg_dump or a standby's feedback holds one, vacuum may remove no row
// version that ends after it, and the index entries of every row that
// ends from here on stay. It needs a database of its own (NewDBAlone).
func (db *DB) HoldSnapshot(tb testing.TB) {
	tb.Helper()
	require.True(tb, db.alone, "HoldSnapshot needs a database of its own (testenv.NewDBAlone)")
	ctx := context.WithoutCancel(tb.Context())
	tx, err := db.Session(tb).BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(ctx, "SELECT 1") // the snapshot, taken by the first statement
	require.NoError(tb, err)
}

// Int runs query and returns its single integer value.
func (db *DB) Int(tb testing.TB, query string, args ...any) int {
	tb.Helper()
	var n int
	require.NoError(tb, db.Pool.QueryRow(context.WithoutCancel(tb.Context()), query, args...).Scan(&n))
	return n
}

// SessionStat runs query, a read of the cumulative statistics views
// (pg_stat_user_tables, pg_stat_user_indexes), on conn and returns its
// single integer value, counting everything conn has done: a backend
// reports its counters at the end of a transaction at most once a second,
// so conn is asked to report them at its next one first, and the views
// are read afresh. Tests count what a statement read this way (index
// entries, rows of sequential scans), not how long it took.
func SessionStat(tb testing.TB, conn *pgx.Conn, query string) int {
	tb.Helper()
	ctx := context.WithoutCancel(tb.Context())
	_, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()")
	require.NoError(tb, err)
	_, err = conn.Exec(ctx, "SELECT pg_stat_clear_snapshot()")
	require.NoError(tb, err)
	var n int
	require.NoError(tb, conn.QueryRow(ctx, query).Scan(&n))
	return n
}

// sweepStale removes schemas, databases and virtual hosts left behind by
// runs that were killed before their cleanups ran.
func sweepStale(s *serverSet) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, s.databaseURL); err == nil {
		for query, drop := range map[string]func(string, string){
			"SELECT nspname FROM pg_namespace WHERE nspname LIKE 't\\_%'": sandbox.DropSchema,
			"SELECT datname FROM pg_database WHERE datname LIKE 't\\_%'":  sandbox.DropDatabase,
		} {
			rows, err := conn.Query(ctx, query)
			if err != nil {
				continue
			}
			names, _ := pgx.CollectRows(rows, pgx.RowTo[string])
			for _, n := range names {
				if isStale(n) {
					drop(s.databaseURL, n)
				}
			}
		}
		_ = conn.Close(ctx)
	}
	if names, err := s.admin.Vhosts(ctx); err == nil {
		for _, n := range names {
			if isStale(n) {
				_ = s.admin.DeleteVhost(ctx, n)
			}
		}
	}
}

// Logger returns a logger that writes through t.Log, so a test's logs show
// only when it fails or runs with -v.
func Logger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tbWriter{tb}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// LogWriter returns a writer that passes each write to t.Log.
func LogWriter(tb testing.TB) io.Writer { return tbWriter{tb} }

type tbWriter struct{ tb testing.TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.tb.Helper()
	w.tb.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
