//go:build !race

// Not built with the race detector: these tests read files and parse
// PromQL, with nothing concurrent for it to watch, and PromQL's parser
// (github.com/prometheus/prometheus) would be compiled a second time,
// instrumented, for the race run (make test-race) alone.

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"
)

// dashboardPath is the shipped Grafana dashboard.
const dashboardPath = "../../deploy/grafana/inboxd.json"

// dashboardDatasource is the datasource every panel and query names: the
// dashboard's datasource variable, so that it imports into any Grafana.
const dashboardDatasource = "${DS_PROMETHEUS}"

// dashboard is what the tests read of a Grafana dashboard JSON model.
type dashboard struct {
	SchemaVersion int              `json:"schemaVersion"`
	Panels        []dashboardPanel `json:"panels"`
	Templating    struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	ID         int              `json:"id"`
	Type       string           `json:"type"`
	Title      string           `json:"title"`
	Datasource *dashboardSource `json:"datasource"`
	Targets    []struct {
		Datasource *dashboardSource `json:"datasource"`
		RefID      string           `json:"refId"`
		Expr       string           `json:"expr"`
	} `json:"targets"`
	// Panels are those of a collapsed row.
	Panels []dashboardPanel `json:"panels"`
}

type dashboardSource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// dashboardQuery is a PromQL expression of the dashboard and where it is.
type dashboardQuery struct {
	where, expr string
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardPath)
	require.NoError(t, err)
	var d dashboard
	require.NoError(t, json.Unmarshal(b, &d), dashboardPath)
	return d
}

// panels returns every panel but the rows, those of collapsed rows too.
func (d dashboard) panels() []dashboardPanel {
	var out []dashboardPanel
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			out = append(out, p)
		}
	}
	walk(d.Panels)
	return out
}

// labelValues is a query variable's label_values(expr, label); the
// metric_name, label_names and label_values(label) forms name no metric.
var labelValues = regexp.MustCompile(`^\s*label_values\((.+),\s*\w+\s*\)\s*$`)

// queries returns the PromQL of every panel target and query variable.
func (d dashboard) queries(t *testing.T) []dashboardQuery {
	t.Helper()
	var out []dashboardQuery
	for _, p := range d.panels() {
		for _, tg := range p.Targets {
			out = append(out, dashboardQuery{fmt.Sprintf("panel %q, query %s", p.Title, tg.RefID), tg.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		// The query is a string, or an object with it under "query".
		var q string
		if json.Unmarshal(v.Query, &q) != nil {
			var obj struct {
				Query string `json:"query"`
			}
			require.NoError(t, json.Unmarshal(v.Query, &obj), "variable %s", v.Name)
			q = obj.Query
		}
		if m := labelValues.FindStringSubmatch(q); m != nil {
			q = m[1]
		} else if inner, ok := strings.CutPrefix(strings.TrimSpace(q), "query_result("); ok {
			q = strings.TrimSuffix(inner, ")")
		}
		out = append(out, dashboardQuery{fmt.Sprintf("variable %s", v.Name), q})
	}
	return out
}

// grafanaVariable is a variable Grafana replaces in a query before sending
// it: $name, ${name}, ${name:format} or [[name]].
var grafanaVariable = regexp.MustCompile(`\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]`)

// promqlMetricNames parses expr, its Grafana variables replaced as Grafana
// would (a duration for the interval variables, a regexp matching anything
// for the others, which the dashboard uses only in =~ matchers), and
// returns the metric name of every selector in it. A selector without a
// name is an error: it could select any metric.
func promqlMetricNames(expr string) ([]string, error) {
	expanded := grafanaVariable.ReplaceAllStringFunc(expr, func(v string) string {
		switch strings.Trim(v, "${}[]") {
		case "__rate_interval", "__interval", "__range":
			return "5m"
		case "__interval_ms", "__range_ms":
			return "300000"
		case "__range_s":
			return "300"
		}
		return ".*"
	})
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expanded)
	if err != nil {
		return nil, fmt.Errorf("parse %q: %w", expanded, err)
	}
	var names []string
	var nameless error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == model.MetricNameLabel && m.Type == labels.MatchEqual && name == "" {
					name = m.Value
				}
			}
			if name == "" {
				nameless = fmt.Errorf("%q: a selector names no metric: %s", expr, vs)
			} else if !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
		return nil
	})
	return names, nameless
}

// The names taken from a query are its metrics', not its functions',
// labels' or keywords'; a selector that names no metric is refused.
func TestPromQLMetricNames(t *testing.T) {
	t.Parallel()
	for expr, want := range map[string][]string{
		`histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{job=~"$job", instance=~"${instance}"}[$__rate_interval])))`: {"a_seconds_bucket"},
		`sum(rate(b_total{outcome="processed"}[5m])) / on (instance) group_left (build) max without (pool) (c)`:                  {"b_total", "c"},
		`max(d) > 0 or absent(e) unless sum by (rows) (f offset 1h)`:                                                             {"d", "e", "f"},
		`{__name__="g", job="x"}`: {"g"},
	} {
		got, err := promqlMetricNames(expr)
		require.NoError(t, err, expr)
		require.ElementsMatch(t, want, got, expr)
	}
	for _, expr := range []string{`sum({job="x"})`, `{__name__=~"inbox.*"}`, `sum(rate(a[5m]`} {
		_, err := promqlMetricNames(expr)
		require.Error(t, err, expr)
	}
}

