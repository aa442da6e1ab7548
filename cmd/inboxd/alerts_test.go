package main

import (
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The shipped alerting rules (deploy/prometheus/alerts.yml) are valid, do
// what their own unit tests say (promtool test rules), and name only
// metrics a running inboxd exports: a rule on a renamed or misspelt metric
// would never fire. promtool is Debian's prometheus package (.ci/run
// installs it); without it the test is skipped, except when
// TEST_DATABASE_URL is set, where it fails.
func TestAlertRulesNameMetricsInboxdExports(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		const why = "promtool is not installed (apt-get install prometheus); the alerting rules cannot be checked"
		if os.Getenv("TEST_DATABASE_URL") == "" {
			t.Skip(why)
		}
		t.Fatal(why)
	}
	for _, args := range [][]string{
		{"check", "rules", "alerts.yml"},
		{"test", "rules", "alerts_test.yml"},
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../deploy/prometheus"
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}

	rules, err := os.ReadFile("../../deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	var named []string
	for _, m := range regexp.MustCompile(`(?m)^\s+expr:\s*(.+)$`).FindAllStringSubmatch(string(rules), -1) {
		for _, name := range regexp.MustCompile(`\b(?:inbox|inboxd|outbox|stock|janitor)_[a-z_]+\b`).FindAllString(m[1], -1) {
			if !slices.Contains(named, name) {
				named = append(named, name)
			}
		}
	}
	require.NotEmpty(t, named)

	b := setup(t)
	_, addr := startServing(t, b)
	b.publishOrders(t, 20, 1, "alerts")
	// The database gauges come from the one process holding the gauge
	// lock: this one, once it has taken it.
	var exported map[string]bool
	require.Eventually(t, func() bool {
		exported = map[string]bool{}
		samples := scrape(t, addr)
		for sample := range samples {
			name, _, _ := strings.Cut(sample, "{")
			exported[name] = true
		}
		return samples["inboxd_inbox_database_gauges_exporter"] == 1
	}, 30*time.Second, 200*time.Millisecond, "inboxd exports the database gauges")
	for _, name := range named {
		require.True(t, exported[name], "alerts.yml names %s, which inboxd does not export", name)
	}
}
