package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// PostgresPair is a PostgreSQL primary and its streaming standby of their
// own, for one test: two servers started on this machine as the postgres
// user, each in a temporary folder with its own port on 127.0.0.1, removed
// when the test ends. The shared server is never touched.
type PostgresPair struct {
	Primary, Standby *PostgresServer
	bin              string
}

// PostgresServer is one server of a PostgresPair.
type PostgresServer struct {
	Port int
	dir  string
}

// URL connects to the server's postgres database.
func (s *PostgresServer) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port)
}

// URL lists both servers and asks for the one that takes writes, as a
// service following a failover is configured: pgx tries the hosts in turn
// and keeps the one that is not read-only.
func (p *PostgresPair) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		p.Primary.Port, p.Standby.Port)
}

// NewPostgresPair starts a primary and a standby streaming from it; with
// synchronous, the primary's commits wait for the standby to have the WAL
// (synchronous_standby_names = '*'). It skips the test where PostgreSQL's
// server programs or the postgres user are missing, or the test does not
// run as root.
func NewPostgresPair(t *testing.T, synchronous bool) *PostgresPair {
	t.Helper()
	bin := postgresBin()
	if bin == "" {
		t.Skip("a failover test: PostgreSQL's server programs (initdb, pg_ctl, pg_basebackup) are not installed here")
	}
	if _, err := user.Lookup("postgres"); err != nil || os.Geteuid() != 0 {
		t.Skip("a failover test: starting servers takes root and a postgres user (.ci/run has both)")
	}
	dir, err := os.MkdirTemp("", "inboxd-pg-pair-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755))
	require.NoError(t, exec.Command("chown", "postgres", dir).Run())
	p := &PostgresPair{bin: bin,
		Primary: &PostgresServer{Port: freePort(t), dir: filepath.Join(dir, "primary")},
		Standby: &PostgresServer{Port: freePort(t), dir: filepath.Join(dir, "standby")},
	}
	t.Cleanup(func() {
		p.stop(p.Standby)
		p.stop(p.Primary)
		_ = os.RemoveAll(dir)
	})

	p.run(t, "initdb", "-D", p.Primary.dir, "-U", "postgres", "--auth=trust", "--no-sync")
	conf := "listen_addresses = '127.0.0.1'\nunix_socket_directories = '" + dir + "'\n" +
		"wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\n"
	if synchronous {
		conf += "synchronous_standby_names = '*'\n"
	}
	p.appendConf(t, p.Primary, conf)
	p.start(t, p.Primary)
	p.run(t, "pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(p.Primary.Port), "-U", "postgres",
		"-D", p.Standby.dir, "-R", "-X", "stream", "--no-sync")
	// Promoted, it has no standby of its own: its commits must not wait
	// for one (what a failover manager such as Patroni sets).
	p.appendConf(t, p.Standby, "synchronous_standby_names = ''\n")
	p.start(t, p.Standby)
	return p
}

// postgresBin is the folder of the newest PostgreSQL server programs
// installed, or "".
func postgresBin() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "pg_basebackup")); err == nil {
			return dirs[i]
		}
	}
	if path, err := exec.LookPath("pg_basebackup"); err == nil {
		return filepath.Dir(path)
	}
	return ""
}

// run runs one of PostgreSQL's programs as the postgres user.
func (p *PostgresPair) run(t *testing.T, program string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := p.command(ctx, program, args...).CombinedOutput()
	require.NoError(t, err, "%s %s: %s", program, strings.Join(args, " "), out)
}

func (p *PostgresPair) command(ctx context.Context, program string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", filepath.Join(p.bin, program)}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
	return cmd
}

// appendConf adds conf and the server's port to its postgresql.conf.
func (p *PostgresPair) appendConf(t *testing.T, s *PostgresServer, conf string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(s.dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	defer f.Close()
	_, err = fmt.Fprintf(f, "\n# the test's\nport = %d\n%s", s.Port, conf)
	require.NoError(t, err)
}

func (p *PostgresPair) start(t *testing.T, s *PostgresServer) {
	t.Helper()
	p.run(t, "pg_ctl", "-D", s.dir, "-l", s.dir+".log", "-w", "start")
}

// stop stops s at once, if it runs.
func (p *PostgresPair) stop(s *PostgresServer) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = p.command(ctx, "pg_ctl", "-D", s.dir, "-m", "immediate", "stop").Run()
}

// KillPrimary ends the primary and every process of it with SIGKILL at
// once, as a lost machine would: the postmaster is stopped first, so that
// it restarts nothing, then its children and itself are killed.
func (p *PostgresPair) KillPrimary(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(p.Primary.dir, "postmaster.pid"))
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0])
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	_ = exec.Command("pkill", "-KILL", "-P", strconv.Itoa(pid)).Run()
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
}

// Promote makes the standby a primary and waits until it takes writes.
func (p *PostgresPair) Promote(t *testing.T) {
	t.Helper()
	p.run(t, "pg_ctl", "-D", p.Standby.dir, "-w", "promote")
}
