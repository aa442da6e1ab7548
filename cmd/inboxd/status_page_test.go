package main

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// inboxd serves the status page and its JSON on HTTP_ADDR, next to
// /metrics, with the profiler on an address of its own, reporting its own state; INBOX_STATUS_PAGE=false
// leaves / as 404.
func TestStatusPageServed(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("On", func(t *testing.T) {
		addr, pprofAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
		startProcess(t, serviceEnv(b.db, b.broker, "HTTP_ADDR="+addr, "INBOX_PPROF_ADDR="+pprofAddr))
		require.Eventually(t, func() bool {
			status, _ := httpGet(t, "http://"+addr+"/readyz")
			return status == http.StatusOK
		}, 30*time.Second, 50*time.Millisecond)
		require.NoError(t, loadgen.Publish(t.Context(), b.broker.URL, []loadgen.Message{
			{MessageID: "bad-1", RoutingKey: "order.created", Body: []byte(`{"orderId":`)},
		}, 1))

		var o struct {
			Service struct {
				Build           string `json:"build"`
				IngestConsuming bool   `json:"ingest_consuming"`
				RelayConnected  bool   `json:"relay_connected"`
				Workers         int    `json:"workers"`
			} `json:"service"`
			Database struct {
				Reachable bool `json:"reachable"`
			} `json:"database"`
			Inbox struct {
				Dead int `json:"dead"`
			} `json:"inbox"`
		}
		require.Eventually(t, func() bool {
			status, body := httpGet(t, "http://"+addr+"/api/overview")
			return status == http.StatusOK && json.Unmarshal([]byte(body), &o) == nil && o.Inbox.Dead == 1
		}, 30*time.Second, 200*time.Millisecond, "the dead message shows")
		require.Equal(t, testBuild, o.Service.Build)
		require.True(t, o.Database.Reachable)
		require.True(t, o.Service.IngestConsuming)
		require.True(t, o.Service.RelayConnected)
		require.Equal(t, 2, o.Service.Workers)

		status, body := httpGet(t, "http://"+addr+"/")
		require.Equal(t, http.StatusOK, status)
		require.Contains(t, body, `href="/messages/bad-1"`)
		status, body = httpGet(t, "http://"+addr+"/messages/bad-1")
		require.Equal(t, http.StatusOK, status)
		require.Contains(t, body, `data-table="attempts"`)
		status, _ = httpGet(t, "http://"+addr+"/metrics")
		require.Equal(t, http.StatusOK, status, "/metrics still served")
		status, _ = httpGet(t, "http://"+pprofAddr+"/debug/pprof/")
		require.Equal(t, http.StatusOK, status, "the profiler on its own address")
		status, _ = httpGet(t, "http://"+addr+"/debug/pprof/")
		require.Equal(t, http.StatusNotFound, status, "and not on HTTP_ADDR")
		resp, err := http.Post("http://"+addr+"/", "text/plain", nil)
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode, "the page is read-only")
	})

	t.Run("Off", func(t *testing.T) {
		addr := testenv.FreeAddr(t)
		startProcess(t, serviceEnv(b.db, b.broker, "HTTP_ADDR="+addr, "INBOX_STATUS_PAGE=false"))
		require.Eventually(t, func() bool {
			status, _ := httpGet(t, "http://"+addr+"/healthz")
			return status == http.StatusOK
		}, 30*time.Second, 50*time.Millisecond)
		for _, path := range []string{"/", "/api/overview", "/messages/bad-1"} {
			status, _ := httpGet(t, "http://"+addr+path)
			require.Equal(t, http.StatusNotFound, status, path)
		}
	})
}
