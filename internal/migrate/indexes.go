package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"

	"github.com/orderconfirm/inboxd/migrations"
)

// InvalidIndexError reports INVALID indexes (pg_index.indisvalid false) in
// the schema: what a CREATE INDEX CONCURRENTLY that failed (cancelled, a
// lock timeout, a duplicate under a unique index) leaves behind. Such an
// index costs every write and serves no read, and CREATE INDEX
// CONCURRENTLY IF NOT EXISTS skips it, so it stays until dropped. Its
// message names each index and the statement that fixes it.
type InvalidIndexError struct {
	// Schema is the schema of the indexes.
	Schema string
	// Indexes are their names.
	Indexes []string
}

func (e *InvalidIndexError) Error() string {
	var drops []string
	for _, name := range e.Indexes {
		drops = append(drops, "DROP INDEX CONCURRENTLY "+pgx.Identifier{e.Schema, name}.Sanitize()+";")
	}
	what := "index " + e.Indexes[0] + " of schema " + e.Schema + " is"
	if len(e.Indexes) > 1 {
		what = "indexes " + strings.Join(e.Indexes, ", ") + " of schema " + e.Schema + " are"
	}
	return what + " INVALID (a concurrent index build failed): run " + strings.Join(drops, " ") +
		" then run inboxd migrate again, which builds what a migration needs"
}

// invalidIndexQuery lists the INVALID indexes of the current schema, but
// not those being built right now (by a migration of another replica).
const invalidIndexQuery = `
SELECT c.relname
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
  AND NOT i.indisvalid
  AND i.indexrelid NOT IN (SELECT index_relid FROM pg_stat_progress_create_index WHERE index_relid IS NOT NULL)
ORDER BY c.relname`

// checkIndexes returns an *InvalidIndexError if the schema has INVALID
// indexes.
func checkIndexes(ctx context.Context, db *sql.DB) error {
	rows, err := db.QueryContext(ctx, invalidIndexQuery)
	if err != nil {
		return fmt.Errorf("look for invalid indexes: %w", err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			return fmt.Errorf("look for invalid indexes: %w", err)
		}
		names = append(names, name)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("look for invalid indexes: %w", err)
	}
	return invalidIndexError(ctx, db.QueryRowContext(ctx, "SELECT current_schema()").Scan, names)
}

// invalidIndexes is checkIndexes on a pgx connection.
func invalidIndexes(ctx context.Context, conn *pgx.Conn) error {
	rows, err := conn.Query(ctx, invalidIndexQuery)
	if err != nil {
		return fmt.Errorf("look for invalid indexes: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("look for invalid indexes: %w", err)
	}
	return invalidIndexError(ctx, conn.QueryRow(ctx, "SELECT current_schema()").Scan, names)
}

func invalidIndexError(_ context.Context, scanSchema func(...any) error, names []string) error {
	if len(names) == 0 {
		return nil
	}
	var schema string
	if err := scanSchema(&schema); err != nil {
		return fmt.Errorf("read current schema: %w", err)
	}
	return &InvalidIndexError{Schema: schema, Indexes: names}
}

// concurrentIndex is an index a migration builds concurrently.
type concurrentIndex struct {
	version   int64
	name      string
	statement string
}

var (
	createConcurrently = regexp.MustCompile(`(?is)CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+(\w+)\s+ON\s+[^;]+;`)
	dropIndex          = regexp.MustCompile(`(?is)DROP\s+INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+EXISTS\s+)?(\w+)`)
)

// concurrentIndexes returns the indexes the Up sections of the embedded
// migrations build with CREATE INDEX CONCURRENTLY IF NOT EXISTS and no
// later migration drops.
func concurrentIndexes() ([]concurrentIndex, error) {
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		return nil, err
	}
	var out []concurrentIndex
	dropped := map[string]int64{} // index name → last version that drops it
	for _, file := range names {
		v, err := goose.NumericComponent(file)
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", file, err)
		}
		b, err := fs.ReadFile(migrations.FS, file)
		if err != nil {
			return nil, err
		}
		up, _, _ := strings.Cut(string(b), "-- +goose Down")
		for _, m := range createConcurrently.FindAllStringSubmatch(up, -1) {
			out = append(out, concurrentIndex{version: v, name: m[1], statement: m[0]})
		}
		for _, m := range dropIndex.FindAllStringSubmatch(up, -1) {
			dropped[m[1]] = max(dropped[m[1]], v)
		}
	}
	return slices.DeleteFunc(out, func(ix concurrentIndex) bool { return dropped[ix.name] > ix.version }), nil
}

// rebuildMissingIndexes builds again each concurrent index of an applied
// migration that the schema lacks: an operator dropped it because it was
// INVALID, as InvalidIndexError says to.
func rebuildMissingIndexes(ctx context.Context, db *sql.DB, logger *slog.Logger) error {
	indexes, err := concurrentIndexes()
	if err != nil {
		return err
	}
	var applied int64
	if err := db.QueryRowContext(ctx, "SELECT coalesce(max(version_id), 0) FROM goose_db_version WHERE is_applied").Scan(&applied); err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	for _, ix := range indexes {
		if ix.version > applied {
			continue
		}
		var exists bool
		err := db.QueryRowContext(ctx, "SELECT to_regclass(quote_ident(current_schema()) || '.' || quote_ident($1)) IS NOT NULL", ix.name).Scan(&exists)
		if err != nil {
			return fmt.Errorf("look for index %s: %w", ix.name, err)
		}
		if exists {
			continue
		}
		logger.InfoContext(ctx, "building a missing index of an applied migration", slog.String("index", ix.name), slog.Int64("version", ix.version))
		if _, err := db.ExecContext(ctx, ix.statement); err != nil {
			return fmt.Errorf("build index %s of migration %d: %w", ix.name, ix.version, err)
		}
	}
	return nil
}
