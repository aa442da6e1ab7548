-- +goose Up

-- order_confirmations holds one row per order: the outcome of handling it.
-- The unique order_id is the domain's own defence against doubles: an order
-- re-sent under a new message id, or one that outlives the inbox's dedupe
-- window, still gets exactly one row.
CREATE TABLE order_confirmations (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id     text        NOT NULL,
    status       text        NOT NULL,
    -- NULL when the order was cancelled before its order.created arrived.
    user_id      text,
    email        text,
    -- The inbox message that created the row.
    message_id   text        NOT NULL,
    reason       text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT order_confirmations_order_id_key UNIQUE (order_id),
    CONSTRAINT order_confirmations_status_check CHECK (status IN ('confirmed', 'rejected', 'cancelled'))
);

-- +goose Down
DROP TABLE order_confirmations;
