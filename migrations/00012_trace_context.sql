-- +goose Up

-- W3C trace context (https://www.w3.org/TR/trace-context/), so that one order
-- can be followed through the service: ingest keeps a delivery's
-- traceparent and tracestate headers with its inbox row, the worker handles
-- the message in that trace, the handler stores the context of its span with
-- each outbox row, and the relay sends it on as the event's headers.
--
-- NULL means no context: the delivery carried none, or a malformed one,
-- which is never stored as if it were valid. Adding nullable columns without
-- a default changes only the catalog: no table rewrite, no long lock.
ALTER TABLE inbox
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;

ALTER TABLE outbox
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;

-- +goose Down
ALTER TABLE outbox
    DROP COLUMN tracestate,
    DROP COLUMN traceparent;

ALTER TABLE inbox
    DROP COLUMN tracestate,
    DROP COLUMN traceparent;
