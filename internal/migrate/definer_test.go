package migrate_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
	"github.com/orderconfirm/inboxd/migrations"
)

// definerFunctions lists the schema's SECURITY DEFINER functions.
func definerFunctions(t *testing.T, db *testenv.DB) []string {
	t.Helper()
	return db.Strings(t, `
		SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = current_schema()::regnamespace AND p.prosecdef
		ORDER BY 1`)
}

// Every function that runs as the schema's owner pins its search_path to
// the schema with pg_temp last, and PUBLIC may not execute it.
func TestDefinerFunctionsAreClosed(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	definers := definerFunctions(t, db)
	require.NotEmpty(t, definers, "the schema has definer functions to check")
	for _, fn := range definers {
		config := db.Strings(t, `SELECT coalesce(array_to_string(proconfig, ' | '), '') FROM pg_proc WHERE oid = $1::regprocedure`, fn)
		require.Equal(t, []string{"search_path=" + db.Schema + ", pg_temp"}, config,
			"%s runs as the owner: its search_path is the schema, then pg_temp, and it sets nothing else", fn)
		require.Zero(t, db.Int(t, `
			SELECT count(*) FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
			WHERE p.oid = $1::regprocedure AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'`, fn),
			"PUBLIC may not execute %s", fn)
	}
}

// definerArguments gives each definer function arguments that take it as
// far into its body as a caller can. A definer function missing here fails
// the hijack test, so that a new one is tried too.
var definerArguments = map[string]string{
	"claim_floor_lower(text,bigint)": "'inbox', 0",
	"inbox_keys_analyze_parts()":     "",
}

// A login of each role (the service's, the operators', and one of none,
// where PUBLIC may use the schema, as in the public schema) shadows every
// table and view of the schema with a temporary view that calls a function
// of its own, then calls every definer function: the function of the
// login's never runs as anyone else, and the login gains no right.
func TestNoLoginGainsARightThroughADefinerFunction(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	ctx := context.WithoutCancel(t.Context())
	db.Exec(t, "GRANT USAGE ON SCHEMA "+db.Schema+" TO PUBLIC")
	definers := definerFunctions(t, db)
	for _, fn := range definers {
		_, known := definerArguments[fn]
		require.True(t, known, "definerArguments has no arguments for %s", fn)
	}
	// Each relation's columns, for a temporary view of the same shape.
	shadows := db.Strings(t, `
		SELECT format('CREATE TEMP VIEW %I AS SELECT %s WHERE NOT pg_temp.pwn()', c.relname,
		              string_agg(format('NULL::%s AS %I', format_type(a.atttypid, a.atttypmod), a.attname), ', ' ORDER BY a.attnum))
		FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
		WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
		GROUP BY c.relname`)
	require.NotEmpty(t, shadows)

	for _, group := range []string{"inbox_service", "inbox_operator", ""} {
		name := cmp.Or(group, "none")
		t.Run(name, func(t *testing.T) {
			login := "hijack_" + name + "_" + db.Schema
			create := "CREATE ROLE " + login + " LOGIN PASSWORD 'pw'"
			if group != "" {
				create += " IN ROLE " + group
			}
			db.Exec(t, create)
			t.Cleanup(func() { _, _ = db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+login) })
			rights := func() string {
				return db.Strings(t, `
					SELECT format('super=%s createrole=%s createdb=%s bypassrls=%s replication=%s member of=%s',
					              r.rolsuper, r.rolcreaterole, r.rolcreatedb, r.rolbypassrls, r.rolreplication,
					              (SELECT coalesce(string_agg(m.roleid::regrole::text, ',' ORDER BY 1), '')
					               FROM pg_auth_members m WHERE m.member = r.oid))
					FROM pg_roles r WHERE r.rolname = $1`, login)[0]
			}
			before := rights()

			u, err := url.Parse(db.URL)
			require.NoError(t, err)
			u.User = url.UserPassword(login, "pw")
			cfg, err := pgx.ParseConfig(u.String())
			require.NoError(t, err)
			var mu sync.Mutex
			var ranAs []string
			cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
				if who, ok := strings.CutPrefix(n.Message, "pwn ran as "); ok {
					mu.Lock()
					ranAs = append(ranAs, who)
					mu.Unlock()
				}
			}
			conn, err := pgx.ConnectConfig(ctx, cfg)
			require.NoError(t, err)
			defer func() { _ = conn.Close(ctx) }()

			// The notice reaches the test even when the call fails and its
			// transaction rolls the escalation back.
			_, err = conn.Exec(ctx, `
				CREATE FUNCTION pg_temp.pwn() RETURNS boolean LANGUAGE plpgsql AS $$
				BEGIN
					RAISE NOTICE 'pwn ran as %', current_user;
					EXECUTE format('ALTER ROLE %I SUPERUSER', session_user);
					RETURN true;
				EXCEPTION WHEN insufficient_privilege THEN
					RETURN true;
				END $$`)
			require.NoError(t, err)
			for _, shadow := range shadows {
				_, err := conn.Exec(ctx, shadow)
				require.NoError(t, err, shadow)
			}
			for _, fn := range definers {
				name, _, _ := strings.Cut(fn, "(")
				_, err := conn.Exec(ctx, fmt.Sprintf("SELECT %s.%s(%s)", db.Schema, name, definerArguments[fn]))
				t.Logf("%s as %s: %v", fn, login, err)
			}
			mu.Lock()
			defer mu.Unlock()
			for _, who := range ranAs {
				require.Equal(t, login, who, "a function of the login's ran as %s inside a definer function", who)
			}
			require.Equal(t, before, rights(), "the login gained no right")
		})
	}
}

// Each migration runs in a transaction of its own, and a run can stop
// between two (a lock timeout, a failover): a definer function must be
// closed in the migration that creates it, not in a later one. After every
// migration, one at a time, every definer function of the schema pins its
// search_path with pg_temp last and PUBLIC may not execute it.
func TestDefinerFunctionsAreClosedAfterEveryMigration(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t) // for its database: the steps go in a schema of their own
	ctx := context.WithoutCancel(t.Context())
	schema := db.Schema + "_steps"
	db.Exec(t, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
	t.Cleanup(func() { db.Exec(t, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE") })

	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	cc.RuntimeParams["search_path"] = schema
	sqlDB := stdlib.OpenDB(*cc)
	defer func() { _ = sqlDB.Close() }()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS)
	require.NoError(t, err)

	steps := 0
	for {
		res, err := provider.UpByOne(ctx)
		if errors.Is(err, goose.ErrNoNextVersion) {
			break
		}
		require.NoError(t, err)
		steps++
		open := db.Strings(t, `
			SELECT p.oid::regprocedure::text || ': ' || coalesce(array_to_string(p.proconfig, ' | '), '')
			       || CASE WHEN EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
			                            WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
			               THEN ' | PUBLIC may execute' ELSE '' END
			FROM pg_proc p
			WHERE p.pronamespace = $1::regnamespace AND p.prosecdef
			  AND (p.proconfig IS DISTINCT FROM ARRAY['search_path=' || $1 || ', pg_temp']
			       OR EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
			                  WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))
			ORDER BY 1`, schema)
		require.Empty(t, open, "after %s, definer functions left open", res.Source.Path)
	}
	require.Positive(t, steps)
}
