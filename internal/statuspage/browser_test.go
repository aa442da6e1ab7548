package statuspage_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// chromiumPath finds Chromium. Without it the browser tests are skipped on a
// developer's machine but fail in CI (TEST_DATABASE_URL set), so that they
// cannot pass there without running.
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("TEST_DATABASE_URL") != "" {
		t.Fatal("chromium is not installed (apt-get install chromium); the status page's browser test cannot run")
	}
	t.Skip("chromium is not installed (apt-get install chromium)")
	return ""
}

// browser is a headless Chromium with a profile of its own, recording
// every URL it requests.
type browser struct {
	ctx context.Context

	mu       sync.Mutex
	requests []string
}

func newBrowser(t *testing.T) *browser {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath(t)),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.WithoutCancel(t.Context()), opts...)
	ctx, cancelCtx := chromedp.NewContext(allocCtx, chromedp.WithLogf(t.Logf))
	ctx, cancelTimeout := context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(func() {
		cancelTimeout()
		cancelCtx()
		cancelAlloc()
	})
	b := &browser{ctx: ctx}
	// Listen starts the browser; chromedp enables the Network domain.
	require.NoError(t, chromedp.Listen(ctx, func(ev any) {
		if e, ok := ev.(*network.EventRequestWillBeSent); ok {
			b.mu.Lock()
			b.requests = append(b.requests, e.Request.URL)
			b.mu.Unlock()
		}
	}))
	return b
}

func (b *browser) do(t *testing.T, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	require.NoError(t, chromedp.Do(b.ctx, steps...))
}

// run runs one action that returns a value.
func run[T any](t *testing.T, b *browser, a chromedp.Action[T]) T {
	t.Helper()
	v, err := chromedp.Run(b.ctx, a)
	require.NoError(t, err)
	return v
}

// eval returns the value of a script in the page.
func eval[T any](t *testing.T, b *browser, script string) T {
	t.Helper()
	return run(t, b, chromedp.Evaluate[T](script))
}

func (b *browser) requested() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.requests...)
}

// rowsJS returns, for each row of the table (or group) named tbl, its fields
// joined with "|".
const rowsJS = `((tbl, fields) => [...document.querySelectorAll('[data-table="' + tbl + '"] [data-row]')]
	.map(r => fields.map(f => r.querySelector('[data-field="' + f + '"]').textContent.trim()).join('|')))`

func rows(t *testing.T, b *browser, table string, fields ...string) []string {
	t.Helper()
	args := `"` + table + `", ["` + strings.Join(fields, `","`) + `"]`
	return eval[[]string](t, b, rowsJS+"("+args+")")
}

