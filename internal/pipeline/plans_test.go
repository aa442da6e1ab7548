package pipeline_test

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// boundedTables are the tables whose size does not grow with the traffic:
// a statement may read them whole.
var boundedTables = map[string]string{
	"stock":                 "one row per SKU",
	"inbox_leader":          "one row",
	"inbox_sessions":        "one row per live process's session key",
	"inbox_key_hot_parts":   "two rows",
	"inbox_key_generations": "eight generations and the one open",
	"claim_floor_locks":     "one row per floor",
	"goose_db_version":      "one row per migration",
}

// replanned are the statements whose plan, made for any parameters on
// empty tables, reads a growing table whole: kept, it would go on doing
// so once the table has grown. The pools drop their plans every
// pipeline.ReplanEvery, so such a plan is made again for the tables as
// they are within seconds (cmd/inboxd's
// TestStatementsReadIndexesOnceTheTablesHaveGrown holds the flow's to
// that). Rewritten to probe an index per key whatever the plan, as
// StockReservedSkus and InboxRecordConflicts are, a statement leaves the
// list; once it is empty the pools may keep their plans for good.
var replanned = map[string]string{
	"InboxCompleteMany":              "the batch's ids joined to the rows it updates",
	"InboxReplyAnswer":               "the requests' ids and their messages, joins",
	"JanitorDeleteConflicts":         "a retention's range, a seq scan while the table is empty",
	"JanitorDeletePublished":         "a retention's range, a seq scan while the table is empty",
	"JanitorDeleteReplyRequests":     "a retention's range, a seq scan while the table is empty",
	"OrderConfirmationRejectMany":    "the batch's order ids joined to the rows it updates",
	"OutboxRelease":                  "the batch's ids, id = ANY(ids), a seq scan while the table is empty",
	"StatusPageConflicts":            "the newest conflicts, an index read from its end",
	"StatusPageFailuresByBuild":      "the last hour's attempts by build",
	"StatusPageHeldBack":             "the orders held back, joins",
	"StatusPageInboxOverview":        "counts over the last hour",
	"StatusPageReplays":              "the last replays",
	"StatusPageThroughput":           "the last hour's rates",
	"StockMovesDeleteFoldedUnlocked": "the folded moves' row ids, ctid = ANY(...), a seq scan while the table is empty",
}

// A pool keeps each statement's plan (pipeline.KeepPlans), and PostgreSQL
// keeps a plan made for any parameters once it is no dearer than those
// made for the first five calls' own. A plan made while the tables were
// empty, kept, must still read them by index once they hold millions of
// rows: on a server without autovacuum nothing but the pools' replanning
// plans it again. So every statement the service runs is planned here as
// PostgreSQL would keep it (a generic plan), on the schema as a migration
// leaves it (no rows, no statistics), and its plan may read a table that
// grows with the traffic only through index conditions: no sequential
// scan of it, and no scan of a whole index that is not partial (a partial
// index holds the open rows only), unless it is listed in replanned. The
// statements are the generated ones (internal/dbsqlc), so a new statement
// is checked as soon as it is written.
func TestEveryStatementsKeptPlanReadsGrowingTablesByIndex(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := t.Context()
	conn := db.SessionWith(t, pipeline.ConfigureSession)

	partial := map[string]bool{}
	for _, name := range db.Strings(t, `SELECT c.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
		WHERE x.indpred IS NOT NULL AND c.relnamespace = current_schema()::regnamespace`) {
		partial[name] = true
	}
	_, err := conn.Exec(ctx, "SET plan_cache_mode = force_generic_plan")
	require.NoError(t, err)

	statements := generatedStatements(t)
	require.Greater(t, len(statements), 50, "the statements of internal/dbsqlc")
	checked := 0
	var failures []string
	for _, name := range slices.Sorted(maps.Keys(statements)) {
		sql := statements[name]
		if _, err := conn.Exec(ctx, "PREPARE kept AS "+sql); err != nil {
			// PREPARE takes SELECT, INSERT, UPDATE and DELETE; the rest
			// (LOCK TABLE, TRUNCATE, SAVEPOINT) plan nothing.
			require.Contains(t, err.Error(), "syntax error", "%s: PREPARE", name)
			continue
		}
		var params int
		require.NoError(t, conn.QueryRow(ctx, "SELECT cardinality(parameter_types) FROM pg_prepared_statements WHERE name = 'kept'").Scan(&params))
		args := strings.TrimSuffix(strings.Repeat("NULL, ", params), ", ")
		var raw []byte
		if params > 0 {
			err = conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) EXECUTE kept("+args+")", pgx.QueryExecModeSimpleProtocol).Scan(&raw)
		} else {
			err = conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) EXECUTE kept", pgx.QueryExecModeSimpleProtocol).Scan(&raw)
		}
		require.NoError(t, err, "%s: EXPLAIN", name)
		_, err = conn.Exec(ctx, "DEALLOCATE kept")
		require.NoError(t, err)
		checked++

		var plan []struct{ Plan planNode }
		require.NoError(t, json.Unmarshal(raw, &plan))
		whole := plan[0].Plan.wholeReads(partial)
		if reason, ok := replanned[name]; ok {
			if len(whole) == 0 {
				failures = append(failures, fmt.Sprintf("%s is listed as read whole by a kept plan (%s), and no longer is: take it off the list", name, reason))
			}
			continue
		}
		if len(whole) > 0 {
			failures = append(failures, fmt.Sprintf("%s: %s", name, strings.Join(whole, ", ")))
			t.Logf("%s's plan:\n%s", name, plan[0].Plan.String(""))
		}
	}
	require.Empty(t, failures, "statements whose plan, kept from when the tables were empty, reads a table whole once it has grown (see replanned)")
	t.Logf("%d statements planned, of %d", checked, len(statements))
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	Index     string     `json:"Index Name"`
	IndexCond string     `json:"Index Cond"`
	Plans     []planNode `json:"Plans"`
}

