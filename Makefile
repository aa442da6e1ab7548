# The project's commands. `make` lists them.

SQLC_VERSION        := v1.31.1
STATICCHECK_VERSION := v0.8.2

BIN         := $(CURDIR)/bin
SQLC        ?= $(BIN)/sqlc
STATICCHECK ?= $(BIN)/staticcheck
GO          ?= go

# Local services for `make run` and `make bench`; override as needed.
DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable
AMQP_URL     ?= amqp://guest:guest@127.0.0.1:5672/
BENCH_FLAGS  ?=
# The build's name in the attempt history and inboxd_build_info.
VERSION      ?= $(shell git describe --always --dirty 2>/dev/null)

.DEFAULT_GOAL := help
# bash, for pipefail in make chaos.
SHELL := bash

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(SQLC):
	@mkdir -p $(BIN)
	GOBIN=$(BIN) $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)

$(STATICCHECK):
	@mkdir -p $(BIN)
	GOBIN=$(BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

.PHONY: tools
tools: $(SQLC) $(STATICCHECK) ## Build the pinned sqlc and staticcheck into bin/

.PHONY: generate
generate: $(SQLC) ## Regenerate internal/dbsqlc from queries/ and migrations/
	$(SQLC) generate

.PHONY: verify
verify: $(SQLC) ## Fail if generated code is stale, go.mod untidy or code unformatted
	$(SQLC) vet
	$(SQLC) diff
	@test -z "$$(gofmt -l .)" || { echo "gofmt needed:"; gofmt -l .; exit 1; }
	$(GO) mod tidy -diff

.PHONY: lint
lint: $(STATICCHECK) ## gofmt, go vet and staticcheck
	@test -z "$$(gofmt -l .)" || { echo "gofmt needed:"; gofmt -l .; exit 1; }
	$(GO) vet ./...
	$(STATICCHECK) ./...

.PHONY: test
test: $(SQLC) ## Run every test against real PostgreSQL and RabbitMQ (see README.md, "Test it")
	SQLC=$(SQLC) $(GO) test -count=1 -timeout 20m ./...
ifneq ($(TEST_DATABASE_URL),)
	$(MAKE) --no-print-directory test-disruptive
endif

.PHONY: test-disruptive
test-disruptive: ## Restart PostgreSQL and RabbitMQ under load (local services only; make test runs it when TEST_DATABASE_URL is set)
	TEST_DISRUPTIVE=1 $(GO) test -count=1 -timeout 10m -run '^TestDisruptive' -v ./cmd/inboxd/

.PHONY: chaos
chaos: ## Two inboxd processes, 20,000 orders, kills and disconnections at random; prints a summary table
	set -o pipefail; CHAOS_ORDERS=$(or $(CHAOS_ORDERS),20000) $(GO) test -count=1 -timeout 20m -run '^TestChaos$$' -v ./cmd/inboxd/ \
		| grep -v '^=== \|^        {'

.PHONY: test-race
test-race: $(SQLC) ## Run every test with the race detector, inboxd built with it too (-short: see docs/testing.md)
	SQLC=$(SQLC) $(GO) test -race -short -count=1 -timeout 20m ./...

.PHONY: fuzz
fuzz: ## Fuzz message decoding for a minute
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime 60s ./internal/orders/

.PHONY: fuzz-schema
fuzz-schema: ## Fuzz the decoder against api/schemas for a minute
	$(GO) test -run '^$$' -fuzz FuzzSchemaAgrees -fuzztime 60s ./internal/orders/

.PHONY: build
build: ## Build bin/inboxd and bin/inboxbench
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/inboxd ./cmd/inboxd
	$(GO) build -o $(BIN)/inboxbench ./cmd/inboxbench

.PHONY: bench
bench: build ## The benchmark suite against the local services (see BENCHMARKS.md)
	$(BIN)/inboxbench -inboxd $(BIN)/inboxd -database-url '$(DATABASE_URL)' -amqp-url '$(AMQP_URL)' $(BENCH_FLAGS)

.PHONY: run
run: ## Run inboxd serve against the local services
	DATABASE_URL='$(DATABASE_URL)' AMQP_URL='$(AMQP_URL)' INBOX_LOG_FORMAT=text $(GO) run ./cmd/inboxd serve

.PHONY: clean
clean: ## Remove bin/
	rm -rf $(BIN)
