// Package sandbox creates the throw-away PostgreSQL schemas (and databases,
// for the tests that need one to themselves) and RabbitMQ virtual hosts
// that the tests and the benchmark run in, so that runs never share state
// and leave nothing behind.
package sandbox

import (
	"context"
	"fmt"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/rabbitadmin"
)

// CreateSchema creates schema in the database at databaseURL. It returns a
// URL whose search_path selects the schema, and a func that drops it with
// everything in it.
func CreateSchema(ctx context.Context, databaseURL, schema string) (string, func(), error) {
	schemaURL, err := withQuery(databaseURL, "search_path", schema)
	if err != nil {
		return "", nil, err
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return "", nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	return schemaURL, func() { DropSchema(databaseURL, schema) }, nil
}

// DropSchema drops schema with everything in it, if it exists. It gives
// up quietly: what it leaves, a later sweep removes.
func DropSchema(databaseURL, schema string) {
	execQuietly(databaseURL, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
}

// CreateDatabase creates database name on the server at serverURL. It
// returns a URL that connects to it, and a func that drops it, ending the
// sessions still connected to it.
func CreateDatabase(ctx context.Context, serverURL, name string) (string, func(), error) {
	u, err := url.Parse(serverURL)
	if err != nil {
		return "", nil, fmt.Errorf("parse database URL: %w", err)
	}
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return "", nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create database %s: %w", name, err)
	}
	// The path names the database, unless the query names another.
	u.Path, u.RawPath = "/"+name, ""
	q := u.Query()
	q.Del("dbname")
	q.Del("database")
	u.RawQuery = q.Encode()
	return u.String(), func() { DropDatabase(serverURL, name) }, nil
}

// DropDatabase drops database name, if it exists, ending the sessions
// still connected to it. It gives up quietly, as DropSchema does.
func DropDatabase(serverURL, name string) {
	execQuietly(serverURL, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// execQuietly runs sql on a connection of its own to databaseURL, within
// a minute, and ignores its failure.
func execQuietly(databaseURL, sql string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return
	}
	defer func() { _ = conn.Close(ctx) }()
	_, _ = conn.Exec(ctx, sql)
}

// CreateVhost creates the virtual host vhost through admin and gives the
// user of amqpURL every permission on it. It returns amqpURL pointed at the
// virtual host, and a func that deletes it with its queues and exchanges.
func CreateVhost(ctx context.Context, admin *rabbitadmin.Client, amqpURL, vhost string) (string, func(), error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", nil, fmt.Errorf("parse AMQP URL: %w", err)
	}
	if err := admin.CreateVhost(ctx, vhost, u.User.Username()); err != nil {
		return "", nil, err
	}
	u.Path, u.RawPath = "/"+vhost, "/"+url.PathEscape(vhost)
	return u.String(), func() { _ = admin.DeleteVhost(context.Background(), vhost) }, nil
}

// withQuery sets one query parameter of a connection URL.
func withQuery(rawURL, key, value string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", fmt.Errorf("parse database URL: %w", err)
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String(), nil
}
