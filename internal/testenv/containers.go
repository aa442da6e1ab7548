package testenv

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Images used when the servers are started with testcontainers-go. They
// match docker-compose.yml.
const (
	postgresImage = "postgres:15-alpine"
	rabbitImage   = "rabbitmq:3.13-management-alpine"
)

func startPostgresContainer(ctx context.Context) (string, func(), error) {
	c, err := tcpostgres.Run(ctx, postgresImage,
		tcpostgres.WithDatabase("test"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return "", nil, fmt.Errorf("start PostgreSQL container (set TEST_DATABASE_URL to use a running server): %w", err)
	}
	dsn, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		return "", nil, err
	}
	return dsn, func() { _ = testcontainers.TerminateContainer(c) }, nil
}

func startRabbitMQContainer(ctx context.Context) (string, string, func(), error) {
	c, err := testcontainers.Run(ctx, rabbitImage,
		testcontainers.WithExposedPorts("5672/tcp", "15672/tcp"),
		testcontainers.WithWaitStrategy(
			wait.ForLog("Server startup complete").WithStartupTimeout(2*time.Minute),
			wait.ForListeningPort("5672/tcp"),
			wait.ForListeningPort("15672/tcp"),
		),
	)
	if err != nil {
		return "", "", nil, fmt.Errorf("start RabbitMQ container (set TEST_AMQP_URL to use a running server): %w", err)
	}
	amqpHostPort, err := c.PortEndpoint(ctx, "5672/tcp", "")
	if err != nil {
		return "", "", nil, err
	}
	adminHostPort, err := c.PortEndpoint(ctx, "15672/tcp", "")
	if err != nil {
		return "", "", nil, err
	}
	stop := func() { _ = testcontainers.TerminateContainer(c) }
	return "amqp://guest:guest@" + amqpHostPort + "/", "http://guest:guest@" + adminHostPort, stop, nil
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// dockerAvailable reports whether a Docker engine answers.
func dockerAvailable(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return false
	}
	defer func() { _ = cli.Close() }()
	_, err = cli.Ping(ctx, client.PingOptions{})
	return err == nil
}
