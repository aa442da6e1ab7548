package main

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

func httpGet(ctx context.Context, url string) (int, error) {
	return clientGet(ctx, http.DefaultClient, url)
}

// getLoop sends GET requests in a loop from clients concurrent clients,
// each with a connection of its own, to the paths path returns, until ctx
// ends, and returns the requests whose status good accepts and the others
// (errors included).
func getLoop(ctx context.Context, httpAddr string, clients int, path func() string, good func(status int) bool) (ok, notOK int64) {
	var okN, badN atomic.Int64
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}, Timeout: 5 * time.Second}
			defer client.CloseIdleConnections()
			for ctx.Err() == nil {
				status, err := clientGet(ctx, client, "http://"+httpAddr+path())
				switch {
				case err != nil && ctx.Err() != nil:
				case err == nil && good(status):
					okN.Add(1)
				default:
					badN.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return okN.Load(), badN.Load()
}

// clientGet sends GET url through client and returns the status, the body
// read and discarded.
func clientGet(ctx context.Context, client *http.Client, url string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}
