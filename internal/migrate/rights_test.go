package migrate_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/doctable"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// rightsRoles are the roles docs/security.md's rights table has a column for.
var rightsRoles = []string{"inbox_service", "inbox_operator", "PUBLIC"}

// otherFunctions names docs/security.md's row for every function it does not
// list by name.
const otherFunctions = "every other function"

// rightsRow is a row of docs/security.md's rights table: its objects, whether
// they run as the owner, and each role's rights as written.
type rightsRow struct {
	objects []string
	definer bool
	rights  map[string]string
}

// readmeRights reads the rights table between docs/security.md's markers.
func readmeRights(t *testing.T) []rightsRow {
	t.Helper()
	var rows []rightsRow
	for _, cells := range doctable.Table(t, "security.md", "rights", 6) {
		row := rightsRow{definer: strings.Contains(cells[1], "runs as the owner"), rights: map[string]string{}}
		row.objects = doctable.Backquoted(cells[0])
		if len(row.objects) == 0 {
			require.Equal(t, otherFunctions, cells[0], "a row names its objects in backquotes")
		}
		for i, role := range rightsRoles {
			if cells[2+i] != "—" {
				row.rights[role] = cells[2+i]
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// catalogRights returns each object's rights by role, as docs/security.md writes
// them: the object's privileges sorted, then those it has on some columns
// only, each with its columns in table order; and whether each function
// runs as the owner. Rights of any other role than the owner and the
// docs/security.md's roles fail the test.
func catalogRights(t *testing.T, db *testenv.DB) (map[string]map[string]string, map[string]bool) {
	t.Helper()
	rows := db.Strings(t, `
		WITH grants AS (
			SELECT c.relname::text AS object, a.grantee, a.privilege_type AS privilege, NULL::text AS cols, 0 AS part
			FROM pg_class c, aclexplode(coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's'::"char" ELSE 'r'::"char" END, c.relowner))) a
			WHERE c.relnamespace = current_schema()::regnamespace AND a.grantee <> c.relowner
			UNION ALL
			SELECT c.relname::text, a.grantee, a.privilege_type, string_agg(att.attname::text, ', ' ORDER BY att.attnum), 1
			FROM pg_class c JOIN pg_attribute att ON att.attrelid = c.oid AND att.attacl IS NOT NULL, aclexplode(att.attacl) a
			WHERE c.relnamespace = current_schema()::regnamespace AND a.grantee <> c.relowner
			GROUP BY 1, 2, 3
			UNION ALL
			SELECT p.oid::regprocedure::text, a.grantee, a.privilege_type, NULL, 0
			FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f'::"char", p.proowner))) a
			WHERE p.pronamespace = current_schema()::regnamespace AND a.grantee <> p.proowner
		)
		SELECT object || E'\t' || CASE grantee WHEN 0 THEN 'PUBLIC' ELSE grantee::regrole::text END || E'\t' ||
		       string_agg(privilege || coalesce(' (' || cols || ')', ''), ', ' ORDER BY part, privilege)
		FROM grants GROUP BY object, grantee`)
	got := map[string]map[string]string{}
	for _, r := range rows {
		f := strings.Split(r, "\t")
		object, role, rights := f[0], f[1], f[2]
		require.Contains(t, rightsRoles, role, "%s has rights on %s (%s): only the owner and docs/security.md's roles may", role, object, rights)
		if got[object] == nil {
			got[object] = map[string]string{}
		}
		got[object][role] = rights
	}
	definers := map[string]bool{}
	for _, fn := range definerFunctions(t, db) {
		definers[fn] = true
	}
	return got, definers
}

// Every role has exactly the rights docs/security.md's table lists on each
// object of a freshly migrated schema, nothing on the schema but USAGE,
// and no role attribute.
func TestEveryRoleHasOnlyTheRightsTheReadmeLists(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	got, definers := catalogRights(t, db)
	functions := db.Strings(t, `SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace`)

	listed := map[string]bool{}
	var others *rightsRow
	for _, row := range readmeRights(t) {
		if len(row.objects) == 0 {
			others = &row
			continue
		}
		for _, object := range row.objects {
			require.False(t, listed[object], "%s is listed twice", object)
			listed[object] = true
			require.Equal(t, row.rights, cmpMap(got[object]), "the rights on %s", object)
			require.Equal(t, row.definer, definers[object], "whether %s runs as the owner", object)
		}
	}
	require.NotNil(t, others, "the table has a row for %s", otherFunctions)
	for object, rights := range got {
		if listed[object] {
			continue
		}
		require.True(t, slices.Contains(functions, object), "%s has rights docs/security.md does not list: %v", object, rights)
		require.Equal(t, others.rights, rights, "the rights on %s, one of %s", object, otherFunctions)
		require.False(t, definers[object], "%s runs as the owner and is not listed", object)
	}
	for _, fn := range functions {
		if !listed[fn] {
			require.Equal(t, others.rights, cmpMap(got[fn]), "the rights on %s, one of %s", fn, otherFunctions)
		}
	}

	for _, role := range []string{"inbox_service", "inbox_operator"} {
		require.Equal(t, []string{"usage"}, db.Strings(t, `
			SELECT p FROM unnest(ARRAY['usage', 'create']) p
			WHERE has_schema_privilege($1, current_schema(), p)`, role), "%s's rights on the schema", role)
		require.Equal(t, []string{"f f f f f f"}, db.Strings(t, `
			SELECT concat_ws(' ', rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls, rolcanlogin)
			FROM pg_roles WHERE rolname = $1`, role), "%s has no role attribute and cannot log in", role)
		require.Empty(t, db.Strings(t, `SELECT m.roleid::regrole::text FROM pg_auth_members m WHERE m.member = $1::regrole`, role),
			"%s is a member of no role (pg_read_all_data, say, would give it more than the table lists)", role)
	}
	require.Zero(t, db.Int(t, `
		SELECT count(*) FROM pg_namespace n, aclexplode(n.nspacl) a
		WHERE n.oid = current_schema()::regnamespace AND a.grantee = 0`), "PUBLIC has no right on the schema")
}

// cmpMap is m, or an empty map for nil, so that no rights compare equal.
func cmpMap(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}
