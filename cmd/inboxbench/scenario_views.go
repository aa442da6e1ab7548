package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// benchViews checks that what an operator reads says the same of the same
// traffic in two builds (issue 23, acceptance 5): -views-before, an
// earlier inboxd, and -inboxd. Each runs on a schema of its own, migrated by
// its own binary, and is sent the same messages: orders (some stock falls
// short for), duplicates, orders sent again under new ids, cancellations,
// bodies that are not JSON, an order that misses its items and the
// cancellation it then holds back, and requests to be answered; once that has settled, an operator
// replays a processed message and a dead one with SQL, and it settles
// again. Then every view both schemas have, the status page's overview and
// message pages, and /metrics' gauges are read and compared.
//
// What depends on when or who rather than on what is left out: timestamps,
// ages, rates, anything per minute (the throughput view is summed), row
// ids, build and process names, the requester's reply address, and the SQL
// an operator would run (it names row ids). A view, field or gauge only
// the later build has is listed as new, not as a difference.
func benchViews(ctx context.Context, o *options, r *report) error {
	if o.viewsBefore == "" {
		return errors.New("-views-before: the earlier build's inboxd binary is needed to compare with")
	}
	before, err := operatorReadings(ctx, o, o.viewsBefore)
	if err != nil {
		return fmt.Errorf("%s: %w", o.viewsBefore, err)
	}
	after, err := operatorReadings(ctx, o, o.inboxd)
	if err != nil {
		return fmt.Errorf("%s: %w", o.inboxd, err)
	}
	same, differ, added := compareReadings(before, after)
	fields := 0
	for _, rd := range before {
		fields += len(rd)
	}
	r.add("views: compared", "%d readings (views, overview, message pages, gauges; %d fields) of the same traffic: %d the same, %d different",
		len(same)+len(differ), fields, len(same), len(differ))
	r.add("views: the same", "%s", strings.Join(same, ", "))
	r.add("views: gauges compared", "%s", strings.Join(slices.Sorted(maps.Keys(before["gauges /metrics"])), ", "))
	for _, d := range differ {
		r.add("views: DIFFERENT", "%s", d)
	}
	if len(added) > 0 {
		r.add("views: new in "+o.inboxd, "%s", strings.Join(added, ", "))
	}
	return nil
}

// A reading is what one screen shows: each of its fields by path, with
// every value it takes there (a list's entries, a view's rows), sorted.
type reading map[string][]string

// viewsTraffic is the messages both builds are sent, and the ids of those
// whose message pages are compared.
func viewsTraffic() (msgs []loadgen.Message, pages []string) {
	w := loadgen.Generate(loadgen.Spec{Orders: 300, DuplicateRate: 0.1, ResendRate: 0.05, CancelRate: 0.1, Seed: 5, Prefix: "views", SKUs: 50})
	msgs = w.Messages
	created := func(orderID string, body []byte) loadgen.Message {
		return loadgen.Message{MessageID: orderID + "-created", RoutingKey: orders.TypeOrderCreated, OrderID: orderID, Body: body}
	}
	for i := range 5 {
		msgs = append(msgs, created(fmt.Sprintf("views-bad-%d", i), []byte(`{"orderId": "views-bad`)))
	}
	for i := range 3 {
		orderID := fmt.Sprintf("views-short-%d", i)
		body, _ := json.Marshal(orders.OrderCreated{OrderID: orderID, UserID: "u", Email: orderID + "@example.com",
			Items: []orders.Item{{SKU: "SKU-NONE", Quantity: 1}}})
		msgs = append(msgs, created(orderID, body))
	}
	// Dead for its missing items, it holds back its order's cancellation.
	msgs = append(msgs, created("views-held", []byte(`{"orderId": "views-held"}`)))
	cancel, _ := json.Marshal(orders.OrderCancelled{OrderID: "views-held", Reason: "customer request"})
	msgs = append(msgs, loadgen.Message{MessageID: "views-held-cancelled", RoutingKey: orders.TypeOrderCancelled, OrderID: "views-held", Body: cancel})
	pages = []string{w.Messages[0].MessageID, "views-000001-created", "views-bad-0-created", "views-bad-1-created",
		"views-short-0-created", "views-held-created", "views-held-cancelled", "views-request-0-created", "views-none"}
	if cancelled := slices.Sorted(maps.Keys(w.Cancelled)); len(cancelled) > 0 {
		pages = append(pages, cancelled[0]+"-cancelled")
	}
	return msgs, pages
}

