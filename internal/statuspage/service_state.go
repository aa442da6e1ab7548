package statuspage

// ServiceState is what the running service reports about itself; the page
// shows it next to what the database says.
type ServiceState struct {
	// IngestConsuming is true while ingest is registered as a consumer of
	// the inbox queue: receiving, or standing by for another replica (the
	// queue has a single active consumer).
	IngestConsuming bool `json:"ingest_consuming"`
	// Partitions is the number of inbox queues (INBOX_PARTITIONS), and
	// PartitionsActive how many of them this process is the active
	// consumer of, as far as it knows (it received a delivery since it
	// subscribed).
	Partitions       int `json:"partitions"`
	PartitionsActive int `json:"partitions_active"`
	// RelayConnected is true while the outbox relay holds a broker
	// connection.
	RelayConnected bool `json:"relay_connected"`
	// Workers is the number of batches handled at once.
	Workers int `json:"workers"`
	// BrokerAlarm, when not empty, says that the broker blocks the relay's
	// connection (a memory or disk alarm), and why: no event is published
	// until it clears.
	BrokerAlarm string `json:"broker_alarm,omitempty"`
	// Durability says what an ack's commit waits for: a synchronous
	// standby, or the primary's disk only (then a failover to an
	// asynchronous standby may lose acked messages). Empty when unknown.
	Durability string `json:"durability,omitempty"`
}

// RabbitMQConnected reports whether both ingest and the relay are
// connected to RabbitMQ.
func (s ServiceState) RabbitMQConnected() bool { return s.IngestConsuming && s.RelayConnected }

// Degraded reports whether RabbitMQ is not fully usable: not connected, or
// blocking publishes.
func (s ServiceState) Degraded() bool { return !s.RabbitMQConnected() || s.BrokerAlarm != "" }
