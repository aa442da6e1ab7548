package statuspage

// ServiceState is what the running service reports about itself; the page
// shows it next to what the database says.
type ServiceState struct {
	// IngestConsuming is true while ingest is registered as a consumer of
	// the inbox queue: receiving, or standing by for another replica (the
	// queue has a single active consumer).
	IngestConsuming bool `json:"ingest_consuming"`
	// RelayConnected is true while the outbox relay holds a broker
	// connection.
	RelayConnected bool `json:"relay_connected"`
	// Workers is the number of batches handled at once.
	Workers int `json:"workers"`
}

// RabbitMQConnected reports whether both ingest and the relay are
// connected to RabbitMQ.
func (s ServiceState) RabbitMQConnected() bool { return s.IngestConsuming && s.RelayConnected }
