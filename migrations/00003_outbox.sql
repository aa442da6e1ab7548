-- +goose Up

-- outbox holds every effect that leaves the service (events, email requests),
-- written by the handler in the same transaction as the order's state, and
-- published to the order-confirmation.events exchange by the relay. A row's
-- idempotency key is derived from the inbox message and the effect, so
-- handling a message again (a replay, a redelivery under the same id) can
-- never add a second row, and every republish carries the same AMQP
-- message_id.
CREATE TABLE outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- '<inbox message_id>:<effect>', e.g. 'msg-1001:order.confirmed'.
    -- Published as the AMQP message_id.
    idempotency_key text        NOT NULL,
    -- Routing key on order-confirmation.events, e.g. 'order.confirmed'.
    routing_key     text        NOT NULL,
    payload         jsonb       NOT NULL,
    -- The inbox message whose handling produced the effect.
    message_id      text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Set once the broker has confirmed the publish.
    published_at    timestamptz,
    -- Number of times a relay has claimed the row to publish it.
    attempts        integer     NOT NULL DEFAULT 0,
    -- Set while a relay holds the row; a claim older than the relay's lease
    -- (a relay that died) is taken over.
    claimed_at      timestamptz,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,

    CONSTRAINT outbox_idempotency_key_key UNIQUE (idempotency_key)
)
WITH (fillfactor = 50);

-- The relay claims unpublished, unclaimed rows in order. The index holds
-- exactly those, so the claim is an ordered index scan that stops after its
-- batch however large the backlog grows (with a looser index, the planner
-- was seen to read and sort the whole backlog on every claim).
CREATE INDEX outbox_claimable_idx ON outbox (id) WHERE published_at IS NULL AND claimed_at IS NULL;

-- Unpublished rows, for the backlog view and for taking over the claims of
-- relays that died.
CREATE INDEX outbox_unpublished_idx ON outbox (id) WHERE published_at IS NULL;

-- outbox_notify wakes the relays of every inboxd process (LISTEN
-- outbox_pending); the payload is the table's schema.
-- +goose StatementBegin
CREATE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM pg_notify('outbox_pending', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_notify_insert
AFTER INSERT ON outbox
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- outbox_backlog answers "is the relay keeping up?".
CREATE VIEW outbox_backlog AS
SELECT count(*)                                         AS unpublished,
       count(*) FILTER (WHERE last_error IS NOT NULL)   AS failing,
       min(created_at)                                  AS oldest_created_at,
       now() - min(created_at)                          AS oldest_age
FROM outbox
WHERE published_at IS NULL;

-- +goose Down
DROP VIEW outbox_backlog;
DROP INDEX outbox_claimable_idx;
DROP TABLE outbox;
DROP FUNCTION outbox_notify();