// viewsReplays is what the operator replays once the traffic has settled:
// a processed message (handled again, with no effect) and a dead one (dead
// again).
const viewsReplays = `UPDATE inbox SET replay_requested = true WHERE message_id IN ('views-000001-created', 'views-bad-1-created')`

// operatorReadings runs the traffic through the inboxd binary at build on a
// fresh schema and virtual host, and reads what an operator would.
func operatorReadings(ctx context.Context, o *options, build string) (map[string]reading, error) {
	e, err := newEnvOf(ctx, o, "views", build)
	if err != nil {
		return nil, err
	}
	defer e.close()
	svc, httpAddr, err := e.serve(ctx, o)
	if err != nil {
		return nil, err
	}
	defer svc.stop()
	msgs, pages := viewsTraffic()
	if err := loadgen.Publish(ctx, e.amqpURL, msgs, o.window); err != nil {
		return nil, err
	}
	// Requests, answered through the outbox.
	requester, err := newBenchRequester(e.amqpURL)
	if err != nil {
		return nil, err
	}
	defer requester.close()
	var requests []loadgen.Message
	for i := range 5 {
		orderID := fmt.Sprintf("views-request-%d", i)
		requests = append(requests, loadgen.Message{MessageID: orderID + "-created", RoutingKey: orders.TypeOrderCreated, OrderID: orderID,
			Body: loadgen.OrderCreatedBody(orderID, 1)})
	}
	if _, err := requester.publishPaced(ctx, requests, 50); err != nil {
		return nil, err
	}
	if arrived, _ := requester.wait(ctx, len(requests), time.Minute); len(arrived) < len(requests) {
		return nil, fmt.Errorf("%d of %d requests answered in a minute", len(arrived), len(requests))
	}
	if err := settle(ctx, e.pool); err != nil {
		return nil, err
	}
	if _, err := e.pool.Exec(ctx, viewsReplays); err != nil {
		return nil, err
	}
	if err := settle(ctx, e.pool); err != nil {
		return nil, err
	}
	out := map[string]reading{}
	if err := readViews(ctx, e.pool, out); err != nil {
		return nil, err
	}
	base := "http://" + httpAddr
	if out["page /api/overview"], err = readJSON(ctx, base+"/api/overview"); err != nil {
		return nil, err
	}
	for _, id := range pages {
		if out["page /api/messages/"+id], err = readJSON(ctx, base+"/api/messages/"+id); err != nil {
			return nil, err
		}
	}
	if out["gauges /metrics"], err = readGauges(ctx, base+"/metrics"); err != nil {
		return nil, err
	}
	return out, nil
}