// Acceptance: in a real browser, on a schema seeded with known states, the
// page shows exactly what the views say, the chart has a point per minute
// for each series, a dead message's link leads to its attempts, and every
// request the browser makes goes to the service.
func TestStatusPageInBrowser(t *testing.T) {
	t.Parallel()
	b := setup(t)
	br := newBrowser(t)
	base, err := url.Parse(b.server.URL)
	require.NoError(t, err)

	br.do(t, chromedp.Navigate(b.server.URL+"/"), chromedp.WaitVisible(chromedp.CSS(`[data-metric="pending"]`)))
	metrics := eval[map[string]string](t, br, `Object.fromEntries([...document.querySelectorAll('[data-metric]')].map(e => [e.dataset.metric, e.textContent.trim()]))`)
	values := eval[map[string]string](t, br, `Object.fromEntries([...document.querySelectorAll('[data-metric][data-value]')].map(e => [e.dataset.metric, e.dataset.value]))`)

	t.Run("Now", func(t *testing.T) {
		view := queryOne(t, b.db, `
			SELECT pending, in_progress, waiting_retry, replays_waiting, dead, processed_last_minute, conflicting_ids,
			       extract(epoch FROM oldest_pending_age)::float8 AS oldest_pending_age
			FROM inbox_overview`)
		outbox := queryOne(t, b.db, `SELECT unpublished, failing, extract(epoch FROM oldest_age)::float8 AS oldest_age FROM outbox_backlog`)
		for _, k := range []string{"pending", "in_progress", "waiting_retry", "replays_waiting", "dead", "processed_last_minute", "conflicting_ids"} {
			require.Equal(t, fmt.Sprint(view[k]), strings.ReplaceAll(metrics[k], ",", ""), k)
		}
		require.Equal(t, fmt.Sprint(outbox["unpublished"]), metrics["outbox_unpublished"])
		require.Equal(t, fmt.Sprint(outbox["failing"]), metrics["outbox_failing"])
		requireSecondsNear(t, view["oldest_pending_age"].(float64), values["oldest_pending_age"])
		requireSecondsNear(t, outbox["oldest_age"].(float64), values["outbox_oldest_age"])
		require.Equal(t, "connected", metrics["postgres"])
		require.Equal(t, "connected", metrics["rabbitmq"])
		require.Equal(t, "test-build", metrics["build"])
		require.Equal(t, testDurability, metrics["durability"])
		require.Equal(t, "needs attention", metrics["verdict"], "dead messages need a person")
	})

	t.Run("Chart", func(t *testing.T) {
		points := eval[map[string][][2]string](t, br, `Object.fromEntries([...document.querySelectorAll('svg [data-series]')].map(g =>
			[g.dataset.series, [...g.querySelectorAll('circle')].map(c => [c.dataset.minute, c.dataset.value])]))`)
		want := map[string]map[string]string{"received": {}, "processed": {}, "failed": {}, "dead": {}}
		for _, r := range b.db.Strings(t, `SELECT format('%s|%s|%s|%s', to_char(minute AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
				processed, retried + dead + abandoned, dead) FROM inbox_throughput`) {
			f := strings.Split(r, "|")
			for i, series := range []string{"processed", "failed", "dead"} {
				if f[i+1] != "0" {
					want[series][f[0]] = f[i+1]
				}
			}
		}
		for _, r := range b.db.Strings(t, `SELECT format('%s|%s', to_char(minute AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), n) FROM (
				SELECT date_trunc('minute', received_at) AS minute, count(*) AS n
				FROM inbox WHERE received_at >= date_trunc('minute', now()) - interval '14 minutes' GROUP BY 1) AS r`) {
			f := strings.Split(r, "|")
			want["received"][f[0]] = f[1]
		}
		require.Len(t, points, 4)
		for series, ps := range points {
			require.Len(t, ps, 15, series)
			got := map[string]string{}
			for _, p := range ps {
				if p[1] != "0" {
					got[p[0]] = p[1]
				}
			}
			require.Equal(t, want[series], got, series)
		}
		require.NotEmpty(t, want["dead"], "the seed has dead attempts in the chart")
	})

	t.Run("WhatIsDying", func(t *testing.T) {
		require.Equal(t, b.db.Strings(t, "SELECT format('%s|%s', messages, last_error) FROM inbox_dead_by_error"),
			rows(t, br, "dead_by_error", "messages", "last_error"))
		// Grouped by build on the page.
		require.ElementsMatch(t, b.db.Strings(t, "SELECT format('%s|%s|%s|%s', build, attempts, outcome, messages) FROM inbox_failures_by_build"),
			rows(t, br, "failures_by_build", "build", "attempts", "outcome", "messages"))
		require.Equal(t, b.db.Strings(t, "SELECT format('%s|%s|%s|%s|%s', message_id, message_type, attempts, last_error, replay_count) FROM inbox_dead LIMIT 20"),
			rows(t, br, "dead", "message_id", "message_type", "attempts", "last_error", "replay_count"))
		require.Equal(t, b.db.Strings(t, "SELECT format('%s|%s|%s|%s', order_key, blocking_message_id, blocking_status, held_messages) FROM inbox_held_back"),
			rows(t, br, "held_back", "order_key", "blocking_message_id", "blocking_status", "held_messages"))
		require.Equal(t, b.db.Strings(t, "SELECT format('%s|%s|%s', message_id, replayed_by, replay_reason) FROM inbox WHERE replay_count > 0 ORDER BY replayed_at DESC"),
			rows(t, br, "replays", "message_id", "replayed_by", "replay_reason"))
		require.Equal(t, b.db.Strings(t, "SELECT format('%s|%s', message_id, deliveries) FROM inbox_conflicts"),
			rows(t, br, "conflicts", "message_id", "deliveries"))
		sql := eval[[]string](t, br, `[...document.querySelectorAll('pre.sql')].map(e => e.textContent)`)
		require.Contains(t, sql, "UPDATE inbox SET replay_requested = true, replay_reason = '<why it is safe now>'\nWHERE status = 'dead' AND last_error = 'unknown sku: SKU-9';")
		html := run(t, br, chromedp.OuterHTML(chromedp.CSS("html")))
		require.NotContains(t, html, "@example.com", "no payload, no e-mail address")
	})

	dir, err := os.MkdirTemp("", "inboxd-status-page-")
	require.NoError(t, err)
	shot := run(t, br, chromedp.FullScreenshot(100))
	path := filepath.Join(dir, "status-page.png")
	require.NoError(t, os.WriteFile(path, shot, 0o644))
	t.Logf("screenshot of the status page: %s", path)

	t.Run("MessageStory", func(t *testing.T) {
		br.do(t, chromedp.Click(chromedp.CSS(`[data-table="dead"] a[href="/messages/dead-sku"]`)),
			chromedp.WaitVisible(chromedp.CSS(`[data-table="attempts"]`)))
		location := run(t, br, chromedp.Location())
		require.Equal(t, b.server.URL+"/messages/dead-sku", location)
		require.Equal(t, b.db.Strings(t, `SELECT format('%s|%s|%s|%s', attempt, outcome, error, build) FROM inbox_attempts
				WHERE inbox_id = (SELECT id FROM inbox WHERE message_id = 'dead-sku') ORDER BY run, attempt`),
			rows(t, br, "attempts", "attempt", "outcome", "error", "build"))
		status := run(t, br, chromedp.Text(chromedp.CSS(`[data-table="inbox"] [data-field="status"]`)))
		require.Equal(t, "dead", status)
	})

	t.Run("PhoneWidth", func(t *testing.T) {
		br.do(t, chromedp.EmulateViewport(390, 844), chromedp.Navigate(b.server.URL+"/"), chromedp.WaitVisible(chromedp.CSS(`[data-metric="pending"]`)))
		overflow := eval[bool](t, br, `document.documentElement.scrollWidth > window.innerWidth + 1`)
		require.False(t, overflow, "the page fits a phone's width")
	})

	t.Run("OnlyTheService", func(t *testing.T) {
		reqs := br.requested()
		require.NotEmpty(t, reqs)
		for _, r := range reqs {
			u, err := url.Parse(r)
			require.NoError(t, err, r)
			require.Equal(t, "http", u.Scheme, r)
			require.Equal(t, base.Host, u.Host, "the browser requested %s", r)
		}
	})
}

// requireSecondsNear checks an age the page shows against the view's,
// read a moment apart.
func requireSecondsNear(t *testing.T, want float64, got string) {
	t.Helper()
	g, err := strconv.ParseFloat(got, 64)
	require.NoError(t, err, got)
	require.InDelta(t, want, g, 5)
}

// queryOne returns the single row of query as a map of column to value.
func queryOne(t *testing.T, db *testenv.DB, query string) map[string]any {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), query)
	require.NoError(t, err)
	defer rows.Close()
	require.True(t, rows.Next(), query)
	vals, err := rows.Values()
	require.NoError(t, err)
	out := map[string]any{}
	for i, f := range rows.FieldDescriptions() {
		out[f.Name] = vals[i]
	}
	return out
}
