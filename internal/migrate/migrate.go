// Package migrate applies the embedded goose migrations.
package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc64"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/orderconfirm/inboxd/migrations"
)

// Up applies every pending migration to the schema that connConfig's
// search_path selects, and returns the number applied.
//
// Replicas starting together are safe: goose holds a PostgreSQL session-level
// advisory lock while it migrates. The lock id is derived from the database and
// schema, so deployments in different schemas of one database do not wait for
// each other.
func Up(ctx context.Context, connConfig *pgx.ConnConfig, logger *slog.Logger) (int, error) {
	db := stdlib.OpenDB(*connConfig)
	defer db.Close()

	lockID, err := lockID(ctx, db)
	if err != nil {
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
	if err != nil {
		return 0, fmt.Errorf("apply migrations: %w", err)
	}
	for _, r := range results {
		logger.InfoContext(ctx, "migration applied",
			slog.Int64("version", r.Source.Version),
			slog.String("file", r.Source.Path),
			slog.Duration("duration", r.Duration))
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
// selects has every migration of this build applied. A serve that does not
// migrate (its role may not) checks this first, so that running a build
// against a schema it does not know fails at once, with what to do. Only
// the version table is read: any role that can read it can check.
func Check(ctx context.Context, connConfig *pgx.ConnConfig) error {
	want, err := Latest()
	if err != nil {
		return err
	}
	conn, err := pgx.ConnectConfig(ctx, connConfig)
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
	return nil
}

// Latest returns the version of the newest embedded migration.
func Latest() (int64, error) {
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