// String is the plan's tree, a node a line.
func (n planNode) String(indent string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s%s", indent, n.NodeType)
	if n.Relation != "" {
		fmt.Fprintf(&b, " on %s", n.Relation)
	}
	if n.Index != "" {
		fmt.Fprintf(&b, " using %s", n.Index)
	}
	if n.IndexCond != "" {
		fmt.Fprintf(&b, " (%s)", n.IndexCond)
	}
	b.WriteString("\n")
	for _, c := range n.Plans {
		b.WriteString(c.String(indent + "  "))
	}
	return b.String()
}

// wholeReads returns the reads of a growing table under n that are not
// bounded by an index condition: sequential scans, and scans of a whole
// index that is not partial.
func (n planNode) wholeReads(partial map[string]bool) []string {
	var out []string
	switch {
	case strings.HasPrefix(n.Relation, "pg_"):
		// The system catalogs.
	case n.NodeType == "Seq Scan" && boundedTables[n.Relation] == "":
		out = append(out, fmt.Sprintf("Seq Scan on %s", n.Relation))
	case strings.HasSuffix(n.NodeType, "Index Scan") || n.NodeType == "Index Only Scan":
		if n.IndexCond == "" && !partial[n.Index] && boundedTables[n.Relation] == "" && !bounded(n.Index) {
			out = append(out, fmt.Sprintf("%s of %s, whole", n.NodeType, n.Index))
		}
	}
	for _, c := range n.Plans {
		out = append(out, c.wholeReads(partial)...)
	}
	return out
}

// bounded reports whether index is one of a bounded table's (a bitmap
// index scan names no relation).
func bounded(index string) bool {
	for table := range boundedTables {
		if strings.HasPrefix(index, table+"_") {
			return true
		}
	}
	return false
}

// generatedStatements returns the SQL of every statement sqlc generated,
// by name: the string constants of internal/dbsqlc that start with
// "-- name:".
func generatedStatements(t *testing.T) map[string]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("..", "dbsqlc", "*.sql.go"))
	require.NoError(t, err)
	out := map[string]string{}
	fset := token.NewFileSet()
	for _, f := range files {
		file, err := parser.ParseFile(fset, f, nil, 0)
		require.NoError(t, err)
		for _, decl := range file.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.CONST {
				continue
			}
			for _, spec := range gen.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						continue
					}
					sql, err := strconv.Unquote(lit.Value)
					require.NoError(t, err)
					if strings.HasPrefix(sql, "-- name: ") {
						out[name.Name] = sql
					}
				}
			}
		}
	}
	return out
}
