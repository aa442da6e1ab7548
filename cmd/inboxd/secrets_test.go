package main

import (
	"bytes"
	"net/url"
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
