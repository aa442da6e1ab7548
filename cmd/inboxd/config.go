package main

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/orderconfirm/inboxd/internal/broker"
	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/ingest"
	"github.com/orderconfirm/inboxd/internal/janitor"
	"github.com/orderconfirm/inboxd/internal/migrate"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/outbox"
	"github.com/orderconfirm/inboxd/internal/pgsession"
	"github.com/orderconfirm/inboxd/internal/pipeline"
	"github.com/orderconfirm/inboxd/internal/retry"
)

// HTTPAddrDefault is HTTP_ADDR's default: loopback only.
const HTTPAddrDefault = "127.0.0.1:8080"

// config is the whole configuration of inboxd, read from the environment.
type config struct {
	dbConfig   *pgxpool.Config
	amqpURL    string
	httpAddr   string
	pprofAddr  string
	statusPage bool

	logLevel  slog.Level
	logFormat string
	migrate   bool
	// migrateLockTimeout is the migration session's lock_timeout.
	migrateLockTimeout time.Duration

	queueType          string
	ingestBatchSize    int
	ingestLinger       time.Duration
	prefetch           int
	maxInflightBytes   int
	goMemLimit         string // GOMEMLIMIT as given; empty: serve sets one
	maxMessageBytes    int
	deriveMessageID    bool
	amqpHeartbeat      time.Duration
	ingestStoreTimeout time.Duration
	// replyQueuePrefixes are the reply queues answered besides direct
	// reply-to.
	replyQueuePrefixes []string

	workers          int
	workerBatchSize  int
	pollInterval     time.Duration
	handlerTimeout   time.Duration
	maxAttempts      int
	partitions       int
	retryBase        time.Duration
	retryMax         time.Duration
	claimLease       time.Duration
	relayBatchSize   int
	relayMaxAttempts int
	relayLease       time.Duration
	statementTimeout time.Duration
	lockTimeout      time.Duration
	idleInTxTimeout  time.Duration
	// workerIdleInTx is the idle_in_transaction_session_timeout of every
	// pool's connections but the relay's (see waitsOutside).
	workerIdleInTx   time.Duration
	dbConnectTimeout time.Duration

	retention         time.Duration
	deadRetention     time.Duration
	dedupeWindow      time.Duration
	janitorInterval   time.Duration
	stockFoldInterval time.Duration
	janitorBatch      int

	shutdownTimeout time.Duration
}

// setting is one environment variable: its name, default and meaning, and
// how to apply its value to the config.
type setting struct {
	name   string
	def    string
	doc    string
	secret bool // the value may hold a password: never print it
	// serveOnly settings are required by serve only (migrate does not
	// talk to RabbitMQ).
	serveOnly bool
	// optional settings may be empty (def is then ""); apply is not called.
	optional bool
	apply    func(v string) error
}

