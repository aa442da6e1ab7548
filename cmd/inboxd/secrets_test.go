package main

import (
	"bytes"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: no password of DATABASE_URL or AMQP_URL, raw, decoded or
// encoded, appears in anything inboxd prints, whether the URL does not
// parse or its connection fails (a closed port), for passwords holding
// the characters URLs reserve.
func TestPasswordsAreNeverPrinted(t *testing.T) {
	if raceEnabled {
		t.Skip(noRaceToWatch)
	}
	t.Parallel()
	db := testenv.NewDB(t) // serve gets as far as the broker with it
	const prefix = "Zx7q"  // no piece of a password may show either
	passwords := []string{prefix + "%zzW", prefix + "#W", prefix + "?W", prefix + "@W", prefix + "[W", prefix + "%41%zz#?@[/:W"}
	closedAMQP := "amqp://guest:guest@127.0.0.1:1/"
	for i, pw := range passwords {
		dsnQuoted := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw)
		encoded := url.UserPassword("inbox", pw).String()
		cases := map[string][2]string{
			"DatabaseURLRaw":        {"postgres://inbox:" + pw + "@127.0.0.1:1/inbox", closedAMQP},
			"DatabaseURLEncoded":    {"postgres://" + encoded + "@127.0.0.1:1/inbox", closedAMQP},
			"DatabaseURLBadHost":    {"postgres://inbox:" + pw + "@[::1", closedAMQP},
			"DatabaseURLQueryParam": {"postgres://inbox@127.0.0.1:1/inbox?password=" + url.QueryEscape(pw), closedAMQP},
			"DatabaseDSN":           {"host=127.0.0.1 port=1 user=inbox dbname=inbox password='" + dsnQuoted + "'", closedAMQP},
			"DatabaseDSNBadPort":    {"host=127.0.0.1 port=x user=inbox dbname=inbox password='" + dsnQuoted + "'", closedAMQP},
			"AMQPURLRaw":            {db.URL, "amqp://guest:" + pw + "@127.0.0.1:1/"},
			"AMQPURLEncoded":        {db.URL, "amqp://" + url.UserPassword("guest", pw).String() + "@127.0.0.1:1/"},
			"AMQPURLBadHost":        {db.URL, "amqp://guest:" + pw + "@[::1"},
		}
		for name, env := range cases {
			t.Run(name+"/"+string(rune('A'+i)), func(t *testing.T) {
				t.Parallel()
				out := runBriefly(t, "DATABASE_URL="+env[0], "AMQP_URL="+env[1], "HTTP_ADDR=127.0.0.1:0", "INBOX_LOG_LEVEL=debug")
				require.NotEmpty(t, out, "inboxd says what went wrong")
				for _, form := range []string{pw, decoded(pw), url.QueryEscape(pw), url.PathEscape(pw), encoded, prefix} {
					require.NotContains(t, out, form, "a form of the password %q is printed", pw)
				}
			})
		}
	}
}

// runBriefly runs inboxd serve with env for at most three seconds (a serve
// waiting for its broker is stopped with SIGTERM) and returns its output.
func runBriefly(t *testing.T, env ...string) string {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(inboxdPath, "serve")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
	failOnRace(t, cmd, out.Bytes())
	return out.String()
}

// decoded is pw percent-decoded, or pw when it holds an invalid escape.
func decoded(pw string) string {
	if d, err := url.PathUnescape(pw); err == nil {
		return d
	}
	return pw
}

// Acceptance: the values of the OTLP headers (a collector's API key or
// bearer token) appear nowhere in inboxd's output, not even where the
// OpenTelemetry SDK itself quotes one it cannot read.
func TestOTLPHeaderValuesAreNeverPrinted(t *testing.T) {
	if raceEnabled {
		t.Skip(noRaceToWatch)
	}
	t.Parallel()
	db := testenv.NewDB(t)
	out := runBriefly(t, "DATABASE_URL="+db.URL, "AMQP_URL=amqp://guest:guest@127.0.0.1:1/", "HTTP_ADDR=127.0.0.1:0",
		"INBOX_LOG_LEVEL=debug", "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:1",
		"OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20Zx7qTokenA,x-api-key=%zzZx7qTokenB,Authorization: Bearer Zx7qTokenC")
	require.Contains(t, out, "escape header value", "the SDK says it cannot read a header")
	require.NotContains(t, out, "Zx7q", "a header value is printed")
}

// Acceptance: a panic of a service's goroutine (one the crashtest build
// starts, panicking with a value that quotes DATABASE_URL) is logged
// through the redactor, the password masked, and inboxd exits with status
// 2; the password appears nowhere in the output. (A handler's panic is
// caught by the worker, logged and stored as the attempt's error.)
func TestAPanicIsLoggedRedacted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const pw = "Zx7qPanicPw"
	u, err := url.Parse(b.db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), pw) // trust auth: any password is taken
	p := startBinary(t, crashingInboxdPath, serviceEnv(b.db, b.broker, "DATABASE_URL="+u.String(), "INBOXD_TEST_GOROUTINE_PANIC=1"))
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		t.Fatal("inboxd did not exit after the panic")
	}
	var exit *exec.ExitError
	require.ErrorAs(t, p.err, &exit)
	require.Equal(t, 2, exit.ExitCode())
	logs, err := os.ReadFile(p.logs)
	require.NoError(t, err)
	require.Contains(t, string(logs), `"msg":"panic: inboxd stops"`)
	require.Contains(t, string(logs), "test panic while connected to postgres://")
	require.NotContains(t, string(logs), "Zx7q", "the password is printed")
}
