package statuspage

// ServiceState is what the running service reports about itself; the page
// shows it next to what the database says.
type ServiceState struct {
	// IngestConsuming is true while every ingest channel consumes from
	// RabbitMQ.
	IngestConsuming bool `json:"ingest_consuming"`
	// RelayConnected is true while the outbox relay holds a broker
	// connection.
	RelayConnected bool `json:"relay_connected"`
	// Workers is the number of batches handled at once.
	Workers int `json:"workers"`
	// IngestChannels is the number of AMQP channels ingest consumes on.
	IngestChannels int `json:"ingest_channels"`
}

// RabbitMQConnected reports whether both ingest and the relay are
// connected to RabbitMQ.
func (s ServiceState) RabbitMQConnected() bool { return s.IngestConsuming && s.RelayConnected }
