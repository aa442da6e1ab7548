-- +goose Up

-- The outbox: every effect that leaves the service (an event, an email
-- request, the reply to a delivery that asked for one) is a row here,
-- written in the transaction that handles the message (and changes the
-- order), and published by the relay.
--
-- The relay claims a batch and marks it published in one statement, in a
-- transaction it commits only once the broker has confirmed every publish:
-- until then the rows stay locked and every other session sees them
-- unpublished. A relay that dies (or loses its connection) leaves nothing
-- behind; the rows go again, under the same AMQP message_id, with the next
-- claim. A publish refused for a reason retrying will not change ends the
-- row dead after the relay's maximum attempts, until an operator replays it.
--
-- The index of an order's open rows (order_key) is below, with the table;
-- the claim floor that bounds the relay's scan is in 00003.

-- The idempotency key is derived from the inbox message and the effect, so
-- handling a message again (a replay, a redelivery under the same id) never
-- adds a second row (the insert skips a key already here), and every publish
-- of a row carries the same AMQP message_id.
--
-- fillfactor 50: each row is written again by the publish (and by a failed
-- publish's release); the free space keeps the new version on the old one's
-- page.
CREATE TABLE outbox (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- '<inbox message_id>:<effect>', e.g. 'msg-1001:order.confirmed';
    -- a reply's is 'reply:<request id>:<run>'. Published as the AMQP message_id.
    idempotency_key  text        NOT NULL UNIQUE,
    -- Routing key on order-confirmation.events, e.g. 'order.confirmed';
    -- 'reply' for a reply, which is published with reply_to as its key.
    routing_key      text        NOT NULL,
    payload          jsonb       NOT NULL,
    -- The inbox message whose handling produced the effect.
    message_id       text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- Set by the claim; committed once the broker has confirmed the publish.
    published_at     timestamptz,
    -- Number of times a relay has tried to publish the row.
    attempts         integer     NOT NULL DEFAULT 0,
    -- Set by a relay that claims rows in a transaction of its own before
    -- publishing them. inboxd's relay holds its rows by row locks instead
    -- and clears it; such a claim is respected for INBOX_RELAY_LEASE.
    claimed_at       timestamptz,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    -- The order the effect belongs to (its event's orderId). A row is
    -- claimed only with every unpublished row of its order of a lower id,
    -- and a batch is published in id order: one order's events leave in
    -- the order the handler wrote them, however many relays run. NULL
    -- orders the row with no other (replies have none).
    order_key        text,
    -- W3C trace context of the handler's span, sent on as the event's
    -- headers; NULL when there is none (a malformed one is never stored).
    traceparent      text,
    tracestate       text,
    -- Since when the row is dead (last_error says why). It stays
    -- unpublished and holds back its order's later rows, visibly
    -- (outbox_dead, outbox_backlog.dead): nothing is skipped silently.
    dead_at          timestamptz,
    -- The replay of a dead row, as for the inbox; see outbox_replay below.
    replay_requested boolean     NOT NULL DEFAULT false,
    replay_count     integer     NOT NULL DEFAULT 0,
    replayed_at      timestamptz,
    replayed_by      text,
    replay_reason    text,
    -- A reply (reply_to set) goes to the default exchange with reply_to as
    -- its routing key, and the delivery's correlation_id. It has no
    -- order_key; one the broker returns (its requester is gone) ends dead:
    -- undeliverable.
    reply_to         text,
    correlation_id   text,

    -- A dead row is unpublished: the relay finds an order's earlier dead
    -- rows among its unpublished ones (OutboxClaimBatch), so a row marked
    -- both would let the order's later rows out ahead of it.
    CONSTRAINT outbox_dead_unpublished CHECK (dead_at IS NULL OR published_at IS NULL)
)
WITH (fillfactor = 50);

-- The open rows, neither published nor dead: the relay's claim scans them in
-- id order from the claim floor, and the floor's raise and audit and the
-- counts of open rows read them too. Dead rows stay out, so that no look-up
-- of an order's preceding rows (which names published_at IS NULL alone) can
-- be served by this index: they read outbox_order_key_unpublished_idx, their
-- order's rows only. (Served from here, the planner took a range from the
-- floor and read every other order's rows in between, for each candidate.)
CREATE INDEX outbox_open_idx ON outbox (id)
WHERE published_at IS NULL AND dead_at IS NULL;

-- The dead rows, by the time they ended: the janitor's deletion of
-- undeliverable replies (in this order, sparing a sort) and the counts of
-- dead rows. Dead rows are few, and this index holds no others: read through
-- an index of unpublished rows, a snapshot held open would make each pass
-- read the entry of every row published since (111,472 buffers a janitor
-- pass). A range on dead_at is a condition only this index serves, so the
-- planner takes it even without statistics.
CREATE INDEX outbox_dead_at_idx ON outbox (dead_at)
WHERE published_at IS NULL AND dead_at IS NOT NULL;

-- Retention deletes published rows by age.
CREATE INDEX outbox_published_at_idx ON outbox (published_at)
WHERE published_at IS NOT NULL;

-- The relay's look-up of a candidate's earlier unpublished effects of the
-- same order, dead ones included (a dead row is never published): that
-- order's rows only, whatever the statistics. Published rows leave the
-- index, so it stays as small as the backlog; a snapshot held open keeps
-- the entries of the order's rows published since, a handful, not those of
-- every row published since, as the indexes of open rows by id do (a claim
-- whose look-up of dead rows went through one read 919,689 buffers with a
-- snapshot held 60 s).
CREATE INDEX outbox_order_key_unpublished_idx ON outbox (order_key, id)
WHERE published_at IS NULL AND order_key IS NOT NULL;

-- Replaying a dead row is one SQL statement by an operator:
--   UPDATE outbox SET replay_requested = true, replay_reason = 'bound the queue'
--   WHERE idempotency_key = 'msg-1001:order.confirmed';
-- outbox_replay makes that safe and records it, in the database so that a
-- replay by hand needs no service: a dead row is put back to be published
-- at once, with fresh attempts, and the replay is counted with when and by
-- whom, whatever the statement said about those columns. A flag set on a
-- row that is not dead is dropped (with its reason). The replay lowers the
-- outbox's claim floor through outbox_claim_floor_replay (floors area).
-- +goose StatementBegin
CREATE FUNCTION outbox_replay() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF NEW.replay_requested AND NOT OLD.replay_requested AND OLD.dead_at IS NOT NULL THEN
        NEW.dead_at         := NULL;
        NEW.attempts        := 0;
        NEW.next_attempt_at := now();
        NEW.replay_count    := OLD.replay_count + 1;
        NEW.replayed_at     := now();
        NEW.replayed_by     := current_user;
        PERFORM pg_notify('outbox_pending', TG_TABLE_SCHEMA);
    ELSE
        -- Only a replay changes the audit columns, the reason included.
        NEW.replay_count  := OLD.replay_count;
        NEW.replayed_at   := OLD.replayed_at;
        NEW.replayed_by   := OLD.replayed_by;
        NEW.replay_reason := OLD.replay_reason;
    END IF;
    -- The flag is a request, not a state: the count records it.
    NEW.replay_requested := false;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

-- The column list and the WHEN clause keep the function out of the relay's
-- updates.
CREATE TRIGGER outbox_replay_update
BEFORE UPDATE OF replay_requested, replay_count, replayed_at, replayed_by, replay_reason
ON outbox
FOR EACH ROW
WHEN (OLD.replay_requested IS DISTINCT FROM NEW.replay_requested
   OR OLD.replay_count     IS DISTINCT FROM NEW.replay_count
   OR OLD.replayed_at      IS DISTINCT FROM NEW.replayed_at
   OR OLD.replayed_by      IS DISTINCT FROM NEW.replayed_by
   OR OLD.replay_reason    IS DISTINCT FROM NEW.replay_reason)
EXECUTE FUNCTION outbox_replay();
