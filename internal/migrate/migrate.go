// Package migrate applies the embedded goose migrations.
package migrate

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc64"
	"io/fs"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/migrations"
)

// LockTimeoutDefault is the lock_timeout of the migration session: how
// long one statement of a migration waits for a lock (a table's, or the
// end of older transactions that CREATE INDEX CONCURRENTLY waits for)
// before the migration fails, instead of holding up every query queued
// behind it.
const LockTimeoutDefault = 10 * time.Second

// Options tune Up.
type Options struct {
	// LockTimeout bounds every lock wait of the migration session. Defaults
	// to LockTimeoutDefault.
	LockTimeout time.Duration
}

// Up applies every pending migration to the schema that connConfig's
// search_path selects, and returns the number applied. It is UpWithOptions
// with the default options.
func Up(ctx context.Context, connConfig *pgx.ConnConfig, logger *slog.Logger) (int, error) {
	return UpWithOptions(ctx, connConfig, logger, Options{})
}

// UpWithOptions applies every pending migration to the schema that
// connConfig's search_path selects, and returns the number applied.
//
// The migration session has no statement_timeout (connConfig's is
// replaced by 0), so that building an index on a large table completes,
// and a lock_timeout of opts.LockTimeout. A concurrent index build that
// fails leaves an INVALID index behind, which CREATE INDEX CONCURRENTLY IF
// NOT EXISTS would then skip forever: Up returns an *InvalidIndexError,
// before and after migrating, while the schema has one.
//
// Replicas starting together are safe: goose holds a PostgreSQL session-level
// advisory lock while it migrates. The lock id is derived from the database and
// schema, so deployments in different schemas of one database do not wait for
// each other.
func UpWithOptions(ctx context.Context, connConfig *pgx.ConnConfig, logger *slog.Logger, opts Options) (int, error) {
	opts.LockTimeout = cmp.Or(opts.LockTimeout, LockTimeoutDefault)
	cc := connConfig.Copy()
	cc.RuntimeParams["statement_timeout"] = "0"
	cc.RuntimeParams["lock_timeout"] = strconv.FormatInt(opts.LockTimeout.Milliseconds(), 10)
	pgsession.SetAfterConnect(cc)
	db := stdlib.OpenDB(*cc)
	defer db.Close()

	lockID, err := lockID(ctx, db)
	if err != nil {
		return 0, err
	}
	if err := checkIndexes(ctx, db); err != nil {
		return 0, err
	}
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(lockID),
		lock.WithLockTimeout(1, 300), // poll every second, for up to five minutes
	)
	if err != nil {
		return 0, fmt.Errorf("create migration locker: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS,
		goose.WithSessionLocker(locker),
	)
	if err != nil {
		return 0, fmt.Errorf("create migration provider: %w", err)
	}
	results, err := provider.Up(ctx)
	for _, r := range results {
		if r.Error != nil {
			continue
		}
		logger.InfoContext(ctx, "migration applied",
			slog.Int64("version", r.Source.Version),
			slog.String("file", r.Source.Path),
			slog.Duration("duration", r.Duration))
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			err = fmt.Errorf("%w (a session held a lock the migration needs for longer than its lock_timeout of %s; find it in pg_locks and pg_stat_activity, then run inboxd migrate again)", err, opts.LockTimeout)
		}
		if idxErr := checkIndexes(ctx, db); idxErr != nil {
			return 0, fmt.Errorf("apply migrations: %w; %w", err, idxErr)
		}
		return 0, fmt.Errorf("apply migrations: %w", err)
	}
	if err := checkIndexes(ctx, db); err != nil {
		return len(results), err
	}
	return len(results), nil
}

func lockID(ctx context.Context, db *sql.DB) (int64, error) {
	var database, schema string
	err := db.QueryRowContext(ctx, "SELECT current_database(), coalesce(current_schema(), '')").Scan(&database, &schema)
	if err != nil {
		return 0, fmt.Errorf("read current schema: %w", err)
	}
	if schema == "" {
		return 0, fmt.Errorf("no schema to migrate: search_path names no existing schema")
	}
	sum := crc64.Checksum([]byte("inboxd-migrate:"+database+"."+schema), crc64.MakeTable(crc64.ECMA))
	return int64(sum), nil
}

// Check returns an error unless the schema that connConfig's search_path
// selects has every migration of this build applied and no INVALID index
// (an *InvalidIndexError). A serve that does not
// migrate (its role may not) checks this first, so that running a build
// against a schema it does not know fails at once, with what to do. Only
// the version table is read: any role that can read it can check.
func Check(ctx context.Context, connConfig *pgx.ConnConfig) error {
	want, err := latest()
	if err != nil {
		return err
	}
	conn, err := pgsession.Connect(ctx, connConfig)
	if err != nil {
		return fmt.Errorf("connect to check the schema version: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	var have int64
	err = conn.QueryRow(ctx, "SELECT coalesce(max(version_id), 0) FROM goose_db_version WHERE is_applied").Scan(&have)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		return fmt.Errorf("the schema is not migrated: run inboxd migrate (as the schema's owner)")
	case err != nil:
		return fmt.Errorf("read the schema version: %w", err)
	case have < want:
		return fmt.Errorf("the schema is at migration %d, this build needs %d: run inboxd migrate (as the schema's owner)", have, want)
	}
	return invalidIndexes(ctx, conn)
}

// latest returns the version of the newest embedded migration.
func latest() (int64, error) {
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		return 0, err
	}
	var latest int64
	for _, name := range names {
		v, err := goose.NumericComponent(name)
		if err != nil {
			return 0, fmt.Errorf("migration %s: %w", name, err)
		}
		latest = max(latest, v)
	}
	return latest, nil
}
