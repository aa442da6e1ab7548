package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/orderconfirm/inboxd/internal/loadgen"
)

// benchFlood measures (9): a real inboxd drains a preloaded queue of
// o.probeMessages orders while one prober, as a kubelet would, times GET
// /healthz and GET /readyz every 20 ms: once alone (the ruler: what the
// probes take on this machine while it drains), and once while
// o.probeClients clients request /api/messages/<a random id> in a loop
// (an anonymous flood of the status page's API, which is paced per client
// and overall). Each run is in a fresh schema and virtual host.
func benchFlood(ctx context.Context, o *options, r *report) error {
	for _, clients := range []int{0, o.probeClients} {
		if err := floodRun(ctx, o, r, clients); err != nil {
			return err
		}
	}
	return nil
}

// floodRun is one run of benchFlood, with clients flooding the page.
func floodRun(ctx context.Context, o *options, r *report, clients int) error {
	e, err := newEnv(ctx, o, fmt.Sprintf("flood%d", clients))
	if err != nil {
		return err
	}
	defer e.close()
	w := loadgen.Generate(loadgen.Spec{Orders: o.probeMessages, Seed: 1, Prefix: e.name, SKUs: o.skus})
	if err := loadgen.PublishParallel(ctx, e.amqpURL, w.Messages, o.publishers, o.window); err != nil {
		return err
	}
	svc, httpAddr, err := e.serve(ctx, o)
	if err != nil {
		return err
	}
	defer svc.stop()

	floodCtx, stopFlood := context.WithCancel(ctx)
	var answered, failed int64
	flooded := make(chan struct{})
	go func() {
		defer close(flooded)
		answered, failed = getLoop(floodCtx, httpAddr, clients,
			func() string { return fmt.Sprintf("/api/messages/flood-%d", rand.Int64()) },
			func(int) bool { return true })
	}()
	probed := make(chan map[string]*probeTimes, 1)
	go func() { probed <- timeProbes(floodCtx, httpAddr, 20*time.Millisecond, "/healthz", "/readyz") }()

	start := time.Now()
	done, err := waitCount(ctx, e.pool, countProcessed, w.UniqueMessageIDs, lastProcessed)
	stopFlood()
	<-flooded
	times := <-probed
	if err != nil {
		return err
	}
	took := done.Sub(start)
	if clients == 0 {
		r.add("9. probes while draining", "%d orders drained at %.0f/s, no flood", w.UniqueMessageIDs, float64(w.UniqueMessageIDs)/took.Seconds())
	} else {
		r.add("   status page flood", "%d clients on /api/messages/<random>: %.0f answers/s, %d failed; %d orders drained at %.0f/s meanwhile",
			clients, float64(answered)/took.Seconds(), failed, w.UniqueMessageIDs, float64(w.UniqueMessageIDs)/took.Seconds())
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		t := times[path]
		r.add("   "+path+" every 20 ms", "p50 %s, p99 %s, max %s over %d probes, %d not answered 200",
			quantile(t.took, 0.5), quantile(t.took, 0.99), quantile(t.took, 1), len(t.took), t.notOK)
	}
	return nil
}

// probeTimes are the times one probe path took, and how many of its
// requests were not answered 200.
type probeTimes struct {
	took  []time.Duration
	notOK int
}

// timeProbes sends GET to each of paths every interval, one client and
// connection for all, until ctx ends, and returns what each took.
func timeProbes(ctx context.Context, httpAddr string, interval time.Duration, paths ...string) map[string]*probeTimes {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}, Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	times := map[string]*probeTimes{}
	for _, p := range paths {
		times[p] = &probeTimes{}
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return times
		case <-tick.C:
		}
		for _, p := range paths {
			started := time.Now()
			status, err := clientGet(ctx, client, "http://"+httpAddr+p)
			if ctx.Err() != nil {
				return times
			}
			times[p].took = append(times[p].took, time.Since(started))
			if err != nil || status != http.StatusOK {
				times[p].notOK++
			}
		}
	}
}
