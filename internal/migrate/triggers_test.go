package migrate_test

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/doctable"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// listedWithReasons returns, sorted, the names docs/schema.md's table
// (between its "<table>: begin" and "end" marks) lists in its first
// column, and fails the test on a row whose last column, its reason, is
// empty.
func listedWithReasons(t *testing.T, table string, columns int) []string {
	t.Helper()
	var listed []string
	for _, cells := range doctable.Table(t, "schema.md", table, columns) {
		require.NotEmpty(t, strings.TrimSpace(cells[columns-1]), "a reason for %s", cells[0])
		listed = append(listed, doctable.Backquoted(cells[0])...)
	}
	slices.Sort(listed)
	return listed
}

// docs/schema.md lists, under "What the database enforces", every trigger
// of a freshly migrated schema with its reason, and no other.
func TestEveryTriggerIsListedWithItsReason(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	listed := listedWithReasons(t, "triggers", 3)
	got := db.Strings(t, `
		SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
		ORDER BY t.tgname`)
	require.Equal(t, got, listed, "the triggers of the schema, as docs/schema.md lists them")
}

// functionBodyBudget is the most lines of function body (neither blank nor
// a comment) a freshly migrated schema may hold: the database keeps the
// rules that must hold for every writer, and the service's state machines
// are Go (docs/schema.md).
const functionBodyBudget = 300

// docs/schema.md lists every function of a freshly migrated schema with its
// reason, and no other; together their bodies stay within
// functionBodyBudget lines.
func TestEveryFunctionIsListedWithItsReason(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	listed := listedWithReasons(t, "functions", 2)
	got := db.Strings(t, `
		SELECT p.proname FROM pg_proc p
		WHERE p.pronamespace = current_schema()::regnamespace
		ORDER BY p.proname`)
	require.Equal(t, got, listed, "the functions of the schema, as docs/schema.md lists them")

	lines := db.Strings(t, `
		SELECT count(*)::text FROM pg_proc p, regexp_split_to_table(p.prosrc, E'\n') AS l(line)
		WHERE p.pronamespace = current_schema()::regnamespace
		  AND btrim(l.line) <> '' AND btrim(l.line) !~ '^--'`)
	require.Len(t, lines, 1)
	n, err := strconv.Atoi(lines[0])
	require.NoError(t, err)
	require.LessOrEqual(t, n, functionBodyBudget, "lines of function body in the schema")
}
