// Package migrate applies the embedded goose migrations.
package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"hash/crc64"
	"log/slog"

	"github.com/jackc/pgx/v5"
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
