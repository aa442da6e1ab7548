-- The simplest correct inbox for the orders domain, the ruler inboxbench
-- holds inboxd against (simplest.go says what it does and leaves out). It
-- is created in a fresh schema of the bench's, dropped with it, and holds
-- nothing its flow does not need.

-- One row per unique message. The unique message_id is the dedupe;
-- processed_at is set by the transaction that handles the message, at the
-- statement that marks it, after the handling (as inboxd's is).
-- message_type is the AMQP type, else the routing key: the handler needs it
-- to tell an order.created from an order.cancelled.
CREATE TABLE inbox (
    id           bigserial   PRIMARY KEY,
    message_id   text        NOT NULL UNIQUE,
    message_type text        NOT NULL,
    payload      bytea       NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz
);

-- The workers' claim reads the pending rows in id order.
CREATE INDEX inbox_pending_idx ON inbox (id) WHERE processed_at IS NULL;

-- One row per order, whichever message recorded it first: an order
-- re-sent under a new message id is not confirmed twice. status is
-- confirmed, rejected or cancelled.
CREATE TABLE order_confirmations (
    order_id   text        PRIMARY KEY,
    message_id text        NOT NULL,
    user_id    text,
    email      text,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE stock (
    sku       text PRIMARY KEY,
    available int  NOT NULL CHECK (available >= 0)
);

-- What each confirmed order took of each SKU; a cancellation gives it back.
CREATE TABLE reservations (
    order_id text NOT NULL,
    sku      text NOT NULL,
    quantity int  NOT NULL,
    PRIMARY KEY (order_id, sku)
);

-- One row per event to publish, keyed by the message that caused it and
-- the event's type; published_at is set once the broker has confirmed it.
CREATE TABLE outbox (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE,
    routing_key     text        NOT NULL,
    payload         jsonb       NOT NULL,
    published_at    timestamptz
);

-- The relay's claim reads the unpublished rows in id order.
CREATE INDEX outbox_unpublished_idx ON outbox (id) WHERE published_at IS NULL;
