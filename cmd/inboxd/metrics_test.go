package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/doctable"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/metrics"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

func httpGet(t *testing.T, rawURL string) (int, string) {
	t.Helper()
	resp, err := http.Get(rawURL)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// startServing starts inboxd serve with env's extra settings and HTTP on an
// address of its own, waits until /readyz answers 200, and returns the
// process and that address.
func startServing(t *testing.T, b *e2eBundle, extra ...string) (*process, string) {
	t.Helper()
	addr := testenv.FreeAddr(t)
	p := startProcess(t, serviceEnv(b.db, b.broker, append(extra, "HTTP_ADDR="+addr)...))
	require.Eventually(t, func() bool {
		status, _ := httpGet(t, "http://"+addr+"/readyz")
		return status == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "inboxd ready")
	return p, addr
}

// scrape returns the samples of /metrics by their name and labels as
// written, e.g. `inboxd_inbox_handled_total{outcome="dead"}`.
func scrape(t *testing.T, addr string) map[string]float64 {
	t.Helper()
	status, body := httpGet(t, "http://"+addr+"/metrics")
	require.Equal(t, http.StatusOK, status, body)
	samples := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(t, err, line)
		samples[line[:i]] = v
	}
	return samples
}

// requireInboxdNames fails the test unless every metric of inboxd's own in
// samples (as scrape returns them) is named inboxd_…. Go's runtime and
// process collectors keep their standard go_ and process_ names, which
// dashboards of any Go service read.
func requireInboxdNames(t *testing.T, samples map[string]float64) {
	t.Helper()
	var others []string
	for sample := range samples {
		name, _, _ := strings.Cut(sample, "{")
		if !strings.HasPrefix(name, "inboxd_") && !strings.HasPrefix(name, "go_") && !strings.HasPrefix(name, "process_") &&
			!slices.Contains(others, name) {
			others = append(others, name)
		}
	}
	slices.Sort(others)
	require.Empty(t, others, "metrics not named inboxd_…")
}

// documentedMetrics returns the metrics docs/operations.md's metrics table
// ("Metrics and health") names: the inboxd_… names in backquotes in its
// first column, without their labels (a histogram by its family's name).
func documentedMetrics(t *testing.T) []string {
	t.Helper()
	var names []string
	for _, cells := range doctable.Table(t, "operations.md", "metrics", 2) {
		for _, name := range doctable.Backquoted(cells[0]) {
			name, _, _ = strings.Cut(name, "{")
			if strings.HasPrefix(name, "inboxd_") && !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
	}
	return names
}

// requireMetricsDocumented fails the test unless the metrics of inboxd's
// own in families (a scrape of /metrics) are the ones docs/operations.md's
// metrics table names, no more and no fewer. Go's runtime and process
// metrics (go_…, process_…) are the client library's standard ones, not
// in the table.
func requireMetricsDocumented(t *testing.T, families map[string]*dto.MetricFamily) {
	t.Helper()
	documented := documentedMetrics(t)
	require.NotEmpty(t, documented)
	var undocumented, notExported []string
	for name := range families {
		if strings.HasPrefix(name, "inboxd_") && !slices.Contains(documented, name) {
			undocumented = append(undocumented, name)
		}
	}
	for _, name := range documented {
		if families[name] == nil {
			notExported = append(notExported, name)
		}
	}
	slices.Sort(undocumented)
	require.Empty(t, undocumented, "metrics inboxd exports that docs/operations.md's metrics table does not list")
	require.Empty(t, notExported, "metrics docs/operations.md's metrics table lists that inboxd does not export")
}

// Acceptance: /metrics exposes the named metrics with the right counts after
// a known workload, and /readyz fails while PostgreSQL is unreachable.
func TestMetricsAndReadiness(t *testing.T) {
	t.Parallel()
	b := setup(t)
	u, err := url.Parse(b.db.URL)
	require.NoError(t, err)
	proxy := startPGProxy(t, u.Host, 1<<62) // forwards everything
	u.Host = proxy.addr()
	addr := testenv.FreeAddr(t)
	startProcess(t, append(serviceEnv(b.db, b.broker), "DATABASE_URL="+u.String(), "HTTP_ADDR="+addr))
	require.Eventually(t, func() bool {
		status, _ := httpGet(t, "http://"+addr+"/readyz")
		return status == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond)

	w := loadgen.Generate(loadgen.Spec{Orders: 100, Seed: 14})
	msgs := append(w.Messages, w.Messages[:20]...) // 20 redeliveries
	for _, m := range w.Messages[20:25] {          // 5 conflicting duplicates
		m.Body = append([]byte(`{"changed":true,`), m.Body[1:]...)
		msgs = append(msgs, m)
	}
	msgs = append(msgs, loadgen.Message{MessageID: "bad", RoutingKey: "order.created", Body: []byte(`{"orderId":`)})
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, msgs, 100))
	require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{{RoutingKey: "order.created", Body: []byte(`{}`)}}, 1))
	b.waitDrained(t, 101, 30*time.Second)
	b.requireEventsOnce(t)
	// Three processed messages replayed.
	_, err = b.db.Pool.Exec(t.Context(), `UPDATE inbox SET replay_requested = true
		WHERE id IN (SELECT id FROM inbox WHERE status = 'processed' ORDER BY id LIMIT 3)`)
	require.NoError(t, err)

	want := map[string]float64{
		"inboxd_inbox_received_total":                     101,
		"inboxd_inbox_duplicates_total":                   25,
		"inboxd_inbox_conflicting_duplicates_total":       5,
		"inboxd_inbox_dead_lettered_total":                1,
		`inboxd_inbox_handled_total{outcome="processed"}`: 103,
		`inboxd_inbox_handled_total{outcome="dead"}`:      1,
		`inboxd_inbox_handled_total{outcome="retried"}`:   0,
		"inboxd_inbox_replays_total":                      3,
		"inboxd_outbox_published_total":                   200,
		"inboxd_inbox_pending":                            0,
		"inboxd_inbox_dead":                               1,
		"inboxd_outbox_backlog":                           0,
		"inboxd_outbox_oldest_unpublished_age_seconds":    0,
		"inboxd_inbox_database_up":                        1,
		"inboxd_inbox_end_to_end_seconds_count":           103,
	}
	require.Eventually(t, func() bool {
		got := scrape(t, addr)
		for k, v := range want {
			if got[k] != v {
				return false
			}
		}
		return true
	}, 10*time.Second, 100*time.Millisecond, "metrics after the workload: %v", func() string {
		got := scrape(t, addr)
		var out []string
		for k := range want {
			out = append(out, fmt.Sprintf("%s=%v", k, got[k]))
		}
		return strings.Join(out, " ")
	}())
	got := scrape(t, addr)
	requireInboxdNames(t, got)
	// Every metric is exported now: this process leads (inboxd_inbox_dead,
	// a gauge only the leader exports, is 1 above), and the others (the
	// pools', the unroutable events, the active partitions, the standby)
	// are exported by every serve whatever its settings.
	requireMetricsDocumented(t, scrapeFamilies(t, addr))
	_, ok := got[`inboxd_janitor_deleted_total{rows="processed"}`]
	require.True(t, ok, "the janitor's deletions are exported before its first")
	require.Positive(t, got["inboxd_inbox_ingest_batch_size_count"])
	require.Equal(t, 1.0, got[`inboxd_build_info{build="`+testBuild+`"}`], "the build is named")
	require.Positive(t, got["inboxd_inbox_handler_batch_seconds_count"])
	// The key ledger's current generation opened when the schema was
	// migrated, moments ago.
	age, ok := got["inboxd_inbox_key_generation_age_seconds"]
	require.True(t, ok, "the key ledger's generation age is exported")
	require.InDelta(t, 60, age, 60)
	// No hot part of the ledger waits to be merged.
	waiting, ok := got["inboxd_inbox_key_hot_part_waiting_seconds"]
	require.True(t, ok, "the key ledger's hot part's wait is exported")
	require.Zero(t, waiting)
	// The orders' stock moves were folded within the last 30 s, or wait.
	unfolded, ok := got["inboxd_stock_unfolded_age_seconds"]
	require.True(t, ok, "the age of the stock moves not folded yet is exported")
	require.InDelta(t, 30, unfolded, 30)
	// No order waits behind a failed message; the held snapshots' age is
	// exported (the workload's own transactions, if any, are short).
	for _, name := range []string{"inboxd_inbox_held_back_orders", "inboxd_inbox_held_back_oldest_age_seconds"} {
		held, ok := got[name]
		require.True(t, ok, "%s is exported", name)
		require.Zero(t, held, name)
	}
	_, ok = got["inboxd_database_oldest_snapshot_age_seconds"]
	require.True(t, ok, "the oldest held snapshot's age is exported")

	proxy.stop()
	require.Eventually(t, func() bool {
		status, _ := httpGet(t, "http://"+addr+"/readyz")
		return status == http.StatusServiceUnavailable
	}, 30*time.Second, 100*time.Millisecond, "/readyz fails while PostgreSQL is unreachable")
	status, _ := httpGet(t, "http://"+addr+"/healthz")
	require.Equal(t, http.StatusOK, status, "still alive")
	// The gauges are read at most once a second: the next read says so.
	require.Eventually(t, func() bool { return scrape(t, addr)["inboxd_inbox_database_up"] == 0 },
		10*time.Second, 100*time.Millisecond, "inboxd_inbox_database_up turns 0")
}

