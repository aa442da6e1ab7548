package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// Acceptance: a client that opens a connection and stalls, in its headers
// or in the body they announce, is cut off by the server's timeouts, and
// the endpoint keeps answering others meanwhile.
func TestSlowClientsAreCutOff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, addr := startServing(t, b)

	for name, tc := range map[string]struct {
		sent   string
		within time.Duration
	}{
		"PartialHeader": {"GET /readyz HTTP/1.1\r\nHost: inboxd\r\nX-Slow: ", HTTPReadHeaderTimeout},
		"StalledBody":   {"GET /readyz HTTP/1.1\r\nHost: inboxd\r\nContent-Length: 1000\r\n\r\n{\"partial\":", HTTPReadTimeout},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			conn, err := net.Dial("tcp", addr)
			require.NoError(t, err)
			defer conn.Close()
			started := time.Now()
			_, err = io.WriteString(conn, tc.sent)
			require.NoError(t, err)
			status, _ := httpGet(t, "http://"+addr+"/healthz")
			require.Equal(t, http.StatusOK, status, "others are served meanwhile")

			// The server closes the connection (perhaps after an error
			// response) within its timeout; give up well after it.
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(tc.within+5*time.Second)))
			_, err = io.Copy(io.Discard, conn)
			require.NoError(t, err, "the server closed the connection, not the test's deadline")
			took := time.Since(started)
			require.Less(t, took, tc.within+2*time.Second)
			t.Logf("cut off after %s", took.Round(time.Millisecond))
		})
	}
}

// inboxd healthcheck exits 0 while /readyz answers 200, asking an
// unspecified HTTP_ADDR host (0.0.0.0, or none: the image's :8080) on
// loopback, and non-zero otherwise.
func TestHealthcheck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, port, err := net.SplitHostPort(testenv.FreeAddr(t))
	require.NoError(t, err)
	p := startProcess(t, serviceEnv(b.db, b.broker, "HTTP_ADDR=:"+port))
	require.Eventually(t, func() bool {
		_, ok := runInboxd(t, "healthcheck", "HTTP_ADDR=0.0.0.0:"+port)
		return ok
	}, 30*time.Second, 100*time.Millisecond, "healthy once ready")
	out, ok := runInboxd(t, "healthcheck", "HTTP_ADDR=:"+port)
	require.True(t, ok, "HTTP_ADDR without a host: %s", out)
	p.kill()
	out, ok = runInboxd(t, "healthcheck", "HTTP_ADDR=0.0.0.0:"+port)
	require.False(t, ok)
	require.Contains(t, out, "not ready")
}

// A flood of requests is answered at the endpoint's pace: beyond the burst,
// a request waits for its turn, and one whose turn is further off than the
// wait allowed is answered 503 with Retry-After, at once.
func TestRequestsBeyondTheRateWaitTheirTurn(t *testing.T) {
	t.Parallel()
	served := 0
	h := paced(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		served++
		w.WriteHeader(http.StatusOK)
	}), 10, 1, 50*time.Millisecond)
	var busy int
	for range 20 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if rec.Code == http.StatusServiceUnavailable {
			busy++
			require.Equal(t, "1", rec.Header().Get("Retry-After"))
		}
	}
	// The burst of one, and perhaps one more whose turn came within the
	// wait (one each 100 ms).
	require.GreaterOrEqual(t, served, 1)
	require.LessOrEqual(t, served, 3)
	require.Equal(t, 20, served+busy)
}

// Acceptance: however many requests the status page gets, the probes and
// /metrics are answered at once; the page is limited per client as well as
// overall, so one client cannot spend it all.
func TestProbesAreNeverPaced(t *testing.T) {
	t.Parallel()
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }
	mux := http.NewServeMux()
	for _, path := range []string{"GET /healthz", "GET /readyz", "GET /metrics"} {
		mux.HandleFunc(path, ok)
	}
	// A page whose overall rate is spent by the first request. Its next
	// turn is 1,000 s away, past any wait, so a request over the rate is
	// refused at once; a wait of a millisecond could end before the first
	// request's own check on a loaded machine (the race run's), refusing it.
	h := routes(mux, http.HandlerFunc(ok), pace{rate: 0.001, burst: 1, wait: time.Second, clientRate: 0.001, clientBurst: 1})
	get := func(path, client string) int {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodGet, path, nil)
		req.RemoteAddr = client + ":40000"
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	require.Equal(t, http.StatusOK, get("/api/messages/a", "10.0.0.1"))
	require.Equal(t, http.StatusTooManyRequests, get("/api/messages/b", "10.0.0.1"), "the client's own limit")
	require.Equal(t, http.StatusServiceUnavailable, get("/api/messages/c", "10.0.0.2"), "the page's overall limit")
	for range 100 {
		for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
			require.Equal(t, http.StatusOK, get(path, "10.0.0.1"), path)
		}
	}
}

// A request over its client's rate is held for the tarpit before its 429
// (until the client gives up, here), so a flood's connections each cost a
// request a second rather than as many as the server can refuse; once
// httpTarpitHeld requests are held, the next is refused at once.
func TestAFloodIsHeldBeforeItIsRefused(t *testing.T) {
	t.Parallel()
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }
	h := perClient(http.HandlerFunc(ok), 0.001, 1, time.Hour)
	serve := func(ctx context.Context) <-chan int {
		code := make(chan int, 1)
		go func() {
			rec := httptest.NewRecorder()
			req := httptest.NewRequestWithContext(ctx, http.MethodGet, "/api/messages/a", nil)
			req.RemoteAddr = "10.0.0.1:40000"
			h.ServeHTTP(rec, req)
			code <- rec.Code
		}()
		return code
	}
	require.Equal(t, http.StatusOK, <-serve(t.Context()))

	ctx, cancel := context.WithCancel(t.Context())
	answers := make(chan int, httpTarpitHeld+1)
	for range httpTarpitHeld + 1 {
		go func() { answers <- <-serve(ctx) }()
	}
	require.Equal(t, http.StatusTooManyRequests, <-answers, "one refused at once: the tarpit is full")
	select {
	case c := <-answers:
		t.Fatalf("answered %d while held", c)
	case <-time.After(100 * time.Millisecond):
	}
	cancel()
	for range httpTarpitHeld {
		require.Equal(t, http.StatusTooManyRequests, <-answers)
	}
}
