// Package rabbitadmin is a small client of the RabbitMQ management HTTP API,
// for the tests and the bench command: virtual hosts, users, queue depths
// and closing connections.
package rabbitadmin

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
)

// Client calls the management API at one base URL, such as
// http://guest:guest@127.0.0.1:15672.
type Client struct {
	base       *url.URL
	httpClient *http.Client
}

// New returns a Client for the management API at rawURL; the URL's user
// info is sent as basic auth.
func New(rawURL string) (*Client, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("parse management URL: %w", err)
	}
	return &Client{base: u, httpClient: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{}}}, nil
}

// Close releases idle connections.
func (c *Client) Close() { c.httpClient.CloseIdleConnections() }

// CreateVhost creates a virtual host and gives user every permission on it.
func (c *Client) CreateVhost(ctx context.Context, vhost, user string) error {
	if err := c.do(ctx, http.MethodPut, "/api/vhosts/"+url.PathEscape(vhost), nil, nil); err != nil {
		return err
	}
	perms := map[string]string{"configure": ".*", "write": ".*", "read": ".*"}
	return c.do(ctx, http.MethodPut, "/api/permissions/"+url.PathEscape(vhost)+"/"+url.PathEscape(user), perms, nil)
}

// CreateUser creates a user with password and no tags, with every
// permission on vhost.
func (c *Client) CreateUser(ctx context.Context, vhost, user, password string) error {
	if err := c.do(ctx, http.MethodPut, "/api/users/"+url.PathEscape(user), map[string]string{"password": password, "tags": ""}, nil); err != nil {
		return err
	}
	perms := map[string]string{"configure": ".*", "write": ".*", "read": ".*"}
	return c.do(ctx, http.MethodPut, "/api/permissions/"+url.PathEscape(vhost)+"/"+url.PathEscape(user), perms, nil)
}

// DeleteUser deletes a user.
func (c *Client) DeleteUser(ctx context.Context, user string) error {
	return c.do(ctx, http.MethodDelete, "/api/users/"+url.PathEscape(user), nil, nil)
}

// DeleteVhost deletes a virtual host with everything in it.
func (c *Client) DeleteVhost(ctx context.Context, vhost string) error {
	return c.do(ctx, http.MethodDelete, "/api/vhosts/"+url.PathEscape(vhost), nil, nil)
}

// Vhosts lists the names of the virtual hosts.
func (c *Client) Vhosts(ctx context.Context) ([]string, error) {
	var vhosts []struct {
		Name string `json:"name"`
	}
	if err := c.do(ctx, http.MethodGet, "/api/vhosts", nil, &vhosts); err != nil {
		return nil, err
	}
	names := make([]string, len(vhosts))
	for i, v := range vhosts {
		names[i] = v.Name
	}
	return names, nil
}

// Connection is a client connection as the management API lists it.
type Connection struct {
	// Name identifies the connection to the API.
	Name string `json:"name"`
	// ClientProperties holds what the client announced, notably its
	// connection_name.
	ClientProperties struct {
		ConnectionName string `json:"connection_name"`
	} `json:"client_properties"`
}

// Connections lists the client connections to a virtual host. The API learns
// of new connections only every few seconds.
func (c *Client) Connections(ctx context.Context, vhost string) ([]Connection, error) {
	var conns []Connection
	err := c.do(ctx, http.MethodGet, "/api/vhosts/"+url.PathEscape(vhost)+"/connections", nil, &conns)
	return conns, err
}

// Consumer is a consumer as the management API lists it.
type Consumer struct {
	Tag string `json:"consumer_tag"`
	// Active is false for a single active consumer's standbys.
	Active bool `json:"active"`
	Queue  struct {
		Name string `json:"name"`
	} `json:"queue"`
}

// Consumers lists the consumers of a virtual host's queues. The API learns
// of changes only every few seconds.
func (c *Client) Consumers(ctx context.Context, vhost string) ([]Consumer, error) {
	var consumers []Consumer
	err := c.do(ctx, http.MethodGet, "/api/consumers/"+url.PathEscape(vhost), nil, &consumers)
	return consumers, err
}

// CloseConnection closes a client connection from the broker's side.
func (c *Client) CloseConnection(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, "/api/connections/"+url.PathEscape(name), nil, nil)
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base.Scheme+"://"+c.base.Host+path, body)
	if err != nil {
		return err
	}
	req.URL.RawPath = path
	if c.base.User != nil {
		pw, _ := c.base.User.Password()
		req.SetBasicAuth(c.base.User.Username(), pw)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.httpClient.Do(req)
	if err != nil {
		return fmt.Errorf("RabbitMQ management API (is the rabbitmq_management plugin enabled?): %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("RabbitMQ management API: %s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(msg))
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}
