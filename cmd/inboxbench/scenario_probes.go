package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchProbes measures (8): a real inboxd with the orders handler drains a
// preloaded queue of o.probeMessages orders, once without and once with
// o.probeClients clients sending GET /readyz in a loop, each run in a fresh
// schema and virtual host; the drop of processed orders per second is what
// the probes cost.
func benchProbes(ctx context.Context, o *options, r *report) error {
	return benchBacklogUnderLoops(ctx, o, r, "/readyz", "8. backlog, no probes")
}

// benchScrapes is benchProbes with the clients scraping /metrics: what
// Prometheus scraping, however eager, costs the workers.
func benchScrapes(ctx context.Context, o *options, r *report) error {
	return benchBacklogUnderLoops(ctx, o, r, "/metrics", "8b. backlog, no scrapes")
}

// benchBacklogUnderLoops drains a preloaded backlog without and with
// o.probeClients clients sending GET path in a loop.
func benchBacklogUnderLoops(ctx context.Context, o *options, r *report, path, label string) error {
	var rates [2]float64
	for i, clients := range []int{0, o.probeClients} {
		e, err := newEnv(ctx, o, fmt.Sprintf("%s%d", strings.Trim(path, "/"), clients))
		if err != nil {
			return err
		}
		w := loadgen.Generate(loadgen.Spec{Orders: o.probeMessages, Seed: 1, Prefix: e.name, SKUs: o.skus})
		if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
			e.close()
			return err
		}
		svc, httpAddr, err := e.startInboxd(o)
		if err != nil {
			e.close()
			return err
		}
		if err := waitReady(ctx, httpAddr); err != nil {
			svc.stop()
			e.close()
			return err
		}
		probeCtx, stopProbes := context.WithCancel(ctx)
		var ok, notOK int64
		probed := make(chan struct{})
		go func() {
			defer close(probed)
			if clients > 0 {
				ok, notOK = getLoop(probeCtx, httpAddr, clients, func() string { return path },
					func(status int) bool { return status == http.StatusOK })
			}
		}()
		start := time.Now()
		done, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
		took := done.Sub(start)
		stopProbes()
		<-probed
		svc.stop()
		e.close()
		if err != nil {
			return err
		}
		rates[i] = float64(w.UniqueMessageIDs) / took.Seconds()
		if clients == 0 {
			r.add(label, "%.0f orders/s processed (%d orders preloaded, %s from ready to the last processed)",
				rates[i], w.UniqueMessageIDs, took.Round(time.Millisecond))
			continue
		}
		r.add(fmt.Sprintf("   with %d %s loops", clients, path), "%.0f orders/s processed (%s), %.1f%% of the run without; %.0f requests/s answered 200, %d not",
			rates[i], took.Round(time.Millisecond), 100*rates[i]/rates[0], float64(ok)/took.Seconds(), notOK)
	}
	return nil
}
