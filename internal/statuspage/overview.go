package statuspage

import "time"

// Overview is everything the status page shows, as /api/overview returns
// it. Every section but Service and Database is read from the operators'
// views in one read-only transaction, so the numbers agree with each other
// and with what the same views answer in psql.
type Overview struct {
	// ReadAt is when the database was read (answers are cached for
	// Config.CacheTTL).
	ReadAt time.Time `json:"read_at"`
	// Service is the state of this inboxd process.
	Service Service `json:"service"`
	// Database says whether the views could be read; when not, every
	// section below is empty.
	Database Database `json:"database"`

	Inbox           *InboxNow      `json:"inbox,omitempty"`
	Outbox          *OutboxNow     `json:"outbox,omitempty"`
	Throughput      []Minute       `json:"throughput"`
	DeadByError     []DeadError    `json:"dead_by_error"`
	FailuresByBuild []BuildFailure `json:"failures_by_build"`
	Dead            []DeadMessage  `json:"dead"`
	HeldBack        []HeldOrder    `json:"held_back"`
	Replays         []Replay       `json:"replays"`
	Conflicts       []Conflict     `json:"conflicts"`
	LockHolders     []LockHolder   `json:"lock_holders"`
}

// NeedsAttention reports whether something needs a person: the database is
// unreachable, or messages or outbox rows are dead.
func (o *Overview) NeedsAttention() bool {
	return !o.Database.Reachable || (o.Inbox != nil && o.Inbox.Dead > 0) || (o.Outbox != nil && o.Outbox.Dead > 0)
}

// Service is the state of this inboxd process.
type Service struct {
	Build         string    `json:"build"`
	StartedAt     time.Time `json:"started_at"`
	UptimeSeconds float64   `json:"uptime_seconds"`
	ServiceState
}

// Database says whether the status page could read the views.
type Database struct {
	Reachable bool `json:"reachable"`
	// Error says why not, without connection details.
	Error string `json:"error,omitempty"`
}

// InboxNow is the row of inbox_overview.
type InboxNow struct {
	Pending                    int64      `json:"pending"`
	InProgress                 int64      `json:"in_progress"`
	WaitingRetry               int64      `json:"waiting_retry"`
	ReplaysWaiting             int64      `json:"replays_waiting"`
	Dead                       int64      `json:"dead"`
	Processed                  int64      `json:"processed"`
	OldestPendingSeconds       float64    `json:"oldest_pending_seconds"`
	ProcessedLastMinute        int64      `json:"processed_last_minute"`
	PerSecondLast5Minutes      float64    `json:"per_second_last_5_minutes"`
	FailedAttemptsLast5Minutes int64      `json:"failed_attempts_last_5_minutes"`
	ConflictingIDs             int64      `json:"conflicting_ids"`
	LastProcessedAt            *time.Time `json:"last_processed_at"`
}

// OutboxNow is the row of outbox_backlog.
type OutboxNow struct {
	Unpublished   int64   `json:"unpublished"`
	Failing       int64   `json:"failing"`
	OldestSeconds float64 `json:"oldest_seconds"`
	// Dead counts the rows refused for good (outbox_dead): each holds back
	// the later rows of its order until an operator replays it.
	Dead int64 `json:"dead"`
	// RepliesUnpublished counts the replies waiting to be sent, and
	// RepliesUndeliverable those whose requester was gone (inbox_replies):
	// not an operator's alarm, as a requester may time out and leave.
	RepliesUnpublished   int64 `json:"replies_unpublished"`
	RepliesUndeliverable int64 `json:"replies_undeliverable"`
}

// Minute is one minute of the chart: messages received, and attempts
// processed, failed (retry, dead or abandoned) and dead, from
// inbox_throughput.
type Minute struct {
	Minute    time.Time `json:"minute"`
	Received  int64     `json:"received"`
	Processed int64     `json:"processed"`
	Failed    int64     `json:"failed"`
	Dead      int64     `json:"dead"`
}

// DeadError is a row of inbox_dead_by_error with the statement that
// replays its messages.
type DeadError struct {
	LastError    *string    `json:"last_error"`
	Messages     int64      `json:"messages"`
	MessageTypes []string   `json:"message_types"`
	FirstDiedAt  *time.Time `json:"first_died_at"`
	LastDiedAt   *time.Time `json:"last_died_at"`
	ReplaySQL    string     `json:"replay_sql"`
}

// BuildFailure is a row of inbox_failures_by_build with the statement that
// replays the dead messages the build failed.
type BuildFailure struct {
	Build     string    `json:"build"`
	Outcome   string    `json:"outcome"`
	Attempts  int64     `json:"attempts"`
	Messages  int64     `json:"messages"`
	FirstAt   time.Time `json:"first_at"`
	LastAt    time.Time `json:"last_at"`
	ReplaySQL string    `json:"replay_sql"`
}

// DeadMessage is a row of inbox_dead.
type DeadMessage struct {
	MessageID   string     `json:"message_id"`
	MessageType string     `json:"message_type"`
	Attempts    int32      `json:"attempts"`
	LastError   *string    `json:"last_error"`
	DiedAt      *time.Time `json:"died_at"`
	ReplayCount int32      `json:"replay_count"`
	LastBuild   string     `json:"last_build"`
}

// HeldOrder is a row of inbox_held_back: an order whose later messages wait
// behind a dead or retrying one.
type HeldOrder struct {
	OrderKey             string    `json:"order_key"`
	BlockingMessageID    string    `json:"blocking_message_id"`
	BlockingMessageType  string    `json:"blocking_message_type"`
	BlockingStatus       string    `json:"blocking_status"`
	Attempts             int32     `json:"attempts"`
	LastError            *string   `json:"last_error"`
	NextAttemptAt        time.Time `json:"next_attempt_at"`
	HeldMessages         int64     `json:"held_messages"`
	OldestHeldReceivedAt time.Time `json:"oldest_held_received_at"`
}

// Replay is a replayed message: who asked, when and why.
type Replay struct {
	MessageID    string     `json:"message_id"`
	ReplayCount  int32      `json:"replay_count"`
	ReplayedAt   *time.Time `json:"replayed_at"`
	ReplayedBy   *string    `json:"replayed_by"`
	ReplayReason *string    `json:"replay_reason"`
	Status       string     `json:"status"`
	Result       *string    `json:"result"`
}

// LockHolder is a row of inbox_lock_holders: a session whose transaction has
// held a lock on the service's tables for over 5 seconds, and the statement
// that ends it.
type LockHolder struct {
	Pid             int32     `json:"pid"`
	User            string    `json:"user"`
	ApplicationName string    `json:"application_name"`
	ClientAddr      string    `json:"client_addr"`
	State           string    `json:"state"`
	XactStart       time.Time `json:"xact_start"`
	OpenSeconds     float64   `json:"open_seconds"`
	Tables          []string  `json:"tables"`
	EndSQL          string    `json:"end_sql"`
}

// Conflict is a row of inbox_conflicts, without the conflicting payload.
type Conflict struct {
	MessageID   string    `json:"message_id"`
	MessageType string    `json:"message_type"`
	Deliveries  int32     `json:"deliveries"`
	FirstSeenAt time.Time `json:"first_seen_at"`
	LastSeenAt  time.Time `json:"last_seen_at"`
}