// settings lists every environment variable inboxd reads. docs/configuration.md's
// configuration table is checked against it by a test.
func (c *config) settings() []setting {
	return []setting{
		{name: "DATABASE_URL", doc: "PostgreSQL connection URL or DSN; a search_path parameter selects the schema", secret: true, apply: c.parseDatabaseURL},
		{name: "AMQP_URL", doc: "RabbitMQ URL, amqp:// or amqps://; a cluster's nodes as several URLs separated by commas, tried in turn on every (re)connect (serve only)", secret: true, serveOnly: true, apply: c.parseAMQPURL},
		{name: "HTTP_ADDR", def: HTTPAddrDefault, doc: "address of /healthz, /readyz, /metrics and the status page; keep it private", apply: c.parseHTTPAddr},
		{name: "INBOX_STATUS_PAGE", def: "true", doc: "serve the read-only status page on HTTP_ADDR at / (JSON under /api/)", apply: boolVar(&c.statusPage)},
		{name: "INBOX_PPROF_ADDR", optional: true, doc: "address of Go's profiler (/debug/pprof/), apart from HTTP_ADDR; empty: no profiler. Keep it private", apply: c.parsePprofAddr},
		{name: "INBOX_LOG_LEVEL", def: "info", doc: "debug, info, warn or error", apply: c.parseLogLevel},
		{name: "INBOX_LOG_FORMAT", def: "json", doc: "json or text", apply: oneOf(&c.logFormat, "json", "text")},
		{name: "INBOX_MIGRATE", def: "true", doc: "serve applies the migrations at start", apply: boolVar(&c.migrate)},
		{name: "INBOX_MIGRATE_LOCK_TIMEOUT", def: migrate.LockTimeoutDefault.String(), doc: "lock_timeout of the migration session (which has no statement_timeout): how long a migration waits for a lock before it fails", apply: durationVar(&c.migrateLockTimeout, time.Millisecond)},
		{name: "INBOX_QUEUE_TYPE", def: broker.QueueTypeQuorum, doc: "type of the declared queues: quorum or classic", apply: oneOf(&c.queueType, broker.QueueTypeQuorum, broker.QueueTypeClassic)},
		{name: "INBOX_PARTITIONS", def: "1", doc: "number of inbox queues, 1 to 64: with more than 1, a consistent-hash exchange spreads the orders over them by the x-order-id header, each replica consumes them all and the active consumers spread over the replicas (needs the rabbitmq_consistent_hash_exchange plugin; see \"Partitioned ingest\" and \"Changing INBOX_PARTITIONS\")", apply: intVar(&c.partitions, 1, broker.MaxPartitions)},
		{name: "INBOX_INGEST_BATCH_SIZE", def: strconv.Itoa(ingest.BatchSizeDefault), doc: "most deliveries stored per insert", apply: intVar(&c.ingestBatchSize, 1, 10000)},
		{name: "INBOX_INGEST_LINGER", def: durationString(ingest.LingerDefault), doc: "how long a batch that is not full waits for more deliveries", apply: durationVar(&c.ingestLinger, time.Microsecond)},
		{name: "INBOX_INGEST_MAX_INFLIGHT_BYTES", def: strconv.Itoa(ingest.MaxInflightBytesDefault), doc: "bound on the message bodies ingest holds unacknowledged; sizes INBOX_PREFETCH (set the broker's max_message_size to INBOX_MAX_MESSAGE_BYTES for it to hold)", apply: intVar(&c.maxInflightBytes, 1, 1<<40)},
		{name: "INBOX_PREFETCH", def: "0", doc: "unacknowledged deliveries the broker may send ahead (AMQP QoS); 0 takes INBOX_INGEST_MAX_INFLIGHT_BYTES / INBOX_MAX_MESSAGE_BYTES", apply: intVar(&c.prefetch, 0, 65535)},
		{name: "INBOX_MAX_MESSAGE_BYTES", def: strconv.Itoa(ingest.MaxMessageBytesDefault), doc: "largest body stored; larger ones are dead-lettered", apply: intVar(&c.maxMessageBytes, 1, 512<<20)},
		{name: "GOMEMLIMIT", optional: true, doc: "Go's soft memory limit (read by the Go runtime); unset, serve sets it to INBOX_INGEST_MAX_INFLIGHT_BYTES plus 64 MiB, so that the garbage of large bodies is collected before it adds up", apply: func(v string) error { c.goMemLimit = v; return nil }},
		{name: "INBOX_DERIVE_MISSING_MESSAGE_ID", def: "false", doc: "give a delivery without message_id the id sha256:<hex of type, NUL, body> instead of dead-lettering it", apply: boolVar(&c.deriveMessageID)},
		{name: "INBOX_AMQP_HEARTBEAT", def: durationString(broker.HeartbeatDefault), doc: "AMQP heartbeat interval", apply: durationVar(&c.amqpHeartbeat, time.Second)},
		{name: "INBOX_REPLY_QUEUE_PREFIXES", optional: true, doc: "comma-separated prefixes of the queue names a reply may go to besides RabbitMQ's direct reply-to (e.g. checkout.replies.); empty: direct reply-to only. A request whose reply_to is any other queue is stored and handled, not answered (a producer cannot make inboxd publish into another service's queue)", apply: c.parseReplyQueuePrefixes},
		{name: "INBOX_INGEST_STORE_TIMEOUT", def: durationString(ingest.StoreTimeoutDefault), doc: "bound on one batch insert", apply: durationVar(&c.ingestStoreTimeout, time.Millisecond)},
		{name: "INBOX_WORKERS", def: strconv.Itoa(inbox.ConcurrencyDefault), doc: "batches handled at once, each in its own transaction", apply: intVar(&c.workers, 1, 256)},
		{name: "INBOX_WORKER_BATCH_SIZE", def: strconv.Itoa(inbox.BatchSizeDefault), doc: "most messages claimed per transaction", apply: intVar(&c.workerBatchSize, 1, 10000)},
		{name: "INBOX_POLL_INTERVAL", def: durationString(inbox.PollIntervalDefault), doc: "how often workers look for due messages without a wake-up", apply: durationVar(&c.pollInterval, time.Millisecond)},
		{name: "INBOX_HANDLER_TIMEOUT", def: durationString(inbox.HandlerTimeoutDefault), doc: "bound on handling one batch", apply: durationVar(&c.handlerTimeout, time.Millisecond)},
		{name: "INBOX_MAX_ATTEMPTS", def: strconv.Itoa(inbox.MaxAttemptsDefault), doc: "failed attempts after which a message is dead", apply: intVar(&c.maxAttempts, 1, 1000)},
		{name: "INBOX_RETRY_BASE", def: durationString(retry.BaseDefault), doc: "delay before the first retry; doubled per attempt, with jitter", apply: durationVar(&c.retryBase, time.Millisecond)},
		{name: "INBOX_RETRY_MAX", def: durationString(retry.MaxDefault), doc: "longest delay between retries", apply: durationVar(&c.retryMax, time.Millisecond)},
		{name: "INBOX_CLAIM_LEASE", def: durationString(inbox.ClaimLeaseDefault), doc: "how long other workers leave a claimed message alone when its process's liveness is unknown (a claim of an earlier build, or taken while its liveness session was down); the claims of a process whose database sessions have ended (it died) are taken over at once", apply: durationVar(&c.claimLease, 10*time.Millisecond)},
		{name: "INBOX_RELAY_MAX_ATTEMPTS", def: strconv.Itoa(outbox.MaxAttemptsDefault), doc: "attempts after which an outbox row the relay cannot send (an id or routing key no AMQP short string holds) is dead, holding back its order's later events until replayed, and after which a reply the broker returns (its requester is gone) ends undeliverable; failures retrying may cure never end an event", apply: intVar(&c.relayMaxAttempts, 1, 1000)},
		{name: "INBOX_RELAY_BATCH_SIZE", def: strconv.Itoa(outbox.BatchSizeDefault), doc: "most outbox rows published at once", apply: intVar(&c.relayBatchSize, 1, 10000)},
		{name: "INBOX_RELAY_LEASE", def: durationString(outbox.LeaseDefault), doc: "how long a claim on outbox rows left by an earlier build's relay is respected (this build holds rows by a lock that ends with the relay's connection, or with `INBOX_IDLE_IN_TX_TIMEOUT` if the relay hangs; they are then published again, under the same ids)", apply: durationVar(&c.relayLease, time.Second)},
		{name: "INBOX_STATEMENT_TIMEOUT", def: "30s", doc: "PostgreSQL statement_timeout of every connection", apply: durationVar(&c.statementTimeout, time.Millisecond)},
		{name: "INBOX_LOCK_TIMEOUT", def: "5s", doc: "PostgreSQL lock_timeout of every connection: no lock wait lasts longer; a message whose handling runs into it waits and is tried again without losing an attempt", apply: durationVar(&c.lockTimeout, time.Millisecond)},
		{name: "INBOX_IDLE_IN_TX_TIMEOUT", def: "60s", doc: "PostgreSQL idle_in_transaction_session_timeout of the relay's connections; at least 15s, as the relay waits for the broker's confirms in its transaction", apply: durationVar(&c.idleInTxTimeout, time.Millisecond)},
		{name: "INBOX_WORKER_IDLE_IN_TX_TIMEOUT", def: "5s", doc: "PostgreSQL idle_in_transaction_session_timeout of every connection but the relay's (the workers', the leader's maintenance's, ingest's, the gauges' and the status page's), whose transactions wait on nothing outside PostgreSQL: a replica frozen between two statements of one (a VM pause, a stopped process) holds the rows and locks it took this long, such as the stock rows every order of their SKUs needs, or a key-ledger rotation's lock every insert waits for", apply: durationVar(&c.workerIdleInTx, time.Second)},
		{name: "INBOX_DB_CONNECT_TIMEOUT", def: "5s", doc: "bound on opening one PostgreSQL connection", apply: durationVar(&c.dbConnectTimeout, time.Millisecond)},
		{name: "INBOX_RETENTION", def: durationString(janitor.RetentionDefault), doc: "how long processed messages (with their payloads, for replay), their attempt history, published outbox rows and conflict records are kept; their ids are remembered for INBOX_DEDUPE_WINDOW either way", apply: durationVar(&c.retention, time.Second)},
		{name: "INBOX_DEAD_RETENTION", def: durationString(janitor.DeadRetentionDefault), doc: "how long dead messages are kept unless replayed; at least INBOX_RETENTION", apply: durationVar(&c.deadRetention, time.Second)},
		{name: "INBOX_DEDUPE_WINDOW", def: durationString(janitor.DedupeWindowDefault), doc: "how long a message id is remembered after its message was stored (at least this, at most a seventh longer): the longest time after which a message may be delivered again", apply: durationVar(&c.dedupeWindow, time.Second)},
		{name: "INBOX_JANITOR_INTERVAL", def: durationString(janitor.IntervalDefault), doc: "time between two cleanups of rows past their retention, run by the leader (see docs/operations.md); 0 turns the janitor off in this process", apply: durationVar(&c.janitorInterval, 0)},
		{name: "INBOX_JANITOR_BATCH_SIZE", def: strconv.Itoa(janitor.BatchSizeDefault), doc: "most rows deleted per cleanup statement", apply: intVar(&c.janitorBatch, 1, 100000)},
		{name: "INBOX_STOCK_FOLD_INTERVAL", def: durationString(orders.StockFoldIntervalDefault), doc: "time between two folds of the stock moves into stock.available (the levels in stock_levels count the moves either way), run by the leader; 0 turns folding off in this process", apply: durationVar(&c.stockFoldInterval, 0)},
		{name: "INBOX_SHUTDOWN_TIMEOUT", def: "20s", doc: "grace period to finish in-flight work after SIGTERM", apply: durationVar(&c.shutdownTimeout, time.Millisecond)},
	}
}

