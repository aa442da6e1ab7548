package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// HealthcheckTimeout bounds `inboxd healthcheck`'s request.
const HealthcheckTimeout = 3 * time.Second

// healthcheck GETs /readyz of the inboxd listening on httpAddr (HTTP_ADDR;
// an unspecified host such as 0.0.0.0 is asked on loopback) and returns nil
// only on 200: a container image without a shell or curl runs it as its
// healthcheck.
func healthcheck(ctx context.Context, httpAddr string) error {
	host, port, err := net.SplitHostPort(httpAddr)
	if err != nil {
		return fmt.Errorf("HTTP_ADDR is invalid: want host:port")
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
		if ip != nil && ip.To4() == nil {
			host = "::1"
		}
	}
	ctx, cancel := context.WithTimeout(ctx, HealthcheckTimeout)
	defer cancel()
	url := "http://" + net.JoinHostPort(host, port) + ReadyzPath
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("not ready: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("not ready: %s answered %d %s", url, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return nil
}
