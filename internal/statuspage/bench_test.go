package statuspage_test

import (
	"flag"
	"io"
	"maps"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

var benchDuration = flag.Duration("statuspage.bench-duration", 30*time.Second, "how long BenchmarkStatusPageLoad sends requests")

// BenchmarkStatusPageLoad sends 100 requests per second to / for
// -statuspage.bench-duration (30 s) and reports the queries each view cost
// per second: at most one, however many requests come.
//
//	go test -run '^$' -bench StatusPageLoad -benchtime 1x ./internal/statuspage/
func BenchmarkStatusPageLoad(b *testing.B) {
	for b.Loop() {
		benchmarkLoad(b, 100, *benchDuration)
	}
}

func benchmarkLoad(b *testing.B, perSecond int, d time.Duration) {
	tb := setupIn(b, testenv.NewDB(b))
	client := &http.Client{Timeout: 5 * time.Second}
	var sent, failed atomic.Int64
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(perSecond))
	defer tick.Stop()
	sample := time.NewTicker(time.Second)
	defer sample.Stop()
	worst := map[string]int64{}
	last := tb.page.QueryCounts()
	end := time.After(d)
	started := time.Now()
loop:
	for {
		select {
		case <-tick.C:
			sent.Add(1)
			wg.Go(func() {
				resp, err := client.Get(tb.server.URL + "/")
				if err != nil {
					failed.Add(1)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					failed.Add(1)
				}
			})
		case <-sample.C:
			now := tb.page.QueryCounts()
			for view, n := range now {
				worst[view] = max(worst[view], n-last[view])
			}
			last = now
		case <-end:
			break loop
		}
	}
	wg.Wait()
	elapsed := time.Since(started).Seconds()
	counts := tb.page.QueryCounts()
	views := slices.Sorted(maps.Keys(counts))
	var most float64
	for _, v := range views {
		perSec := float64(counts[v]) / elapsed
		most = max(most, perSec)
		b.Logf("%-24s %4d queries in %.1f s = %.2f/s, at most %d in one second", v, counts[v], elapsed, perSec, worst[v])
	}
	b.Logf("%d requests (%.0f/s), %d failed", sent.Load(), float64(sent.Load())/elapsed, failed.Load())
	b.ReportMetric(float64(sent.Load())/elapsed, "requests/s")
	b.ReportMetric(most, "queries/view/s")
	if failed.Load() > 0 {
		b.Errorf("%d requests failed", failed.Load())
	}
}