// prometheusOwnSeries are the series Prometheus writes for every target it
// scrapes, which no /metrics serves.
var prometheusOwnSeries = []string{"up"}

// exported reports whether name is a series of families: a family's own
// name, or a histogram's _bucket, _sum or _count (a summary's _sum or
// _count).
func exported(families map[string]*dto.MetricFamily, name string) bool {
	if families[name] != nil || slices.Contains(prometheusOwnSeries, name) {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if f := families[base]; ok && f != nil {
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM:
				return true
			case dto.MetricType_SUMMARY:
				return suffix != "_bucket"
			}
		}
	}
	return false
}

// The dashboard imports into any Grafana: a Prometheus datasource variable
// that every panel and query uses, panel ids of their own, and a PromQL
// query in every panel that parses and names its metrics.
func TestDashboardIsWellFormed(t *testing.T) {
	t.Parallel()
	d := readDashboard(t)
	require.GreaterOrEqual(t, d.SchemaVersion, 36, "a schemaVersion of Grafana 10 or later")
	var dsVariable bool
	for _, v := range d.Templating.List {
		if v.Name == strings.Trim(dashboardDatasource, "${}") {
			require.Equal(t, "datasource", v.Type, "variable %s", v.Name)
			require.JSONEq(t, `"prometheus"`, string(v.Query), "variable %s chooses among the Prometheus datasources", v.Name)
			dsVariable = true
		}
	}
	require.True(t, dsVariable, "the dashboard has the variable %s", dashboardDatasource)

	ids := map[int]string{}
	var all []dashboardPanel
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			all = append(all, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, p := range all {
		require.NotContains(t, ids, p.ID, "panel %q has the id of panel %q", p.Title, ids[p.ID])
		ids[p.ID] = p.Title
	}
	panels := d.panels()
	require.NotEmpty(t, panels)
	for _, p := range panels {
		require.NotEmpty(t, p.Title, "panel %d has a title", p.ID)
		require.NotEmpty(t, p.Targets, "panel %q has a query", p.Title)
		require.Equal(t, &dashboardSource{Type: "prometheus", UID: dashboardDatasource}, p.Datasource, "panel %q's datasource", p.Title)
		for _, tg := range p.Targets {
			require.Equal(t, &dashboardSource{Type: "prometheus", UID: dashboardDatasource}, tg.Datasource, "panel %q query %s's datasource", p.Title, tg.RefID)
		}
	}
	for _, q := range d.queries(t) {
		names, err := promqlMetricNames(q.expr)
		require.NoError(t, err, q.where)
		require.NotEmpty(t, names, "%s names a metric", q.where)
	}
}

// Every metric the dashboard's panels and variables query is one a running
// inboxd exports (or Prometheus's own up): a panel on a renamed or misspelt
// metric would show "No data" and look like a quiet service. The queries
// are parsed with Prometheus's own PromQL parser, so function names,
// label names and keywords are never taken for metrics.
func TestDashboardQueriesOnlyMetricsInboxdExports(t *testing.T) {
	t.Parallel()
	queried := map[string][]string{} // metric → where the dashboard queries it
	for _, q := range readDashboard(t).queries(t) {
		names, err := promqlMetricNames(q.expr)
		require.NoError(t, err, q.where)
		for _, name := range names {
			queried[name] = append(queried[name], q.where)
		}
	}
	require.NotEmpty(t, queried)

	b := setup(t)
	_, addr := startServing(t, b)
	// Orders through the whole flow: stored, handled, their events
	// published, so that the histograms have observations and the
	// counters have moved.
	b.publishOrders(t, 5, 1, "dashboard")
	// The database gauges come from the process that leads: this one, once
	// it has taken the lead.
	var families map[string]*dto.MetricFamily
	require.Eventually(t, func() bool {
		families = scrapeFamilies(t, addr)
		f := families["inboxd_inbox_database_gauges_exporter"]
		return f != nil && len(f.GetMetric()) == 1 && f.GetMetric()[0].GetGauge().GetValue() == 1 &&
			families["inboxd_inbox_pending"] != nil
	}, 30*time.Second, 200*time.Millisecond, "inboxd leads and exports the database gauges")
	require.Positive(t, families["inboxd_inbox_end_to_end_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(),
		"the orders were handled")

	var missing []string
	for name, where := range queried {
		if !exported(families, name) {
			missing = append(missing, fmt.Sprintf("%s (%s)", name, strings.Join(where, "; ")))
		}
	}
	slices.Sort(missing)
	require.Empty(t, missing, "%s queries metrics inboxd does not export", dashboardPath)
}
