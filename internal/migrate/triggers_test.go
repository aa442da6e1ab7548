package migrate_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/doctable"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// docs/schema.md lists, under "What the database enforces", every trigger
// of a freshly migrated schema with its reason, and no other.
func TestEveryTriggerIsListedWithItsReason(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	var listed []string
	for _, cells := range doctable.Table(t, "schema.md", "triggers", 3) {
		require.NotEmpty(t, strings.TrimSpace(cells[2]), "a reason for %s", cells[0])
		listed = append(listed, doctable.Backquoted(cells[0])...)
	}
	slices.Sort(listed)
	got := db.Strings(t, `
		SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
		ORDER BY t.tgname`)
	require.Equal(t, got, listed, "the triggers of the schema, as docs/schema.md lists them")
}
