package migrate_test

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// A build accepts a schema migrated further than it knows, as an earlier
// build meets one while a rolling deploy replaces it and after a rollback
// (docs/upgrading.md): the check serve runs without migrating passes, and
// migrating applies nothing and fails not. A schema behind the build is
// refused, naming both versions.
func TestABuildAcceptsASchemaMigratedFurther(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	latest := db.Int(t, "SELECT max(version_id) FROM goose_db_version WHERE is_applied")

	// A migration of a later build, applied.
	db.Exec(t, "INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)", latest+1)
	require.NoError(t, migrate.Check(ctx, cc), "the check accepts a schema ahead of the build")
	applied, err := migrate.Up(ctx, cc, slog.New(slog.DiscardHandler))
	require.NoError(t, err, "migrating a schema ahead of the build")
	require.Zero(t, applied, "nothing to apply to a schema ahead of the build")

	// The schema one migration behind the build.
	db.Exec(t, "UPDATE goose_db_version SET is_applied = false WHERE version_id >= $1", latest)
	require.ErrorContains(t, migrate.Check(ctx, cc),
		fmt.Sprintf("the schema is at migration %d, this build needs %d: run inboxd migrate", latest-1, latest))
}