// settle waits until no message is pending but the one held back, no
// replay is asked for, no event waits to be published, and the counts have
// stayed so for two seconds.
func settle(ctx context.Context, pool *pgxpool.Pool) error {
	const counts = `SELECT (SELECT count(*) FROM inbox WHERE status = 'pending' OR replay_requested),
	                       (SELECT count(*) FROM inbox),
	                       (SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL),
	                       (SELECT count(*) FROM outbox)`
	deadline := time.Now().Add(2 * time.Minute)
	var last [4]int64
	since := time.Now()
	for {
		var now [4]int64
		if err := pool.QueryRow(ctx, counts).Scan(&now[0], &now[1], &now[2], &now[3]); err != nil {
			return err
		}
		switch {
		case now != last:
			last, since = now, time.Now()
		case now[0] <= 1 && now[2] == 0 && time.Since(since) >= 2*time.Second:
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the traffic did not settle in 2 minutes: pending or replaying %d, stored %d, unpublished %d, outbox rows %d", now[0], now[1], now[2], now[3])
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// whenNotWhat reports whether a field's value says when, or who ran it,
// rather than what happened: the readings leave such fields out.
func whenNotWhat(field string) bool {
	switch field {
	case "id", "blocking_id", "inbox_id", "pid", "build", "last_build", "claimed_build", "claimed_by", "process",
		"last_process", "replay_sql", "end_sql", "application_name", "reply_to":
		return true
	}
	for _, word := range strings.Split(field, "_") {
		switch word {
		case "at", "age", "second", "seconds", "minute", "minutes", "uptime":
			return true
		}
	}
	return false
}

// readViews reads every view of the schema, row by row, without the
// columns that say when; a view with a minute column is summed over its
// minutes.
func readViews(ctx context.Context, pool *pgxpool.Pool, out map[string]reading) error {
	rows, err := pool.Query(ctx, `SELECT table_name FROM information_schema.views WHERE table_schema = current_schema() ORDER BY 1`)
	if err != nil {
		return err
	}
	views, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, view := range views {
		if view == "inbox_lock_holders" {
			continue // the sessions holding rows now: none, or the reader's own
		}
		rows, err := pool.Query(ctx, `SELECT column_name, data_type FROM information_schema.columns
		                               WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position`, view)
		if err != nil {
			return err
		}
		var cols, kinds []string
		for rows.Next() {
			var col, kind string
			if err := rows.Scan(&col, &kind); err != nil {
				return err
			}
			cols, kinds = append(cols, col), append(kinds, kind)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		summed := slices.Contains(cols, "minute")
		var exprs []string
		for i, col := range cols {
			if whenNotWhat(col) || strings.HasPrefix(kinds[i], "timestamp") || kinds[i] == "interval" {
				continue
			}
			expr := fmt.Sprintf("%q::text", col)
			if summed {
				expr = fmt.Sprintf("sum(%q)::text", col)
			}
			exprs = append(exprs, fmt.Sprintf("%s AS %q", expr, col))
		}
		if len(exprs) == 0 {
			continue
		}
		// Ordered by every column, in their order: a later build may add
		// columns only at the end of a view, so rows compare in the same
		// order column by column.
		order := make([]string, len(exprs))
		for i := range order {
			order[i] = fmt.Sprint(i + 1)
		}
		vals, err := pool.Query(ctx, fmt.Sprintf("SELECT %s FROM %q ORDER BY %s", strings.Join(exprs, ", "), view, strings.Join(order, ", ")))
		if err != nil {
			return fmt.Errorf("read view %s: %w", view, err)
		}
		rd := reading{}
		for vals.Next() {
			fields := vals.FieldDescriptions()
			values, err := vals.Values()
			if err != nil {
				return err
			}
			for i, v := range values {
				rd[fields[i].Name] = append(rd[fields[i].Name], fmt.Sprint(v))
			}
		}
		if err := vals.Err(); err != nil {
			return err
		}
		out["view "+view] = rd
	}
	return nil
}

// readJSON reads a page of the status page's API: each field by path, a
// list of objects as one line per entry (its fields sorted), the
// throughput list summed over its minutes.
func readJSON(ctx context.Context, url string) (reading, error) {
	body, err := get(ctx, url)
	if err != nil {
		return nil, err
	}
	var doc any
	if err := json.Unmarshal(body, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", url, err)
	}
	rd := reading{}
	flatten(rd, "", doc)
	for path := range rd {
		slices.Sort(rd[path])
	}
	return rd, nil
}

func flatten(rd reading, path string, v any) {
	switch v := v.(type) {
	case map[string]any:
		for k, sub := range v {
			if whenNotWhat(k) || k == "service" || k == "database" || k == "lock_holders" {
				continue
			}
			flatten(rd, strings.TrimPrefix(path+"."+k, "."), sub)
		}
	case []any:
		if strings.HasSuffix(path, "throughput") {
			sums := map[string]float64{}
			for _, entry := range v {
				if m, ok := entry.(map[string]any); ok {
					for k, n := range m {
						if f, ok := n.(float64); ok && !whenNotWhat(k) {
							sums[k] += f
						}
					}
				}
			}
			for k, n := range sums {
				rd[path+"[]."+k] = []string{fmt.Sprint(n)}
			}
			return
		}
		rd[path+"[]"] = []string{} // an empty list is a reading too
		for _, entry := range v {
			sub := reading{}
			flatten(sub, "", entry)
			var parts []string
			for _, k := range slices.Sorted(maps.Keys(sub)) {
				parts = append(parts, k+"="+strings.Join(sub[k], "|"))
			}
			rd[path+"[]"] = append(rd[path+"[]"], strings.Join(parts, " "))
		}
	default:
		rd[path] = append(rd[path], fmt.Sprint(v))
	}
}

// readGauges reads /metrics' gauges, but those that say how long or how
// big, or describe the process and its connection pools (sized by
// configuration, not by traffic).
func readGauges(ctx context.Context, url string) (reading, error) {
	body, err := get(ctx, url)
	if err != nil {
		return nil, err
	}
	gauges := map[string]bool{}
	rd := reading{}
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		line := sc.Text()
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" && f[3] == "gauge" {
			gauges[f[2]] = true
			continue
		}
		if strings.HasPrefix(line, "#") || line == "" {
			continue
		}
		series, value, ok := strings.Cut(line, " ")
		name, labels, _ := strings.Cut(series, "{")
		if !ok || !gauges[name] || whenNotWhat(name) || strings.Contains(name, "bytes") ||
			strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") || strings.Contains(name, "build_info") ||
			strings.HasPrefix(name, "inboxd_pool_") {
			continue
		}
		if labels != "" {
			labels = "{" + labels
		}
		rd[currentMetricName(name)+labels] = []string{value}
	}
	return rd, sc.Err()
}

// currentMetricName is the name a metric has now: builds before every
// metric was named inboxd_… exported inbox_pending, outbox_backlog and the
// like, now inboxd_inbox_pending and inboxd_outbox_backlog, so that a
// build of either kind compares with the other.
func currentMetricName(name string) string {
	if strings.HasPrefix(name, "inboxd_") {
		return name
	}
	return "inboxd_" + name
}

func get(ctx context.Context, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
		return nil, fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	return body, nil
}

// compareReadings returns the readings both builds agree on, a line for
// each field on which they differ (or which only the earlier build has),
// and the readings and fields only the later build has.
func compareReadings(before, after map[string]reading) (same, differ, added []string) {
	for _, name := range slices.Sorted(maps.Keys(after)) {
		b, ok := before[name]
		if !ok {
			added = append(added, name)
			continue
		}
		a := after[name]
		agree := true
		for _, field := range slices.Sorted(maps.Keys(b)) {
			av, ok := a[field]
			switch {
			case !ok:
				agree = false
				differ = append(differ, fmt.Sprintf("%s: %s only before: %s", name, field, strings.Join(b[field], "; ")))
			case !slices.Equal(av, b[field]):
				agree = false
				differ = append(differ, fmt.Sprintf("%s: %s: before %s, after %s", name, field, strings.Join(b[field], "; "), strings.Join(av, "; ")))
			}
		}
		for _, field := range slices.Sorted(maps.Keys(a)) {
			if _, ok := b[field]; !ok {
				added = append(added, name+": "+field)
			}
		}
		if agree {
			same = append(same, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(before)) {
		if _, ok := after[name]; !ok {
			differ = append(differ, name+": only before")
		}
	}
	return same, differ, added
}
