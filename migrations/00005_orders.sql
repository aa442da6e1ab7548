-- +goose Up

-- Orders and stock: the domain state the order handler keeps, in the same
-- transaction as the inbox message it handles.
--
--   order_confirmations  one row per order: the outcome of handling it
--   stock                what can be sold, per SKU, as last folded
--   stock_moves          what orders took and cancellations gave back since
--   stock_levels         stock + its unfolded moves: the level, read here
--   stock_reservations   what each confirmed order took, per SKU
--
-- A SKU's level never goes below zero, whoever writes: stock.available by its
-- CHECK, a move by the stock_moves_chain trigger, an update of
-- stock.available that undercuts the unfolded moves by stock_level_check.
--
-- The order handler (internal/orders) locks the rows a batch needs in key
-- order, waiting a bounded time, then skipping what others hold, so that a
-- session holding a row (an operator's open transaction) delays only the
-- messages that need that row; it folds the moves into stock.available.
--
-- The indexes that keep each order's messages, and each order's effects, in
-- arrival order are with their tables: inbox_order_key_open_idx (00001) and
-- outbox_order_key_unpublished_idx (00002).

-- order_confirmations holds one row per order: the outcome of handling it.
-- The order_id key is the domain's own defence against doubles: an order
-- re-sent under a new message id, or one that outlives the inbox's dedupe
-- window, still gets exactly one row.
CREATE TABLE order_confirmations (
    order_id   text        PRIMARY KEY,
    status     text        NOT NULL CHECK (status IN ('confirmed', 'rejected', 'cancelled')),
    -- NULL when the order was cancelled before its order.created arrived.
    user_id    text,
    email      text,
    -- The inbox message that created the row.
    message_id text        NOT NULL,
    reason     text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- stock holds what can be sold per SKU, as of its last fold: the level
-- itself is stock_levels. Operators fill it with SQL by adding to
-- available, e.g.
--   INSERT INTO stock (sku, available) VALUES ('BOOK-1', 100)
--   ON CONFLICT (sku) DO UPDATE SET available = stock.available + EXCLUDED.available;
-- The handler never updates a stock row to take from it: it inserts moves
-- (stock_moves), which a SKU look-up reads by one index probe. Updating the
-- rows of busy SKUs several times a second made every look-up walk their
-- row versions while any snapshot was held open (a long query, pg_dump, a
-- standby's feedback): p99 of 12 s with a snapshot held 2 minutes.
CREATE TABLE stock (
    sku            text        PRIMARY KEY,
    available      integer     NOT NULL CHECK (available >= 0),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The id of the newest move folded into available; 0 before any fold.
    folded_through bigint      NOT NULL DEFAULT 0
);

-- stock_reservations records what each confirmed order took, once per
-- (order, sku): the key is the domain's defence against reserving twice.
-- A cancellation gives the quantity back (a move) and sets released_at, once.
CREATE TABLE stock_reservations (
    order_id    text        NOT NULL,
    sku         text        NOT NULL REFERENCES stock (sku),
    quantity    integer     NOT NULL CHECK (quantity > 0),
    reserved_at timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,

    PRIMARY KEY (order_id, sku)
);

-- Every reservation by SKU: stock_overview, and the foreign key's check
-- when a stock row is deleted. Deliberately not partial on "released_at IS
-- NULL": an order's open reservations are looked up by "order_id = ... AND
-- released_at IS NULL" (release, the order lock), and without statistics the
-- planner took such a partial index for cheaper than the primary key and
-- read it end to end for each cancellation (7.1 M entries for 30). An index
-- naming no condition leaves those look-ups to the primary key, and a
-- release changes no indexed column, so it can be a HOT update.
CREATE INDEX stock_reservations_by_sku_idx ON stock_reservations (sku);

-- stock_moves: orders take stock, and cancellations give it back, by
-- inserting one move per SKU per batch. Each move carries the SKU's running
-- total since its last fold (unfolded), so a level is one index look-up
-- however many moves wait, and no row version is left for an old snapshot
-- to keep. inboxd folds them every 30 s: it adds the unfolded total to
-- stock.available, moves folded_through to the newest move, and deletes
-- the moves it folded (internal/orders/fold.go).
CREATE TABLE stock_moves (
    sku      text        NOT NULL,
    -- The SKU's moves are numbered 1, 2, 3 ... by the stock_moves_chain
    -- trigger, under the SKU's row lock, whatever the insert says: no
    -- sequence to fall behind (a data-only copy, a logical replica).
    id       bigint      NOT NULL,
    -- Negative: taken by orders; positive: given back by cancellations.
    quantity integer     NOT NULL CHECK (quantity <> 0),
    -- The SKU's moves since its last fold, this one included (set by the
    -- stock_moves_chain trigger, whatever the insert says).
    unfolded integer     NOT NULL,
    moved_at timestamptz NOT NULL DEFAULT now(),

    PRIMARY KEY (sku, id)
);

-- stock_levels is each SKU's level; everything that reads a level reads it
-- here:
--   available   what can be sold now: stock.available + the unfolded of the
--               SKU's newest move past folded_through (0 with none)
--   folded      what stock.available says
--   unfolded    what moves have changed since the last fold
--   updated_at  the later of the stock row's last change (an owner's, or a
--               fold) and its newest move
--   last_move   the id of its newest move, folded or not
CREATE VIEW stock_levels AS
SELECT s.sku,
       (s.available + coalesce(n.unfolded, 0))::integer AS available,
       s.available                                       AS folded,
       coalesce(n.unfolded, 0)::integer                  AS unfolded,
       greatest(s.updated_at, n.moved_at)::timestamptz   AS updated_at,
       greatest(s.folded_through, n.id)::bigint          AS last_move
FROM stock s
LEFT JOIN LATERAL (
    SELECT m.id, m.unfolded, m.moved_at FROM stock_moves m
    WHERE m.sku = s.sku AND m.id > s.folded_through
    ORDER BY m.id DESC LIMIT 1
) n ON true;

-- stock_read_committed refuses a transaction outside READ COMMITTED, whose
-- snapshot may miss a move committed since it began; what says what the
-- caller is doing.
-- +goose StatementBegin
CREATE FUNCTION stock_read_committed(what text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '% in READ COMMITTED transactions only, not %', what, current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
END;
$$;
-- +goose StatementEnd

-- stock_moves_chain numbers each move after every earlier move of its SKU
-- and gives it the running total, refusing one that would take the level
-- below zero (as stock's CHECK refuses for stock.available). A trigger, not
-- the service, so that every writer's moves (an owner's INSERT too) chain.
--   - It locks the SKU's stock row first: the moves of a SKU are written one
--     transaction at a time. The handler holds the lock already; anyone
--     else waits for it here. FOR UPDATE returns the row as last
--     committed, so available and folded_through come from that statement.
--   - It reads the newest move after the lock, in a statement of its own (a
--     snapshot of its own): every move written before is committed, and none
--     can be written until this transaction ends. The same sum as
--     stock_levels, without reading through the view.
--   - Outside READ COMMITTED the newest move may be missing from the
--     transaction's snapshot: refused (checked without a statement).
-- It runs for every move, so its statements keep their plans (planning at
-- each call cost 110 us a move against 32 us). enable_seqscan off keeps a
-- plan made while stock_moves looked empty (after a fold and a vacuum) an
-- index look-up: as a scan and sort it read every move since the fold, and a
-- batch of 100 moves took 100 ms instead of 5.
-- +goose StatementBegin
CREATE FUNCTION stock_moves_chain() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    folded integer;
    through bigint;
    last_id bigint;
    last_unfolded integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'stock moves are written in READ COMMITTED transactions only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported';
    END IF;
    SELECT s.available, s.folded_through INTO folded, through
    FROM stock s WHERE s.sku = NEW.sku FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no stock row for sku %', NEW.sku USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT m.id, m.unfolded INTO last_id, last_unfolded
    FROM stock_moves m
    WHERE m.sku = NEW.sku AND m.id > through
    ORDER BY m.id DESC LIMIT 1;
    NEW.id := coalesce(last_id, through) + 1;
    NEW.unfolded := coalesce(last_unfolded, 0) + NEW.quantity;
    IF folded + NEW.unfolded < 0 THEN
        RAISE EXCEPTION 'stock of sku % would go below zero: % available, % asked',
            NEW.sku, folded + NEW.unfolded - NEW.quantity, -NEW.quantity
            USING ERRCODE = 'check_violation', TABLE = 'stock_moves';
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER stock_moves_chain BEFORE INSERT ON stock_moves
FOR EACH ROW EXECUTE FUNCTION stock_moves_chain();

-- stock_level_check refuses an update that takes stock.available down past
-- what the unfolded moves leave: the CHECK on stock sees only the folded
-- part. It covers whoever lowers stock.available directly (an owner, a
-- build of inboxd that takes from stock.available). Folds leave the level
-- as it is, so the WHEN clause skips them (they move folded_through).
-- An owner who sets a level, rather than adding to it, folds the SKU in
-- the same update (with its row locked first, so that no move is missed):
-- SET available = 40, folded_through = the SKU's stock_levels.last_move
-- (docs/operations.md).
-- enable_seqscan off keeps its kept plans index look-ups, as for
-- stock_moves_chain.
-- +goose StatementBegin
CREATE FUNCTION stock_level_check() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    level stock_levels;
BEGIN
    PERFORM stock_read_committed('stock.available is lowered');
    -- An AFTER trigger's statement sees the row as updated.
    SELECT * INTO level FROM stock_levels l WHERE l.sku = NEW.sku;
    IF level.available < 0 THEN
        RAISE EXCEPTION 'stock of sku % would go below zero: % available after the moves not folded yet (%)',
            NEW.sku, level.available, level.unfolded
            USING ERRCODE = 'check_violation', TABLE = 'stock';
    END IF;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER stock_level_check AFTER UPDATE OF available ON stock
FOR EACH ROW WHEN (NEW.available < OLD.available AND NEW.folded_through = OLD.folded_through)
EXECUTE FUNCTION stock_level_check();
