package pipeline_test

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
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

// plannedEachCall are the statements whose plan, made for any parameters
// on empty tables, reads a growing table whole: kept, it would go on doing
// so once the table has grown. None is kept: each is planned for its
// parameters and the tables as they are at each call, either by running
// through dbsqlc.PlanEachCall at every call (eachCall, which the test holds
// the code to), or by running only on a pool that keeps no plans (serve's
// maintenance and status pools, plansEachCall). Rewritten to probe an
// index per key whatever the plan, as StockReservedSkus and
// InboxRecordConflicts are, a statement leaves the list.
var plannedEachCall = map[string]string{
	"InboxCompleteMany":              eachCall + ": the batch's ids joined to the rows it updates",
	"InboxReplyAnswer":               eachCall + ": the requests' ids and their messages, joins",
	"OrderConfirmationRejectMany":    eachCall + ": the batch's order ids joined to the rows it updates",
	"OutboxRelease":                  eachCall + ": the batch's ids, id = ANY(ids), a seq scan while the table is empty",
	"JanitorDeleteConflicts":         onMaintenance + ": a retention's range, a seq scan while the table is empty",
	"JanitorDeletePublished":         onMaintenance + ": a retention's range, a seq scan while the table is empty",
	"JanitorDeleteReplyRequests":     onMaintenance + ": a retention's range, a seq scan while the table is empty",
	"StockMovesDeleteFoldedUnlocked": onMaintenance + ": the folded moves' row ids, ctid = ANY(...), a seq scan while the table is empty",
	"StatusPageConflicts":            onStatus + ": the newest conflicts, an index read from its end",
	"StatusPageFailuresByBuild":      onStatus + ": the last hour's attempts by build",
	"StatusPageHeldBack":             onStatus + ": the orders held back, joins",
	"StatusPageInboxOverview":        onStatus + ": counts over the last hour",
	"StatusPageReplays":              onStatus + ": the last replays",
	"StatusPageThroughput":           onStatus + ": the last hour's rates",
}

// How a statement of plannedEachCall is kept from a kept plan.
const (
	eachCall      = "through dbsqlc.PlanEachCall"
	onMaintenance = "on the maintenance's pool"
	onStatus      = "on the status page's pool"
)

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
// index holds the open rows only), unless it is listed in plannedEachCall. The
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
		if reason, ok := plannedEachCall[name]; ok {
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
	require.Empty(t, failures, "statements whose plan, kept from when the tables were empty, reads a table whole once it has grown (see plannedEachCall)")
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

// Every call of a statement plannedEachCall has run through
// dbsqlc.PlanEachCall does so: its database argument is
// dbsqlc.PlanEachCall(...). The calls are found in the service's code
// (internal/ and cmd/, tests left out), as q.Name(ctx, db, ...).
func TestEveryCallOfAStatementPlannedEachCallGoesThroughIt(t *testing.T) {
	t.Parallel()
	fset := token.NewFileSet()
	calls := map[string]int{}
	var wrong []string
	for _, root := range []string{filepath.Join("..", "..", "internal"), filepath.Join("..", "..", "cmd")} {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") ||
				strings.Contains(path, filepath.Join("internal", "dbsqlc")) {
				return err
			}
			file, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				return err
			}
			ast.Inspect(file, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok || !strings.HasPrefix(plannedEachCall[sel.Sel.Name], eachCall) || len(call.Args) < 2 {
					return true
				}
				calls[sel.Sel.Name]++
				if !isPlanEachCall(call.Args[1]) {
					wrong = append(wrong, fmt.Sprintf("%s: %s not through dbsqlc.PlanEachCall", fset.Position(call.Pos()), sel.Sel.Name))
				}
				return true
			})
			return nil
		})
		require.NoError(t, err)
	}
	require.Empty(t, wrong)
	for name, how := range plannedEachCall {
		if strings.HasPrefix(how, eachCall) {
			require.Positive(t, calls[name], "%s is called somewhere", name)
		}
	}
}

// isPlanEachCall reports whether e is dbsqlc.PlanEachCall(...).
func isPlanEachCall(e ast.Expr) bool {
	call, ok := e.(*ast.CallExpr)
	if !ok {
		return false
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	return ok && pkg.Name == "dbsqlc" && sel.Sel.Name == "PlanEachCall"
}
