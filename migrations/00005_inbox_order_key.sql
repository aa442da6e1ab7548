-- +goose Up

-- order_key groups the messages that must be handled in arrival order (for
-- order messages, the orderId). Ingest fills it; NULL means the message is
-- not ordered with any other (its body had no key, or could not be read).
ALTER TABLE inbox ADD COLUMN order_key text;

-- The claim takes a message only when no earlier message of its order is
-- still open (pending or dead). Processed rows leave this index, so it stays
-- as small as the open backlog.
CREATE INDEX inbox_order_key_open_idx ON inbox (order_key, id)
WHERE status <> 'processed' AND order_key IS NOT NULL;

-- inbox_held_back lists the orders whose later messages wait behind an
-- earlier one that is dead or waiting for a retry, with that message.
-- Release an order by replaying the blocking message or by skipping it (see
-- the README).
CREATE VIEW inbox_held_back AS
SELECT h.order_key,
       h.id              AS blocking_id,
       h.message_id      AS blocking_message_id,
       h.message_type    AS blocking_message_type,
       h.status          AS blocking_status,
       h.attempts,
       h.last_error,
       h.next_attempt_at,
       held.messages     AS held_messages,
       held.oldest       AS oldest_held_received_at
FROM inbox h
CROSS JOIN LATERAL (
    SELECT count(*) AS messages, min(w.received_at) AS oldest
    FROM inbox w
    WHERE w.order_key = h.order_key AND w.id > h.id AND w.status = 'pending'
) AS held
WHERE h.order_key IS NOT NULL
  AND h.status <> 'processed'
  AND (h.status = 'dead' OR h.last_error IS NOT NULL)
  AND held.messages > 0
  AND NOT EXISTS (
      SELECT 1 FROM inbox e
      WHERE e.order_key = h.order_key AND e.id < h.id AND e.status <> 'processed'
  );

-- +goose Down
DROP VIEW inbox_held_back;
DROP INDEX inbox_order_key_open_idx;
ALTER TABLE inbox DROP COLUMN order_key;
