package statuspage

import "time"

// Message is one message's story, as /api/messages/{message_id} returns it:
// its inbox row without the payload, and its attempts from inbox_attempts.
type Message struct {
	ReadAt   time.Time `json:"read_at"`
	Database Database  `json:"database"`
	// Found is false when no inbox row has the id (never stored, or
	// deleted past its retention).
	Found    bool      `json:"found"`
	Inbox    *InboxRow `json:"inbox,omitempty"`
	Attempts []Attempt `json:"attempts"`
}

// InboxRow is an inbox row without its payload (only its size).
type InboxRow struct {
	ID              int64      `json:"id"`
	MessageID       string     `json:"message_id"`
	MessageType     string     `json:"message_type"`
	RoutingKey      string     `json:"routing_key"`
	Status          string     `json:"status"`
	Attempts        int32      `json:"attempts"`
	LastError       *string    `json:"last_error"`
	Result          *string    `json:"result"`
	ReceivedAt      time.Time  `json:"received_at"`
	NextAttemptAt   time.Time  `json:"next_attempt_at"`
	ClaimedAt       *time.Time `json:"claimed_at"`
	ClaimedBy       *string    `json:"claimed_by"`
	ClaimedBuild    *string    `json:"claimed_build"`
	ProcessedAt     *time.Time `json:"processed_at"`
	ReplayRequested bool       `json:"replay_requested"`
	ReplayCount     int32      `json:"replay_count"`
	ReplayedAt      *time.Time `json:"replayed_at"`
	ReplayedBy      *string    `json:"replayed_by"`
	ReplayReason    *string    `json:"replay_reason"`
	OrderKey        *string    `json:"order_key"`
	PayloadBytes    int64      `json:"payload_bytes"`
}

// Attempt is a row of inbox_attempts.
type Attempt struct {
	Run        int32      `json:"run"`
	Attempt    int32      `json:"attempt"`
	Outcome    string     `json:"outcome"`
	Error      *string    `json:"error"`
	Result     *string    `json:"result"`
	Process    string     `json:"process"`
	Build      string     `json:"build"`
	StartedAt  *time.Time `json:"started_at"`
	FinishedAt time.Time  `json:"finished_at"`
}