// Acceptance: 500 scrapes, 50 at a time, during a drain of 1,000 orders (200
// and 300 with -short)
// never make the relay's pool wait: the gauges are read on a pool of their
// own at most once a second, shared by the scrapes, and scrapes beyond the
// bound get 503 at once. Every order's events are published.
func TestScrapesNeverTakeTheRelaysConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, addr := startServing(t, b)
	before := scrape(t, addr)
	started := time.Now()

	orders, scrapers := 1000, 50
	if testing.Short() { // the race run: its inboxd is slower, the point the same
		orders, scrapers = 300, 20
	}
	w := loadgen.Generate(loadgen.Spec{Orders: orders, Seed: 43})
	published := make(chan error, 1)
	go func() { published <- loadgen.Publish(t.Context(), b.broker.URL, w.Messages, 100) }()
	var mu sync.Mutex
	statuses := map[int]int{}
	var wg sync.WaitGroup
	for range scrapers {
		wg.Go(func() {
			for range 10 {
				status, _ := httpGet(t, "http://"+addr+"/metrics")
				mu.Lock()
				statuses[status]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.NoError(t, <-published)
	b.waitDrained(t, len(w.Messages), 60*time.Second)
	b.requireEventsOnce(t)

	t.Logf("scrapes by status: %v", statuses)
	require.Equal(t, 10*scrapers, statuses[http.StatusOK]+statuses[http.StatusServiceUnavailable], "each scrape served or refused at once: %v", statuses)
	require.Positive(t, statuses[http.StatusOK])
	after := scrape(t, addr)
	elapsed := time.Since(started)
	relay := `{pool="relay"}`
	require.LessOrEqual(t, after["inboxd_pool_empty_acquires_total"+relay], after["inboxd_pool_max_connections"+relay],
		"the relay's pool waited for no connection another had (its only waits are its first connections)")
	gaugeReads := after[`inboxd_pool_acquires_total{pool="gauges"}`] - before[`inboxd_pool_acquires_total{pool="gauges"}`]
	require.LessOrEqual(t, gaugeReads, elapsed.Seconds()/metrics.GaugeReadInterval.Seconds()+2,
		"the gauges were read at most once a second in %s", elapsed)
}

// scrapeFamilies reads /metrics as metric families.
func scrapeFamilies(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return families
}
