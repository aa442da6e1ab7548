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
// small, kept, must still read them by index once they hold millions of
// rows: on a server without autovacuum nothing but the pools' replanning
// plans it again. So every statement the service runs is planned here as
// PostgreSQL would keep it (a generic plan): on the schema as a migration
// leaves it (no rows, no statistics), and again once each table that
// grows with the traffic holds 30, 300 and 3,000 rows, still without
// statistics (a service's first minutes: there "order_id = ANY(...)" took
// a table of 300 rows for cheaper to read whole than to probe, and the
// plan kept for the lock of a batch's orders read 100,000 rows at each
// cancellation once the table had grown). In none may its plan read a
// growing table but
// through index conditions: no sequential scan of it, and no scan of a
// whole index that is not partial (a partial index holds the open rows
// only), unless it is listed in plannedEachCall. The statements are the
// generated ones (internal/dbsqlc), so a new statement is checked as soon
// as it is written.
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
	// No statistics, whatever the server's autovacuum says.
	for _, table := range db.Strings(t, `SELECT c.relname FROM pg_class c
		WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace`) {
		_, err := conn.Exec(ctx, fmt.Sprintf("ALTER TABLE %s SET (autovacuum_enabled = false)", pgx.Identifier{table}.Sanitize()))
		require.NoError(t, err)
	}
	empty, checked := keptPlansWholeReads(t, conn, statements, partial)
	whole := map[string][]string{}
	var failures []string
	note := func(tables string, reads map[string][]string) {
		for _, name := range slices.Sorted(maps.Keys(reads)) {
			whole[name] = append(whole[name], reads[name]...)
			if _, listed := plannedEachCall[name]; !listed {
				failures = append(failures, fmt.Sprintf("%s, planned on %s: %s", name, tables, strings.Join(reads[name], ", ")))
			}
		}
	}
	note("empty tables", empty)
	rows := 0
	for _, size := range []int{30, 300, 3000} {
		fillSmall(t, conn, rows, size)
		rows = size
		reads, _ := keptPlansWholeReads(t, conn, statements, partial)
		note(fmt.Sprintf("%d rows a table", size), reads)
	}
	for _, name := range slices.Sorted(maps.Keys(plannedEachCall)) {
		if len(whole[name]) == 0 {
			failures = append(failures, fmt.Sprintf("%s is listed as read whole by a kept plan (%s), and no longer is: take it off the list", name, plannedEachCall[name]))
		}
	}
	require.Empty(t, failures, "statements whose plan, kept from when the tables were small, reads a table whole once it has grown (see plannedEachCall)")
	t.Logf("%d statements planned, of %d", checked, len(statements))
}

// keptPlansWholeReads plans each statement as PostgreSQL keeps it (conn
// forces generic plans) on the tables as they are, and returns by name the
// reads of a growing table that no index condition bounds, with how many
// statements it planned (PREPARE takes SELECT, INSERT, UPDATE and DELETE;
// the rest, LOCK TABLE, TRUNCATE, SAVEPOINT, plan nothing).
func keptPlansWholeReads(t *testing.T, conn *pgx.Conn, statements map[string]string, partial map[string]bool) (map[string][]string, int) {
	t.Helper()
	ctx := t.Context()
	out := map[string][]string{}
	checked := 0
	for _, name := range slices.Sorted(maps.Keys(statements)) {
		sql := statements[name]
		if _, err := conn.Exec(ctx, "PREPARE kept AS "+sql); err != nil {
			require.Contains(t, err.Error(), "syntax error", "%s: PREPARE", name)
			continue
		}
		var params int
		require.NoError(t, conn.QueryRow(ctx, "SELECT cardinality(parameter_types) FROM pg_prepared_statements WHERE name = 'kept'").Scan(&params))
		args := strings.TrimSuffix(strings.Repeat("NULL, ", params), ", ")
		var raw []byte
		var err error
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
		if whole := plan[0].Plan.wholeReads(partial); len(whole) > 0 {
			out[name] = whole
			if _, listed := plannedEachCall[name]; !listed {
				t.Logf("%s's plan:\n%s", name, plan[0].Plan.String(""))
			}
		}
	}
	return out, checked
}

// fillSmall grows each table that grows with the traffic from from rows
// to to, the inbox's keys and a SKU's moves included, and leaves them
// without statistics: nothing analyzes them.
func fillSmall(t *testing.T, conn *pgx.Conn, from, to int) {
	t.Helper()
	_, err := conn.Exec(t.Context(), `INSERT INTO stock (sku, available) VALUES ('SKU-1', 1000000) ON CONFLICT DO NOTHING`)
	require.NoError(t, err)
	for _, q := range []string{
		`INSERT INTO inbox (message_id, message_type, payload, status, attempts, order_key, received_at, processed_at)
		 SELECT 'small-' || g, 'order.created', '\x7b7d', CASE WHEN g % 2 = 0 THEN 'processed' ELSE 'pending' END, 1,
		        'small-order-' || g, now(), CASE WHEN g % 2 = 0 THEN now() END
		 FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO inbox_attempts (inbox_id, run, attempt, message_id, outcome, process, build)
		 SELECT i.id, 0, 1, i.message_id, 'processed', 'small', 'small'
		 FROM generate_series($1 + 1, $2) AS g JOIN inbox i ON i.message_id = 'small-' || g`,
		`INSERT INTO inbox_conflicts (message_id, message_type, stored_sha256, conflicting_sha256, conflicting_payload)
		 SELECT 'small-' || g, 'order.created', 'a', 'b' || g, '\x7b7d' FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO inbox_reply_requests (message_id, reply_to)
		 SELECT 'small-' || g, 'amq.rabbitmq.reply-to' FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO outbox (idempotency_key, routing_key, payload, message_id, order_key, published_at, attempts)
		 SELECT 'small-' || g, 'order.confirmed', '{}', 'small-' || g, 'small-order-' || g, CASE WHEN g % 2 = 0 THEN now() END, 1
		 FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO order_confirmations (order_id, status, user_id, message_id)
		 SELECT 'small-order-' || g, 'confirmed', 'user', 'small-' || g FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO stock_reservations (order_id, sku, quantity)
		 SELECT 'small-order-' || g, 'SKU-1', 1 FROM generate_series($1 + 1, $2) AS g`,
		`INSERT INTO stock_moves (sku, quantity) SELECT 'SKU-1', -1 FROM generate_series($1 + 1, $2)`,
	} {
		_, err := conn.Exec(t.Context(), q, from, to)
		require.NoError(t, err, q)
	}
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
