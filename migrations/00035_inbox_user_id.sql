-- +goose Up

-- inbox.user_id is the AMQP user_id of the delivery that stored the message
-- (RabbitMQ refuses a publish whose user_id is not its connection's user),
-- NULL when it carried none. When it is set, a copy of the message that
-- asks for a reply is answered only if it carries the same user_id (see
-- InboxInsertMany): a producer that learns another's message id cannot
-- read that message's stored result by sending a copy. Adding a column
-- without a default rewrites nothing.
ALTER TABLE inbox ADD COLUMN user_id text;

COMMENT ON COLUMN inbox.user_id IS 'AMQP user_id of the delivery that stored the message; a copy asking for a reply is answered only under the same';

-- +goose Down
ALTER TABLE inbox DROP COLUMN user_id;
