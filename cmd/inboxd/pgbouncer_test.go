package main

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// pgBouncerDefaults are the [pgbouncer] settings startPgBouncer runs with,
// beside its addresses and authentication: session pooling, and what a
// deployment would leave as it is, in particular no
// ignore_startup_parameters, so that a client sending a startup parameter
// PgBouncer does not track is refused, and server_round_robin off (idle
// server connections are handed out last in, first out).
var pgBouncerDefaults = map[string]string{
	"pool_mode":         "session",
	"max_client_conn":   "200",
	"default_pool_size": "100",
}

// startPgBouncer runs PgBouncer in front of the PostgreSQL server of
// databaseURL with pgBouncerDefaults, each of settings (a name and its
// value, e.g. "pool_mode": "transaction") replacing or adding to them. It
// returns databaseURL pointing at PgBouncer instead. The binary is Debian's
// pgbouncer package (.ci/run installs it); without it the test is skipped,
// except when TEST_DATABASE_URL is set, where it fails.
func startPgBouncer(t *testing.T, databaseURL string, settings map[string]string) string {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer"
		_, err = os.Stat(bin)
	}
	if err != nil {
		const why = "pgbouncer is not installed (apt-get install pgbouncer); the test of inboxd behind a pooler cannot run"
		if os.Getenv("TEST_DATABASE_URL") == "" {
			t.Skip(why)
		}
		t.Fatal(why)
	}

	u, err := url.Parse(databaseURL)
	require.NoError(t, err)
	server, port, err := net.SplitHostPort(u.Host)
	require.NoError(t, err)
	listen := testenv.FreeAddr(t)
	_, listenPort, err := net.SplitHostPort(listen)
	require.NoError(t, err)

	dir := t.TempDir()
	users := filepath.Join(dir, "users.txt")
	require.NoError(t, os.WriteFile(users, fmt.Appendf(nil, "%q \"\"\n", u.User.Username()), 0o644))
	ini := filepath.Join(dir, "pgbouncer.ini")
	conf := fmt.Sprintf(`[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %s
unix_socket_dir =
auth_type = trust
auth_file = %s
`, server, port, listenPort, users)
	all := maps.Clone(pgBouncerDefaults)
	maps.Copy(all, settings)
	for _, name := range slices.Sorted(maps.Keys(all)) {
		conf += name + " = " + all[name] + "\n"
	}
	require.NoError(t, os.WriteFile(ini, []byte(conf), 0o644))
	require.NoError(t, os.Chmod(dir, 0o755))

	args := []string{ini}
	if os.Geteuid() == 0 { // PgBouncer refuses to run as root
		nobody, err := user.Lookup("postgres")
		if err != nil {
			nobody, err = user.Lookup("nobody")
		}
		require.NoError(t, err)
		args = []string{"-u", nobody.Username, ini}
	}
	cmd := exec.Command(bin, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("pgbouncer log:\n%s", out.String())
		}
	})
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", listen)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "pgbouncer listens")

	u.Host = listen
	return u.String()
}

// inboxd runs behind PgBouncer (session pooling, its settings as shipped):
// it migrates, stores, handles and publishes through it. Every setting
// inboxd gives its sessions (timeouts, synchronous_commit, the planner's,
// the search_path of DATABASE_URL) is set once the session is up
// (pgsession.SetAfterConnect): sent at startup, PgBouncer refused the first
// of them (08P01, "unsupported startup parameter: lock_timeout") and
// inboxd never connected.
func TestServesThroughPgBouncer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	viaPooler := startPgBouncer(t, b.db.URL, nil)

	out, ok := runInboxd(t, "migrate", "DATABASE_URL="+viaPooler, "PATH="+os.Getenv("PATH"))
	require.True(t, ok, "migrate through pgbouncer: %s", out)

	env := serviceEnv(b.db, b.broker)
	p := startProcess(t, withDatabaseURL(env, viaPooler))
	// Every event of the orders arrives downstream (publishOrders waits).
	b.publishOrders(t, 200, 1, "pooled")
	p.terminate(30 * time.Second)
}

// withDatabaseURL returns env with DATABASE_URL set to databaseURL.
func withDatabaseURL(env []string, databaseURL string) []string {
	env = slices.Clone(env)
	for i, kv := range env {
		if strings.HasPrefix(kv, "DATABASE_URL=") {
			env[i] = "DATABASE_URL=" + databaseURL
		}
	}
	return env
}

// refusal is the line inboxd prints when it refuses a connection pooled
// per transaction.
const refusal = "inboxd: the database connection is pooled per transaction (PgBouncer pool_mode=transaction or statement); " +
	"inboxd needs session pooling or a direct connection: see docs/failure-handling.md"

