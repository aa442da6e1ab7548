package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// inboxdPath is the inboxd binary built for the tests that run it as a
// child process; crashingInboxdPath is its crashtest build, which kills
// itself on messages of type "test.crash".
var inboxdPath, crashingInboxdPath string

// testBuild is the build name of the inboxd binaries the tests run.
const testBuild = "test-build"

// noRaceToWatch is why a test skips under the race detector (make
// test-race) when all it checks is what inboxd prints, detects or refuses
// as it starts: nothing runs concurrently by then, and the plain run
// (make test) checks the same.
const noRaceToWatch = "checks what inboxd prints, detects or refuses as it starts, before anything runs concurrently: nothing for the race detector to watch"

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "inboxd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	inboxdPath = filepath.Join(dir, "inboxd")
	crashingInboxdPath = filepath.Join(dir, "inboxd-crashtest")
	for path, tags := range map[string]string{inboxdPath: "", crashingInboxdPath: "crashtest"} {
		args := []string{"build", "-tags", tags, "-ldflags", "-X main.version=" + testBuild, "-o", path}
		if raceEnabled {
			args = append(args, "-race")
		}
		if out, err := exec.Command("go", append(args, ".")...).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build inboxd: %v\n%s", err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	testenv.Stop()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// serviceEnv is the environment of an inboxd under test.
func serviceEnv(db *testenv.DB, broker *testenv.Broker, extra ...string) []string {
	env := []string{
		"DATABASE_URL=" + db.URL,
		"AMQP_URL=" + broker.URL,
		"HTTP_ADDR=127.0.0.1:0",
		"INBOX_POLL_INTERVAL=200ms",
		"INBOX_SHUTDOWN_TIMEOUT=10s",
		"PATH=" + os.Getenv("PATH"),
	}
	return append(env, extra...)
}

// process is inboxd running as a child process.
type process struct {
	t    *testing.T
	cmd  *exec.Cmd
	logs string
	done chan struct{}
	err  error
}

// startProcess runs `inboxd serve` with env. Its log goes to a file that the
// test prints if it fails.
func startProcess(t *testing.T, env []string) *process {
	t.Helper()
	return startBinary(t, inboxdPath, env)
}

// startBinary runs `serve` of the inboxd binary at path.
func startBinary(t *testing.T, path string, env []string) *process {
	t.Helper()
	logs := filepath.Join(t.TempDir(), fmt.Sprintf("inboxd-%d.log", time.Now().UnixNano()))
	f, err := os.Create(logs)
	require.NoError(t, err)
	cmd := exec.Command(path, "serve")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = f, f
	require.NoError(t, cmd.Start())
	p := &process{t: t, cmd: cmd, logs: logs, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		_ = f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		b, _ := os.ReadFile(logs)
		failOnRace(t, cmd, b)
		if t.Failed() {
			if len(b) > 20000 {
				b = b[len(b)-20000:]
			}
			t.Logf("inboxd (pid %d) log tail:\n%s", cmd.Process.Pid, b)
		}
	})
	return p
}

// combinedOutput runs cmd, an inboxd command, and returns its combined
// output and error, failing the test on a data race reported in it.
func combinedOutput(t *testing.T, cmd *exec.Cmd) ([]byte, error) {
	t.Helper()
	out, err := cmd.CombinedOutput()
	failOnRace(t, cmd, out)
	return out, err
}

// failOnRace fails the test with the report when out, the output of the
// inboxd process cmd ran, holds a data race. A race-built inboxd (make
// test-race builds the ones the tests run) reports a race on its stderr and
// goes on; the tests end most of them with SIGKILL or expect them to fail,
// so the exit status cannot tell. The output does.
func failOnRace(t *testing.T, cmd *exec.Cmd, out []byte) {
	t.Helper()
	if i := bytes.Index(out, []byte("WARNING: DATA RACE")); i >= 0 {
		t.Errorf("inboxd (pid %d) reported a data race:\n%s", cmd.Process.Pid, out[i:min(len(out), i+10000)])
	}
}

// kill sends SIGKILL and waits for the process to die.
func (p *process) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// exited reports whether the process has ended.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// terminate sends SIGTERM and returns how long the process took to exit.
func (p *process) terminate(timeout time.Duration) time.Duration {
	p.t.Helper()
	started := time.Now()
	require.NoError(p.t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("inboxd did not exit within %s of SIGTERM", timeout)
	}
	require.NoError(p.t, p.err, "inboxd exits cleanly after SIGTERM")
	return time.Since(started)
}

// logContains reports whether the process's log holds s.
func (p *process) logContains(s string) bool {
	b, _ := os.ReadFile(p.logs)
	return bytes.Contains(b, []byte(s))
}

// runInProcess runs `inboxd serve` through run() in this process until the
// test ends.
func runInProcess(t *testing.T, env []string) {
	t.Helper()
	vars := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	logs := testenv.LogWriter(t)
	go func() {
		done <- run(ctx, []string{"serve"}, func(k string) string { return vars[k] }, logs, logs)
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}
