package main

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// startPgBouncer runs PgBouncer in session pooling, in front of the
// PostgreSQL server of databaseURL, with the settings a deployment would
// leave as they are: in particular no ignore_startup_parameters, so that a
// client sending a startup parameter PgBouncer does not track is refused.
// It returns databaseURL pointing at PgBouncer instead. The binary is
// Debian's pgbouncer package (.ci/run installs it); without it the test is
// skipped, except when TEST_DATABASE_URL is set, where it fails.
func startPgBouncer(t *testing.T, databaseURL string) string {
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
	listen := freeAddr(t)
	_, listenPort, err := net.SplitHostPort(listen)
	require.NoError(t, err)

	dir := t.TempDir()
	users := filepath.Join(dir, "users.txt")
	require.NoError(t, os.WriteFile(users, fmt.Appendf(nil, "%q \"\"\n", u.User.Username()), 0o644))
	ini := filepath.Join(dir, "pgbouncer.ini")
	require.NoError(t, os.WriteFile(ini, fmt.Appendf(nil, `[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %s
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = session
max_client_conn = 200
default_pool_size = 100
`, server, port, listenPort, users), 0o644))
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
	viaPooler := startPgBouncer(t, b.db.URL)

	out, ok := runInboxd(t, "migrate", "DATABASE_URL="+viaPooler, "PATH="+os.Getenv("PATH"))
	require.True(t, ok, "migrate through pgbouncer: %s", out)

	env := serviceEnv(b.db, b.broker)
	for i, kv := range env {
		if strings.HasPrefix(kv, "DATABASE_URL=") {
			env[i] = "DATABASE_URL=" + viaPooler
		}
	}
	p := startProcess(t, env)
	// Every event of the orders arrives downstream (publishOrders waits).
	b.publishOrders(t, 200, 1, "pooled")
	p.terminate(30 * time.Second)
}
