-- +goose Up

-- Orders take stock, and cancellations give it back, by inserting moves;
-- they no longer update the stock rows.
--
-- Every batch that took from a SKU updated its stock row: at 1,000
-- orders/s each of 1,000 rows about twice a second. While a snapshot is
-- held open (a long query, pg_dump, a standby's feedback, a replication
-- slot) every version of those rows stays, and every look-up of a SKU
-- (its lock, its level, the foreign key of each reservation) walks them
-- all: with a snapshot held 2 minutes, publish to processed p99 12.4 s.
--
-- Now each batch inserts one move per SKU, and the move carries the SKU's
-- running total since the last fold, "unfolded". A SKU's level is
--   stock.available + the unfolded of its newest move past folded_through
-- (plus nothing when it has none): one index look-up however many moves
-- wait, and no row version for an old snapshot to keep. stock_fold()
-- adds the unfolded total to stock.available and deletes the moves it
-- folded; inboxd calls it every 30 s. An owner still changes
-- stock.available by adding to it, as before.
CREATE TABLE stock_moves (
    sku      text        NOT NULL,
    -- The SKU's moves are numbered 1, 2, 3 … by the stock_moves_chain
    -- trigger, under the SKU's row lock, whatever the insert says: no
    -- sequence to fall behind (a data-only copy, a logical replica).
    id       bigint      NOT NULL,
    -- Negative: taken by orders; positive: given back by cancellations.
    quantity integer     NOT NULL,
    -- The SKU's moves since its last fold, this one included (set by the
    -- stock_moves_chain trigger, whatever the insert says).
    unfolded integer     NOT NULL,
    moved_at timestamptz NOT NULL DEFAULT now(),

    PRIMARY KEY (sku, id),
    CONSTRAINT stock_moves_quantity_check CHECK (quantity <> 0)
);

-- The newest move folded into available; 0 before any fold. A new column
-- with a constant default rewrites nothing.
ALTER TABLE stock ADD COLUMN folded_through bigint NOT NULL DEFAULT 0;

-- stock_levels is each SKU's level: available is what can be sold now,
-- folded what stock.available says, unfolded what moves have changed
-- since, updated_at the later of the stock row's last change (an owner's,
-- or a fold) and its newest move, and last_move the number of its newest
-- move, folded or not. Everything that reads a level reads it here.
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

CREATE OR REPLACE VIEW stock_overview AS
SELECT l.sku,
       l.available,
       coalesce(sum(r.quantity) FILTER (WHERE r.released_at IS NULL), 0)::integer AS reserved,
       count(r.order_id) FILTER (WHERE r.released_at IS NULL)                   AS orders,
       l.updated_at
FROM stock_levels l
LEFT JOIN stock_reservations r USING (sku)
GROUP BY l.sku, l.available, l.updated_at;