// Behind PgBouncer in transaction or statement pooling, every server
// connection serves many clients in turn: the LISTEN of the wake-ups, the
// session-level advisory locks of the liveness and leader keys, the
// session settings (synchronous_commit among them) and the kept plans of
// inboxd's sessions would stay on a server connection other clients then
// use, or be missing from the one a statement runs on. inboxd refuses to
// start, with one line naming the pool mode, before it consumes anything:
// an order published before it started stays in the queue, and migrate
// (whose lock is goose's session-level advisory lock) refuses likewise.
// With server_round_robin the idle server connections are handed out in
// turn instead of last in, first out; with default_pool_size 1 there is
// one server connection for every client.
func TestRefusesPoolingPerTransaction(t *testing.T) {
	if raceEnabled {
		t.Skip(noRaceToWatch)
	}
	t.Parallel()
	for name, settings := range map[string]map[string]string{
		"Transaction":           {"pool_mode": "transaction"},
		"Statement":             {"pool_mode": "statement"},
		"TransactionRoundRobin": {"pool_mode": "transaction", "server_round_robin": "1"},
		"TransactionOneServer":  {"pool_mode": "transaction", "default_pool_size": "1"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			viaPooler := startPgBouncer(t, b.db.URL, settings)
			w := loadgen.Generate(loadgen.Spec{Orders: 1, Seed: 1, Prefix: "refused"})
			require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 1))

			cmd := exec.Command(inboxdPath, "serve")
			cmd.Env = withDatabaseURL(serviceEnv(b.db, b.broker), viaPooler)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			started := time.Now()
			require.NoError(t, cmd.Start())
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			var err error
			select {
			case err = <-exited:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
				t.Fatalf("inboxd serve still ran 10 s after it started; inbox rows: %d, orders left in the queue: %d; stderr:\n%s",
					b.count(t, "SELECT count(*) FROM inbox"), b.broker.ReadyMessages(t, broker.QueueInbox), stderr.String())
			}
			failOnRace(t, cmd, stderr.Bytes())
			t.Logf("inboxd serve exited after %s: %v", time.Since(started).Round(time.Millisecond), err)
			require.Error(t, err, "inboxd serve exits non-zero")
			require.Equal(t, refusal+"\n", stderr.String(), "stderr is one line naming the pool mode")
			require.Empty(t, stdout.String())
			require.Equal(t, len(w.Messages), b.broker.ReadyMessages(t, broker.QueueInbox), "nothing was consumed")
			require.Zero(t, b.count(t, "SELECT count(*) FROM inbox"))

			out, ok := runInboxd(t, "migrate", "DATABASE_URL="+viaPooler, "PATH="+os.Getenv("PATH"))
			require.False(t, ok, "migrate exits non-zero: %s", out)
			require.Equal(t, refusal+"\n", out)
		})
	}
}

// DetectPooling answers each of PgBouncer's pool modes, however PgBouncer
// hands out its idle server sessions, many times over: session pooling is
// never taken for transaction pooling (inboxd would refuse to start), and
// transaction or statement pooling never for session pooling (inboxd would
// run with its session state scattered).
func TestDetectPoolingThroughPgBouncer(t *testing.T) {
	if raceEnabled {
		t.Skip(noRaceToWatch)
	}
	t.Parallel()
	db := testenv.NewDB(t)
	for name, c := range map[string]struct {
		settings map[string]string
		want     pgsession.Pooling
	}{
		"Session":               {map[string]string{}, pgsession.PooledPerSession},
		"SessionRoundRobin":     {map[string]string{"server_round_robin": "1"}, pgsession.PooledPerSession},
		"Transaction":           {map[string]string{"pool_mode": "transaction"}, pgsession.PooledPerTransaction},
		"TransactionRoundRobin": {map[string]string{"pool_mode": "transaction", "server_round_robin": "1"}, pgsession.PooledPerTransaction},
		"TransactionOneServer":  {map[string]string{"pool_mode": "transaction", "default_pool_size": "1"}, pgsession.PooledPerTransaction},
		"TransactionReset":      {map[string]string{"pool_mode": "transaction", "server_reset_query_always": "1"}, pgsession.PooledPerTransaction},
		"Statement":             {map[string]string{"pool_mode": "statement"}, pgsession.PooledPerTransaction},
		"StatementRoundRobin":   {map[string]string{"pool_mode": "statement", "server_round_robin": "1"}, pgsession.PooledPerTransaction},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cc, err := pgx.ParseConfig(startPgBouncer(t, db.URL, c.settings))
			require.NoError(t, err)
			// Other clients of the pooler run statements at once, so that
			// it has more server sessions: idle ones between their
			// statements when it pools per transaction, theirs for good
			// when it pools per session. PgBouncer hands out one idle
			// server session differently from two, or more.
			var others []*pgx.Conn
			for servers := 1; servers <= 4; servers++ {
				for len(others) < servers {
					conn, err := pgsession.Connect(t.Context(), cc)
					require.NoError(t, err)
					t.Cleanup(func() { pgsession.Close(t.Context(), conn) })
					others = append(others, conn)
				}
				errs := make([]error, len(others))
				var wg sync.WaitGroup
				for i, conn := range others {
					wg.Go(func() { _, errs[i] = conn.Exec(t.Context(), "SELECT pg_sleep(0.05)") })
				}
				wg.Wait()
				require.NoError(t, errors.Join(errs...))
				for i := range 5 {
					pooling, err := pgsession.DetectPooling(t.Context(), cc)
					require.NoError(t, err)
					require.Equal(t, c.want, pooling, "probe %d beside %d other clients", i+1, servers)
				}
			}
		})
	}
}
