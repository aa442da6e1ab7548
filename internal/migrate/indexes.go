package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
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
		" then run inboxd migrate again"
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