-- stock_read_committed refuses a transaction outside READ COMMITTED, which
-- may miss a move committed since its snapshot; what says what it is
-- about.
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
-- below zero (as stock_available_check refuses for stock.available).
--   - It locks the SKU's stock row first: the moves of a SKU are written
--     one transaction at a time. The handler holds the lock already
--     (stock_lock); anyone else (an owner's INSERT) waits for it here.
--   - It reads the newest move after the lock, in a statement of its own
--     (a snapshot of its own): every move written before is committed, and
--     none can be written until this transaction ends.
--   - Outside READ COMMITTED the newest move may be missing from the
--     transaction's snapshot: refused.
-- It runs for every move, so its statements keep their plans (look-ups of
-- one key, by index however small the tables were when planned): planned
-- at each call, as the lock functions' are, it took 110 µs a move, most
-- of a batch's time; kept, 32 µs.
-- +goose StatementBegin
CREATE FUNCTION stock_moves_chain() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    level stock_levels;
BEGIN
    PERFORM stock_read_committed('stock moves are written');
    PERFORM 1 FROM stock s WHERE s.sku = NEW.sku FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no stock row for sku %', NEW.sku USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT * INTO level FROM stock_levels l WHERE l.sku = NEW.sku;
    NEW.id := level.last_move + 1;
    NEW.unfolded := level.unfolded + NEW.quantity;
    IF level.available + NEW.quantity < 0 THEN
        RAISE EXCEPTION 'stock of sku % would go below zero: % available, % asked',
            NEW.sku, level.available, -NEW.quantity
            USING ERRCODE = 'check_violation', TABLE = 'stock_moves';
    END IF;
    RETURN NEW;
END;
$$;
-- +goose StatementEnd

CREATE TRIGGER stock_moves_chain BEFORE INSERT ON stock_moves
FOR EACH ROW EXECUTE FUNCTION stock_moves_chain();

-- stock_level_check refuses an update that takes stock.available down
-- past what the unfolded moves leave: an owner's, or an earlier inboxd's
-- take during a rolling upgrade (it reads stock.available and takes
-- from it directly). Folds leave the level as it is and are not checked.
-- +goose StatementBegin
CREATE FUNCTION stock_level_check() RETURNS trigger
LANGUAGE plpgsql
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

-- stock_lock: as before (see 00015 and 00023), and wait_ms 0 waits for no
-- row at all. The levels are read after the locks, in a statement of
-- their own: the moves of whoever held a row before are committed then,
-- and are in its level.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION stock_lock(skus text[], wait_ms integer)
RETURNS TABLE (sku text, available integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    previous text := current_setting('lock_timeout');
    got text[];
    waited boolean := false;
BEGIN
    IF wait_ms > 0 THEN
        BEGIN
            PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
            SELECT array_agg(l.sku) INTO got
            FROM (SELECT s.sku FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE) AS l;
            PERFORM set_config('lock_timeout', previous, true);
            waited := true;
        EXCEPTION WHEN lock_not_available THEN
            -- The block is rolled back: the locks it took, and lock_timeout.
            waited := false;
        END;
    END IF;
    IF NOT waited THEN
        SELECT array_agg(l.sku) INTO got
        FROM (SELECT s.sku FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE SKIP LOCKED) AS l;
    END IF;
    RETURN QUERY SELECT l.sku, l.available FROM stock_levels l WHERE l.sku = ANY(coalesce(got, '{}'));
END;
$$;
-- +goose StatementEnd

-- stock_fold folds the moves of skus into stock.available (waiting for
-- their rows as lock_timeout says), or, with no skus, those of every SKU
-- with moves to fold whose row nobody holds, max_skus at most; it
-- returns how many SKUs it folded. The level stays as it was.
--
-- An owner who sets a level, rather than adding to it, folds first in
-- the same transaction:
--   BEGIN;
--   SELECT stock_fold('{BOOK-1}');
--   UPDATE stock SET available = 10, updated_at = now() WHERE sku = 'BOOK-1';
--   COMMIT;
-- +goose StatementBegin
CREATE FUNCTION stock_fold(skus text[] DEFAULT NULL, max_skus integer DEFAULT 10000) RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    previous_timeout text := current_setting('lock_timeout');
    locked text[];
    folded_skus text[];
    previous bigint[];
    through bigint[];
    n integer;
BEGIN
    PERFORM stock_read_committed('stock is folded');
    IF skus IS NULL THEN
        SELECT array_agg(l.sku) INTO locked FROM (
            SELECT s.sku FROM stock s
            WHERE EXISTS (SELECT 1 FROM stock_moves m WHERE m.sku = s.sku AND m.id > s.folded_through)
            ORDER BY s.sku LIMIT max_skus
            FOR UPDATE SKIP LOCKED
        ) AS l;
    ELSE
        SELECT array_agg(l.sku) INTO locked FROM (
            SELECT s.sku FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE
        ) AS l;
    END IF;
    -- After the locks, in a statement of its own: every move of these
    -- SKUs is committed, and none can be added until this transaction ends.
    WITH due AS (
        SELECT l.sku, s.folded_through AS previous, l.last_move, l.unfolded
        FROM stock_levels l JOIN stock s USING (sku)
        WHERE l.sku = ANY(coalesce(locked, '{}')) AND l.last_move > s.folded_through
    ), folded AS (
        UPDATE stock s
        SET available = s.available + due.unfolded, folded_through = due.last_move, updated_at = now()
        FROM due
        WHERE s.sku = due.sku
        RETURNING s.sku, due.previous, due.last_move
    )
    SELECT array_agg(f.sku), array_agg(f.previous), array_agg(f.last_move), count(*)
    INTO folded_skus, previous, through, n
    FROM folded f;
    -- The folded moves go. One that another session has locked (an
    -- owner's SELECT … FOR UPDATE) is not waited for while this holds
    -- stock rows that batches wait for: it stays, under folded_through,
    -- where nothing reads it.
    BEGIN
        PERFORM set_config('lock_timeout', '100ms', true);
        DELETE FROM stock_moves m
        USING unnest(folded_skus, previous, through) AS f(sku, previous, through)
        WHERE m.sku = f.sku AND m.id > f.previous AND m.id <= f.through;
        PERFORM set_config('lock_timeout', previous_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        -- The block is rolled back: its deletes, and lock_timeout.
        DELETE FROM stock_moves m WHERE m.ctid = ANY (ARRAY(
            SELECT x.ctid FROM stock_moves x
            JOIN unnest(folded_skus, previous, through) AS f(sku, previous, through)
              ON x.sku = f.sku AND x.id > f.previous AND x.id <= f.through
            FOR UPDATE OF x SKIP LOCKED));
    END;
    RETURN n;
END;
$$;
-- +goose StatementEnd

-- The grants of migration 00025 stay as they were, under another name.
-- +goose StatementBegin
DO $$ BEGIN ALTER FUNCTION inbox_grant_roles() RENAME TO inbox_grant_roles_00025; END $$;
-- +goose StatementEnd

-- The service writes moves and folds them; operators read them.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION inbox_grant_roles() RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    result text := inbox_grant_roles_00025();
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_operator') THEN
        GRANT SELECT ON stock_moves, stock_levels TO inbox_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inbox_service') THEN
        GRANT SELECT, INSERT, DELETE ON stock_moves TO inbox_service;
        GRANT SELECT ON stock_levels TO inbox_service;
        GRANT UPDATE (folded_through) ON stock TO inbox_service;
    END IF;
    RETURN result;
END;
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION inbox_grant_roles_00025() IS 'the grants of migration 00025; call inbox_grant_roles() instead';

SELECT inbox_grant_roles();

-- +goose Down
DROP FUNCTION inbox_grant_roles();
ALTER FUNCTION inbox_grant_roles_00025() RENAME TO inbox_grant_roles;
COMMENT ON FUNCTION inbox_grant_roles() IS NULL;
-- Nothing taken or given back is lost: with no move written meanwhile,
-- every SKU's moves are folded first (a running inboxd's batch is waited
-- for, as lock_timeout allows).
LOCK TABLE stock, stock_moves IN SHARE ROW EXCLUSIVE MODE;
DROP TRIGGER stock_level_check ON stock;
DROP FUNCTION stock_level_check();
UPDATE stock s SET available = l.available, updated_at = now()
FROM stock_levels l WHERE l.sku = s.sku AND l.unfolded <> 0;
DROP FUNCTION stock_fold(text[], integer);
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION stock_lock(skus text[], wait_ms integer)
RETURNS TABLE (sku text, available integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    previous text := current_setting('lock_timeout');
    got text[];
    levels integer[];
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
        SELECT array_agg(l.sku ORDER BY l.sku), array_agg(l.available ORDER BY l.sku) INTO got, levels
        FROM (SELECT s.sku, s.available FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE) AS l;
        PERFORM set_config('lock_timeout', previous, true);
    EXCEPTION WHEN lock_not_available THEN
        -- The block is rolled back: the locks it took, and lock_timeout.
        SELECT array_agg(l.sku ORDER BY l.sku), array_agg(l.available ORDER BY l.sku) INTO got, levels
        FROM (SELECT s.sku, s.available FROM stock s WHERE s.sku = ANY(skus) ORDER BY s.sku FOR UPDATE SKIP LOCKED) AS l;
    END;
    -- The levels as locked: FOR UPDATE returns the last committed version.
    RETURN QUERY SELECT u.sku, u.available FROM unnest(coalesce(got, '{}'), coalesce(levels, '{}')) AS u(sku, available);
END;
$$;
-- +goose StatementEnd
DROP TRIGGER stock_moves_chain ON stock_moves;
DROP FUNCTION stock_moves_chain();
DROP FUNCTION stock_read_committed(text);
CREATE OR REPLACE VIEW stock_overview AS
SELECT s.sku,
       s.available,
       coalesce(sum(r.quantity) FILTER (WHERE r.released_at IS NULL), 0)::integer AS reserved,
       count(r.order_id) FILTER (WHERE r.released_at IS NULL)                   AS orders,
       s.updated_at
FROM stock s
LEFT JOIN stock_reservations r USING (sku)
GROUP BY s.sku, s.available, s.updated_at;
DROP VIEW stock_levels;
ALTER TABLE stock DROP COLUMN folded_through;
DROP TABLE stock_moves;
