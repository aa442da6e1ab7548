package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Broker is a RabbitMQ virtual host of its own for one test.
type Broker struct {
	// Vhost is the virtual host's name.
	Vhost string
	// URL connects to the virtual host.
	URL string

	adminURL string
}

// NewBroker creates a virtual host, grants the test user every permission on
// it, and deletes it (with its queues and exchanges) when the test ends.
func NewBroker(tb testing.TB) *Broker {
	tb.Helper()
	s := getServers(tb)
	ctx := context.WithoutCancel(tb.Context())
	vhost := uniqueName()

	u, err := url.Parse(s.amqpURL)
	require.NoError(tb, err)
	user := u.User.Username()

	require.NoError(tb, adminDo(ctx, s.adminURL, http.MethodPut, "/api/vhosts/"+url.PathEscape(vhost), nil, nil))
	tb.Cleanup(func() { _ = deleteVhost(context.Background(), s.adminURL, vhost) })
	perms := map[string]string{"configure": ".*", "write": ".*", "read": ".*"}
	require.NoError(tb, adminDo(ctx, s.adminURL, http.MethodPut,
		"/api/permissions/"+url.PathEscape(vhost)+"/"+url.PathEscape(user), perms, nil))

	u.Path = "/" + vhost
	u.RawPath = "/" + url.PathEscape(vhost)
	return &Broker{Vhost: vhost, URL: u.String(), adminURL: s.adminURL}
}

// QueueMessages returns the number of messages (ready and unacknowledged) in
// a queue of the virtual host, as the management API last sampled it.
func (b *Broker) QueueMessages(tb testing.TB, queue string) int {
	tb.Helper()
	var q struct {
		Messages int `json:"messages"`
	}
	err := adminDo(tb.Context(), b.adminURL, http.MethodGet,
		"/api/queues/"+url.PathEscape(b.Vhost)+"/"+url.PathEscape(queue), nil, &q)
	require.NoError(tb, err)
	return q.Messages
}

// CloseConnections closes, from the broker's side, every client connection
// to the virtual host whose name contains nameContains, as an operator or a
// broker restart would. The management API learns of new connections only
// every few seconds, so it waits up to 30 seconds for at least one to show.
// It returns how many it closed.
func (b *Broker) CloseConnections(tb testing.TB, nameContains string) int {
	tb.Helper()
	type connection struct {
		Name           string `json:"name"`
		ClientProperty struct {
			ConnectionName string `json:"connection_name"`
		} `json:"client_properties"`
	}
	var matching []connection
	deadline := time.Now().Add(30 * time.Second)
	for len(matching) == 0 && time.Now().Before(deadline) {
		var conns []connection
		err := adminDo(tb.Context(), b.adminURL, http.MethodGet, "/api/vhosts/"+url.PathEscape(b.Vhost)+"/connections", nil, &conns)
		require.NoError(tb, err)
		for _, c := range conns {
			if strings.Contains(c.ClientProperty.ConnectionName, nameContains) {
				matching = append(matching, c)
			}
		}
		if len(matching) == 0 {
			time.Sleep(250 * time.Millisecond)
		}
	}
	for _, c := range matching {
		_ = adminDo(tb.Context(), b.adminURL, http.MethodDelete, "/api/connections/"+url.PathEscape(c.Name), nil, nil)
	}
	return len(matching)
}

func listVhosts(ctx context.Context, adminURL string) ([]string, error) {
	var vhosts []struct {
		Name string `json:"name"`
	}
	if err := adminDo(ctx, adminURL, http.MethodGet, "/api/vhosts", nil, &vhosts); err != nil {
		return nil, err
	}
	names := make([]string, len(vhosts))
	for i, v := range vhosts {
		names[i] = v.Name
	}
	return names, nil
}

func deleteVhost(ctx context.Context, adminURL, vhost string) error {
	return adminDo(ctx, adminURL, http.MethodDelete, "/api/vhosts/"+url.PathEscape(vhost), nil, nil)
}

// adminClient is closed by Stop, so tests leave no idle connections behind.
var adminClient = &http.Client{Transport: &http.Transport{}}

// adminDo calls the RabbitMQ management API.
func adminDo(ctx context.Context, adminURL, method, path string, in, out any) error {
	base, err := url.Parse(adminURL)
	if err != nil {
		return fmt.Errorf("parse management URL: %w", err)
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, base.Scheme+"://"+base.Host+path, body)
	if err != nil {
		return err
	}
	req.URL.RawPath = path
	if base.User != nil {
		pw, _ := base.User.Password()
		req.SetBasicAuth(base.User.Username(), pw)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := adminClient.Do(req)
	if err != nil {
		return fmt.Errorf("RabbitMQ management API (is the rabbitmq_management plugin enabled?): %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("RabbitMQ management API: %s %s: %s: %s", method, path, resp.Status, msg)
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}