// durationString writes d as a setting's default is written: 5m, not 5m0s.
func durationString(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// otelSettings lists the OpenTelemetry variables inboxd documents. They
// are not part of config: tracing.Setup and the OpenTelemetry SDK read them,
// with the standard meaning. docs/configuration.md's tracing table is checked against
// this list by a test.
func otelSettings() []setting {
	return []setting{
		{name: "OTEL_EXPORTER_OTLP_ENDPOINT", def: "(none)", doc: "OTLP endpoint spans are exported to, e.g. http://jaeger:4318 (http/protobuf) or http://jaeger:4317 (grpc); unset (with OTEL_TRACES_EXPORTER unset) means no export"},
		{name: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", def: "(none)", doc: "the same, for traces only; for http/protobuf the full URL, .../v1/traces"},
		{name: "OTEL_EXPORTER_OTLP_PROTOCOL", def: "http/protobuf", doc: "grpc or http/protobuf (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides it)"},
		{name: "OTEL_TRACES_EXPORTER", def: "otlp", doc: "otlp or none; none turns export off"},
		{name: "OTEL_SDK_DISABLED", def: "false", doc: "true turns export off"},
		{name: "OTEL_SERVICE_NAME", def: "inboxd", doc: "service.name of the exported spans (OTEL_RESOURCE_ATTRIBUTES adds attributes)"},
		{name: "OTEL_TRACES_SAMPLER", def: "parentbased_always_on", doc: "sampler, e.g. parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG=0.1"},
		{name: "OTEL_EXPORTER_OTLP_HEADERS", def: "(none)", doc: "headers sent with each export, key=value,..."},
		{name: "OTEL_BSP_SCHEDULE_DELAY", def: "5000", doc: "milliseconds between two exports of buffered spans"},
		{name: "OTEL_SPAN_LINK_COUNT_LIMIT", def: "128", doc: "most links a span keeps (a batch span links to each of its messages)"},
	}
}

// loadConfig reads the configuration of command (serve or migrate) through
// getenv. The error names the first bad setting and never holds a secret
// value.
func loadConfig(getenv func(string) string, command string) (*config, error) {
	c := &config{}
	for _, s := range c.settings() {
		v := strings.TrimSpace(getenv(s.name))
		if v == "" {
			v = s.def
		}
		if v == "" && (s.optional || s.serveOnly && command == "migrate") {
			continue
		}
		if v == "" {
			return nil, fmt.Errorf("%s is required: %s", s.name, s.doc)
		}
		if err := s.apply(v); err != nil {
			if s.secret {
				return nil, fmt.Errorf("%s is invalid: %w", s.name, err)
			}
			return nil, fmt.Errorf("%s is invalid: %q: %w", s.name, v, err)
		}
	}
	// INBOX_PPROF (true: the profiler on HTTP_ADDR) is no longer read.
	if v := strings.TrimSpace(getenv("INBOX_PPROF")); v != "" {
		if on, err := strconv.ParseBool(v); err != nil || on {
			return nil, errors.New("INBOX_PPROF is no longer read: the profiler has a listener of its own now, set INBOX_PPROF_ADDR to its address (e.g. 127.0.0.1:6060) and unset INBOX_PPROF")
		}
	}
	if c.retryMax < c.retryBase {
		return nil, fmt.Errorf("INBOX_RETRY_MAX is invalid: %s is shorter than INBOX_RETRY_BASE (%s)", c.retryMax, c.retryBase)
	}
	if c.deadRetention < c.retention {
		return nil, fmt.Errorf("INBOX_DEAD_RETENTION is invalid: %s is shorter than INBOX_RETENTION (%s)", c.deadRetention, c.retention)
	}
	// The relay's transaction is idle while it waits for the broker's
	// confirms of a batch; ending it there would publish the batch again.
	if minIdle := outbox.ConfirmTimeoutDefault + 5*time.Second; c.idleInTxTimeout < minIdle {
		return nil, fmt.Errorf("INBOX_IDLE_IN_TX_TIMEOUT is invalid: %s is shorter than %s, the relay's wait for the broker's confirms of a batch (%s) and a margin, inside its transaction", c.idleInTxTimeout, minIdle, outbox.ConfirmTimeoutDefault)
	}
	c.dbConfig.ConnConfig.ConnectTimeout = c.dbConnectTimeout
	rp := c.dbConfig.ConnConfig.RuntimeParams
	// A PostgreSQL application_name given in DATABASE_URL prefixes the
	// name of every connection; each pool adds what it is for.
	if rp["application_name"] == "" {
		rp["application_name"] = "inboxd"
	}
	rp["statement_timeout"] = strconv.FormatInt(c.statementTimeout.Milliseconds(), 10)
	rp["idle_in_transaction_session_timeout"] = strconv.FormatInt(c.idleInTxTimeout.Milliseconds(), 10)
	rp["lock_timeout"] = strconv.FormatInt(c.lockTimeout.Milliseconds(), 10)
	// A statement checks every second that its client is still there, so
	// that a killed replica's running statements end with it, and with
	// them the row locks its transactions hold (its claims among them),
	// instead of at their end or at a timeout.
	rp["client_connection_check_interval"] = "1000"
	// Both ends of every connection notice a silent network (packets
	// lost, nothing refused) within seconds.
	pgsession.WatchNetwork(c.dbConfig.ConnConfig)
	pipeline.ConfigureSession(c.dbConfig.ConnConfig)
	return c, nil
}

func (c *config) parseDatabaseURL(v string) error {
	cfg, err := pgxpool.ParseConfig(v)
	if err != nil {
		return secretParseError(v, err)
	}
	c.dbConfig = cfg
	return nil
}

func (c *config) parseAMQPURL(v string) error {
	for _, node := range broker.Nodes(v) {
		if _, err := amqp.ParseURI(node); err != nil {
			return secretParseError(node, err)
		}
	}
	c.amqpURL = v
	return nil
}

// urlEncodingHint is what to do about most URLs that do not parse.
const urlEncodingHint = "percent-encode reserved characters in the user and password: % as %25, # as %23, ? as %3F, @ as %40, / as %2F, : as %3A, [ as %5B"

// secretParseError says why v, a value that may hold a password, does not
// parse, showing v with its password masked. It quotes nothing of the
// parser's message: parsers quote the part they could not read, which may
// be a piece of the password.
func secretParseError(v string, err error) error {
	reason := parseProblem(err)
	if strings.Contains(v, "://") {
		reason += "; " + urlEncodingHint
	}
	return fmt.Errorf("cannot parse `%s`: %s", maskKeyValuePasswords(maskURLPasswords(v)), reason)
}

// parseProblem describes err, a parser's error, without the text it
// quotes.
func parseProblem(err error) string {
	var escape url.EscapeError
	var host url.InvalidHostError
	var pgErr *pgconn.ParseConfigError
	switch {
	case errors.As(err, &escape):
		return "an invalid percent-escape"
	case errors.As(err, &host):
		return "an invalid character in the host"
	case errors.As(err, &pgErr):
		// "cannot parse `<value>`: <what> (<inner error>)"
		msg := err.Error()
		if i := strings.LastIndex(msg, "`: "); i >= 0 {
			msg = msg[i+3:]
		}
		if inner := errors.Unwrap(err); inner != nil {
			msg = strings.TrimSuffix(msg, " ("+inner.Error()+")") + " (" + parseProblem(inner) + ")"
		}
		return unquoted(msg)
	}
	var urlErr *url.Error
	if errors.As(err, &urlErr) {
		err = urlErr.Err
	}
	return unquoted(err.Error())
}

// unquoted returns msg up to the first text it quotes.
func unquoted(msg string) string {
	if i := strings.IndexAny(msg, "\"`"); i >= 0 {
		msg = strings.TrimRight(msg[:i], " :(")
	}
	return cmp.Or(msg, "not valid")
}

func (c *config) parseHTTPAddr(v string) error {
	if _, _, err := net.SplitHostPort(v); err != nil {
		return errors.New("want host:port")
	}
	c.httpAddr = v
	return nil
}

func (c *config) parsePprofAddr(v string) error {
	if _, _, err := net.SplitHostPort(v); err != nil {
		return errors.New("want host:port")
	}
	c.pprofAddr = v
	return nil
}

// parseReplyQueuePrefixes reads a comma-separated list of queue name
// prefixes, none of them empty (an empty one would allow every queue).
func (c *config) parseReplyQueuePrefixes(v string) error {
	for p := range strings.SplitSeq(v, ",") {
		p = strings.TrimSpace(p)
		switch {
		case p == "":
			return errors.New("an empty prefix would allow every queue")
		case len(p) > 255:
			return errors.New("a prefix is longer than a queue name may be (255 bytes)")
		}
		c.replyQueuePrefixes = append(c.replyQueuePrefixes, p)
	}
	return nil
}

func (c *config) parseLogLevel(v string) error {
	return c.logLevel.UnmarshalText([]byte(v))
}

func intVar(p *int, lo, hi int) func(string) error {
	return func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return errors.New("not an integer")
		}
		if n < lo || n > hi {
			return fmt.Errorf("must be between %d and %d", lo, hi)
		}
		*p = n
		return nil
	}
}

func durationVar(p *time.Duration, lo time.Duration) func(string) error {
	return func(v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return errors.New("not a duration such as 500ms, 10s or 5m")
		}
		if d < lo {
			return fmt.Errorf("must be at least %s", lo)
		}
		*p = d
		return nil
	}
}

func boolVar(p *bool) func(string) error {
	return func(v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return errors.New("not true or false")
		}
		*p = b
		return nil
	}
}

func oneOf(p *string, allowed ...string) func(string) error {
	return func(v string) error {
		for _, a := range allowed {
			if v == a {
				*p = v
				return nil
			}
		}
		return fmt.Errorf("must be one of %s", strings.Join(allowed, ", "))
	}
}
